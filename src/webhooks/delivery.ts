/**
 * Webhook deliveries (docs/webhooks.md "How it works"): the dispatcher that sends every event to
 * every webhook subscribed to it as a signed POST, at least once, on SPEC's schedule, and the
 * delivery log.
 *
 * First attempts come from the events themselves (migration 0015): each webhook has a position
 * in the events' transaction order. A worker
 *
 * 1. claims a webhook's stream: the events after its position and below the horizon (every
 *    older transaction has ended), leased to it for a minute, in one statement;
 * 2. sends them outside any transaction (5 s deadline, no redirects, the SSRF guard of
 *    src/net/outbound.ts), 64 at a time, then
 * 3. records the batch, one delivery and its attempt per event, with the outcome, and moves
 *    the position, in one statement, if the lease is still its own. A lease that lapses is
 *    taken over: its first attempts are recorded lost, their second attempts due on schedule.
 *
 * Later attempts are claimed from `webhook_deliveries` with `FOR UPDATE SKIP LOCKED`: the claim
 * moves the delivery's `next_attempt_at` to when the following attempt would be due and
 * records the attempt (primary key: delivery, attempt number). That time is the lease. The
 * fifth failure of a run pauses the delivery and degrades the webhook, which pauses all its
 * pending deliveries until an operator re-enables it.
 */
import { Type } from 'typebox';
import { inBatches } from '../db/batches.ts';
import type { Database, Queryable } from '../db/database.ts';
import type { AppContext } from '../http/context.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { newId } from '../ids/ids.ts';
import { DELIVERY_TIMEOUT_MS, type AttemptRequest, type AttemptResult, type SendOptions, type SentAttempt, type Signing } from './attempt.ts';
import { AttemptSenderError } from './sender.ts';
import { deliveryIdOf, getWebhook, lockPendingDeliveries, pausePendingDeliveries, webhookNotFound } from './webhooks.ts';

/** SPEC: 5 attempts: immediately, then after 1 min, 5 min, 30 min and 2 h. */
export const ATTEMPTS_PER_RUN = 5;
/** Before attempts 2…5 of a run, counted from the start of the attempt before (docs/webhooks.md "Schedule"). */
export const RETRY_DELAYS_MS = [60_000, 300_000, 1_800_000, 7_200_000] as const;
/**
 * The last attempt of a run has no next attempt whose time can serve as its lease: it is
 * leased this long, then counted as failed if its worker never said how it went.
 */
export const FINAL_ATTEMPT_LEASE_MS = 60_000;
/** Undelivered and finished deliveries alike are kept this long (the delivery log). */
export const DELIVERY_LOG_RETENTION_MS = 30 * 24 * 3600 * 1000;

/** Attempts claimed together and sent concurrently by one claimer. */
const CLAIM_BATCH = 50;
/** Claimers of one dispatch run serving webhooks side by side (more while some are held up: CLAIMERS_MAX). */
const CLAIMERS = 4;
/** One dispatch run stops claiming after this long; the next run continues. */
const DISPATCH_BUDGET_MS = 20_000;
/** How often a claimer busy with streams looks for due attempts (at once after a full batch of them). */
const DUE_LOOK_EVERY_MS = 250;
/**
 * A receiver that accepts connections and does not answer holds a claimer for its 5 s deadline
 * at each step. So that it cannot hold up other webhooks' deliveries (another organisation's),
 * a webhook whose attempt failed after this long is marked slow in this process, and only
 * SLOW_LANE_CLAIMERS claimers take its work; a claimer whose step has lasted HELD_UP_AFTER_MS
 * is replaced by another, up to CLAIMERS_MAX in all (docs/webhooks.md "A slow receiver").
 */
const SLOW_FAILURE_MS = 1_000;
/** How long a webhook stays marked slow, unless an attempt to it succeeds first. */
const SLOW_FOR_MS = 5 * 60_000;
/** Claimers of a run that take slow webhooks' work; the others pass it by. */
const SLOW_LANE_CLAIMERS = 2;
/** A claimer whose step (a stream batch, a batch of due attempts) has lasted this long is held up. */
const HELD_UP_AFTER_MS = 1_000;
/** Claimers of one run at most, held-up ones included (so at most 12 × 64 attempts in flight). */
const CLAIMERS_MAX = 12;
/**
 * Streams of one organisation sent at once (by every worker; leases taken side by side may pass
 * it by a few): receivers of one organisation that never answer, not yet marked slow (after a
 * restart, or new), hold that many claimers at most, and CLAIMERS_MAX - STREAMS_PER_ORG_MAX
 * are left for the others. As many as a run's claimers, so that one organisation alone is sent
 * as fast as before.
 */
const STREAMS_PER_ORG_MAX = CLAIMERS;
/** How often a run looks for held-up claimers. */
const HELD_UP_LOOK_EVERY_MS = 250;
/** The delivery log shows at most this many attempts per delivery (the latest). */
const LOG_ATTEMPTS_SHOWN_MAX = 25;
const RETENTION_BATCH = 1_000;
/** A retention run of the delivery log (the `webhooks.retention` job) stops starting statements after this long (each of its two parts). */
const RETENTION_RUN_MS = 2_000;
const LOST_ATTEMPT_ERROR = 'No outcome was recorded: the worker making this attempt stopped. It may have reached the endpoint.';

// ---------------------------------------------------------------------------------------------
// Slow webhooks: marked per process (per service), with until when

const slowWebhooks = new WeakMap<AppContext, Map<string, number>>();

function slowMarks(ctx: AppContext): Map<string, number> {
  let marks = slowWebhooks.get(ctx);
  if (!marks) slowWebhooks.set(ctx, marks = new Map());
  return marks;
}

function slowFailure(result: AttemptResult): boolean {
  return !result.succeeded && result.latencyMs >= SLOW_FAILURE_MS;
}

function markSlow(ctx: AppContext, webhookId: string): void {
  slowMarks(ctx).set(webhookId, performance.now() + SLOW_FOR_MS);
}

/** A success clears the webhook's mark; a slow failure sets it. */
function noteOutcome(ctx: AppContext, webhookId: string, result: AttemptResult): void {
  if (result.succeeded) slowMarks(ctx).delete(webhookId);
  else if (slowFailure(result)) markSlow(ctx, webhookId);
}

/** The webhooks marked slow now. */
function slowWebhookIds(ctx: AppContext): string[] {
  const now = performance.now();
  const marks = slowMarks(ctx);
  for (const [id, until] of marks) if (until <= now) marks.delete(id);
  return [...marks.keys()];
}

// ---------------------------------------------------------------------------------------------
// What a delivery is made of

export interface StoredEvent {
  id: string;
  type: string;
  created_at: Date;
  payload: Record<string, unknown>;
}

/** DESIGN §8: `{event, id, timestamp, ...payload}`; the three envelope fields always win. */
export function deliveryBody(event: StoredEvent): string {
  const { event: _event, id: _id, timestamp: _timestamp, ...payload } = event.payload;
  return JSON.stringify({ event: event.type, id: event.id, timestamp: event.created_at.toISOString(), ...payload });
}

// ---------------------------------------------------------------------------------------------
// Claiming

