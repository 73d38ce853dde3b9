/**
 * Authentication and roles at the edge: `Authorization: Bearer <API key>` resolves to the key's
 * organisation and role; a route declares the permission it needs in `config.permission`.
 */
import { performance } from 'node:perf_hooks';
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { Database } from '../db/database.ts';
import { digestsEqual, hashApiKey, looksLikeApiKey, roleAllows, rolesAllowed, type Permission, type Role } from '../auth/api-keys.ts';
import { ServiceError } from '../errors/errors.ts';
import type { AppContext } from './context.ts';

export interface Principal {
  keyId: string;
  orgId: string;
  role: Role;
}

declare module 'fastify' {
  interface FastifyContextConfig {
    /** the permission a route needs; routes without one are public (health, docs) */
    permission?: Permission;
    /**
     * The key may come from a cache of at most KEY_CACHE_MS: only for routes whose own database
     * transaction checks again that the key is live (payments), so a revoked key never acts.
     */
    cachedKey?: boolean;
    /** what a path parameter left empty answers (`GET /v1/wallets/`); by default, no route (app.ts) */
    emptyParam?: () => ServiceError;
  }
  interface FastifyRequest {
    principal: Principal | null;
  }
}

/** last_used_at is refreshed at most this often per key (one write per request would be waste). */
const LAST_USED_RESOLUTION_MS = 60_000;
/** How long a key read for a `cachedKey` route answers the next ones without reading it again. */
export const KEY_CACHE_MS = 1_000;
const KEY_CACHE_MAX = 10_000;

interface KeyRow { id: string; org_id: string; role: Role; key_hash: string; last_used_at: Date | null }

/** Keys by their hash, per database (one per service; tests run several). */
const keyCaches = new WeakMap<Database, Map<string, { key: KeyRow; expiresAt: number }>>();

function keyCacheOf(db: Database): Map<string, { key: KeyRow; expiresAt: number }> {
  let cache = keyCaches.get(db);
  if (!cache) {
    cache = new Map();
    keyCaches.set(db, cache);
  }
  return cache;
}

/** A revoked key leaves this process's cache at once (other processes' within KEY_CACHE_MS). */
export function forgetApiKey(db: Database, keyId: string): void {
  const cache = keyCaches.get(db);
  if (!cache) return;
  for (const [hash, entry] of cache) if (entry.key.id === keyId) cache.delete(hash);
}

export function invalidKeyError(): ServiceError {
  return new ServiceError('authentication_failed', 'This API key is not valid (unknown or revoked).');
}

async function readKey(ctx: AppContext, presentedHash: string, cached: boolean): Promise<KeyRow | undefined> {
  const cache = cached ? keyCacheOf(ctx.db) : null;
  const hit = cache?.get(presentedHash);
  if (hit && hit.expiresAt > performance.now()) return hit.key;
  const [key] = await ctx.db.query<KeyRow>(
    'SELECT id, org_id, role, key_hash, last_used_at FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL',
    [presentedHash]);
  if (cache) {
    if (!key) cache.delete(presentedHash);
    else {
      if (cache.size >= KEY_CACHE_MAX) cache.clear();
      cache.set(presentedHash, { key, expiresAt: performance.now() + KEY_CACHE_MS });
    }
  }
  return key;
}

/** Counts a request against its key's rate limit; rejects (429 `rate_limited`) over it. */
export type CountRequest = (request: FastifyRequest, reply: FastifyReply) => Promise<unknown>;

/**
 * Identifies the key (401 without a live one), counts the request against that key's rate limit
 * (`count`), then checks the key's role (403). Counted before the role check and before the body
 * is parsed and validated, so a key looping requests it may not make, or malformed ones, is
 * throttled like any other: over its limit every request it sends is 429.
 */
export function authenticate(ctx: AppContext, count: CountRequest) {
  return async function onRequest(request: FastifyRequest, reply: FastifyReply): Promise<void> {
    const { permission, cachedKey } = request.routeOptions.config;
    if (!permission) return;
    const header = request.headers.authorization;
    const match = typeof header === 'string' ? /^Bearer (\S+)$/.exec(header) : null;
    if (!match || !looksLikeApiKey(match[1]!)) {
      throw new ServiceError('authentication_failed', 'Send your API key as `Authorization: Bearer <API_KEY>`.');
    }
    const presentedHash = hashApiKey(match[1]!);
    const key = await readKey(ctx, presentedHash, cachedKey === true);
    if (!key || !digestsEqual(key.key_hash, presentedHash)) throw invalidKeyError();
    request.principal = { keyId: key.id, orgId: key.org_id, role: key.role };
    await count(request, reply);
    if (!roleAllows(key.role, permission)) {
      const allowed = rolesAllowed(permission).map((role) => `"${role}"`).join(', ');
      // An agent reading the organisation's lists is most likely looking for its own vault.
      const hint = key.role === 'agent' && permission === 'read'
        ? ' An agent reads its own vault: GET /v1/wallets/{wallet_id} and /v1/wallets/{wallet_id}/transactions, with its Session-Token.' : '';
      throw new ServiceError('insufficient_permissions', `A key with role "${key.role}" cannot do this; keys that can: ${allowed}.${hint}`);
    }
    const nowMs = ctx.clock.nowMs();
    if (!key.last_used_at || nowMs - key.last_used_at.getTime() > LAST_USED_RESOLUTION_MS) {
      key.last_used_at = new Date(nowMs);
      await ctx.db.query('UPDATE api_keys SET last_used_at = $2 WHERE id = $1', [key.id, key.last_used_at]);
    }
  };
}

/** The caller of a route that declared a permission (set by authenticate). */
export function principalOf(request: FastifyRequest): Principal {
  if (!request.principal) throw new Error('route without a permission asked for the principal');
  return request.principal;
}
