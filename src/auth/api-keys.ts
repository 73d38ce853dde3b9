/**
 * API keys: shown once at creation, stored as SHA-256 with a visible prefix and the last four
 * characters. Roles and the permissions each holds (DESIGN §7) live here, in one table.
 */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';

export const ROLES = ['admin', 'operator', 'agent', 'viewer', 'arbiter'] as const;
export type Role = (typeof ROLES)[number];

/**
 * - `read`: everything of the organisation, read only
 * - `write`: change wallets, policies, funding, recipients, webhooks
 * - `api_keys`: create, list and revoke API keys
 * - `pay`: pay and open escrows (an agent key only from a vault whose session token it shows)
 * - `vault_read`: read one vault and its transactions (an agent key: with that vault's token)
 * - `arbitrate`: resolve disputed escrows
 * - `test_helpers`: the local validator's test helpers
 */
export type Permission = 'read' | 'write' | 'api_keys' | 'pay' | 'vault_read' | 'arbitrate' | 'test_helpers';

const PERMISSIONS: Record<Role, ReadonlySet<Permission>> = {
  admin: new Set(['read', 'write', 'api_keys', 'pay', 'vault_read', 'test_helpers']),
  operator: new Set(['read', 'write', 'pay', 'vault_read', 'test_helpers']),
  agent: new Set(['pay', 'vault_read']),
  viewer: new Set(['read', 'vault_read']),
  arbiter: new Set(['read', 'vault_read', 'arbitrate']),
};

export function roleAllows(role: Role, permission: Permission): boolean {
  return PERMISSIONS[role].has(permission);
}

/** The roles that hold `permission`, for an error telling a refused key which would do. */
export function rolesAllowed(permission: Permission): Role[] {
  return ROLES.filter((role) => PERMISSIONS[role].has(permission));
}

const KEY_PREFIX = 'av_';
const BASE62 = '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz';

/** `av_<role initial>_<32 base62 characters>` (~190 bits of randomness). */
export function generateApiKey(role: Role): string {
  const bytes = randomBytes(48);
  let body = '';
  for (const byte of bytes) {
    if (byte < 248) body += BASE62[byte % 62];
    if (body.length === 32) break;
  }
  if (body.length < 32) return generateApiKey(role);
  return `${KEY_PREFIX}${role}_${body}`;
}

export function hashApiKey(key: string): string {
  return createHash('sha256').update(key, 'utf8').digest('hex');
}

/**
 * What lists show of a key: its role part and 4 more characters (`av_admin_x7Kq`), never more
 * than 16 characters, and its last 4; the prefix stops 16 characters before the end, so at least
 * 12 stay hidden between the two — a bootstrap key of any shape stays secret.
 */
export function describeKey(key: string): { prefix: string; last4: string } {
  const end = Math.min(key.lastIndexOf('_') + 5, 16, Math.max(0, key.length - 16));
  return { prefix: key.slice(0, end), last4: key.slice(-4) };
}

/** Constant-time comparison of two hex digests of equal length. */
export function digestsEqual(a: string, b: string): boolean {
  const left = Buffer.from(a, 'hex');
  const right = Buffer.from(b, 'hex');
  return left.length === right.length && timingSafeEqual(left, right);
}

/** A syntactically possible key: anything else is refused before touching the database. */
export function looksLikeApiKey(value: string): boolean {
  return /^[A-Za-z0-9_.-]{24,256}$/.test(value);
}
