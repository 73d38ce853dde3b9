/**
 * Authentication and roles at the edge: `Authorization: Bearer <API key>` resolves to the key's
 * organisation and role; a route declares the permission it needs in `config.permission`.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import { digestsEqual, hashApiKey, looksLikeApiKey, roleAllows, type Permission, type Role } from '../auth/api-keys.ts';
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
  }
  interface FastifyRequest {
    principal: Principal | null;
  }
}

/** last_used_at is refreshed at most this often per key (one write per request would be waste). */
const LAST_USED_RESOLUTION_MS = 60_000;

export function authenticate(ctx: AppContext) {
  return async function onRequest(request: FastifyRequest, _reply: FastifyReply): Promise<void> {
    const permission = request.routeOptions.config.permission;
    if (!permission) return;
    const header = request.headers.authorization;
    const match = typeof header === 'string' ? /^Bearer (\S+)$/.exec(header) : null;
    if (!match || !looksLikeApiKey(match[1]!)) {
      throw new ServiceError('authentication_failed', 'Send your API key as `Authorization: Bearer <API_KEY>`.');
    }
    const presentedHash = hashApiKey(match[1]!);
    const rows = await ctx.db.query<{ id: string; org_id: string; role: Role; key_hash: string; last_used_at: Date | null }>(
      'SELECT id, org_id, role, key_hash, last_used_at FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL',
      [presentedHash]);
    const key = rows[0];
    if (!key || !digestsEqual(key.key_hash, presentedHash)) {
      throw new ServiceError('authentication_failed', 'This API key is not valid (unknown or revoked).');
    }
    request.principal = { keyId: key.id, orgId: key.org_id, role: key.role };
    if (!roleAllows(key.role, permission)) {
      throw new ServiceError('insufficient_permissions', `A key with role "${key.role}" cannot do this.`);
    }
    const nowMs = ctx.clock.nowMs();
    if (!key.last_used_at || nowMs - key.last_used_at.getTime() > LAST_USED_RESOLUTION_MS) {
      await ctx.db.query('UPDATE api_keys SET last_used_at = $2 WHERE id = $1', [key.id, new Date(nowMs)]);
    }
  };
}

/** The caller of a route that declared a permission (set by authenticate). */
export function principalOf(request: FastifyRequest): Principal {
  if (!request.principal) throw new Error('route without a permission asked for the principal');
  return request.principal;
}