interface DeliveryRow {
  id: string;
  org_id: string;
  webhook_id: string;
  event_id: string;
  event_type: string;
  event_created_at: Date;
  status: 'pending' | 'paused' | 'delivered' | 'failed';
  attempts: number;
  run_start: number;
  next_attempt_at: Date | null;
  created_at: Date;
  updated_at: Date;
  delivered_at: Date | null;
  failure_reason: string | null;
}

/** One attempt a worker holds: everything needed to send it and to record how it went. */
export interface ClaimedAttempt extends AttemptRequest {
  webhookId: string;
  /** the fifth of its run: a failure degrades the webhook */
  final: boolean;
  ping: boolean;
}

interface SigningRow {
  id: string;
  url: string;
  signing_secret: string;
  previous_signing_secret: string | null;
  previous_secret_expires_at: Date | null;
}

function signingOf(row: SigningRow, nowMs: number): Signing {
  const previousValid = row.previous_signing_secret !== null && row.previous_secret_expires_at !== null
    && nowMs < row.previous_secret_expires_at.getTime();
  return { secret: row.signing_secret, previousSecret: previousValid ? row.previous_signing_secret : null };
}

/**
 * Claims up to `limit` due attempts of active webhooks, oldest due first, in one statement (one
 * transaction): each delivery's attempt count goes up by one and its `next_attempt_at` moves to
 * when the next attempt of the run would be due (the lease); the attempt is recorded in flight
 * with when its successor is due; an earlier attempt still in flight is marked lost (its worker
 * died); the webhook's URL and secrets and the event come back with it. Rows locked by another
 * claimer are skipped, and a row claimed a moment ago is no longer due: no attempt is ever made
 * twice. The attempts of `skipWebhooks` are passed by.
 */
export async function claimDueAttempts(
  db: Database, nowMs: number, limit: number, skipWebhooks: readonly string[] = [],
): Promise<ClaimedAttempt[]> {
  // Delay after attempt k of a run (1-based), and the lease of the last one.
  const leasesMs = [...RETRY_DELAYS_MS, FINAL_ATTEMPT_LEASE_MS];
  const claimed = await db.query<DeliveryRow & SigningRow & { event_org_id: string | null; event_created: Date | null; payload: StoredEvent['payload'] | null }>(
    `WITH due AS (
       SELECT d.id FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id
       WHERE d.status = 'pending' AND d.next_attempt_at <= $1 AND w.status = 'active'
         AND d.attempts - d.run_start < ${ATTEMPTS_PER_RUN} AND NOT (d.webhook_id = ANY ($5::text[]))
       ORDER BY d.next_attempt_at, d.id
       LIMIT ${Math.max(1, Math.floor(limit))}
       FOR UPDATE OF d SKIP LOCKED
     ), claimed AS (
       UPDATE webhook_deliveries d
       SET attempts = d.attempts + 1,
           next_attempt_at = $1::timestamptz + ($2::bigint[])[d.attempts + 1 - d.run_start] * INTERVAL '1 millisecond',
           updated_at = $1
       FROM due WHERE d.id = due.id
       RETURNING d.*
     ), lost AS (
       UPDATE webhook_attempts a SET outcome = 'lost', error = $4
       FROM claimed c WHERE a.delivery_id = c.id AND a.attempt < c.attempts AND a.outcome IS NULL
     ), attempted AS (
       -- past the last delay of a run the index is out of the array: no next attempt (NULL)
       INSERT INTO webhook_attempts (delivery_id, attempt, attempted_at, next_attempt_at)
       SELECT c.id, c.attempts, $1, $1::timestamptz + ($3::bigint[])[c.attempts - c.run_start] * INTERVAL '1 millisecond' FROM claimed c
     )
     SELECT c.*, w.url, w.signing_secret, w.previous_signing_secret, w.previous_secret_expires_at,
       e.org_id AS event_org_id, e.created_at AS event_created, e.payload
     FROM claimed c JOIN webhooks w ON w.id = c.webhook_id LEFT JOIN events e ON e.id = c.event_id
     ORDER BY c.next_attempt_at, c.id`,
    [new Date(nowMs), leasesMs, RETRY_DELAYS_MS, LOST_ATTEMPT_ERROR, skipWebhooks]);
  return claimed.map((row) => {
    const stored = row.event_org_id === row.org_id && row.payload !== null
      ? { id: row.event_id, type: row.event_type, created_at: row.event_created!, payload: row.payload } : null;
    return {
      deliveryId: row.id,
      webhookId: row.webhook_id,
      eventId: row.event_id,
      attempt: row.attempts,
      final: row.attempts - row.run_start >= ATTEMPTS_PER_RUN,
      ping: false,
      url: row.url,
      signing: signingOf(row, nowMs),
      body: stored ? deliveryBody(stored) : null,
    };
  });
}

// ---------------------------------------------------------------------------------------------
// Sending and recording

/**
 * Degrades an active webhook and pauses its pending deliveries (one in flight finishes, and is
 * then paused unless it succeeded). Returns whether this call degraded it.
 */
async function degradeWebhook(tx: Queryable, webhookId: string, now: Date): Promise<boolean> {
  const rows = await tx.query(
    `UPDATE webhooks SET status = 'degraded', degraded_at = $2, updated_at = $2 WHERE id = $1 AND status = 'active' RETURNING id`,
    [webhookId, now]);
  if (!rows.length) return false;
  await pausePendingDeliveries(tx, webhookId, now);
  return true;
}

/**
 * Records how an attempt went. A success delivers (even if the delivery was paused meanwhile);
 * a failure of the last attempt of a run pauses the delivery and degrades the webhook, unless a
 * later attempt was claimed meanwhile (then that one decides). A ping is never retried.
 *
 * Locks are taken in the one order of docs/webhooks.md "Lock order": the webhook, then
 * deliveries in one pass in id order, then attempts. A failure that may degrade the webhook
 * therefore locks this delivery together with the pending ones the degrading pauses, in one
 * pass: taking this one first, then lower ids, it could deadlock with recordSuccesses.
 */
export async function recordAttempt(db: Database, nowMs: number, claim: ClaimedAttempt, result: AttemptResult): Promise<void> {
  const now = new Date(nowMs);
  const exhausts = !result.succeeded && claim.final && !claim.ping && claim.body !== null;
  await db.transaction(async (tx) => {
    if (exhausts) {
      await tx.query('SELECT id FROM webhooks WHERE id = $1 FOR NO KEY UPDATE', [claim.webhookId]);
      await lockPendingDeliveries(tx, claim.webhookId, claim.deliveryId);
    }
    const [delivery] = await tx.query<Pick<DeliveryRow, 'status' | 'attempts' | 'run_start'>>(
      'SELECT status, attempts, run_start FROM webhook_deliveries WHERE id = $1 FOR UPDATE', [claim.deliveryId]);
    // Deleted with its webhook meanwhile: nothing left to record.
    if (!delivery) return;
    await tx.query(
      `UPDATE webhook_attempts SET outcome = $3, finished_at = $4, status_code = $5, latency_ms = $6, error = $7, response_excerpt = $8
       WHERE delivery_id = $1 AND attempt = $2`,
      [claim.deliveryId, claim.attempt, result.succeeded ? 'succeeded' : 'failed', now, result.statusCode, result.latencyMs,
        result.error, result.responseExcerpt]);
    const open = delivery.status === 'pending' || delivery.status === 'paused';
    if (!open) return;
    if (result.succeeded) {
      await tx.query(
        `UPDATE webhook_deliveries SET status = 'delivered', delivered_at = $2, next_attempt_at = NULL, updated_at = $2 WHERE id = $1`,
        [claim.deliveryId, now]);
    } else if (claim.ping || claim.body === null) {
      await tx.query(
        `UPDATE webhook_deliveries SET status = 'failed', failure_reason = $3, next_attempt_at = NULL, updated_at = $2 WHERE id = $1`,
        [claim.deliveryId, now, claim.ping ? 'ping_failed' : 'event_missing']);
    } else if (exhausts && delivery.status === 'pending' && delivery.attempts === claim.attempt
      && delivery.attempts - delivery.run_start >= ATTEMPTS_PER_RUN) {
      // Still the last attempt of the delivery's current run: not one of a run the operator has
      // since ended by re-enabling the webhook (which starts a new run, run_start = attempts).
      await tx.query(
        `UPDATE webhook_deliveries SET status = 'paused', next_attempt_at = NULL, updated_at = $2 WHERE id = $1`, [claim.deliveryId, now]);
      await degradeWebhook(tx, claim.webhookId, now);
    }
  });
}

