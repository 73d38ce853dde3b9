/**
 * API keys of an organisation (DESIGN §7): created with a role and shown once, listed by their
 * visible prefix and last four characters, revoked at once. The HTTP routes and the operator's
 * CLI (`agent-vault keys`) both call these use-cases, so both obey the same rules.
 */
import { Type } from 'typebox';
import { ROLES, type Role } from '../auth/api-keys.ts';
import type { Database, Queryable } from '../db/database.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { NAME_PATTERN, NAME_TEXT, patternString } from '../http/fields.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { assertBelowCount, lockOrganization } from '../organizations/limits.ts';
import { insertApiKey } from '../organizations/organizations.ts';
import { forgetApiKey } from '../http/auth.ts';

export const KEY_NAME_MAX = 100;
/** At least one visible character and no control characters (names are printed in tables). */
const KEY_NAME_REGEX = new RegExp(NAME_PATTERN, 'u');

export const RoleSchema = Type.Union([
  Type.Literal('admin'), Type.Literal('operator'), Type.Literal('agent'), Type.Literal('viewer'), Type.Literal('arbiter'),
], { description: 'admin: everything, API keys included; operator: all but API keys; agent: pay from vaults it holds a session token for; viewer: read only; arbiter: resolves disputed escrows' });

export const KeyNameSchema = patternString(NAME_PATTERN, NAME_TEXT, { minLength: 1, maxLength: KEY_NAME_MAX });

/** A key as lists show it: never the key itself, never its hash. */
export const ApiKeyView = Type.Object({
  api_key_id: Type.String(),
  name: Type.String(),
  role: RoleSchema,
  prefix: Type.String({ description: 'the visible start of the key' }),
  last4: Type.String({ description: 'its last four characters' }),
  created_at: Type.String(),
  last_used_at: Type.Union([Type.String(), Type.Null()], { description: 'refreshed at most once a minute' }),
  revoked_at: Type.Union([Type.String(), Type.Null()], { description: 'when it stopped working; null while active' }),
});

export const CreatedApiKeyView = Type.Object({
  api_key_id: Type.String(),
  name: Type.String(),
  role: RoleSchema,
  key: Type.String({ description: 'the API key: shown this once, store it now (only its hash is kept)' }),
  prefix: Type.String(),
  last4: Type.String(),
  created_at: Type.String(),
});

export interface ApiKeyRow {
  id: string;
  org_id: string;
  name: string;
  role: Role;
  prefix: string;
  last4: string;
  created_at: Date;
  last_used_at: Date | null;
  revoked_at: Date | null;
}

// The hash column is deliberately absent: nothing that reads keys for display can leak it.
const API_KEY_COLUMNS = 'id, org_id, name, role, prefix, last4, created_at, last_used_at, revoked_at';

export function apiKeyView(row: ApiKeyRow) {
  return {
    api_key_id: row.id,
    name: row.name,
    role: row.role,
    prefix: row.prefix,
    last4: row.last4,
    created_at: row.created_at.toISOString(),
    last_used_at: row.last_used_at?.toISOString() ?? null,
    revoked_at: row.revoked_at?.toISOString() ?? null,
  };
}

export function apiKeyNotFound(apiKeyId: string): ServiceError {
  return new ServiceError('api_key_not_found', `No API key ${apiKeyId} in your organisation.`, { param: 'api_key_id' });
}

/** The route's schema already checks these; the CLI reaches the use-case without it. */
function assertNewKey(input: { name: string; role: string }): asserts input is { name: string; role: Role } {
  // Characters as the schema counts them (code points: an emoji is one).
  const chars = Array.from(input.name).length;
  if (chars < 1 || chars > KEY_NAME_MAX || !KEY_NAME_REGEX.test(input.name)) {
    throw invalidRequest('name', `name must be 1 to ${KEY_NAME_MAX} characters, not blank, without control characters.`);
  }
  if (!(ROLES as readonly string[]).includes(input.role)) {
    throw invalidRequest('role', `role must be one of ${ROLES.join(', ')}.`);
  }
}

/**
 * The API key a request came with, read again in the transaction that records its work, once
 * that holds its locks: a key revoked while its request waited (behind the revocation, for a
 * lock, for an escrow's output) does nothing more — it makes no key, revokes none, moves no
 * escrow. Revocation is immediate for these too, as for payments.
 */
