/**
 * The creatable fields of a policy: parsing what a request sends, formatting them as the API
 * shows them, and the diff of two versions that audit entries and `policy.updated` carry.
 * Pure — no I/O, no clock (the caller passes the time) — so every rule is unit-tested.
 */
import { isAddress } from '@solana/kit';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { amountOf } from '../http/fields.ts';
import { DATE_MS_MAX } from '../http/pagination.ts';
import { formatUsdc } from '../money/money.ts';
import { normaliseDomain } from '../recipients/recipients.ts';
import type { PolicyRules } from './presets.ts';

export const POLICY_NAME_MAX = 100;
export const ALLOWED_RECIPIENTS_MAX = 1_000;
export const BLOCKED_CATEGORIES_MAX = 100;
export const VELOCITY_CAP_MAX = 1_000_000;
/** A domain name is at most 253 characters; a base58 address at most 44. */
export const RECIPIENT_LENGTH_MAX = 253;

/** A policy as a request shapes it: a name and its rules. */
export interface PolicyFields extends PolicyRules {
  name: string;
}

/** What a request may send, after the schema checked types and sizes (null = no limit). */
export interface PolicyFieldsInput {
  name?: string;
  maxPerTx?: string | null;
  maxPerDay?: string | null;
  maxPerMonth?: string | null;
  requireCoSign?: string | null;
  velocityCap?: number | null;
  allowedRecipients?: string[];
  blockedCategories?: string[];
  expiry?: string | null;
}

const AMOUNT_FIELDS = [
  ['maxPerTx', 'max_per_tx'], ['maxPerDay', 'max_per_day'], ['maxPerMonth', 'max_per_month'], ['requireCoSign', 'require_co_sign'],
] as const;

/**
 * Turns the sent fields into typed values; fields not sent stay absent. `nowMs` is the service
 * clock: an expiry that is already over is refused, because a policy created or changed to be
 * expired would only block every payment of its vaults.
 */
export function parsePolicyFields(input: PolicyFieldsInput, nowMs: number): Partial<PolicyFields> {
  const out: Partial<PolicyFields> = {};
  if (input.name !== undefined) out.name = input.name;
  for (const [field, param] of AMOUNT_FIELDS) {
    const value = input[field];
    if (value !== undefined) out[field] = value === null ? null : parseLimit(value, param);
  }
  if (input.velocityCap !== undefined) out.velocityCap = input.velocityCap;
  if (input.allowedRecipients !== undefined) out.allowedRecipients = parseRecipients(input.allowedRecipients);
  // Any case, as the recipient directory and a payment's category take them: compared lowercase.
  if (input.blockedCategories !== undefined) out.blockedCategories = [...new Set(input.blockedCategories.map((c) => c.toLowerCase()))];
  if (input.expiry !== undefined) out.expiry = input.expiry === null ? null : parseExpiry(input.expiry, nowMs);
  return out;
}

/** "0" is a real limit (nothing allowed), so zero is accepted here, unlike payment amounts. */
function parseLimit(text: string, param: string): bigint {
  return amountOf(text, param, { allowZero: true, alternative: ' ("0" allowed)' });
}

/**
 * Each entry is a chain address (base58 of 32 bytes, case-sensitive) or a domain name (stored
 * lowercase, as the policy engine compares domains). Duplicates are dropped, first one kept.
 * A domain need not be in the recipient directory yet: a payment resolves it when it is made.
 * A domain is whatever the directory takes (its own `normaliseDomain`), so every domain a payment
 * can name can be allowed; an address never has a dot.
 */
export function parseRecipients(entries: readonly string[]): string[] {
  const seen = new Set<string>();
  entries.forEach((entry, index) => {
    const normalised = entry.includes('.') ? normaliseDomain(entry) : isAddress(entry) ? entry : null;
    if (normalised === null) {
      throw new ServiceError('invalid_recipient',
        `allowed_recipients[${index}] is neither a chain address (base58) nor a domain name.`, { param: `allowed_recipients.${index}` });
    }
    seen.add(normalised);
  });
  return [...seen];
}

const TIMESTAMP = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2})(?::(\d{2})(?:\.(\d{1,9}))?)?(Z|[+-]\d{2}:\d{2})$/i;

/**
 * An ISO 8601 timestamp with a date, a time and a zone (`Z` or `±hh:mm`); anything else
 * (a date alone, no zone, 30 February) is refused rather than guessed. Kept to the whole
 * second below it, because the chain stores Unix seconds: the service and the program then
 * expire the policy at the same instant, never later than asked.
 */