/**
 * Records attempts that succeeded: each attempt gets its outcome, and each delivery still open
 * (pending or paused) becomes delivered — what `recordAttempt` does for one success — at the
 * time its 2xx came back (`finishedAt`), not when the batch is recorded. The deliveries' rows
 * are locked first, in id order, as `deleteWebhook` locks them before their attempts: the
 * statement alone would lock the attempts first (an unreferenced WITH step runs last) and could
 * deadlock with a webhook being deleted.
 */
export async function recordSuccesses(
  db: Database, done: ReadonlyArray<{ claim: ClaimedAttempt; result: AttemptResult; finishedAt: Date }>,
): Promise<void> {
  if (done.length === 0) return;
  await db.transaction(async (tx) => {
    await tx.query('SELECT id FROM webhook_deliveries WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE',
      [done.map((d) => d.claim.deliveryId)]);
    await tx.query(
    `WITH r AS (
       SELECT * FROM unnest($1::text[], $2::int[], $3::int[], $4::int[], $5::text[], $6::timestamptz[])
         AS r(delivery_id, attempt, status_code, latency_ms, excerpt, finished_at)
     ), delivered AS (
       UPDATE webhook_deliveries d SET status = 'delivered', delivered_at = r.finished_at, next_attempt_at = NULL, updated_at = r.finished_at
       FROM r WHERE d.id = r.delivery_id AND d.status IN ('pending', 'paused')
     )
     UPDATE webhook_attempts a SET outcome = 'succeeded', finished_at = r.finished_at, status_code = r.status_code, latency_ms = r.latency_ms,
       error = NULL, response_excerpt = r.excerpt, next_attempt_at = NULL
     FROM r WHERE a.delivery_id = r.delivery_id AND a.attempt = r.attempt`,
    [done.map((d) => d.claim.deliveryId), done.map((d) => d.claim.attempt), done.map((d) => d.result.statusCode),
      done.map((d) => d.result.latencyMs), done.map((d) => d.result.responseExcerpt), done.map((d) => d.finishedAt)]);
  });
}

/**
 * A last attempt whose lease ran out without an outcome counts as failed: its delivery pauses
 * and its webhook degrades, as if the endpoint had failed it. Returns how many were settled.
 */
export async function settleLostFinalAttempts(db: Database, nowMs: number): Promise<number> {
  const now = new Date(nowMs);
  const due = `status = 'pending' AND next_attempt_at <= $1 AND attempts - run_start >= ${ATTEMPTS_PER_RUN}`;
  const webhooks = await db.query<{ webhook_id: string }>(
    `SELECT DISTINCT webhook_id FROM webhook_deliveries WHERE ${due} LIMIT 100`, [now]);
  let settled = 0;
  for (const { webhook_id: webhookId } of webhooks) {
    settled += await db.transaction(async (tx) => {
      await tx.query('SELECT id FROM webhooks WHERE id = $1 FOR NO KEY UPDATE', [webhookId]);
      // The lost ones and those the degrading pauses, in one pass in id order (docs/webhooks.md "Lock order").
      await lockPendingDeliveries(tx, webhookId);
      const lost = await tx.query<{ id: string }>(
        `UPDATE webhook_deliveries SET status = 'paused', next_attempt_at = NULL, updated_at = $1
         WHERE webhook_id = $2 AND ${due} RETURNING id`, [now, webhookId]);
      if (!lost.length) return 0;
      await tx.query(
        `UPDATE webhook_attempts SET outcome = 'lost', error = $2 WHERE delivery_id = ANY($1::text[]) AND outcome IS NULL`,
        [lost.map((row) => row.id), LOST_ATTEMPT_ERROR]);
      await degradeWebhook(tx, webhookId, now);
      return lost.length;
    });
  }
  return settled;
}

/**
 * A ping's request ends within its 5 s deadline, answered by POST /v1/webhooks/{id}/test: one
 * pending a minute later was cut off by its process stopping, and is never retried.
 */
export const PING_LOST_AFTER_MS = 60_000;

/** Pings whose process stopped before recording them: failed (`ping_failed`), their attempt `lost`. */
export async function settleLostPings(db: Database, nowMs: number): Promise<number> {
  const lost = await db.query<{ id: string }>(
    `WITH lost AS (
       UPDATE webhook_deliveries SET status = 'failed', failure_reason = 'ping_failed', next_attempt_at = NULL, updated_at = $1
       WHERE id IN (SELECT id FROM webhook_deliveries WHERE event_type = 'ping' AND status = 'pending' AND created_at <= $2
                    ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
       RETURNING id
     ), attempts AS (
       UPDATE webhook_attempts SET outcome = 'lost', error = $3 WHERE delivery_id IN (SELECT id FROM lost) AND outcome IS NULL
     )
     SELECT id FROM lost`, [new Date(nowMs), new Date(nowMs - PING_LOST_AFTER_MS), LOST_ATTEMPT_ERROR]);
  return lost.length;
}

// ---------------------------------------------------------------------------------------------
// The stream: first attempts, read from the events themselves

/** Events one stream claim takes at most. */
const STREAM_BATCH = 512;
/** Attempts of one stream claim in flight at once (so a receiver gets at most this many connections). */
const STREAM_SENDS_MAX = 64;
/**
 * How long a worker holds a webhook's stream: a batch is at most 512 / 64 = 8 rounds of sends,
 * each within the 5 s deadline, its name's resolution included, so 40 s. After this the
 * batch counts as lost (its first attempts are `lost`, and their second attempts are due), as a
 * claimed attempt does after its lease. It equals the delay before a second attempt, so a lost
 * first attempt keeps SPEC's schedule.
 */
export const STREAM_LEASE_MS = RETRY_DELAYS_MS[0];
/**
 * A stream batch's attempts are started within this long of each other; the rest wait for the
 * webhook to be read again, so that a change made meanwhile (url, secret, subscriptions, a
 * disable, a delete) applies to them. A receiver answering at once takes a batch well within it.
 */
