/**
 * `agent-vault org create|list`: the operator's commands for organisations, run on the database
 * (and, for create, the chain) directly. Each returns the text to print, so tests read exactly
 * what an operator reads.
 */
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';
import { parsePageRequest } from '../http/pagination.ts';
import type { AppContext } from '../http/context.ts';
import { formatUsdc } from '../money/money.ts';
import {
  assertOrganizationName, assertSameChain, createOrganization, findDefaultOrganization, getOrganization, listOrganizations,
  type OrganizationRow,
} from './organizations.ts';

/** Operators want the whole table at once; a page of the API's maximum is that, with a cursor beyond. */
export const COMMAND_PAGE_LIMIT = '100';

/** A failure whose whole message is for the operator: it holds a key shown once (the CLI prints it all). */
export class KeyShownError extends Error {
  readonly printWhole = true;
}

export async function createOrganizationCommand(
  ctx: Pick<AppContext, 'db' | 'clock' | 'chain'>, options: { name: string },
): Promise<string> {
  assertOrganizationName(options.name);
  // On another chain (a command run without the service's AGENT_VAULT_RPC_URL starts an embedded
  // one) the organisation would be set up where the service never looks, and marked ready.
  const defaultOrganization = await findDefaultOrganization(ctx.db);
  if (defaultOrganization) await assertSameChain(ctx, defaultOrganization);
  let shown: { orgId: string; key: string } | null = null;
  let created;
  try {
    created = await createOrganization(ctx, { name: options.name, onCreated: (orgId, key) => { shown = { orgId, key: key.key }; } });
  } catch (error) {
    if (shown === null) throw error;
    // Stored, but not yet on chain: its key is shown now or never; a running `serve` (its organizations.setup job) finishes the setup.
    const { orgId, key } = shown as { orgId: string; key: string };
    throw new KeyShownError([
      `Organisation ${orgId} was created, but its setup on chain failed (${(error as Error).message}); `
        + 'a running serve tries it again (its organizations.setup job), and so does its next start.',
      'Its admin API key (shown once, store it now):', '', `  ${key}`, '',
    ].join('\n'));
  }
  const { org, adminKey } = created;
  return [
    `Created organisation ${org.id} (${JSON.stringify(org.name)}); its reserve on chain is ${org.reserve_address}.`,
    'Admin API key (shown once, store it now):',
    '',
    `  ${adminKey.key}`,
    '',
  ].join('\n');
}

export async function listOrganizationsCommand(db: Queryable, options: { cursor?: string } = {}): Promise<string> {
  const page = await listOrganizations(db, parsePageRequest({ limit: COMMAND_PAGE_LIMIT, cursor: options.cursor }));
  const rows = page.data.map((org) => [
    org.id, shorten(org.name), org.is_default ? 'yes' : '', formatUsdc(org.reserve_balance), org.chain_status, timeOf(org.created_at),
  ]);
  const lines = [textTable(['ID', 'NAME', 'DEFAULT', 'RESERVE USDC', 'CHAIN', 'CREATED'], rows)];
  if (page.next_cursor) lines.push(`More: agent-vault org list --cursor ${page.next_cursor}`);
  return lines.join('\n');
}

/**
 * The organisation an operator command acts on: the one named by --org, else the default one
 * (created by the first `agent-vault serve`).
 */
export async function organizationForCommand(db: Queryable, orgId: string | undefined): Promise<OrganizationRow> {
  if (orgId !== undefined) {
    const org = await getOrganization(db, orgId);
    if (!org) throw new ServiceError('not_found', `No organisation ${orgId} (see agent-vault org list).`, { param: 'org' });
    return org;
  }
  const org = await findDefaultOrganization(db);
  if (!org) {
    throw new ServiceError('not_found',
      'There is no default organisation yet: start agent-vault serve once (it creates it), or pass --org.', { param: 'org' });
  }
  return org;
}

/** Columns padded to their widest cell; the last column is not padded (no trailing spaces). */
export function textTable(headers: string[], rows: string[][]): string {
  const widths = headers.map((header, column) => Math.max(header.length, ...rows.map((row) => row[column]!.length)));
  const line = (cells: string[]) => cells.map((cell, column) => (column === cells.length - 1 ? cell : cell.padEnd(widths[column]!))).join('  ');
  return [line(headers), ...rows.map(line)].join('\n');
}

/** Times in tables: UTC to the second, which is what an operator compares. */
export function timeOf(time: Date | string | null): string {
  if (time === null) return '-';
  return `${(typeof time === 'string' ? time : time.toISOString()).slice(0, 19)}Z`;
}

const CELL_MAX = 32;

/** Long names would make a table unreadable; the full name is in the API. */
export function shorten(text: string): string {
  return text.length > CELL_MAX ? `${text.slice(0, CELL_MAX - 1)}…` : text;
}
