/**
 * Organisations: each has a reserve account on chain (its USDC), the four preset policies, and
 * at least one admin API key. The first start creates a default organisation.
 */
import { address } from '@solana/kit';
import type { AppContext } from '../http/context.ts';
import type { Queryable } from '../db/database.ts';
import { generateApiKey, hashApiKey, describeKey, type Role } from '../auth/api-keys.ts';
import { invalidRequest } from '../errors/errors.ts';
import { NAME_PATTERN } from '../http/fields.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { newId } from '../ids/ids.ts';
import { decodeReserve, type ReserveAccount } from '../chain/program.ts';
import { sameLimits } from '../policies/policies.ts';
import { PRESETS, chainLimitsOf } from '../policies/presets.ts';
import { backoffMs } from '../workers/backoff.ts';

export interface OrganizationRow {
  id: string;
  name: string;
  is_default: boolean;
  reserve_address: string;
  reserve_token_address: string;
  reserve_balance: bigint;
  chain_status: string;
  created_at: Date;
}

export interface CreatedKey {
  id: string;
  key: string;
  role: Role;
}

/** Inserts an API key; the key itself is returned once and only its hash is stored. */
export async function insertApiKey(
  tx: Queryable, nowMs: number, orgId: string, role: Role, name: string, presetKey?: string,
): Promise<CreatedKey> {
  const key = presetKey ?? generateApiKey(role);
  const id = newId('key', nowMs);
  const { prefix, last4 } = describeKey(key);
  await tx.query(
    `INSERT INTO api_keys (id, org_id, name, role, key_hash, prefix, last4, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
    [id, orgId, name, role, hashApiKey(key), prefix, last4, new Date(nowMs)]);
  return { id, key, role };
}

/**
 * Creates an organisation with its admin key and preset policies, then sets it up on chain.
 * `onCreated` is told the key as soon as it is committed, before the chain setup, which may
 * fail (an operator key without SOL on a real cluster): the organisation is then finished by the
 * organizations.setup job or the next start (it stays `pending` until then), and the key, stored
 * only as a hash, has been shown all the same.
 */
export async function createOrganization(
  ctx: Pick<AppContext, 'db' | 'clock' | 'chain'>,
  options: { name: string; isDefault?: boolean; adminKey?: string; onCreated?: (orgId: string, adminKey: CreatedKey) => void },
): Promise<{ org: OrganizationRow; adminKey: CreatedKey }> {
  const nowMs = ctx.clock.nowMs();
  const orgId = newId('org', nowMs);
  const { reserve, reserveToken } = await ctx.chain.reserveAddresses(orgId);
  const policyAddresses = await Promise.all(PRESETS.map((preset) => ctx.chain.policyAddress(orgId, preset.id)));
  const adminKey = await ctx.db.transaction(async (tx) => {
    await tx.query(
      `INSERT INTO organizations (id, name, is_default, reserve_address, reserve_token_address, created_at)
       VALUES ($1, $2, $3, $4, $5, $6)`,
      [orgId, options.name, options.isDefault ?? false, reserve, reserveToken, new Date(nowMs)]);
    for (const [index, preset] of PRESETS.entries()) {
      const r = preset.rules;
      await tx.query(
        `INSERT INTO policies (org_id, id, name, is_preset, max_per_tx, max_per_day, max_per_month, velocity_cap,
           allowed_recipients, blocked_categories, require_co_sign, expiry, chain_address, created_at, updated_at)
         VALUES ($1, $2, $3, TRUE, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $13)`,
        [orgId, preset.id, preset.name, r.maxPerTx, r.maxPerDay, r.maxPerMonth, r.velocityCap,
          JSON.stringify(r.allowedRecipients), JSON.stringify(r.blockedCategories), r.requireCoSign, r.expiry,
          policyAddresses[index], new Date(nowMs)]);
    }
    return insertApiKey(tx, nowMs, orgId, 'admin', 'Admin key', options.adminKey);
  });
  options.onCreated?.(orgId, adminKey);
  await provisionOrganizationOnChain(ctx, orgId);
  const org = await getOrganization(ctx.db, orgId);
  return { org: org!, adminKey };
}

/**
 * Creates the reserve and the preset policy accounts on chain, in one transaction. Safe to
 * repeat: an organisation still `pending` after a crash is provisioned again at start.
 */
export async function provisionOrganizationOnChain(ctx: Pick<AppContext, 'db' | 'chain'>, orgId: string): Promise<void> {
  const { reserve } = await ctx.chain.reserveAddresses(orgId);
  const existing = await ctx.chain.getProgramAccountData(reserve);
  if (!existing) {
    const instructions = [
      await ctx.chain.initReserveIx(orgId),
      ...await Promise.all(PRESETS.map((preset) => ctx.chain.setPolicyIx(orgId, preset.id, chainLimitsOf(preset.rules)))),
    ];
    const outcome = await ctx.chain.execute(instructions);
    // AlreadyInitialized with the reserve there: another process set it up at the same moment
    // (its transaction held the same instructions).
    const doneElsewhere = outcome.err?.name === 'AlreadyInitialized' && await ctx.chain.getProgramAccountData(reserve) !== null;
    if (outcome.err && !doneElsewhere) throw new Error(`provisioning organisation ${orgId} on chain failed: ${outcome.err.name}`);
  }
  await assertOwnSetup(ctx, orgId);
  await ctx.db.transaction(async (tx) => {
    await tx.query(`UPDATE organizations SET chain_status = 'ready' WHERE id = $1`, [orgId]);
    await tx.query(`UPDATE policies SET chain_status = 'ready' WHERE org_id = $1 AND is_preset`, [orgId]);
  });
}

/** After the first failed setup, the job tries again in 15 s, then twice as long each time, at most an hour. */
const SETUP_RETRY_FIRST_MS = 15_000;
const SETUP_RETRY_MAX_MS = 60 * 60 * 1000;
/** Pending organisations the job tries per run, and how long a run goes on starting them. */
const SETUP_BATCH = 20;
const SETUP_RUN_MS = 20_000;
/** How long one try holds its organisation from other processes' jobs: past its chain calls (30 s each). */
const SETUP_CLAIM_MS = 120_000;

/**
 * The `organizations.setup` job: sets up on chain each organisation still `pending` whose next
 * try is due (one created a moment ago by `org create` is its own creator's to set up first),
 * one at a time, each claimed first (its next try put past the attempt) so that several
 * processes never try one together. A failure is logged and tried again later and later; a
 * start tries them all at once. Returns how many were set up.
 */
export async function setUpPendingOrganizations(ctx: Pick<AppContext, 'db' | 'chain' | 'clock' | 'log'>): Promise<number> {
  const deadline = performance.now() + SETUP_RUN_MS;
  let done = 0;
  for (let tried = 0; tried < SETUP_BATCH && performance.now() < deadline; tried += 1) {
    const nowMs = ctx.clock.nowMs();
    const [claimed] = await ctx.db.query<{ id: string; setup_failures: number }>(
      `UPDATE organizations SET setup_retry_at = $3 WHERE id = (
         SELECT id FROM organizations WHERE chain_status = 'pending'
           AND COALESCE(setup_retry_at, created_at + make_interval(secs => $2)) <= $1
         ORDER BY COALESCE(setup_retry_at, created_at), id LIMIT 1 FOR UPDATE SKIP LOCKED)
       RETURNING id, setup_failures`, [new Date(nowMs), SETUP_RETRY_FIRST_MS / 1000, new Date(nowMs + SETUP_CLAIM_MS)]);
    if (!claimed) break;
    const { id, setup_failures: failures } = claimed;
    try {
      await provisionOrganizationOnChain(ctx, id);
      done += 1;
    } catch (error) {
      const retryAt = new Date(ctx.clock.nowMs() + backoffMs(failures + 1, SETUP_RETRY_FIRST_MS, SETUP_RETRY_MAX_MS));
      await ctx.db.query('UPDATE organizations SET setup_failures = $2, setup_retry_at = $3 WHERE id = $1 AND chain_status = \'pending\'',
        [id, failures + 1, retryAt]);
      ctx.log.error({ err: error, orgId: id, retryAt }, 'organisation not set up on chain; tried again later (docs/operations.md, "An organisation stays pending")');
    }
  }
  return done;
}

/**
 * The organisation's accounts found on chain are the service's own: the reserve made by the
 * operator key for the service's USDC mint, and each preset policy made by it with the preset's
 * limits. The program lets any key create them at their addresses first (they derive from the
 * organisation's id alone): a reserve made by another key is that key's to spend from, so its
 * token account must never be shown as the organisation's deposit address, nor vaults made
 * under it. The organisation then stays `pending`.
 */
async function assertOwnSetup(ctx: Pick<AppContext, 'chain'>, orgId: string): Promise<void> {
  const { reserve } = await ctx.chain.reserveAddresses(orgId);
  const operator = ctx.chain.operator.address;
  const refuse = (what: string): never => {
    throw new Error(`organisation ${orgId}: ${what} on chain was not set up by this service's operator key (${operator}); `
      + 'refusing to use it (the organisation stays pending; see docs/operations.md, "An organisation stays pending")');
  };
  const data = await ctx.chain.getProgramAccountData(reserve);
  // Read right after the setup landed (at `confirmed`): an account missing is a node behind the
  // one that answered, not another key's doing, and the setup is tried again.
  if (!data) throw new Error(`organisation ${orgId}: its reserve ${reserve} is not on chain yet after its setup; it is tried again`);
  let account: ReserveAccount | null = null;
  try {
    account = decodeReserve(data);
  } catch {
    refuse(`the account at its reserve address ${reserve}`);
  }
  if (!account || account.authority !== operator || account.mint !== ctx.chain.usdcMint) refuse(`its reserve ${reserve}`);
  for (const preset of PRESETS) {
    const policyAccount = await ctx.chain.policyAddress(orgId, preset.id);
    const policy = await ctx.chain.getPolicy(policyAccount);
    if (!policy) throw new Error(`organisation ${orgId}: its preset policy ${preset.id} (${policyAccount}) is not on chain yet; it is tried again`);
    if (policy.authority !== operator || !sameLimits(policy, chainLimitsOf(preset.rules))) {
      refuse(`its preset policy ${preset.id} (${policyAccount})`);
    }
  }
}

