/**
 * The recipient directory: per organisation, a domain names a chain address and, optionally,
 * the category payments to it count under (DESIGN §6). Payments resolve their `to` here:
 * a domain must be in the directory, a bare address may be, and the directory's category
 * wins over the one a payment request brings.
 */
import { Type } from 'typebox';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import { isAddressText } from '../chain/base58.ts';
import type { Database, Queryable } from '../db/database.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { PageFilter, type PageRequest, toPage } from '../http/pagination.ts';
import { newId } from '../ids/ids.ts';

/** The longest DNS name (RFC 1035, without the trailing dot). */
export const DOMAIN_LENGTH_MAX = 253;
export const RECIPIENT_LABEL_MAX = 200;
/** What a request may send as a category; it is stored and compared lowercase. */
export const CATEGORY_PATTERN = '^[A-Za-z0-9_.-]{1,64}$';
export const CATEGORY_TEXT = 'must be 1–64 characters of letters, digits, "_", "." or "-"';

/**
 * One DNS label (RFC 1123): letters, digits and inner hyphens, 1–63 characters. Checked after
 * lowercasing an input already known to be ASCII, so no Unicode case mapping (the Kelvin sign
 * lowercases to "k") can turn a look-alike into a real domain.
 */
const DOMAIN_LABEL = /^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$/;
const DOMAIN_CHARACTERS = /^[A-Za-z0-9.-]+$/;
const CATEGORY = new RegExp(CATEGORY_PATTERN);

/** The domain in its stored (lowercase) form, or null when the text is not a DNS name with a dot. */
export function normaliseDomain(text: string): string | null {
  if (text.length > DOMAIN_LENGTH_MAX || !DOMAIN_CHARACTERS.test(text)) return null;
  const domain = text.toLowerCase();
  const labels = domain.split('.');
  if (labels.length < 2 || !labels.every((label) => DOMAIN_LABEL.test(label))) return null;
  // A top-level label is never all digits: `1.2.3.4` is an IP address, not a name.
  if (/^\d+$/.test(labels.at(-1)!)) return null;
  return domain;
}

/** The category in its stored (lowercase) form, or null when it is not a category code. */
export function normaliseCategory(text: string): string | null {
  return CATEGORY.test(text) ? text.toLowerCase() : null;
}

/** Refused input is echoed in messages, but never at a length that would flood a log line. */
function quoted(text: string): string {
  return JSON.stringify(text.length > 80 ? `${text.slice(0, 80)}…` : text);
}

function domainOf(text: string): string {
  const domain = normaliseDomain(text);
  if (domain === null) {
    throw new ServiceError('invalid_recipient',
      `domain ${quoted(text)} is not a DNS name (labels of letters, digits and hyphens, at least one dot, at most ${DOMAIN_LENGTH_MAX} characters).`,
      { param: 'domain' });
  }
  return domain;
}

function addressOf(text: string): string {
  if (!isAddressText(text)) {
    throw new ServiceError('invalid_recipient', `address ${quoted(text)} is not a chain address (base58 of a 32-byte public key).`,
      { param: 'address' });
  }
  return text;
}

function categoryOf(text: string, param = 'category'): string {
  const category = normaliseCategory(text);
  if (category === null) throw invalidRequest(param, `${param} must be 1–64 characters of letters, digits, "_", "." or "-".`);
  return category;
}

// ---------------------------------------------------------------------------------------------
// Rows and views

export interface RecipientRow {
  org_id: string;
  id: string;
  domain: string;
  address: string;
  category: string | null;
  label: string | null;
  created_at: Date;
  updated_at: Date;
  deleted_at: Date | null;
}

const TEXT_OR_NULL = Type.Union([Type.String(), Type.Null()]);

export const RecipientView = Type.Object({
  recipient_id: Type.String(),
  domain: Type.String({ description: 'lowercase; unique among the organisation\'s recipients' }),
  address: Type.String({ description: 'chain address payments to the domain go to' }),
  category: TEXT_OR_NULL,
  label: TEXT_OR_NULL,
  created_at: Type.String(),
  updated_at: Type.String(),
});

export function recipientView(row: RecipientRow) {
  return {
    recipient_id: row.id,
    domain: row.domain,
    address: row.address,
    category: row.category,
    label: row.label,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
  };
}

function recipientNotFound(recipientId: string): ServiceError {
  return new ServiceError('recipient_not_found', `No recipient ${quoted(recipientId)} in your organisation.`, { param: 'recipient_id' });
}

// ---------------------------------------------------------------------------------------------
// Use-cases