export const STREAM_START_WITHIN_MS = 2_000;
/** Time kept on a stream's lease to record its batch. */
const STREAM_RECORD_MARGIN_MS = 5_000;
/** Lapsed streams taken over per dispatch run. */
const LAPSED_STREAMS_MAX = 20;

/** A first attempt from the stream: a claimed attempt, with what the delivery log records of its event. */
export interface StreamAttempt extends ClaimedAttempt {
  eventType: string;
  eventCreatedAt: Date;
}

/** A worker's hold on one webhook's stream: the events after its position, up to the lease's end. */
export interface StreamClaim {
  webhookId: string;
  /** degraded: the events are recorded paused, not sent */
  active: boolean;
  lease: { xact: string; eventId: string; expiresAt: Date };
  /** one per event of the batch the webhook subscribes to */
  attempts: StreamAttempt[];
}

interface StreamRow extends SigningRow {
  status: 'active' | 'degraded';
  lease_xact: string;
  lease_event_id: string;
  lease_expires_at: Date;
  event_id: string | null;
  event_type: string | null;
  event_created_at: Date | null;
  payload: StoredEvent['payload'] | null;
}

/**
 * Takes the stream of one webhook that has undelivered events and no worker sending them: up to
 * `limit` events after its position and below the horizon, leased to this worker until
 * `nowMs + STREAM_LEASE_MS`, in one statement. The webhook row is locked while the statement
 * runs (another worker skips it) and leased once it commits (another worker passes it by), so
 * two workers never hold the same events. Null when no stream has work. `skipWebhooks` are
 * passed by (slow ones, left to the claimers that serve them), and so are the webhooks of an
 * organisation whose streams are already being sent STREAMS_PER_ORG_MAX at a time.
 */
export async function claimStream(
  db: Database, nowMs: number, limit: number, skipWebhooks: readonly string[] = [],
): Promise<StreamClaim | null> {
  const rows = await db.query<StreamRow>(
    `WITH horizon AS MATERIALIZED (
       SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin
     ), picked AS (
       SELECT w.id, w.org_id, w.stream_xact, w.stream_event_id FROM webhooks w
       WHERE w.status <> 'disabled' AND w.lease_expires_at IS NULL AND NOT (w.id = ANY ($2::text[]))
         AND (SELECT count(*) FROM webhooks o WHERE o.org_id = w.org_id AND o.lease_expires_at > $3) < ${STREAMS_PER_ORG_MAX}
         AND EXISTS (SELECT 1 FROM events e WHERE e.org_id = w.org_id
                       AND (e.xact, e.id) > (w.stream_xact, w.stream_event_id) AND e.xact < (SELECT xmin FROM horizon))
       ORDER BY w.stream_xact, w.id
       LIMIT 1
       FOR UPDATE OF w SKIP LOCKED
     ), batch AS (
       SELECT e.* FROM picked p CROSS JOIN LATERAL (
         SELECT e.id, e.type, e.created_at, e.payload, e.xact FROM events e
         WHERE e.org_id = p.org_id AND (e.xact, e.id) > (p.stream_xact, p.stream_event_id) AND e.xact < (SELECT xmin FROM horizon)
         ORDER BY e.xact, e.id
         LIMIT ${Math.max(1, Math.floor(limit))}
       ) e
     ), last AS (
       SELECT xact, id FROM batch ORDER BY xact DESC, id DESC LIMIT 1
     ), leased AS (
       UPDATE webhooks w SET lease_xact = last.xact, lease_event_id = last.id, lease_expires_at = $1,
         lease_from_xact = picked.stream_xact, lease_from_event_id = picked.stream_event_id
       FROM picked, last WHERE w.id = picked.id
       RETURNING w.id, w.status, w.events, w.url, w.signing_secret, w.previous_signing_secret, w.previous_secret_expires_at,
         w.lease_xact::text AS lease_xact, w.lease_event_id, w.lease_expires_at
     )
     SELECT l.id, l.status, l.url, l.signing_secret, l.previous_signing_secret, l.previous_secret_expires_at, l.lease_xact,
       l.lease_event_id, l.lease_expires_at, b.id AS event_id, b.type AS event_type, b.created_at AS event_created_at, b.payload
     FROM leased l LEFT JOIN batch b ON '*' = ANY (l.events) OR b.type = ANY (l.events)
     ORDER BY b.xact, b.id`,
    [new Date(nowMs + STREAM_LEASE_MS), skipWebhooks, new Date(nowMs)]);
  const [first] = rows;
  if (!first) return null;
  const signing = signingOf(first, nowMs);
  const attempts: StreamAttempt[] = [];
  for (const row of rows) {
    if (row.event_id === null) continue;
    const created = row.event_created_at!;
    attempts.push({
      deliveryId: deliveryIdOf(first.id, row.event_id, created),
      webhookId: first.id,
      eventId: row.event_id,
      eventType: row.event_type!,
      eventCreatedAt: created,
      attempt: 1,
      final: false,
      ping: false,
      url: first.url,
      signing,
      body: deliveryBody({ id: row.event_id, type: row.event_type!, created_at: created, payload: row.payload! }),
    });
  }
  return {
    webhookId: first.id,
    active: first.status === 'active',
    lease: { xact: first.lease_xact, eventId: first.lease_event_id, expiresAt: first.lease_expires_at },
    attempts,
  };
}

/**
 * What became of one event of a stream batch: an attempt's outcome; `lost` (its worker stopped:
 * the attempt may have been made); `paused` (the webhook is degraded: not attempted, waits for
 * it to be re-enabled); `deferred` (not attempted for want of time on the lease: its first
 * attempt is due at once, made as a retry is; also the rest of a batch whose receiver stalled);
 * `expired` (older than the delivery log keeps: given up unsent).
 */
type StreamOutcome =
  | { kind: 'succeeded' | 'failed'; attemptedAt: Date; finishedAt: Date; result: AttemptResult }
  | { kind: 'lost'; attemptedAt: Date }
  | { kind: 'paused' | 'deferred' | 'expired' };

/**
 * Records a stream batch and moves the webhook's position to the end of its lease, in one
 * statement, provided the lease is still the one given (otherwise nothing: it lapsed and was
 * taken over). Each event gets its delivery: delivered, or failed or lost with its second
 * attempt due (paused if the webhook is no longer active), or paused (due at once instead if
 * the webhook was re-enabled since the claim: the re-enabling resumed only the deliveries that
 * existed then), or expired. The webhook's status is read under its row lock, which a status
 * change takes too. Returns whether the lease was still held.
 */