/** The chain or the operator key is not the one the database was made with: the operator's to fix (the CLI says it in one line). */
export class ChainMismatchError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ChainMismatchError';
  }
}

/**
 * The default organisation's reserve, set up on chain, is there and answers to this process's
 * operator key: otherwise the service runs against another chain than its database was made
 * with (a new data dir, with a new embedded chain and operator key, beside an existing
 * PostgreSQL), or signs with another key (another data dir's, pointed at the same chain), and
 * every money move would fail. `serve` and `org create` check it before doing anything.
 */
export async function assertSameChain(
  ctx: Pick<AppContext, 'chain'>, org: { id: string; reserve_address: string; chain_status: string },
): Promise<void> {
  if (org.chain_status !== 'ready') return;
  const data = await ctx.chain.getAccountData(address(org.reserve_address));
  if (data === null) {
    throw new ChainMismatchError(`the default organisation ${org.id} of this database has no reserve (${org.reserve_address}) on this chain: `
      + 'the chain, or the data dir that holds the embedded validator\'s state and the operator key, is not the one the database '
      + 'was made with (a new AGENT_VAULT_DATA_DIR beside an existing DATABASE_URL, or no AGENT_VAULT_RPC_URL?); start it with those');
  }
  let authority: string;
  try {
    ({ authority } = decodeReserve(data));
  } catch {
    throw new ChainMismatchError(`the default organisation ${org.id}'s reserve address ${org.reserve_address} holds another account on this chain: `
      + 'the chain is not the one the database was made with; start it with that one (AGENT_VAULT_RPC_URL)');
  }
  if (authority !== ctx.chain.operator.address) {
    throw new ChainMismatchError(`the default organisation ${org.id}'s reserve answers to the operator key ${authority}, not to this `
      + `process's ${ctx.chain.operator.address}, so every payment and funding would fail: start it with the operator key the `
      + 'database was made with (AGENT_VAULT_OPERATOR_KEY, or the operator-key.json of the data dir it was made with)');
  }
}

