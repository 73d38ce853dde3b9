/**
 * Idempotency (DESIGN §2): a key from the `Idempotency-Key` header or the body's
 * `idempotencyKey`, scoped to the organisation, stored with a hash of the operation and its
 * parameters for 24 hours. A replay returns the first response (status and body); the same key
 * with other parameters, or while its first request still runs, is 409 idempotency_conflict.
 *
 * The key row is claimed (INSERT … ON CONFLICT DO NOTHING) before any work, so concurrent
 * identical requests run the work once. Outcomes that a retry could change — 5xx, 429 — are not
 * kept. A running key is leased; the work names what it records on the key in the same
 * database transaction, so a retry after a crash answers with that record instead of running
 * the work twice.
 */
import { createHash, randomUUID } from 'node:crypto';
import type { FastifyReply } from 'fastify';
import { inBatches } from '../db/batches.ts';
import type { Database, Queryable } from '../db/database.ts';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import { ServiceError, invalidRequest, type ErrorCode } from '../errors/errors.ts';

export const IDEMPOTENCY_TTL_MS = 24 * 60 * 60 * 1000;
const KEY_PATTERN = /^[\x21-\x7e]{1,255}$/;

export interface IdempotentResponse {
  status: number;
  body: unknown;
  replayed: boolean;
  /** the body as stored for the key: sent as it is, not through today's response schema */
  stored?: boolean;
}

export function requestHash(operation: string, params: unknown): string {
  return createHash('sha256').update(operation).update('\0').update(canonicalJson(params)).digest('hex');
}

/** JSON with sorted object keys, bigint as decimal strings: the same parameters hash the same. */
export function canonicalJson(value: unknown): string {
  if (typeof value === 'bigint') return JSON.stringify(value.toString());
  if (value === null || typeof value !== 'object') return JSON.stringify(value) ?? 'null';
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  const entries = Object.entries(value as Record<string, unknown>)
    .filter(([, v]) => v !== undefined)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return `{${entries.map(([k, v]) => `${JSON.stringify(k)}:${canonicalJson(v)}`).join(',')}}`;
}

/** The key from header or body; both given and different is a malformed request. */
export function idempotencyKeyOf(headerValue: unknown, bodyValue: unknown): string | null {
  const header = typeof headerValue === 'string' ? headerValue : null;
  const body = typeof bodyValue === 'string' ? bodyValue : null;
  if (header !== null && body !== null && header !== body) {
    throw invalidRequest('idempotency_key', 'the Idempotency-Key header and idempotencyKey differ');
  }
  const key = header ?? body;
  if (key !== null && !KEY_PATTERN.test(key)) {
    throw invalidRequest('idempotency_key', 'an idempotency key is 1 to 255 printable ASCII characters, no space');
  }
  return key;
}

/**
 * Names, inside the database transaction that records it, what the first request created, so
 * a retry whose first request never answered (a crash, a lost reply) answers with it.
 */
export type RecordMarker = (tx: Queryable, resourceId: string) => Promise<void>;

export interface IdempotentOperation {
  orgId: string;
  key: string | null;
  operation: string;
  params: unknown;
  nowMs: number;
  /**
   * When leases are measured from: the wall clock unless given (tests). Not the service clock,
   * which a test clock moves forward: that must not end a running request's lease, letting a
   * retry take its key over and answer for it.
   */
  leaseNowMs?: number;
  /**
   * The API key asking: checked still live where the work records (`mark`, after its locks), so
   * that a key revoked while the request waited moves nothing. Payments check it themselves.
   */
  actingKeyId?: string;
  /** The answer for a resource the first request recorded but did not answer with. */
  recover?: (resourceId: string) => Promise<{ status: number; body: unknown }>;
}

/** How long a running first request holds its key; longer than any request runs (≤ ~25 s). */
export const IDEMPOTENCY_LEASE_MS = 60_000;

type Claim =
  | { mode: 'run'; holder: string }
  | { mode: 'recover'; holder: string; resourceId: string }
  | { mode: 'replay'; status: number; body: unknown }
  | { mode: 'conflict'; message: string };

interface KeyRow {
  request_hash: string;
  state: string;
  response_status: number | null;
  response_body: unknown;
  lease_until: Date | null;
  resource_id: string | null;
}