async function recordStream(
  q: Queryable, nowMs: number, stream: Pick<StreamClaim, 'webhookId' | 'lease'>,
  done: ReadonlyArray<{ attempt: Pick<StreamAttempt, 'deliveryId' | 'eventId' | 'eventType' | 'eventCreatedAt'>; outcome: StreamOutcome }>,
): Promise<boolean> {
  const column = <T>(pick: (entry: (typeof done)[number]) => T) => done.map(pick);
  const result = (entry: (typeof done)[number]) => ('result' in entry.outcome ? entry.outcome.result : null);
  const rows = await q.query<{ released: boolean }>(
    `WITH released AS (
       UPDATE webhooks SET
         stream_xact = CASE WHEN (lease_xact, lease_event_id) > (stream_xact, stream_event_id) THEN lease_xact ELSE stream_xact END,
         stream_event_id = CASE WHEN (lease_xact, lease_event_id) > (stream_xact, stream_event_id) THEN lease_event_id ELSE stream_event_id END,
         lease_xact = NULL, lease_event_id = NULL, lease_expires_at = NULL, lease_from_xact = NULL, lease_from_event_id = NULL
       WHERE id = $1 AND lease_xact = $2::xid8 AND lease_event_id = $3 AND lease_expires_at = $4
       RETURNING id, org_id, status
     ), r AS (
       SELECT * FROM unnest($5::text[], $6::text[], $7::text[], $8::timestamptz[], $9::text[], $10::timestamptz[], $11::int[],
                            $12::int[], $13::text[], $14::text[], $17::timestamptz[])
         AS r(delivery_id, event_id, event_type, event_created_at, outcome, attempted_at, status_code, latency_ms, error, excerpt,
              finished_at)
     ), delivery AS (
       INSERT INTO webhook_deliveries (id, org_id, webhook_id, event_id, event_type, event_created_at, status, attempts,
                                       next_attempt_at, created_at, updated_at, delivered_at, failure_reason)
       SELECT r.delivery_id, w.org_id, w.id, r.event_id, r.event_type, r.event_created_at,
              CASE WHEN r.outcome = 'succeeded' THEN 'delivered' WHEN r.outcome = 'expired' THEN 'failed'
                   WHEN w.status = 'active' THEN 'pending' ELSE 'paused' END,
              CASE WHEN r.outcome IN ('succeeded', 'failed', 'lost') THEN 1 ELSE 0 END,
              -- Not attempted (deferred, or held back while the webhook was degraded and it has been
              -- re-enabled since the claim): due now.
              CASE WHEN r.outcome IN ('failed', 'lost') AND w.status = 'active' THEN r.attempted_at + $16 * INTERVAL '1 millisecond'
                   WHEN r.outcome IN ('paused', 'deferred') AND w.status = 'active' THEN $15 END,
              r.event_created_at, $15, CASE WHEN r.outcome = 'succeeded' THEN r.finished_at END,
              CASE WHEN r.outcome = 'expired' THEN 'expired' END
       FROM r CROSS JOIN released w
       ON CONFLICT (webhook_id, event_id) DO NOTHING
       RETURNING id
     ), attempt AS (
       INSERT INTO webhook_attempts (delivery_id, attempt, attempted_at, outcome, finished_at, status_code, latency_ms, error,
                                     response_excerpt, next_attempt_at)
       SELECT r.delivery_id, 1, r.attempted_at, r.outcome, r.finished_at,
              r.status_code, r.latency_ms, r.error, r.excerpt,
              CASE WHEN r.outcome <> 'succeeded' THEN r.attempted_at + $16 * INTERVAL '1 millisecond' END
       FROM r JOIN delivery d ON d.id = r.delivery_id
       WHERE r.outcome IN ('succeeded', 'failed', 'lost')
     )
     SELECT EXISTS (SELECT 1 FROM released) AS released`,
    [stream.webhookId, stream.lease.xact, stream.lease.eventId, stream.lease.expiresAt,
      column((entry) => entry.attempt.deliveryId), column((entry) => entry.attempt.eventId), column((entry) => entry.attempt.eventType),
      column((entry) => entry.attempt.eventCreatedAt), column((entry) => entry.outcome.kind),
      column((entry) => ('attemptedAt' in entry.outcome ? entry.outcome.attemptedAt : null)),
      column((entry) => result(entry)?.statusCode ?? null), column((entry) => result(entry)?.latencyMs ?? null),
      column((entry) => (entry.outcome.kind === 'lost' ? LOST_ATTEMPT_ERROR : result(entry)?.error ?? null)),
      column((entry) => result(entry)?.responseExcerpt ?? null),
      new Date(nowMs), RETRY_DELAYS_MS[0], column((entry) => ('finishedAt' in entry.outcome ? entry.outcome.finishedAt : null))]);
  return rows[0]?.released === true;
}

/**
 * Hands a batch to the sending thread. A batch whose thread failed or got stuck is sent once
 * more, on a new thread: its attempts were perhaps made (a receiver may see one twice, which
 * at-least-once allows), but otherwise they would all be lost, and a lost fifth attempt
 * degrades its webhook. If the second try fails too, the error stands and the leases decide.
 */
async function sendBatch(ctx: AppContext, requests: readonly AttemptRequest[], options: SendOptions): Promise<SentAttempt[]> {
  try {
    return await ctx.webhookSender.send(requests, options);
  } catch (error) {
    if (!(error instanceof AttemptSenderError) || ctx.webhookSender.closed) throw error;
    ctx.log.warn({ err: error, attempts: requests.length }, 'webhook sender failed; sending the batch once more');
    return ctx.webhookSender.send(requests, options);
  }
}

/**
 * Sends a stream batch, at most STREAM_SENDS_MAX at a time, and records it. A degraded
 * webhook's events are recorded paused, unsent; an event older than the delivery log keeps is
 * given up. Attempts not started within STREAM_START_WITHIN_MS (a slow receiver) are made only
 * after the webhook is read again, as it is then: to its url, signed with its secrets, if it
 * still subscribes to the event; paused if it is no longer active; not at all if it was
 * deleted. Returns the attempts made.
 */
export async function sendStream(ctx: AppContext, stream: StreamClaim): Promise<number> {
  const expiredBeforeMs = ctx.clock.nowMs() - DELIVERY_LOG_RETENTION_MS;
  const done: Array<{ attempt: StreamAttempt; outcome: StreamOutcome }> = [];
  let toSend: StreamAttempt[] = [];
  for (const attempt of stream.attempts) {
    if (attempt.eventCreatedAt.getTime() < expiredBeforeMs) done.push({ attempt, outcome: { kind: 'expired' } });
    else if (!stream.active) done.push({ attempt, outcome: { kind: 'paused' } });
    else toSend.push(attempt);
  }
  let made = 0;
  while (toSend.length > 0) {
    const sent = await sendBatch(ctx, toSend, {
      allowPrivate: ctx.config.allowPrivateWebhooks, concurrency: STREAM_SENDS_MAX, startWithinMs: STREAM_START_WITHIN_MS,
    });
    sent.forEach(({ attemptedAt, finishedAt, result }, index) => {
      done.push({ attempt: toSend[index]!, outcome: { kind: result.succeeded ? 'succeeded' : 'failed', attemptedAt, finishedAt, result } });
    });
    made += sent.length;
    for (const { result } of sent) noteOutcome(ctx, stream.webhookId, result);
    const rest = toSend.slice(sent.length);
    if (rest.length === 0) break;
    // A receiver that stalls (an attempt failed slowly) gets no further round from this claimer:
    // the rest are due at once, taken by the claimers that serve slow webhooks.
    if (sent.some(({ result }) => slowFailure(result))) {
      for (const attempt of rest) done.push({ attempt, outcome: { kind: 'deferred' } });
      break;
    }
    // Another round must end, its attempts answered (5 s each at most, the host name's
    // resolution included; counted twice, a margin), and be recorded before the lease does:
    // otherwise the rest are left to the retries.
    if (ctx.clock.nowMs() + 2 * DELIVERY_TIMEOUT_MS + STREAM_RECORD_MARGIN_MS > stream.lease.expiresAt.getTime()) {
      for (const attempt of rest) done.push({ attempt, outcome: { kind: 'deferred' } });
      break;
    }
    const [now] = await ctx.db.query<SigningRow & { status: string; events: string[] }>(
      'SELECT id, url, signing_secret, previous_signing_secret, previous_secret_expires_at, status, events FROM webhooks WHERE id = $1',
      [stream.webhookId]);
    if (!now) return made; // deleted: nothing more is sent, and nothing is recorded for it
    const subscribed = rest.filter((attempt) => now.events.includes('*') || now.events.includes(attempt.eventType));
    if (now.status !== 'active') {
      for (const attempt of subscribed) done.push({ attempt, outcome: { kind: 'paused' } });
      break;
    }
    const signing = signingOf(now, ctx.clock.nowMs());
    toSend = subscribed.map((attempt) => ({ ...attempt, url: now.url, signing }));
  }
  await recordStream(ctx.db, ctx.clock.nowMs(), stream, done);
  return made;
}