export async function getOrganization(db: Queryable, orgId: string): Promise<OrganizationRow | null> {
  const rows = await db.query<OrganizationRow>('SELECT * FROM organizations WHERE id = $1', [orgId]);
  return rows[0] ?? null;
}

export interface BootstrapOptions {
  /** told the generated admin key of a new default organisation, once */
  onAdminKey?: (orgId: string, adminKey: string) => void;
  /** told why an organisation other than the default could not be set up on chain (it stays pending); without it, the start fails */
  onPendingFailed?: (orgId: string, error: Error) => void;
}

/**
 * At start: the default organisation exists (created with AGENT_VAULT_BOOTSTRAP_KEY, or a
 * generated admin key returned once for printing), and every organisation is on chain.
 */
export async function bootstrapOrganizations(
  ctx: Pick<AppContext, 'db' | 'clock' | 'chain'>, bootstrapKey: string | null,
  options: BootstrapOptions = {},
): Promise<{ created: boolean; orgId: string; adminKey: string | null }> {
  try {
    return await bootstrapOnce(ctx, bootstrapKey, options);
  } catch (error) {
    // Another process starting at the same moment created the default organisation (or stored
    // the bootstrap key) first: a unique violation. Once more, it is found.
    if ((error as { code?: unknown }).code !== '23505') throw error;
    return bootstrapOnce(ctx, bootstrapKey, options);
  }
}

