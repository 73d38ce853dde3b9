/**
 * Webhooks (docs/webhooks.md): HTTPS endpoints an organisation registers to receive its events
 * as signed POST requests. This file holds the endpoint records: subscriptions, status, signing
 * secrets. Deliveries and the dispatcher are in delivery.ts.
 *
 * A signing secret is stored as is: every delivery is signed with it (HMAC-SHA256 needs the
 * secret itself, which a digest could not give back). It is shown in the creation and rotation
 * responses only.
 */
import { randomBytes } from 'node:crypto';
import { Type } from 'typebox';
import type { Database, Queryable } from '../db/database.ts';
import { EVENT_TYPES } from '../events/events.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { derivedId, newId } from '../ids/ids.ts';
import { assertPublicUrl } from '../net/outbound.ts';
import { assertBelowCount, lockOrganization } from '../organizations/limits.ts';

/** Enough for one endpoint per event type and per environment; more is a mistake or abuse. */
export const WEBHOOKS_PER_ORG_MAX = 20;
/** After a rotation the previous secret keeps signing this long, so receivers can switch without a gap. */
export const SECRET_ROTATION_OVERLAP_MS = 24 * 3600 * 1000;
/** Every event name at most once, plus slack for requests that repeat names (deduplicated). */
export const SUBSCRIPTIONS_MAX = 2 * EVENT_TYPES.length + 10;
export const ALL_EVENTS = '*';
const SECRET_PREFIX = 'whsec_';

export type WebhookStatus = 'active' | 'degraded' | 'disabled';

/** A new signing secret: `whsec_` and 256 random bits in base64url. */
export function generateSigningSecret(): string {
  return `${SECRET_PREFIX}${randomBytes(32).toString('base64url')}`;
}

/** Refused input is echoed in messages, but never at a length that would flood a log line. */
function quoted(text: string): string {
  return JSON.stringify(text.length > 80 ? `${text.slice(0, 80)}…` : text);
}

/**
 * The stored form of a subscription: `['*']`, or known event names without repeats, in the
 * order given. `*` may come as a string or as the only element of the array.
 */
export function normaliseSubscriptions(events: string | readonly string[]): string[] {
  const names = typeof events === 'string' ? [events] : [...events];
  if (!names.length) throw invalidRequest('events', `events is "*" or a non-empty array of event names.`);
  if (names.includes(ALL_EVENTS)) {
    if (names.some((name) => name !== ALL_EVENTS)) {
      throw invalidRequest('events', '"*" already subscribes to every event: send it alone, or list event names without it.');
    }
    return [ALL_EVENTS];
  }
  const unknown = names.find((name) => !(EVENT_TYPES as readonly string[]).includes(name));
  if (unknown === 'ping') {
    throw invalidRequest('events', '"ping" is the test event: POST /v1/webhooks/{id}/test sends it to any webhook, subscribed or not.');
  }
  if (unknown !== undefined) {
    throw invalidRequest('events', `Unknown event ${quoted(unknown)}: events is "*" or names among ${EVENT_TYPES.join(', ')}.`);
  }
  return [...new Set(names)];
}

// ---------------------------------------------------------------------------------------------
// Rows and views

export interface WebhookRow {
  id: string;
  org_id: string;
  url: string;
  events: string[];
  status: WebhookStatus;
  signing_secret: string;
  previous_signing_secret: string | null;
  previous_secret_expires_at: Date | null;
  secret_rotated_at: Date | null;
  degraded_at: Date | null;
  created_at: Date;
  updated_at: Date;
}

/** A webhook as reads show it: never a secret. */
export const WebhookView = Type.Object({
  webhook_id: Type.String(),
  url: Type.String(),
  events: Type.Array(Type.String(), { description: 'event names, or ["*"] for every event' }),
  status: Type.Union([Type.Literal('active'), Type.Literal('degraded'), Type.Literal('disabled')], {
    description: '`degraded`: a delivery failed 5 attempts in a row; deliveries are paused until PATCH {status: "active"}. '
      + '`disabled`: turned off by an operator; events are not queued meanwhile.',
  }),
  degraded_at: Type.Union([Type.String(), Type.Null()], { description: 'when the webhook last became degraded' }),
  secret_rotated_at: Type.Union([Type.String(), Type.Null()], { description: 'the last rotation; null if never rotated' }),
  previous_secret_expires_at: Type.Union([Type.String(), Type.Null()], {
    description: 'until when deliveries also carry `Service-Signature-Previous`, signed with the secret before the last rotation',
  }),
  created_at: Type.String(),
  updated_at: Type.String(),
});