/**
 * Streams whose lease ran out without their batch being recorded (the worker stopped, or took
 * longer than the lease): each event of the batch is recorded with a `lost` first attempt and
 * its second attempt due when the lease ended, and the position moves past the batch. The
 * events are those the webhook subscribes to now. Returns how many streams were taken over.
 */
export async function recoverLapsedStreams(db: Database, nowMs: number): Promise<number> {
  // The leased range from where it started: the position may have moved past it since (a
  // webhook disabled and re-enabled restarts its stream at the re-enabling).
  const lapsed = await db.query<{ id: string; org_id: string; events: string[]; stream_xact: string; stream_event_id: string;
    lease_xact: string; lease_event_id: string; lease_expires_at: Date }>(
    `SELECT id, org_id, events, COALESCE(lease_from_xact, stream_xact)::text AS stream_xact,
            COALESCE(lease_from_event_id, stream_event_id) AS stream_event_id, lease_xact::text AS lease_xact, lease_event_id,
            lease_expires_at
     FROM webhooks WHERE lease_expires_at <= $1 ORDER BY lease_expires_at LIMIT ${LAPSED_STREAMS_MAX}`, [new Date(nowMs)]);
  let recovered = 0;
  for (const webhook of lapsed) {
    const events = await db.query<{ id: string; type: string; created_at: Date }>(
      `SELECT id, type, created_at FROM events
       WHERE org_id = $1 AND (xact, id) > ($2::xid8, $3) AND (xact, id) <= ($4::xid8, $5) AND ('*' = ANY ($6::text[]) OR type = ANY ($6::text[]))`,
      [webhook.org_id, webhook.stream_xact, webhook.stream_event_id, webhook.lease_xact, webhook.lease_event_id, webhook.events]);
    const attemptedAt = new Date(webhook.lease_expires_at.getTime() - STREAM_LEASE_MS);
    const lease = { xact: webhook.lease_xact, eventId: webhook.lease_event_id, expiresAt: webhook.lease_expires_at };
    // Another worker taking the same stream over at the same moment finds the lease gone and records nothing.
    if (await recordStream(db, nowMs, { webhookId: webhook.id, lease }, events.map((event) => ({
      attempt: { deliveryId: deliveryIdOf(webhook.id, event.id, event.created_at), eventId: event.id, eventType: event.type, eventCreatedAt: event.created_at },
      outcome: { kind: 'lost', attemptedAt },
    })))) recovered += 1;
  }
  return recovered;
}

// ---------------------------------------------------------------------------------------------
// Retention and the dispatcher

/**
 * The delivery log keeps 30 days: an undelivered delivery older than that is given up
 * (`failed`, `expired`), a finished one older than that is deleted with its attempts; each
 * `batch` per statement until none is left or RETENTION_RUN_MS has passed (src/db/batches.ts).
 */
export async function expireDeliveryLog(
  db: Database, nowMs: number, options: { batch?: number } = {},
): Promise<{ expired: number; deleted: number }> {
  const cutoff = new Date(nowMs - DELIVERY_LOG_RETENTION_MS);
  const now = new Date(nowMs);
  const budget = { batch: options.batch ?? RETENTION_BATCH, budgetMs: RETENTION_RUN_MS };
  // Each batch is picked by its index, then locked in id order (docs/webhooks.md "Lock order").
  const expired = await inBatches(async (batch) => (await db.query<{ n: number }>(
    `WITH locked AS (
       SELECT id FROM webhook_deliveries
       WHERE id IN (SELECT id FROM webhook_deliveries WHERE status IN ('pending', 'paused') AND created_at < $1 LIMIT $3)
         AND status IN ('pending', 'paused')
       ORDER BY id FOR UPDATE
     ), given_up AS (
       UPDATE webhook_deliveries d SET status = 'failed', failure_reason = 'expired', next_attempt_at = NULL, updated_at = $2
       FROM locked WHERE d.id = locked.id
       RETURNING 1
     ) SELECT count(*)::int AS n FROM given_up`, [cutoff, now, batch]))[0]!.n, budget);
  // A finished delivery gets no new attempt, so its attempts can go in the same statement
  // (the log has no foreign keys: migration 0016).
  const deleted = await inBatches(async (batch) => (await db.query<{ n: number }>(
    `WITH locked AS (
       SELECT id FROM webhook_deliveries
       WHERE id IN (SELECT id FROM webhook_deliveries WHERE status IN ('delivered', 'failed') AND updated_at < $1 LIMIT $2)
         AND status IN ('delivered', 'failed') AND updated_at < $1
       ORDER BY id FOR UPDATE
     ), gone AS (
       DELETE FROM webhook_deliveries d USING locked WHERE d.id = locked.id
       RETURNING d.id
     ), attempts AS (
       DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM gone)
     )
     SELECT count(*)::int AS n FROM gone`, [cutoff, batch]))[0]!.n, budget);
  return { expired, deleted };
}

/** A claimer of a dispatch run, as the run sees it. */
interface Claimer {
  /** takes slow webhooks' work too */
  slowLane: boolean;
  /** when its current step began; null between steps */
  stepStartedMs: number | null;
  /** the webhook whose stream it is sending, if it is */
  streamOf: string | null;
}

/**
 * One run of the dispatcher (the `webhooks.deliver` job): takes over lapsed streams, settles
 * lost last attempts and lost pings, then sends streams and due attempts until nothing is left
 * or its time budget is spent. Claimers work side by side (one's database round trips overlap
 * another's requests), each taking a stream and a batch of due attempts in turn. The first
 * SLOW_LANE_CLAIMERS take any webhook's work; the others pass slow webhooks by. A claimer held
 * up by a receiver that does not answer is replaced, so that CLAIMERS keep serving the others.
 */