async function claimKey(db: Database, op: IdempotentOperation & { key: string }, hash: string): Promise<Claim> {
  const now = new Date(op.nowMs);
  const leaseNowMs = op.leaseNowMs ?? Date.now();
  const leaseUntil = new Date(leaseNowMs + IDEMPOTENCY_LEASE_MS);
  const holder = randomUUID();
  return db.transaction(async (tx) => {
    // An expired key is forgotten first, so it can be used again.
    await tx.query('DELETE FROM idempotency_keys WHERE org_id = $1 AND key = $2 AND expires_at <= $3', [op.orgId, op.key, now]);
    const inserted = await tx.query(
      `INSERT INTO idempotency_keys (org_id, key, request_hash, state, created_at, expires_at, lease_until, lease_holder)
       VALUES ($1, $2, $3, 'running', $4, $5, $6, $7) ON CONFLICT (org_id, key) DO NOTHING RETURNING key`,
      [op.orgId, op.key, hash, now, new Date(op.nowMs + IDEMPOTENCY_TTL_MS), leaseUntil, holder]);
    if (inserted.length) return { mode: 'run', holder };
    const [row] = await tx.query<KeyRow>(
      `SELECT request_hash, state, response_status, response_body, lease_until, resource_id
       FROM idempotency_keys WHERE org_id = $1 AND key = $2 FOR UPDATE`, [op.orgId, op.key]);
    if (!row) return { mode: 'conflict', message: 'A request with this idempotency key is still being processed; retry shortly.' };
    if (row.request_hash !== hash) return { mode: 'conflict', message: 'This idempotency key was already used with other parameters.' };
    if (row.state === 'done' && row.response_status !== null) {
      return { mode: 'replay', status: row.response_status, body: row.response_body };
    }
    if (row.lease_until !== null && row.lease_until.getTime() > leaseNowMs) {
      return { mode: 'conflict', message: 'A request with this idempotency key is still being processed; retry shortly.' };
    }
    // The first request stopped without answering (or is still running, past its lease): this
    // one takes the key over, and the first can no longer write to it.
    await tx.query('UPDATE idempotency_keys SET lease_until = $3, lease_holder = $4 WHERE org_id = $1 AND key = $2',
      [op.orgId, op.key, leaseUntil, holder]);
    if (row.resource_id === null) return { mode: 'run', holder };
    if (!op.recover) return { mode: 'conflict', message: 'The first request with this idempotency key did not finish; use a new key.' };
    return { mode: 'recover', holder, resourceId: row.resource_id };
  });
}

/**
 * Runs `work` once per key. A replay answers the first answer; a key whose first request is
 * running is a conflict; one whose first request stopped without answering (its lease ran out)
 * is taken over: it answers with what that request recorded, or runs again when it recorded
 * nothing — which `mark` makes certain, since it is written with the record.
 */
export async function runIdempotent(
  db: Database,
  op: IdempotentOperation,
  work: (mark: RecordMarker) => Promise<{ status: number; body: unknown }>,
): Promise<IdempotentResponse> {
  const keyLive: RecordMarker = async (tx) => { await assertActingKeyLive(tx, op.orgId, op.actingKeyId); };
  if (op.key === null) return { ...(await work(keyLive)), replayed: false };
  const key = op.key;
  const claim = await claimKey(db, { ...op, key }, requestHash(op.operation, op.params));
  if (claim.mode === 'conflict') throw new ServiceError('idempotency_conflict', claim.message);
  if (claim.mode === 'replay') {
    if (claim.status >= 400) {
      // A refused first request is refused again, the same way, marked as a replay.
      const { code, message, ...details } = (claim.body as { error: Record<string, unknown> }).error;
      const replay = new ServiceError(code as ErrorCode, String(message), details);
      replay.replayed = true;
      throw replay;
    }
    return { status: claim.status, body: claim.body, replayed: true, stored: true };
  }

  const { holder } = claim;
  const mark: RecordMarker = async (tx, resourceId) => {
    await keyLive(tx, resourceId);
    // In the transaction that records: a request whose key a retry took over (its lease ran out
    // while it waited, on the chain say) records nothing, so the key's work is done once.
    const marked = await tx.query(
      'UPDATE idempotency_keys SET resource_id = $3 WHERE org_id = $1 AND key = $2 AND lease_holder = $4 RETURNING key',
      [op.orgId, key, resourceId, holder]);
    if (!marked.length) throw new LeaseLostError();
  };
  // An answer a retry may change (5xx, 429, or one about the caller's credentials): the lease
  // ends now, so the retry takes the key over at once and answers with what was recorded, or
  // runs again if nothing was.
  const endLease = () => db.query('UPDATE idempotency_keys SET lease_until = $3 WHERE org_id = $1 AND key = $2 AND lease_holder = $4',
    [op.orgId, key, new Date(op.leaseNowMs ?? Date.now()), holder]);
  // The answer stored under the key; when the database fails to store it (a dropped connection),
  // the request answers 503 as any failure then does, and its lease ends if the database lets it:
  // the retry it was told to make then answers from the record at once, not after the lease.
  const answered = async (outcome: { status: number; body: unknown }) => {
    try {
      await finish(db, op.orgId, key, holder, outcome);
    } catch (error) {
      await endLease().catch(() => {});
      throw error;
    }
  };
  let outcome: { status: number; body: unknown };
  try {
    outcome = claim.mode === 'recover' ? await op.recover!(claim.resourceId) : await work(mark);
  } catch (error) {
    if (error instanceof ServiceError && isKeptAnswer(error.status) && !(error instanceof LeaseLostError)) {
      outcome = { status: error.status, body: { error: { code: error.code, message: error.message, ...error.details } } };
      await answered(outcome);
      // Recovered, it is the earlier request's answer (a payment it recorded blocked, say).
      if (claim.mode === 'recover') error.replayed = true;
      throw error;
    }
    await endLease();
    throw error;
  }
  await answered(outcome);
  // A recovered answer is an earlier request's work: this request made nothing.
  return { ...outcome, replayed: claim.mode === 'recover' };
}