export interface NewRecipient {
  domain: string;
  address: string;
  category?: string | null;
  label?: string | null;
}

export async function createRecipient(q: Queryable, nowMs: number, orgId: string, input: NewRecipient): Promise<RecipientRow> {
  const domain = domainOf(input.domain);
  const address = addressOf(input.address);
  const category = input.category == null ? null : categoryOf(input.category);
  const now = new Date(nowMs);
  // The unique index decides between two concurrent creations of one domain: no read-then-write race.
  const rows = await q.query<RecipientRow>(
    `INSERT INTO recipients (org_id, id, domain, address, category, label, created_at, updated_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $7)
     ON CONFLICT (org_id, domain) WHERE deleted_at IS NULL DO NOTHING
     RETURNING *`,
    [orgId, newId('rcp', nowMs), domain, address, category, input.label ?? null, now]);
  if (!rows[0]) {
    // The closed error list has no conflict code for this; invalid_request names the field to change.
    throw invalidRequest('domain', `The directory already has a recipient for ${quoted(domain)}: change or delete that one.`);
  }
  return rows[0];
}

export async function getRecipient(q: Queryable, orgId: string, recipientId: string): Promise<RecipientRow> {
  const rows = await q.query<RecipientRow>(
    'SELECT * FROM recipients WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL', [orgId, recipientId]);
  if (!rows[0]) throw recipientNotFound(recipientId);
  return rows[0];
}

export interface RecipientFilter {
  category?: string;
  domain?: string;
}

/** One page of live recipients, newest first; filter values are validated like stored ones. */
export async function listRecipients(q: Queryable, orgId: string, page: PageRequest, filter: RecipientFilter) {
  const where = new PageFilter().where((p) => `org_id = ${p}`, orgId).whereSql('deleted_at IS NULL');
  if (filter.category !== undefined) where.where((p) => `category = ${p}`, categoryOf(filter.category));
  if (filter.domain !== undefined) {
    const domain = normaliseDomain(filter.domain);
    if (domain === null) throw invalidRequest('domain', `domain ${quoted(filter.domain)} is not a DNS name.`);
    where.where((p) => `domain = ${p}`, domain);
  }
  const { sql, params } = where.page(page);
  const rows = await q.query<RecipientRow>(`SELECT * FROM recipients ${sql}`, params);
  return toPage(rows, page, recipientView);
}

export interface RecipientChange {
  /** accepted only when it names the recipient's own domain: a domain is the entry's identity */
  domain?: string;
  address?: string;
  /** null removes the category */
  category?: string | null;
  /** null removes the label */
  label?: string | null;
}

export async function updateRecipient(
  db: Database, nowMs: number, orgId: string, recipientId: string, change: RecipientChange, actingKeyId?: string,
): Promise<RecipientRow> {
  const address = change.address === undefined ? undefined : addressOf(change.address);
  const category = change.category == null ? change.category : categoryOf(change.category);
  return db.transaction(async (tx) => {
    const [current] = await tx.query<RecipientRow>(
      'SELECT * FROM recipients WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL FOR UPDATE', [orgId, recipientId]);
    if (!current) throw recipientNotFound(recipientId);
    // A key revoked while this waited for the row redirects no payment.
    await assertActingKeyLive(tx, orgId, actingKeyId);
    if (change.domain !== undefined && normaliseDomain(change.domain) !== current.domain) {
      throw invalidRequest('domain',
        'A recipient\'s domain cannot change (payments name it): delete this recipient and create one for the new domain.');
    }
    const next = {
      address: address ?? current.address,
      category: category === undefined ? current.category : category,
      label: change.label === undefined ? current.label : change.label,
    };
    // A change to what it already is (the current domain alone, say) changes nothing, updated_at included.
    if (next.address === current.address && next.category === current.category && next.label === current.label) return current;
    const rows = await tx.query<RecipientRow>(
      `UPDATE recipients SET address = $3, category = $4, label = $5, updated_at = $6
       WHERE org_id = $1 AND id = $2 RETURNING *`,
      [orgId, recipientId, next.address, next.category, next.label, new Date(nowMs)]);
    return rows[0]!;
  });
}

/** Soft delete: the domain stops resolving at once and may be registered again. */
export async function deleteRecipient(q: Queryable, nowMs: number, orgId: string, recipientId: string): Promise<void> {
  const rows = await q.query(
    `UPDATE recipients SET deleted_at = $3, updated_at = $3
     WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL RETURNING id`,
    [orgId, recipientId, new Date(nowMs)]);
  if (!rows.length) throw recipientNotFound(recipientId);
}

