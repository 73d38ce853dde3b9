/**
 * Idempotency (DESIGN §2): a key from the `Idempotency-Key` header or the body's
 * `idempotencyKey`, scoped to the organisation, stored with a hash of the operation and its
 * parameters for 24 hours. A replay returns the first response (status and body); the same key
 * with other parameters, or while its first request still runs, is 409 idempotency_conflict.
 *
 * The key row is claimed (INSERT … ON CONFLICT DO NOTHING) before any work, so concurrent
 * identical requests run the work once. Outcomes that a retry could change — 5xx, 429 — are not
 * kept: the key is released so the client can retry it.
 */
import { createHash } from 'node:crypto';
import type { FastifyReply } from 'fastify';
import type { Database } from '../db/database.ts';
import { ServiceError, invalidRequest, type ErrorCode } from '../errors/errors.ts';

export const IDEMPOTENCY_TTL_MS = 24 * 60 * 60 * 1000;
const KEY_PATTERN = /^[\x21-\x7e]{1,255}$/;

export interface IdempotentResponse {
  status: number;
  body: unknown;
  replayed: boolean;
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
    throw invalidRequest('idempotencyKey', 'the Idempotency-Key header and idempotencyKey differ');
  }
  const key = header ?? body;
  if (key !== null && !KEY_PATTERN.test(key)) {
    throw invalidRequest('idempotencyKey', 'an idempotency key is 1 to 255 printable ASCII characters');
  }
  return key;
}

export async function runIdempotent(
  db: Database,
  options: { orgId: string; key: string | null; operation: string; params: unknown; nowMs: number },
  work: () => Promise<{ status: number; body: unknown }>,
): Promise<IdempotentResponse> {
  if (options.key === null) return { ...(await work()), replayed: false };
  const hash = requestHash(options.operation, options.params);
  const now = new Date(options.nowMs);

  const claimed = await db.transaction(async (tx) => {
    // An expired key is forgotten first, so it can be used again.
    await tx.query('DELETE FROM idempotency_keys WHERE org_id = $1 AND key = $2 AND expires_at <= $3',
      [options.orgId, options.key, now]);
    const inserted = await tx.query(
      `INSERT INTO idempotency_keys (org_id, key, request_hash, state, created_at, expires_at)
       VALUES ($1, $2, $3, 'running', $4, $5) ON CONFLICT (org_id, key) DO NOTHING RETURNING key`,
      [options.orgId, options.key, hash, now, new Date(options.nowMs + IDEMPOTENCY_TTL_MS)]);
    if (inserted.length) return null;
    const rows = await tx.query<{ request_hash: string; state: string; response_status: number | null; response_body: unknown }>(
      'SELECT request_hash, state, response_status, response_body FROM idempotency_keys WHERE org_id = $1 AND key = $2',
      [options.orgId, options.key]);
    return rows[0] ?? { request_hash: '', state: 'running', response_status: null, response_body: null };
  });

  if (claimed) {
    if (claimed.request_hash !== hash) {
      throw new ServiceError('idempotency_conflict', 'This idempotency key was already used with other parameters.');
    }
    if (claimed.state !== 'done' || claimed.response_status === null) {
      throw new ServiceError('idempotency_conflict', 'A request with this idempotency key is still being processed; retry shortly.');
    }
    if (claimed.response_status >= 400) {
      // A refused first request is refused again, the same way, marked as a replay.
      const { code, message, ...details } = (claimed.response_body as { error: Record<string, unknown> }).error;
      const replay = new ServiceError(code as ErrorCode, String(message), details);
      replay.replayed = true;
      throw replay;
    }
    return { status: claimed.response_status, body: claimed.response_body, replayed: true };
  }

  let outcome: { status: number; body: unknown };
  try {
    outcome = await work();
  } catch (error) {
    if (error instanceof ServiceError && error.status < 500 && error.status !== 429) {
      outcome = { status: error.status, body: { error: { code: error.code, message: error.message, ...error.details } } };
      await finish(db, options.orgId, options.key, outcome);
      throw error;
    }
    await db.query('DELETE FROM idempotency_keys WHERE org_id = $1 AND key = $2', [options.orgId, options.key]);
    throw error;
  }
  await finish(db, options.orgId, options.key, outcome);
  return { ...outcome, replayed: false };
}

async function finish(db: Database, orgId: string, key: string, outcome: { status: number; body: unknown }): Promise<void> {
  await db.query(
    `UPDATE idempotency_keys SET state = 'done', response_status = $3, response_body = $4 WHERE org_id = $1 AND key = $2`,
    [orgId, key, outcome.status, JSON.stringify(outcome.body, (_k, v: unknown) => (typeof v === 'bigint' ? v.toString() : v))]);
}

/** Sends an idempotent outcome, marking a replay with `Idempotency-Replayed: true`. */
export function sendIdempotent(reply: FastifyReply, result: IdempotentResponse): FastifyReply {
  if (result.replayed) reply.header('Idempotency-Replayed', 'true');
  return reply.code(result.status).send(result.body);
}