export async function assertActingKeyLive(tx: Queryable, orgId: string, actingKeyId: string | undefined): Promise<void> {
  if (actingKeyId === undefined) return;
  const [live] = await tx.query('SELECT 1 FROM api_keys WHERE org_id = $1 AND id = $2 AND revoked_at IS NULL', [orgId, actingKeyId]);
  if (!live) throw new ServiceError('authentication_failed', 'This API key was revoked while the request waited.');
}

/**
 * Creates a key. `max`: the keys the organisation may have that are not revoked (the API's
 * AGENT_VAULT_API_KEYS_PER_ORG_MAX); the operator's CLI passes none, so that a key can always be
 * made for an organisation that lost its admin key. `actingKeyId`: the API key asking.
 */
export async function createApiKey(
  db: Database, nowMs: number, orgId: string, input: { name: string; role: string }, options: { max?: number; actingKeyId?: string } = {},
): Promise<{ row: ApiKeyRow; key: string }> {
  assertNewKey(input);
  const created = await db.transaction(async (tx) => {
    if (options.max !== undefined || options.actingKeyId !== undefined) {
      await lockOrganization(tx, orgId);
      await assertActingKeyLive(tx, orgId, options.actingKeyId);
    }
    if (options.max !== undefined) {
      await assertBelowCount(tx, orgId, {
        noun: 'API keys not revoked', countSql: 'SELECT count(*)::int AS n FROM api_keys WHERE org_id = $1 AND revoked_at IS NULL',
        max: options.max, advice: 'revoke keys no longer used, or ask the operator (AGENT_VAULT_API_KEYS_PER_ORG_MAX).',
      });
    }
    return insertApiKey(tx, nowMs, orgId, input.role, input.name);
  });
  return { row: await getApiKey(db, orgId, created.id), key: created.key };
}

export function createdApiKeyView(created: { row: ApiKeyRow; key: string }) {
  const { row, key } = created;
  return {
    api_key_id: row.id, name: row.name, role: row.role, key, prefix: row.prefix, last4: row.last4,
    created_at: row.created_at.toISOString(),
  };
}

export async function getApiKey(db: Queryable, orgId: string, apiKeyId: string): Promise<ApiKeyRow> {
  const rows = await db.query<ApiKeyRow>(
    `SELECT ${API_KEY_COLUMNS} FROM api_keys WHERE org_id = $1 AND id = $2`, [orgId, apiKeyId]);
  if (!rows[0]) throw apiKeyNotFound(apiKeyId);
  return rows[0];
}

/** The organisation's keys, newest first, revoked ones included (they show when). */
export async function listApiKeys(db: Queryable, orgId: string, page: PageRequest) {
  const { sql, params } = new PageFilter().where((p) => `org_id = ${p}`, orgId).page(page);
  const rows = await db.query<ApiKeyRow>(`SELECT ${API_KEY_COLUMNS} FROM api_keys ${sql}`, params);
  return toPage(rows, page, apiKeyView);
}

/**
 * Revokes a key at once: authentication only accepts keys whose revoked_at is null, so its
 * very next request fails. Revoking a revoked key changes nothing and returns it. The
 * organisation's last active admin key is refused: without one, nobody could manage keys
 * through the API again.
 */
export async function revokeApiKey(
  db: Database, nowMs: number, orgId: string, apiKeyId: string, options: { actingKeyId?: string } = {},
): Promise<ApiKeyRow> {
  const revoked = await db.transaction(async (tx) => {
    // One revocation at a time per organisation, so two admins revoking each other's keys
    // cannot both pass the last-admin check. NO KEY UPDATE leaves inserts referencing the
    // organisation (new keys, wallets) unblocked.
    await lockOrganization(tx, orgId);
    await assertActingKeyLive(tx, orgId, options.actingKeyId);
    const key = await getApiKey(tx, orgId, apiKeyId);
    if (key.revoked_at) return key;
    if (key.role === 'admin') {
      const others = await tx.query<{ id: string }>(
        `SELECT id FROM api_keys WHERE org_id = $1 AND role = 'admin' AND revoked_at IS NULL AND id <> $2 LIMIT 1`,
        [orgId, apiKeyId]);
      if (!others.length) {
        throw invalidRequest('api_key_id',
          'This is the organisation\'s last active admin key: create another admin key before revoking it.');
      }
    }
    const rows = await tx.query<ApiKeyRow>(
      `UPDATE api_keys SET revoked_at = $3 WHERE org_id = $1 AND id = $2 RETURNING ${API_KEY_COLUMNS}`,
      [orgId, apiKeyId, new Date(nowMs)]);
    return rows[0]!;
  });
  forgetApiKey(db, apiKeyId);
  return revoked;
}