async function bootstrapOnce(
  ctx: Pick<AppContext, 'db' | 'clock' | 'chain'>, bootstrapKey: string | null,
  options: BootstrapOptions,
): Promise<{ created: boolean; orgId: string; adminKey: string | null }> {
  const pending = await ctx.db.query<{ id: string; is_default: boolean }>(
    `SELECT id, is_default FROM organizations WHERE chain_status = 'pending' ORDER BY id`);
  for (const { id, is_default: isDefault } of pending) {
    try {
      await provisionOrganizationOnChain(ctx, id);
    } catch (error) {
      // Nothing works without the default organisation; another one stays pending (its API
      // answers, its money moves fail) and is tried again by the organizations.setup job.
      if (isDefault || !options.onPendingFailed) throw error;
      options.onPendingFailed(id, error as Error);
    }
  }
  const existing = await ctx.db.query<{ id: string; reserve_address: string; chain_status: string }>(
    'SELECT id, reserve_address, chain_status FROM organizations WHERE is_default');
  if (existing[0]) {
    await assertSameChain(ctx, existing[0]);
    if (bootstrapKey) {
      // The configured bootstrap key is honoured even when set after the first start.
      const known = await ctx.db.query('SELECT 1 FROM api_keys WHERE key_hash = $1', [hashApiKey(bootstrapKey)]);
      if (!known.length) {
        await insertApiKey(ctx.db, ctx.clock.nowMs(), existing[0].id, 'admin', 'Bootstrap key', bootstrapKey);
      }
    }
    return { created: false, orgId: existing[0].id, adminKey: null };
  }
  const { org, adminKey } = await createOrganization(ctx, {
    name: 'Default organization', isDefault: true, adminKey: bootstrapKey ?? undefined,
    // Shown before the chain setup, which may fail: its key would otherwise never be seen.
    onCreated: (orgId, created) => { if (!bootstrapKey) options.onAdminKey?.(orgId, created.key); },
  });
  return { created: true, orgId: org.id, adminKey: bootstrapKey ? null : adminKey.key };
}

export const ORGANIZATION_NAME_MAX = 100;
/** At least one visible character and no control characters (names are printed in tables). */
const ORGANIZATION_NAME = new RegExp(NAME_PATTERN, 'u');

export function assertOrganizationName(name: string): void {
  if (name.length > ORGANIZATION_NAME_MAX || !ORGANIZATION_NAME.test(name)) {
    throw invalidRequest('name', `name must be 1 to ${ORGANIZATION_NAME_MAX} characters, not blank, without control characters.`);
  }
}

export async function findDefaultOrganization(db: Queryable): Promise<OrganizationRow | null> {
  const rows = await db.query<OrganizationRow>('SELECT * FROM organizations WHERE is_default');
  return rows[0] ?? null;
}

/** Every organisation of the service, newest first: an operator's view (the API shows only the caller's). */
export async function listOrganizations(db: Queryable, page: PageRequest) {
  const { sql, params } = new PageFilter().page(page);
  const rows = await db.query<OrganizationRow>(`SELECT * FROM organizations ${sql}`, params);
  return toPage(rows, page, (row) => row);
}