/** A webhook with its new secret: the creation and rotation responses, and only those. */
export const WebhookWithSecretView = Type.Object({
  ...WebhookView.properties,
  signing_secret: Type.String({ description: 'the signing secret: shown this once, store it now' }),
});

export function webhookView(row: WebhookRow) {
  return {
    webhook_id: row.id,
    url: row.url,
    events: row.events,
    status: row.status,
    degraded_at: row.degraded_at?.toISOString() ?? null,
    secret_rotated_at: row.secret_rotated_at?.toISOString() ?? null,
    previous_secret_expires_at: row.previous_secret_expires_at?.toISOString() ?? null,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
  };
}

export function webhookWithSecretView(row: WebhookRow) {
  return { ...webhookView(row), signing_secret: row.signing_secret };
}

export function webhookNotFound(webhookId: string): ServiceError {
  return new ServiceError('webhook_not_found', `No webhook ${quoted(webhookId)} in your organisation.`, { param: 'webhook_id' });
}

// ---------------------------------------------------------------------------------------------
// Use-cases

export interface UrlPolicy {
  /** AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS */
  allowPrivateUrls: boolean;
}

export interface NewWebhook {
  url: string;
  events: string | string[];
}

/**
 * Registers an endpoint; its secret is in the returned row (shown once). The organisation row
 * is locked while counting, so two concurrent creations cannot both take the last place.
 */
export async function createWebhook(db: Database, nowMs: number, orgId: string, input: NewWebhook, policy: UrlPolicy): Promise<WebhookRow> {
  const url = assertPublicUrl(input.url, { allowPrivate: policy.allowPrivateUrls, param: 'url' }).href;
  const events = normaliseSubscriptions(input.events);
  return db.transaction(async (tx) => {
    await lockOrganization(tx, orgId);
    await assertBelowCount(tx, orgId, {
      noun: 'webhooks', countSql: 'SELECT count(*)::int AS n FROM webhooks WHERE org_id = $1', max: WEBHOOKS_PER_ORG_MAX,
      advice: 'delete one, or subscribe an existing one to more events.',
    });
    const now = new Date(nowMs);
    const rows = await tx.query<WebhookRow>(
      `INSERT INTO webhooks (id, org_id, url, events, status, signing_secret, created_at, updated_at)
       VALUES ($1, $2, $3, $4, 'active', $5, $6, $6) RETURNING *`,
      [newId('whk', nowMs), orgId, url, events, generateSigningSecret(), now]);
    return rows[0]!;
  });
}

export async function getWebhook(q: Queryable, orgId: string, webhookId: string): Promise<WebhookRow> {
  const rows = await q.query<WebhookRow>('SELECT * FROM webhooks WHERE org_id = $1 AND id = $2', [orgId, webhookId]);
  if (!rows[0]) throw webhookNotFound(webhookId);
  return rows[0];
}

/** One page of the organisation's webhooks, newest first. */
export async function listWebhooks(q: Queryable, orgId: string, page: PageRequest) {
  const { sql, params } = new PageFilter().where((p) => `org_id = ${p}`, orgId).page(page);
  const rows = await q.query<WebhookRow>(`SELECT * FROM webhooks ${sql}`, params);
  return toPage(rows, page, webhookView);
}

export interface WebhookChange {
  url?: string;
  events?: string | string[];
  /** `degraded` is the dispatcher's to set, never a request's */
  status?: 'active' | 'disabled';
}

/** The delivery of one event to one webhook always has this id, whoever records it. */
export function deliveryIdOf(webhookId: string, eventId: string, eventCreatedAt: Date): string {
  return derivedId('dlv', eventCreatedAt.getTime(), `${webhookId}\n${eventId}`);
}

/** At most this many events not yet taken by the dispatcher are kept, paused, for a webhook being disabled. */
const DISABLE_KEEPS_MAX = 10_000;