export async function dispatchWebhooks(ctx: AppContext): Promise<{ attempted: number }> {
  await recoverLapsedStreams(ctx.db, ctx.clock.nowMs());
  await settleLostFinalAttempts(ctx.db, ctx.clock.nowMs());
  await settleLostPings(ctx.db, ctx.clock.nowMs());
  const deadlineMs = performance.now() + DISPATCH_BUDGET_MS;
  let attempted = 0;
  const failures: unknown[] = [];
  const claimers = new Set<Claimer>();
  const running = new Set<Promise<void>>();

  // Each claimer makes at least one step, then goes on until nothing is left or the run's time
  // is spent (none is started after it).
  const claim = async (self: Claimer): Promise<void> => {
    let dueLookedAt = -Infinity;
    let dueWasFull = false;
    do {
      const skip = self.slowLane ? [] : slowWebhookIds(ctx);
      self.stepStartedMs = performance.now();
      const stream = await claimStream(ctx.db, ctx.clock.nowMs(), STREAM_BATCH, skip);
      if (stream) {
        self.streamOf = stream.webhookId;
        attempted += await sendStream(ctx, stream);
        self.streamOf = null;
      }
      // A claimer that keeps finding streams looks for due attempts after its first batch, then
      // at most every 250 ms unless its last look found a full batch of them: a look that finds
      // nothing is a round trip, and after every batch it took a busy stream's throughput. A
      // backlog of due attempts is still taken a batch per stream batch, and a claimer with no
      // stream to take looks each time.
      const lookForDue: boolean = !stream || dueWasFull || performance.now() - dueLookedAt >= DUE_LOOK_EVERY_MS;
      if (lookForDue) dueLookedAt = performance.now();
      const retried: number = lookForDue ? await sendDueAttempts(ctx, skip) : 0;
      if (lookForDue) dueWasFull = retried >= CLAIM_BATCH;
      attempted += retried;
      self.stepStartedMs = null;
      if (!stream && !retried) return;
    } while (performance.now() < deadlineMs);
  };
  const start = (slowLane: boolean) => {
    const self: Claimer = { slowLane, stepStartedMs: null, streamOf: null };
    claimers.add(self);
    const done: Promise<void> = claim(self).catch((error: unknown) => { failures.push(error); })
      .finally(() => { claimers.delete(self); running.delete(done); });
    running.add(done);
  };
  for (let i = 0; i < CLAIMERS; i += 1) start(i < SLOW_LANE_CLAIMERS);

  while (running.size > 0) {
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, HELD_UP_LOOK_EVERY_MS);
      void Promise.allSettled([...running]).then(() => { clearTimeout(timer); resolve(); });
    });
    const now = performance.now();
    // Past the run's time no claimer is started: the run ends once the steps under way do.
    if (failures.length > 0 || now >= deadlineMs) continue;
    const heldUp = [...claimers].filter((c) => c.stepStartedMs !== null && now - c.stepStartedMs >= HELD_UP_AFTER_MS);
    if (heldUp.length === 0) continue;
    // Its receiver is slow: marked so, its next work goes to the slow lane.
    for (const c of heldUp) if (c.streamOf !== null) markSlow(ctx, c.streamOf);
    // The slow lane is kept at its size while the run goes on (its claimers that found nothing to
    // do have ended; slow webhooks' retries come due meanwhile), and the others are topped up to
    // CLAIMERS not held up.
    const slowLane = [...claimers].filter((c) => c.slowLane).length;
    for (let n = slowLane; n < SLOW_LANE_CLAIMERS && claimers.size < CLAIMERS_MAX; n += 1) start(true);
    for (let free = claimers.size - heldUp.length; free < CLAIMERS && claimers.size < CLAIMERS_MAX; free += 1) start(false);
  }
  if (failures.length > 0) throw failures[0];
  return { attempted };
}

/** Claims a batch of due attempts (second and later ones), sends them and records how they went; returns how many. */
async function sendDueAttempts(ctx: AppContext, skipWebhooks: readonly string[]): Promise<number> {
  const claims = await claimDueAttempts(ctx.db, ctx.clock.nowMs(), CLAIM_BATCH, skipWebhooks);
  if (!claims.length) return 0;
  // Successes are recorded together; any other outcome on its own.
  const succeeded: Array<{ claim: ClaimedAttempt; result: AttemptResult; finishedAt: Date }> = [];
  const sent = await sendBatch(ctx, claims, { allowPrivate: ctx.config.allowPrivateWebhooks, concurrency: claims.length });
  sent.forEach(({ result }, index) => noteOutcome(ctx, claims[index]!.webhookId, result));
  const outcomes = await Promise.allSettled(claims.map(async (claim, index) => {
    const { result, finishedAt } = sent[index]!;
    if (result.succeeded && !claim.ping && claim.body !== null) succeeded.push({ claim, result, finishedAt });
    else await recordAttempt(ctx.db, finishedAt.getTime(), claim, result);
  }));
  outcomes.push(...await Promise.allSettled([recordSuccesses(ctx.db, succeeded)]));
  const failure = outcomes.find((outcome): outcome is PromiseRejectedResult => outcome.status === 'rejected');
  // An attempt whose outcome could not be recorded becomes lost, and its next attempt comes on schedule.
  if (failure) throw failure.reason;
  return claims.length;
}

// ---------------------------------------------------------------------------------------------
// The test ping

export const PingResultView = Type.Object({
  delivery_id: Type.String({ description: 'the ping\'s entry in the delivery log' }),
  event_id: Type.String({ description: 'the synthetic event\'s id (`Service-Event-Id`); never stored as an event' }),
  success: Type.Boolean({ description: 'whether the endpoint answered 2xx within 5 seconds' }),
  status_code: Type.Union([Type.Integer(), Type.Null()], { description: 'null when no HTTP answer came back' }),
  latency_ms: Type.Integer(),
  error: Type.Union([Type.String(), Type.Null()]),
});

/**
 * Sends a synthetic `ping` now, whatever the webhook's status, and answers how it went. It is
 * recorded in the delivery log, never retried, and never changes the webhook's status.
 */
export async function sendTestPing(ctx: AppContext, orgId: string, webhookId: string) {
  const nowMs = ctx.clock.nowMs();
  const now = new Date(nowMs);
  const webhook = await getWebhook(ctx.db, orgId, webhookId);
  const eventId = newId('evt', nowMs);
  const deliveryId = newId('dlv', nowMs);
  const body = JSON.stringify({ event: 'ping', id: eventId, timestamp: now.toISOString(), webhook_id: webhook.id });
  await ctx.db.transaction(async (tx) => {
    const inserted = await tx.query(
      `INSERT INTO webhook_deliveries
         (id, org_id, webhook_id, event_id, event_type, event_created_at, status, attempts, next_attempt_at, created_at, updated_at)
       SELECT $1, org_id, id, $3, 'ping', $4, 'pending', 1, NULL, $4, $4 FROM webhooks WHERE org_id = $5 AND id = $2 FOR KEY SHARE
       RETURNING id`, [deliveryId, webhookId, eventId, now, orgId]);
    if (!inserted.length) throw webhookNotFound(webhookId);
    await tx.query('INSERT INTO webhook_attempts (delivery_id, attempt, attempted_at) VALUES ($1, 1, $2)', [deliveryId, now]);
  });
  const claim: ClaimedAttempt = {
    deliveryId, webhookId, eventId, attempt: 1, final: false, ping: true, url: webhook.url, signing: signingOf(webhook, nowMs), body,
  };
  // A sender that failed (its thread stopped) is a failed ping, not a delivery left pending.
  const result = await ctx.webhookSender.send([claim], { allowPrivate: ctx.config.allowPrivateWebhooks, concurrency: 1 }).then(
    ([sent]) => sent!.result,
    (): AttemptResult => ({ succeeded: false, statusCode: null, latencyMs: 0, error: 'The request could not be made.', responseExcerpt: null }));
  await recordAttempt(ctx.db, ctx.clock.nowMs(), claim, result);
  return {
    delivery_id: deliveryId, event_id: eventId, success: result.succeeded, status_code: result.statusCode,
    latency_ms: result.latencyMs, error: result.error,
  };
}