/**
 * Whether an error answer is kept under the key and replayed. Not 5xx or 429 (try again later),
 * nor 401 or 403: those describe the credentials presented (a revoked key, a session token
 * rotated or expired while the request waited for its vault), not the request, and a retry with
 * valid ones must make the payment rather than replay the refusal for 24 hours.
 */
function isKeptAnswer(status: number): boolean {
  return status < 500 && status !== 429 && status !== 401 && status !== 403;
}

/** A purge run stops starting statements after this long; the next run (a minute later) goes on. */
const PURGE_RUN_MS = 10_000;

/**
 * The `idempotency.purge` job: keys past their 24 hours are deleted, `batch` per statement, until
 * none is left or the run has taken 10 s (src/db/batches.ts).
 */
export async function purgeExpiredKeys(db: Database, nowMs: number, batch = 1_000): Promise<number> {
  return inBatches(async (size) => (await db.query<{ n: number }>(
    `WITH gone AS (DELETE FROM idempotency_keys WHERE (org_id, key) IN (
       SELECT org_id, key FROM idempotency_keys WHERE expires_at <= $1 LIMIT $2) RETURNING 1)
     SELECT count(*)::int AS n FROM gone`, [new Date(nowMs), size]))[0]!.n, { batch, budgetMs: PURGE_RUN_MS });
}

/** The key's answer, kept for replays: only while this request holds its lease (a retry that took it over answers for it). */
async function finish(db: Database, orgId: string, key: string, holder: string, outcome: { status: number; body: unknown }): Promise<void> {
  await db.query(
    `UPDATE idempotency_keys SET state = 'done', response_status = $3, response_body = $4 WHERE org_id = $1 AND key = $2 AND lease_holder = $5`,
    [orgId, key, outcome.status, JSON.stringify(outcome.body, (_k, v: unknown) => (typeof v === 'bigint' ? v.toString() : v)), holder]);
}

/** A request whose idempotency key a retry took over (its lease ran out): it records nothing. */
export class LeaseLostError extends ServiceError {
  constructor() {
    super('idempotency_conflict', 'This request ran past its idempotency key\'s lease and a retry took the key over; that retry answers for it.');
  }
}

/** Sends an idempotent outcome, marking a replay with `Idempotency-Replayed: true`. */
export function sendIdempotent(reply: FastifyReply, result: IdempotentResponse): FastifyReply {
  if (result.replayed) reply.header('Idempotency-Replayed', 'true');
  // A stored answer is the first answer, equal as JSON (stored as jsonb, its fields may come in
  // another order), sent as stored: one a process of an earlier version stored may lack a field
  // today's schema requires, which its serializer would refuse (a 500 on every retry of the key
  // for 24 hours).
  if (result.stored) reply.type('application/json; charset=utf-8').serializer((payload: unknown) => JSON.stringify(payload));
  return reply.code(result.status).send(result.body);
}