/**
 * Changes url, subscriptions or status. Status moves pause and resume deliveries in the same
 * transaction:
 * - to `disabled`: pending deliveries pause, and so do the events written before, which the
 *   dispatcher had not taken yet (up to DISABLE_KEEPS_MAX); events written while disabled are
 *   not delivered;
 * - to `active` (from `degraded` or `disabled`): every paused delivery starts a new run of
 *   five attempts, the first one due at once; from `disabled`, the webhook's stream of events
 *   starts again at the oldest transaction still running (the horizon), not at this one, so
 *   that an event whose transaction began before this one and commits after it is delivered.
 *   The price, at least once: events that transactions from the horizon on committed while it
 *   was disabled are delivered too, and one kept paused at the disabling may be sent twice.
 */
export async function updateWebhook(
  db: Database, nowMs: number, orgId: string, webhookId: string, change: WebhookChange, policy: UrlPolicy,
): Promise<WebhookRow> {
  const url = change.url === undefined ? undefined : assertPublicUrl(change.url, { allowPrivate: policy.allowPrivateUrls, param: 'url' }).href;
  const events = change.events === undefined ? undefined : normaliseSubscriptions(change.events);
  const now = new Date(nowMs);
  return db.transaction(async (tx) => {
    const [current] = await tx.query<WebhookRow>(
      'SELECT * FROM webhooks WHERE org_id = $1 AND id = $2 FOR NO KEY UPDATE', [orgId, webhookId]);
    if (!current) throw webhookNotFound(webhookId);
    const status = change.status ?? current.status;
    // Events written while it was disabled are not for it: re-enabled, its stream starts from the horizon.
    const restartsStream = status === 'active' && current.status === 'disabled';
    if (status === 'disabled' && current.status !== 'disabled') await keepUntakenEvents(tx, webhookId, now);
    const rows = await tx.query<WebhookRow>(
      `UPDATE webhooks SET url = $3, events = $4, status = $5, updated_at = $6,
         stream_xact = CASE WHEN $7 THEN pg_snapshot_xmin(pg_current_snapshot()) ELSE stream_xact END,
         stream_event_id = CASE WHEN $7 THEN '' ELSE stream_event_id END
       WHERE org_id = $1 AND id = $2 RETURNING *`,
      [orgId, webhookId, url ?? current.url, events ?? current.events, status, now, restartsStream]);
    if (status === 'disabled' && current.status !== 'disabled') await pausePendingDeliveries(tx, webhookId, now);
    if (status === 'active' && current.status !== 'active') await resumePausedDeliveries(tx, webhookId, now);
    return rows[0]!;
  });
}

/**
 * The events a webhook being disabled subscribes to that its stream has not taken yet (after
 * its position and any batch leased: that batch records its own), written before this moment
 * (committed when this statement began; not only those below the horizon a claim waits for,
 * since the stream never takes the rest once disabled): each gets its delivery, paused, so that
 * re-enabling sends it like any delivery paused then. The stream itself starts again at the
 * re-enabling's horizon, past all of them unless a transaction older than one of theirs is still
 * running then (updateWebhook).
 */
async function keepUntakenEvents(tx: Queryable, webhookId: string, now: Date): Promise<void> {
  const events = await tx.query<{ id: string; org_id: string; type: string; created_at: Date }>(
    `SELECT e.id, e.org_id, e.type, e.created_at FROM webhooks w JOIN events e ON e.org_id = w.org_id
     WHERE w.id = $1 AND (e.xact, e.id) > (w.stream_xact, w.stream_event_id)
       AND (w.lease_expires_at IS NULL OR (e.xact, e.id) > (w.lease_xact, w.lease_event_id))
       AND ('*' = ANY (w.events) OR e.type = ANY (w.events))
     ORDER BY e.xact, e.id LIMIT ${DISABLE_KEEPS_MAX}`, [webhookId]);
  if (events.length === 0) return;
  await tx.query(
    `INSERT INTO webhook_deliveries (id, org_id, webhook_id, event_id, event_type, event_created_at, status, created_at, updated_at)
     SELECT k.id, $2, $1, k.event_id, k.event_type, k.event_created_at, 'paused', k.event_created_at, $3
     FROM unnest($4::text[], $5::text[], $6::text[], $7::timestamptz[]) AS k(id, event_id, event_type, event_created_at)
     ON CONFLICT (webhook_id, event_id) DO NOTHING`,
    [webhookId, events[0]!.org_id, now, events.map((e) => deliveryIdOf(webhookId, e.id, e.created_at)), events.map((e) => e.id),
      events.map((e) => e.type), events.map((e) => e.created_at)]);
}