// ---------------------------------------------------------------------------------------------
// Resolution, for payments

export interface ResolvedRecipient {
  address: string;
  domain: string | null;
  /**
   * The category the payment is recorded under and its attestation hash commits to: its own
   * entry's, else that of the oldest entry for the address with one, else the request's.
   */
  category: string | null;
  /**
   * Every category `blocked_categories` judges: `category` first, then each other one the
   * organisation's live entries give the address (oldest entry first), without repeats. A payment
   * is blocked when any of them is, whichever domain (or the bare address) it named.
   */
  categories: string[];
  recipientId: string | null;
}

/** What a payment's `to` names: a chain address or a domain (null: neither). */
export type RecipientTarget = { address: string; domain: null } | { address: null; domain: string };

export function recipientTarget(to: string): RecipientTarget | null {
  if (isAddressText(to)) return { address: to, domain: null };
  const domain = normaliseDomain(to);
  return domain === null ? null : { address: null, domain };
}

/** The refusal of a `to` that is neither a chain address nor a domain, whoever asks. */
export function malformedRecipient(to: string): ServiceError {
  return new ServiceError('invalid_recipient', `to ${quoted(to)} is neither a chain address nor a domain.`, { param: 'to' });
}

/**
 * A payment's `to` as it is recorded, hashed, compared for idempotency and filtered: trimmed, and
 * a domain in its directory (lowercase) form, so `API.Shop.Example` and `api.shop.example` are
 * one recipient. An address stays as given (base58 is case-sensitive), and so does anything
 * else, for `resolveRecipient` to refuse.
 */
export function recipientName(to: string): string {
  const trimmed = to.trim();
  return recipientTarget(trimmed)?.domain ?? trimmed;
}

/**
 * The directory entry a payment's `to` names, if any: `category` as `ResolvedRecipient` has it
 * (its own, else the address's oldest), `categories` every category of the address's live entries.
 */
export type RecipientEntry = Pick<RecipientRow, 'id' | 'address' | 'category'> & { categories: string[] };

/**
 * The directory entry of each row of `k` (columns `org_id`, `address`, `domain`, one of the last
 * two null), for a lateral join, with the categories its address counts under. Among several
 * entries for one address, one with a category comes first; an entry without a category takes
 * that of another entry for its address (the oldest with one). `categories` holds every category
 * the live entries give the address, oldest entry first, each once: the policy judges them all,
 * as otherwise a payer could dodge a blocked category by naming the address, or a second domain
 * for it, with a category of its own or none. Its length is bounded by the organisation's
 * entries for that one address (and by the distinct categories among them); it is not capped,
 * since a category past a cap would not be judged.
 */
export const recipientEntrySql = (k: string): string =>
  `SELECT e.id, e.address, COALESCE(e.category, c.categories[1]) AS category, c.categories
   FROM (SELECT e.id, e.org_id, e.address, e.category FROM recipients e
         WHERE e.org_id = ${k}.org_id AND e.deleted_at IS NULL AND (e.address = ${k}.address OR e.domain = ${k}.domain)
         ORDER BY e.category IS NULL, e.created_at, e.id LIMIT 1) e
   CROSS JOIN LATERAL (SELECT ARRAY(
     SELECT oldest.category FROM (
       SELECT DISTINCT ON (a.category) a.category, a.created_at, a.id FROM recipients a
       WHERE a.org_id = e.org_id AND a.address = e.address AND a.deleted_at IS NULL AND a.category IS NOT NULL
       ORDER BY a.category, a.created_at, a.id) oldest
     ORDER BY oldest.created_at, oldest.id) AS categories) c`;

/**
 * Whether `address` (an SQL expression) is one of this service's own accounts, of any
 * organisation: a vault, a reserve, a policy or an escrow account, or the token account of a
 * vault, a reserve or an escrow. A payment there would be credited on chain and in no index (a
 * token account's, to a token account the program opens for it, which nothing can spend), so it
 * is refused: agents pay each other through escrow, and money moves between a reserve and its
 * vaults by funding and withdrawal. Each column has an index (migrations 0019, 0021).
 */
export const serviceAccountSql = (address: string): string =>
  `(EXISTS (SELECT 1 FROM wallets sw WHERE sw.chain_address = ${address})
    OR EXISTS (SELECT 1 FROM wallets sw WHERE sw.token_address = ${address})
    OR EXISTS (SELECT 1 FROM organizations so WHERE so.reserve_address = ${address})
    OR EXISTS (SELECT 1 FROM organizations so WHERE so.reserve_token_address = ${address})
    OR EXISTS (SELECT 1 FROM policies sp WHERE sp.chain_address = ${address})
    OR EXISTS (SELECT 1 FROM escrows se WHERE se.chain_address = ${address})
    OR EXISTS (SELECT 1 FROM escrows se WHERE se.token_address = ${address}))`;

