/**
 * `agent-vault keys create|list|revoke`: the operator's commands for API keys, on the database
 * directly — how a key gets into an organisation without an admin key at hand (a lost admin
 * key, a new operator). They call the same use-cases as the API, so the same rules hold
 * (validation, hashing, the last-admin guard). Each returns the text to print.
 */
import type { Clock } from '../clock/clock.ts';
import type { Database } from '../db/database.ts';
import { parsePageRequest } from '../http/pagination.ts';
import { COMMAND_PAGE_LIMIT, organizationForCommand, shorten, textTable, timeOf } from '../organizations/command.ts';
import { createApiKey, listApiKeys, revokeApiKey } from './api-keys.ts';

export interface KeysCommandContext {
  db: Database;
  clock: Clock;
}

export async function createKeyCommand(
  ctx: KeysCommandContext, options: { role: string; name?: string; org?: string },
): Promise<string> {
  const org = await organizationForCommand(ctx.db, options.org);
  const name = options.name ?? `${options.role} key (CLI)`;
  const { row, key } = await createApiKey(ctx.db, ctx.clock.nowMs(), org.id, { name, role: options.role });
  return [
    `Created API key ${row.id} (${row.role}, ${JSON.stringify(row.name)}) in organisation ${org.id}.`,
    'API key (shown once, store it now):',
    '',
    `  ${key}`,
    '',
  ].join('\n');
}

export async function listKeysCommand(ctx: KeysCommandContext, options: { org?: string; cursor?: string } = {}): Promise<string> {
  const org = await organizationForCommand(ctx.db, options.org);
  const page = await listApiKeys(ctx.db, org.id, parsePageRequest({ limit: COMMAND_PAGE_LIMIT, cursor: options.cursor }));
  const rows = page.data.map((key) => [
    key.api_key_id, shorten(key.name), key.role, `${key.prefix}…${key.last4}`,
    timeOf(key.created_at), timeOf(key.last_used_at), timeOf(key.revoked_at),
  ]);
  const lines = [
    `API keys of organisation ${org.id} (${JSON.stringify(org.name)}), newest first:`,
    textTable(['ID', 'NAME', 'ROLE', 'KEY', 'CREATED', 'LAST USED', 'REVOKED'], rows),
  ];
  if (page.next_cursor) {
    lines.push(`More: agent-vault keys list${options.org ? ` --org ${org.id}` : ''} --cursor ${page.next_cursor}`);
  }
  return lines.join('\n');
}

export async function revokeKeyCommand(ctx: KeysCommandContext, options: { apiKeyId: string; org?: string }): Promise<string> {
  const org = await organizationForCommand(ctx.db, options.org);
  const row = await revokeApiKey(ctx.db, ctx.clock.nowMs(), org.id, options.apiKeyId);
  return `API key ${row.id} (${row.role}, ${JSON.stringify(row.name)}) of organisation ${org.id} is revoked since ${timeOf(row.revoked_at)}.`;
}