// ---------------------------------------------------------------------------------------------
// The delivery log

interface AttemptRow {
  delivery_id: string;
  attempt: number;
  attempted_at: Date;
  outcome: 'succeeded' | 'failed' | 'lost' | null;
  finished_at: Date | null;
  status_code: number | null;
  latency_ms: number | null;
  error: string | null;
  response_excerpt: string | null;
  next_attempt_at: Date | null;
}

const TIME_OR_NULL = Type.Union([Type.String(), Type.Null()]);

export const AttemptView = Type.Object({
  attempt: Type.Integer({ description: 'its number among all attempts of the delivery (`Service-Delivery-Attempt`)' }),
  attempted_at: Type.String(),
  outcome: Type.Union([Type.Literal('in_flight'), Type.Literal('succeeded'), Type.Literal('failed'), Type.Literal('lost')], {
    description: '`lost`: the worker stopped before recording an outcome (the request may have arrived)',
  }),
  status_code: Type.Union([Type.Integer(), Type.Null()], { description: 'the endpoint\'s HTTP status; null when none came back' }),
  latency_ms: Type.Union([Type.Integer(), Type.Null()]),
  error: Type.Union([Type.String(), Type.Null()], { description: 'why the attempt failed' }),
  response_excerpt: Type.Union([Type.String(), Type.Null()], { description: 'the first 500 characters of the endpoint\'s answer' }),
  next_attempt_at: Type.Union([Type.String(), Type.Null()], { description: 'when the next attempt is due should this one fail; null after the last of a run' }),
});

export const DeliveryStatusSchema = Type.Union([Type.Literal('pending'), Type.Literal('paused'), Type.Literal('delivered'), Type.Literal('failed')]);

export const DeliveryView = Type.Object({
  delivery_id: Type.String(),
  webhook_id: Type.String(),
  event_id: Type.String(),
  event_type: Type.String({ description: 'an event name, or `ping` for a test' }),
  status: Type.Union([Type.Literal('pending'), Type.Literal('paused'), Type.Literal('delivered'), Type.Literal('failed')], {
    description: '`pending`: an attempt is due at next_attempt_at; `paused`: waits for the webhook to be active; '
      + '`failed`: given up (see failure_reason)',
  }),
  attempt_count: Type.Integer(),
  next_attempt_at: TIME_OR_NULL,
  failure_reason: Type.Union([Type.Literal('expired'), Type.Literal('event_missing'), Type.Literal('ping_failed'), Type.Null()]),
  created_at: Type.String({ description: 'when the event happened' }),
  delivered_at: TIME_OR_NULL,
  attempts: Type.Array(AttemptView, { description: `oldest first; at most the ${LOG_ATTEMPTS_SHOWN_MAX} latest` }),
});

function attemptView(row: AttemptRow) {
  return {
    attempt: row.attempt,
    attempted_at: row.attempted_at.toISOString(),
    outcome: row.outcome ?? 'in_flight' as const,
    status_code: row.status_code,
    latency_ms: row.latency_ms,
    error: row.error,
    response_excerpt: row.response_excerpt,
    next_attempt_at: row.next_attempt_at?.toISOString() ?? null,
  };
}

export interface DeliveryFilter {
  status?: DeliveryRow['status'];
  eventId?: string;
}

/** One page of a webhook's deliveries, newest event first, each with its latest attempts. */
export async function listDeliveries(q: Queryable, orgId: string, webhookId: string, page: PageRequest, filter: DeliveryFilter) {
  await getWebhook(q, orgId, webhookId);
  const where = new PageFilter().where((p) => `org_id = ${p}`, orgId).where((p) => `webhook_id = ${p}`, webhookId);
  if (filter.status !== undefined) {
    where.where((p) => `status = ${p}`, filter.status);
    // Unsent ones are few: as a literal too, so that a generic plan reads their index (migration 0047).
    if (filter.status === 'pending' || filter.status === 'paused') where.whereSql(`status IN ('pending', 'paused')`);
  }
  if (filter.eventId !== undefined) where.where((p) => `event_id = ${p}`, filter.eventId);
  const { sql, params } = where.page(page);
  const rows = await q.query<DeliveryRow>(`SELECT * FROM webhook_deliveries ${sql}`, params);
  const shown = rows.slice(0, page.limit).map((row) => row.id);
  const attempts = shown.length ? await q.query<AttemptRow>(
    `SELECT * FROM (
       SELECT a.*, row_number() OVER (PARTITION BY delivery_id ORDER BY attempt DESC) AS recency
       FROM webhook_attempts a WHERE delivery_id = ANY($1::text[])
     ) latest WHERE recency <= ${LOG_ATTEMPTS_SHOWN_MAX} ORDER BY delivery_id, attempt`, [shown]) : [];
  const attemptsOf = new Map<string, AttemptRow[]>();
  for (const attempt of attempts) attemptsOf.set(attempt.delivery_id, [...(attemptsOf.get(attempt.delivery_id) ?? []), attempt]);
  return toPage(rows, page, (row) => ({
    delivery_id: row.id,
    webhook_id: row.webhook_id,
    event_id: row.event_id,
    event_type: row.event_type,
    status: row.status,
    attempt_count: row.attempts,
    next_attempt_at: row.next_attempt_at?.toISOString() ?? null,
    failure_reason: row.failure_reason as 'expired' | 'event_missing' | 'ping_failed' | null,
    created_at: row.created_at.toISOString(),
    delivered_at: row.delivered_at?.toISOString() ?? null,
    attempts: (attemptsOf.get(row.id) ?? []).map(attemptView),
  }));
}

// ---------------------------------------------------------------------------------------------
// Lag, for benchmarks

/**
 * Webhook lag as a receiver sees it: from an event's time to its delivery's 2xx, over the
 * events delivered since `sinceMs` (service clock), pings excluded. A benchmark reads it after
 * a run; docs/webhooks.md "Measuring lag".
 */
export async function deliveryLag(q: Queryable, sinceMs: number): Promise<{ delivered: number; p50Ms: number | null; p95Ms: number | null; maxMs: number | null }> {
  const [row] = await q.query<{ delivered: number; p50: number | null; p95: number | null; max: number | null }>(
    `SELECT count(*)::int AS delivered,
            percentile_cont(0.5) WITHIN GROUP (ORDER BY lag) AS p50,
            percentile_cont(0.95) WITHIN GROUP (ORDER BY lag) AS p95,
            max(lag) AS max
     FROM (SELECT extract(epoch FROM delivered_at - event_created_at) * 1000 AS lag FROM webhook_deliveries
           WHERE status = 'delivered' AND event_type <> 'ping' AND delivered_at >= $1) lags`, [new Date(sinceMs)]);
  const ms = (value: number | null | undefined) => (value === null || value === undefined ? null : Math.round(Number(value)));
  return { delivered: row?.delivered ?? 0, p50Ms: ms(row?.p50), p95Ms: ms(row?.p95), maxMs: ms(row?.max) };
}