/**
 * Locks a webhook's pending deliveries (pings aside: a ping is never paused) and `alsoId` if
 * given, in id order: every transaction that locks several deliveries takes them in one pass in
 * id order (docs/webhooks.md "Lock order"). An UPDATE alone takes them in its plan's order,
 * newest first by the index that lists a webhook's deliveries, say, while recordSuccesses takes
 * them oldest first: each could hold a delivery the other waits for, until PostgreSQL aborts one.
 */
export async function lockPendingDeliveries(tx: Queryable, webhookId: string, alsoId: string | null = null): Promise<void> {
  await tx.query(
    `SELECT id FROM webhook_deliveries WHERE webhook_id = $1 AND (id = $2 OR (status = 'pending' AND event_type <> 'ping'))
     ORDER BY id FOR UPDATE`, [webhookId, alsoId]);
}

/** Pauses a webhook's pending deliveries, pings aside; the caller holds the webhook's row, so no other becomes pending meanwhile. */
export async function pausePendingDeliveries(tx: Queryable, webhookId: string, now: Date): Promise<void> {
  await lockPendingDeliveries(tx, webhookId);
  await tx.query(
    `UPDATE webhook_deliveries SET status = 'paused', next_attempt_at = NULL, updated_at = $2
     WHERE webhook_id = $1 AND status = 'pending' AND event_type <> 'ping'`, [webhookId, now]);
}

/** A paused delivery restarts its schedule: a new run of five attempts, the first due now. Locked in id order, as above. */
async function resumePausedDeliveries(tx: Queryable, webhookId: string, now: Date): Promise<void> {
  await tx.query(`SELECT id FROM webhook_deliveries WHERE webhook_id = $1 AND status = 'paused' ORDER BY id FOR UPDATE`, [webhookId]);
  await tx.query(
    `UPDATE webhook_deliveries SET status = 'pending', run_start = attempts, next_attempt_at = $2, updated_at = $2
     WHERE webhook_id = $1 AND status = 'paused'`, [webhookId, now]);
}

/**
 * Deletes the webhook with its delivery log; an attempt in flight finishes unrecorded. The log
 * has no foreign keys (migration 0016), so this is their cascade, in an order that leaves
 * nothing behind: the webhook's row is locked first (a batch being recorded for it finishes
 * first, and none starts after), then its deliveries' rows (an attempt being claimed on one
 * finishes first, and none starts after); the statements after those see every attempt.
 */
export async function deleteWebhook(db: Database, orgId: string, webhookId: string): Promise<void> {
  await db.transaction(async (tx) => {
    const found = await tx.query('SELECT id FROM webhooks WHERE org_id = $1 AND id = $2 FOR UPDATE', [orgId, webhookId]);
    if (!found.length) throw webhookNotFound(webhookId);
    await tx.query('SELECT count(*) FROM (SELECT id FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY id FOR UPDATE) locked', [webhookId]);
    await tx.query(
      'DELETE FROM webhook_attempts a USING webhook_deliveries d WHERE d.webhook_id = $1 AND a.delivery_id = d.id', [webhookId]);
    await tx.query('DELETE FROM webhook_deliveries WHERE webhook_id = $1', [webhookId]);
    await tx.query('DELETE FROM webhooks WHERE id = $1', [webhookId]);
  });
}

/**
 * A new secret, returned once; the one it replaces keeps signing (`Service-Signature-Previous`)
 * for 24 hours. Only one previous secret is kept: rotating again within the overlap ends the
 * older one at once. One statement, so two concurrent rotations cannot lose a secret.
 */
export async function rotateSigningSecret(q: Queryable, nowMs: number, orgId: string, webhookId: string): Promise<WebhookRow> {
  const rows = await q.query<WebhookRow>(
    `UPDATE webhooks
     SET previous_signing_secret = signing_secret, previous_secret_expires_at = $3, signing_secret = $4,
         secret_rotated_at = $5, updated_at = $5
     WHERE org_id = $1 AND id = $2 RETURNING *`,
    [orgId, webhookId, new Date(nowMs + SECRET_ROTATION_OVERLAP_MS), generateSigningSecret(), new Date(nowMs)]);
  if (!rows[0]) throw webhookNotFound(webhookId);
  return rows[0];
}