/**
 * Refuses a payment's or an escrow's receiving `address` that the chain cannot pay
 * (ChainClient.reservedAccount): before anything is recorded, as the service's own accounts are.
 */
export function assertChainPayable(chain: { reservedAccount(address: string): string | null }, address: string, param: string): void {
  const account = chain.reservedAccount(address);
  if (account !== null) {
    throw new ServiceError('invalid_recipient',
      `${address} is ${account}, which nothing can be paid to: pay a wallet's address, not the service's keys or a program.`, { param });
  }
}

/**
 * What a payment's `to` means for the organisation, given its directory entry: the address to
 * pay, the entry (if any) and the categories the payment counts under (the directory's, else the
 * request's, lowercase). Throws `invalid_recipient`, also when the address is one of the
 * service's own accounts (`serviceAccount`, from `serviceAccountSql`).
 */
export function resolvedRecipient(
  to: string, target: RecipientTarget | null, entry: RecipientEntry | undefined, requestCategory?: string | null,
  serviceAccount = false,
): ResolvedRecipient {
  const resolved = resolvedTarget(to, target, entry, requestCategory);
  if (serviceAccount) {
    throw new ServiceError('invalid_recipient',
      `${resolved.address} is an account of this service (a vault, a reserve, a policy or an escrow, or a token account of one): pay another agent through `
        + 'escrow (POST /v1/payments/a2a), and move money between a reserve and its vaults with fund and withdraw.', { param: 'to' });
  }
  return resolved;
}

function resolvedTarget(
  to: string, target: RecipientTarget | null, entry: RecipientEntry | undefined, requestCategory?: string | null,
): ResolvedRecipient {
  const fallbackCategory = requestCategory == null ? null : categoryOf(requestCategory);
  if (target === null) throw malformedRecipient(to);
  if (target.domain !== null && !entry) {
    throw new ServiceError('invalid_recipient',
      `${quoted(target.domain)} is not in your recipient directory: add it with POST /v1/recipients, or pay a chain address.`, { param: 'to' });
  }
  // The request's category counts only where the directory gives the address none.
  const category = entry?.category ?? fallbackCategory;
  const categories = [...new Set([...(category === null ? [] : [category]), ...(entry?.categories ?? [])])];
  return { address: target.address ?? entry!.address, domain: target.domain, category, categories, recipientId: entry?.id ?? null };
}

/** `resolvedRecipient` with the entry read here. Takes a Queryable so a payment resolves inside its own transaction. */
export async function resolveRecipient(
  q: Queryable, orgId: string, to: string, requestCategory?: string | null,
): Promise<ResolvedRecipient> {
  const target = recipientTarget(to);
  const [row] = target === null ? [] : await q.query<RecipientEntry & { service_account: boolean }>(
    `SELECT entry.id, entry.address, entry.category, entry.categories, ${serviceAccountSql('COALESCE(entry.address, k.address)')} AS service_account
     FROM (SELECT $1::text AS org_id, $2::text AS address, $3::text AS domain) k LEFT JOIN LATERAL (${recipientEntrySql('k')}) entry ON TRUE`,
    [orgId, target.address, target.domain]);
  const entry = row && row.id !== null ? { id: row.id, address: row.address, category: row.category, categories: row.categories } : undefined;
  return resolvedRecipient(to, target, entry, requestCategory, row?.service_account ?? false);
}

/**
 * The categories the organisation's directory gives a chain address (an escrow's receiver):
 * `category` the one a spend to it is recorded under (an entry with one first, the oldest),
 * `categories` every one, for `blocked_categories`. None when it is not in the directory.
 */
export async function addressCategories(
  q: Queryable, orgId: string, address: string,
): Promise<Pick<ResolvedRecipient, 'category' | 'categories'>> {
  const [entry] = await q.query<Pick<RecipientEntry, 'category' | 'categories'>>(
    `SELECT e.category, e.categories FROM (SELECT $1::text AS org_id, $2::text AS address, NULL::text AS domain) k
     JOIN LATERAL (${recipientEntrySql('k')}) e ON TRUE`, [orgId, address]);
  return { category: entry?.category ?? null, categories: entry?.categories ?? [] };
}