export function parseExpiry(text: string, nowMs: number): Date {
  const match = TIMESTAMP.exec(text);
  const bad = () => invalidRequest('expiry', 'expiry must be an ISO 8601 timestamp with a time zone, such as "2026-12-31T23:59:59Z".');
  if (!match) throw bad();
  const [year, month, day, hour, minute, second] = match.slice(1, 7).map((part) => Number(part ?? 0)) as
    [number, number, number, number, number, number];
  const daysInMonth = month >= 1 && month <= 12 ? new Date(Date.UTC(year, month, 0)).getUTCDate() : 0;
  if (day < 1 || day > daysInMonth || hour > 23 || minute > 59 || second > 59) throw bad();
  const zone = match[8]!.toUpperCase();
  const offsetMinutes = zone === 'Z' ? 0 : (zone[0] === '-' ? -1 : 1) * (Number(zone.slice(1, 3)) * 60 + Number(zone.slice(4, 6)));
  if (Math.abs(offsetMinutes) > 18 * 60) throw bad();
  const utc = new Date(0);
  utc.setUTCFullYear(year, month - 1, day);
  utc.setUTCHours(hour, minute, second, 0);
  const atMs = utc.getTime() - offsetMinutes * 60_000;
  if (atMs <= nowMs) throw invalidRequest('expiry', 'expiry must be in the future.');
  if (atMs > DATE_MS_MAX) throw invalidRequest('expiry', 'expiry must be in the year 9999 or before (UTC).');
  return new Date(atMs);
}

/** Values as the API shows them: what audit entries and events carry under snake_case keys. */
export interface PolicyFieldsView {
  name: string;
  max_per_tx: string | null;
  max_per_day: string | null;
  max_per_month: string | null;
  velocity_cap: number | null;
  allowed_recipients: string[];
  blocked_categories: string[];
  require_co_sign: string | null;
  expiry: string | null;
}

const usdcOrNull = (micro: bigint | null): string | null => (micro === null ? null : formatUsdc(micro));

export function fieldsView(fields: PolicyFields): PolicyFieldsView {
  return {
    name: fields.name,
    max_per_tx: usdcOrNull(fields.maxPerTx),
    max_per_day: usdcOrNull(fields.maxPerDay),
    max_per_month: usdcOrNull(fields.maxPerMonth),
    velocity_cap: fields.velocityCap,
    allowed_recipients: fields.allowedRecipients,
    blocked_categories: fields.blockedCategories,
    require_co_sign: usdcOrNull(fields.requireCoSign),
    expiry: fields.expiry ? fields.expiry.toISOString() : null,
  };
}

export type Changes = Record<string, { from: unknown; to: unknown }>;

/** Entries of a list an event names as added, and as removed, at most (the audit log has them all). */
export const EVENT_LIST_CHANGES_MAX = 50;

/**
 * A diff as a policy's events carry it: scalar fields from/to, as in the audit log; a list
 * (`allowed_recipients`, `blocked_categories`: up to 1,000 entries each) by the entries added
 * and removed, at most EVENT_LIST_CHANGES_MAX of each with their counts. Two whole lists would
 * make an event of half a megabyte, sent to every webhook and read back by every feed page.
 */
export function eventChanges(changes: Changes): Record<string, unknown> {
  const shown: Record<string, unknown> = {};
  for (const [key, change] of Object.entries(changes)) {
    if (!Array.isArray(change.to)) {
      shown[key] = change;
      continue;
    }
    const before = new Set(Array.isArray(change.from) ? change.from as unknown[] : []);
    const after = new Set(change.to as unknown[]);
    const added = [...after].filter((entry) => !before.has(entry));
    const removed = [...before].filter((entry) => !after.has(entry));
    shown[key] = {
      added: added.slice(0, EVENT_LIST_CHANGES_MAX), removed: removed.slice(0, EVENT_LIST_CHANGES_MAX),
      added_count: added.length, removed_count: removed.length,
    };
  }
  return shown;
}

/** The fields whose API value differs, in a fixed order. A creation is a diff from nothing (`before` null). */
export function diffFields(before: PolicyFields | null, after: PolicyFields): Changes {
  const from = before ? fieldsView(before) : null;
  const to = fieldsView(after);
  const changes: Changes = {};
  for (const key of Object.keys(to) as Array<keyof PolicyFieldsView>) {
    const old = from ? from[key] : null;
    if (from === null || JSON.stringify(old) !== JSON.stringify(to[key])) changes[key] = { from: old, to: to[key] };
  }
  return changes;
}
