/**
 * Wallets (vaults): one per agent of an organisation, a program-derived account on chain whose
 * address follows from (organisation, agent). The database is the service's index; the chain
 * holds the money and enforces what the program can check alone.
 *
 * The database decides first (a freeze is effective for the next request the moment it is
 * committed); the vault account on chain is then brought to the same state. A wallet whose chain
 * state has not caught up is `chain_status = 'pending'`, and the `wallets.sync` job finishes it
 * after a crash or a failed send.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import { Type } from 'typebox';
import { address, type Address, type Instruction, type Signature } from '@solana/kit';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import { referenceMemoIx, type PreparedTransaction } from '../chain/client.ts';
import type { Clock } from '../clock/clock.ts';
import type { Queryable } from '../db/database.ts';
import { invalidRequest, ServiceError } from '../errors/errors.ts';
import { recordEvent } from '../events/events.ts';
import { assertBelowCount, lockOrganization } from '../organizations/limits.ts';
import type { AppContext } from '../http/context.ts';
import type { RecordMarker } from '../http/idempotency.ts';
import { newId } from '../ids/ids.ts';
import { backoffMs } from '../workers/backoff.ts';
import { formatUsdc } from '../money/money.ts';
import { newSessionAuthority, tokenMatches } from './session-token.ts';
import { balanceMatchingChain, inFlightSql, openEscrowSql } from './unrecorded.ts';
import type { Principal } from '../http/auth.ts';
import { SpendingView } from '../payments/budgets.ts';
import { EXPIRY_MARGIN_BLOCKS, settlePendingOf } from '../transactions/settlement.ts';

export const WALLET_STATUSES = ['active', 'idle', 'policy_violation', 'frozen', 'unfunded', 'archived'] as const;
export type WalletStatus = (typeof WALLET_STATUSES)[number];
/** What is stored; idle, policy_violation and unfunded are derived (docs/wallets.md). */
type StoredStatus = 'active' | 'frozen' | 'archived';

export const AGENT_ID_PATTERN = '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$';
export const TAG_PATTERN = '^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,49}$';
export const TAGS_MAX = 20;
export const LABEL_MAX = 200;

export interface WalletRow {
  id: string;
  org_id: string;
  agent_id: string;
  label: string;
  policy_id: string;
  tags: string[];
  status: StoredStatus;
  chain_address: string;
  token_address: string;
  balance: bigint;
  chain_status: 'pending' | 'ready';
  /** the last payment attempt was blocked by the policy, at this time (cleared by an accepted one) */
  policy_violation_at: Date | null;
  /** balance.low fires when a debit leaves the balance below it */
  low_balance_threshold: bigint | null;
  session_public_key: string | null;
  session_expires_at: Date | null;
  auto_topup_enabled: boolean;
  auto_topup_trigger_below: bigint | null;
  auto_topup_amount: bigint | null;
  created_at: Date;
  updated_at: Date;
  last_transaction_at: Date | null;
  archived_at: Date | null;
  provisioned_at: Date | null;
  /** syncs of it in a row that the chain refused or that failed, and when the wallets.sync job may try again (syncRetryDelayMs) */
  sync_failures: number;
  sync_retry_at: Date | null;
}

/** A wallet row with its policy's summary columns (for views). */
export interface WalletWithPolicy extends WalletRow {
  policy_name: string;
  policy_max_per_tx: bigint | null;
  policy_max_per_day: bigint | null;
  policy_max_per_month: bigint | null;
}

export const WalletStatusSchema = Type.Union([
  Type.Literal('active'), Type.Literal('idle'), Type.Literal('policy_violation'), Type.Literal('frozen'),
  Type.Literal('unfunded'), Type.Literal('archived'),
]);

const AMOUNT_OR_NULL = Type.Union([Type.String(), Type.Null()]);

export const WalletView = Type.Object({
  wallet_id: Type.String(),
  chain_address: Type.String({ description: 'the vault: a program-derived address, no private key' }),
  token_account: Type.String({ description: 'the vault\'s USDC token account' }),
  agent_id: Type.String(),
  label: Type.String(),
  usdc_balance: Type.String(),
  policy: Type.Object({
    policy_id: Type.String(), name: Type.String(),
    max_per_tx: AMOUNT_OR_NULL, max_per_day: AMOUNT_OR_NULL, max_per_month: AMOUNT_OR_NULL,
  }),
  status: WalletStatusSchema,
  low_balance_threshold: Type.Union([Type.String(), Type.Null()], { description: 'balance.low fires when the balance falls below it' }),
  tags: Type.Array(Type.String()),
  auto_topup: Type.Object({
    enabled: Type.Boolean(), trigger_below: AMOUNT_OR_NULL, topup_amount: AMOUNT_OR_NULL,
  }),
  session_token_expires_at: Type.Union([Type.String(), Type.Null()]),
  created_at: Type.String(),
  updated_at: Type.String(),
  last_transaction_at: Type.Union([Type.String(), Type.Null()]),
  /** GET of one wallet only: spent and remaining per policy window, and when each frees up */
  spending: Type.Optional(SpendingView),
});

const orNull = (value: bigint | null): string | null => (value === null ? null : formatUsdc(value));

/** An active vault without a transaction for this long is `idle`. */
export const IDLE_AFTER_MS = 7 * 24 * 3600 * 1000;

type StatusFields = Pick<WalletRow, 'status' | 'policy_violation_at' | 'balance' | 'last_transaction_at' | 'created_at'>;

/**
 * The status a client sees (docs/wallets.md "Status"): the stored one (frozen, archived), or
 * for an active vault, the first that holds of
 * - `policy_violation`: its last payment attempt was blocked by its policy (until its next
 *   accepted payment or a change of policy);
 * - `unfunded`: it held money once (it has transactions) and its balance is now zero;
 * - `idle`: no transaction for 7 days (from its creation when it never had one);
 * - `active`.
 */
export function displayedStatus(row: StatusFields, nowMs: number): WalletStatus {
  if (row.status !== 'active') return row.status;
  if (row.policy_violation_at !== null) return 'policy_violation';
  if (row.balance === 0n && row.last_transaction_at !== null) return 'unfunded';
  if (nowMs - (row.last_transaction_at ?? row.created_at).getTime() >= IDLE_AFTER_MS) return 'idle';
  return 'active';
}

/** The SQL condition selecting the wallets a client sees with `status` (the list filter); `nowParam`: the placeholder of the time (idle and active need it). */
export function statusCondition(status: WalletStatus, nowParam: string | null, alias = 'w'): string {
  const a = alias;
  const violation = `${a}.policy_violation_at IS NOT NULL`;
  const unfunded = `(${a}.balance = 0 AND ${a}.last_transaction_at IS NOT NULL)`;
  const idle = () => {
    if (nowParam === null) throw new Error(`the ${status} condition needs the time`);
    return `COALESCE(${a}.last_transaction_at, ${a}.created_at) <= ${nowParam}::timestamptz - INTERVAL '${IDLE_AFTER_MS / 1000} seconds'`;
  };
  switch (status) {
    case 'frozen': case 'archived': return `${a}.status = '${status}'`;
    case 'policy_violation': return `${a}.status = 'active' AND ${violation}`;
    case 'unfunded': return `${a}.status = 'active' AND NOT ${violation} AND ${unfunded}`;
    case 'idle': return `${a}.status = 'active' AND NOT ${violation} AND NOT ${unfunded} AND ${idle()}`;
    case 'active': return `${a}.status = 'active' AND NOT ${violation} AND NOT ${unfunded} AND NOT (${idle()})`;
  }
}

export function walletView(row: WalletWithPolicy, nowMs: number) {
  return {
    wallet_id: row.id,
    chain_address: row.chain_address,
    token_account: row.token_address,
    agent_id: row.agent_id,
    label: row.label,
    usdc_balance: formatUsdc(row.balance),
    policy: {
      policy_id: row.policy_id, name: row.policy_name,
      max_per_tx: orNull(row.policy_max_per_tx), max_per_day: orNull(row.policy_max_per_day),
      max_per_month: orNull(row.policy_max_per_month),
    },
    status: displayedStatus(row, nowMs),
    low_balance_threshold: orNull(row.low_balance_threshold),
    tags: row.tags,
    auto_topup: {
      enabled: row.auto_topup_enabled,
      trigger_below: orNull(row.auto_topup_trigger_below),
      topup_amount: orNull(row.auto_topup_amount),
    },
    session_token_expires_at: row.session_expires_at?.toISOString() ?? null,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
    last_transaction_at: row.last_transaction_at?.toISOString() ?? null,
  };
}

export const WALLET_SELECT = `SELECT w.*, p.name AS policy_name, p.max_per_tx AS policy_max_per_tx,
  p.max_per_day AS policy_max_per_day, p.max_per_month AS policy_max_per_month
  FROM wallets w JOIN policies p ON p.org_id = w.org_id AND p.id = w.policy_id`;

export async function findWallet(q: Queryable, orgId: string, walletId: string): Promise<WalletWithPolicy | null> {
  const rows = await q.query<WalletWithPolicy>(`${WALLET_SELECT} WHERE w.org_id = $1 AND w.id = $2`, [orgId, walletId]);
  return rows[0] ?? null;
}

export async function getWallet(q: Queryable, orgId: string, walletId: string): Promise<WalletWithPolicy> {
  const wallet = await findWallet(q, orgId, walletId);
  if (!wallet) throw walletNotFound(walletId);
  return wallet;
}

/** `param` names the field that carried the id (`to_wallet`, `allocations.2.wallet_id`). */
export function walletNotFound(walletId: string, param = 'wallet_id'): ServiceError {
  return new ServiceError('wallet_not_found', `No wallet ${walletId} in your organisation.`, { param });
}

/**
 * Refuses a wallet id the organisation does not have, before an idempotency key is taken: a
 * mistyped id is not the key's answer, and the corrected request may use the same key.
 */
export async function assertWalletsExist(q: Queryable, orgId: string, walletIds: readonly string[],
  paramOf: (index: number) => string): Promise<void> {
  const rows = await q.query<{ id: string }>('SELECT id FROM wallets WHERE org_id = $1 AND id = ANY($2)', [orgId, walletIds]);
  const known = new Set(rows.map((row) => row.id));
  const missing = walletIds.findIndex((id) => !known.has(id));
  if (missing >= 0) throw walletNotFound(walletIds[missing]!, paramOf(missing));
}

/** Locks the wallet row for the rest of the database transaction. */
export async function lockWallet(tx: Queryable, orgId: string, walletId: string): Promise<WalletRow> {
  const rows = await tx.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = $2 FOR UPDATE', [orgId, walletId]);
  if (!rows[0]) throw walletNotFound(walletId);
  return rows[0];
}

export function assertNotArchived(wallet: Pick<WalletRow, 'id' | 'status'>): void {
  if (wallet.status === 'archived') throw archivedError(wallet);
}

export function archivedError(wallet: Pick<WalletRow, 'id'>): ServiceError {
  return new ServiceError('wallet_archived', `Wallet ${wallet.id} is archived: it only answers reads.`, { wallet_id: wallet.id });
}

/**
 * Refuses what needs the organisation's reserve on chain while the organisation is not set up
 * there (`organizations.chain_status` not `ready`: its setup failed, or another key made its
 * reserve first; docs/operations.md "An organisation stays pending"). The program creates a
 * vault only under a reserve whose authority is the operator, and moves money only between a
 * reserve and vaults of that authority: a wallet row or a move recorded now would be sent only to
 * fail on chain (the wallet then `pending` for good, retried by wallets.sync). Refused before
 * anything is written. 503, not 4xx: the request is right and succeeds once a start has set the
 * organisation up, and a 5xx is not kept under its idempotency key (src/http/idempotency.ts), so
 * that retry is not answered with this refusal. An organisation only ever goes from `pending` to
 * `ready`, so a `ready` read at any point of a request still holds when it writes.
 */
export function assertOrganizationReady(org: { chain_status: string }): void {
  if (org.chain_status === 'ready') return;
  throw new ServiceError('service_unavailable',
    'Your organisation is not set up on chain yet: no vault can be created, funded or withdrawn from until it is, '
    + 'and retrying will not help before then. The service\'s operator can see why '
    + '(docs/operations.md, "An organisation stays pending").');
}

/**
 * The policy exists and has not expired, and stays so until the caller's transaction ends: the
 * share lock makes a concurrent delete wait, then see the wallet attached (policy_in_use). A vault
 * attached to an expired policy could pay nothing and would never be frozen by the expiry (that
 * has passed), so it is refused: extend the policy's expiry, or attach another.
 */
async function assertPolicyUsable(q: Queryable, orgId: string, policyId: string, clock: Pick<Clock, 'nowMs'>): Promise<void> {
  const rows = await q.query<{ expiry: Date | null; expired_at: Date | null }>(
    'SELECT expiry, expired_at FROM policies WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL FOR SHARE', [orgId, policyId]);
  if (!rows.length) {
    throw new ServiceError('policy_not_found', `No policy ${policyId} in your organisation.`, { param: 'policy_id' });
  }
  // The time is read once the lock is held: a request that waited (for its vault's lock, for the
  // expiry job's commit on this row) while the expiry passed sees it passed, and one the job has
  // already expired says so, so no vault is attached after the job froze the policy's vaults.
  const { expiry, expired_at: expiredAt } = rows[0]!;
  if (expiry && (expiredAt !== null || expiry.getTime() <= clock.nowMs())) {
    throw invalidRequest('policy_id', `Policy ${policyId} expired at ${expiry.toISOString()}: extend its expiry, or attach another policy.`);
  }
}

/**
 * An `agent` key acts on one vault only, the one whose session token it presents
 * (`Session-Token` header). Other roles are not asked for one.
 */
export function assertVaultAccess(principal: Principal, wallet: WalletRow, sessionToken: string | undefined, nowMs: number): void {
  if (principal.role !== 'agent') return;
  if (!sessionToken || !tokenMatches(sessionToken, wallet.session_public_key)) throw sessionTokenInvalid();
  const expired = sessionExpiredError(wallet, nowMs);
  if (expired) throw expired;
}

export function sessionTokenInvalid(): ServiceError {
  return new ServiceError('session_token_invalid', 'Send this wallet\'s session token in the Session-Token header.');
}

/** `session_token_expired` when the vault's session authority has expired at `nowMs`, else null. */
export function sessionExpiredError(wallet: Pick<WalletRow, 'session_expires_at'>, nowMs: number): ServiceError | null {
  if (wallet.session_expires_at && wallet.session_expires_at.getTime() > nowMs) return null;
  return new ServiceError('session_token_expired', 'This wallet\'s session token has expired: an admin or operator makes a new one with POST /v1/wallets/{wallet_id}/rotate-token.');
}

// ---------------------------------------------------------------------------------------------
// Create

export interface CreateWalletInput {
  agentId: string;
  label: string;
  policyId: string;
  tags: string[];
}

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log' | 'config'>;

export async function createWallet(ctx: Ctx, orgId: string, input: CreateWalletInput, mark?: RecordMarker): Promise<WalletWithPolicy> {
  const nowMs = ctx.clock.nowMs();
  const tags = normaliseTags(input.tags);
  const { vault, vaultToken } = await ctx.chain.vaultAddresses(orgId, input.agentId);
  const walletId = await ctx.db.transaction(async (tx) => {
    await lockOrganization(tx, orgId);
    const [org] = await tx.query<{ chain_status: string }>('SELECT chain_status FROM organizations WHERE id = $1', [orgId]);
    assertOrganizationReady(org!);
    await assertPolicyUsable(tx, orgId, input.policyId, ctx.clock);
    const known = await tx.query('SELECT 1 FROM wallets WHERE org_id = $1 AND agent_id = $2', [orgId, input.agentId]);
    if (known.length === 0) {
      // Archived ones count: a vault's accounts on chain stay open (the program has no instruction
      // to close them), and their rent with them; archiving to make room would let a loop of
      // creations and archives spend the operator key's SOL without a bound.
      await assertBelowCount(tx, orgId, {
        noun: 'vaults (archived ones count: their chain accounts stay open)',
        countSql: 'SELECT count(*)::int AS n FROM wallets WHERE org_id = $1',
        max: ctx.config.walletsPerOrgMax,
        advice: 'ask the operator to raise it (AGENT_VAULT_WALLETS_PER_ORG_MAX).',
      });
    }
    const creatingUntil = new Date(nowMs + CREATING_HOLD_MS);
    const inserted = await tx.query<{ id: string }>(
      `INSERT INTO wallets (id, org_id, agent_id, label, policy_id, tags, status, chain_address, token_address, creating_until, created_at, updated_at)
       VALUES ($1, $2, $3, $4, $5, $6, 'active', $7, $8, $9, $10, $10) ON CONFLICT (org_id, agent_id) DO NOTHING RETURNING id`,
      [newId('wal', nowMs), orgId, input.agentId, input.label, input.policyId, tags, vault, vaultToken, creatingUntil, new Date(nowMs)]);
    if (inserted[0]) {
      await mark?.(tx, inserted[0].id);
      return inserted[0].id;
    }
    const existing = await tx.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND agent_id = $2', [orgId, input.agentId]);
    const row = existing[0]!;
    // A creation interrupted before its vault existed on chain is resumed by the same request,
    // sent again once the first has answered (or its process died): not while another request
    // is creating it, which holds the row (creating_until) until it answers.
    const conflict = () => new ServiceError('wallet_agent_id_conflict',
      `Agent ${input.agentId} already has a wallet (${row.id}); agent ids are never reused.`, { param: 'agent_id' });
    const sameRequest = row.provisioned_at === null && row.label === input.label && row.policy_id === input.policyId
      && row.tags.join(',') === tags.join(',');
    if (!sameRequest) throw conflict();
    const resumed = await tx.query(
      `UPDATE wallets SET creating_until = $3
       WHERE org_id = $1 AND id = $2 AND provisioned_at IS NULL AND (creating_until IS NULL OR creating_until <= $4) RETURNING id`,
      [orgId, row.id, creatingUntil, new Date(nowMs)]);
    if (!resumed.length) throw conflict();
    return row.id;
  });
  try {
    return await provisionedWallet(ctx, orgId, walletId);
  } finally {
    await ctx.db.query('UPDATE wallets SET creating_until = NULL WHERE org_id = $1 AND id = $2', [orgId, walletId])
      .catch((error: unknown) => ctx.log.warn({ err: error, walletId }, 'could not release the creation\'s hold on the wallet; it lapses by itself'));
  }
}

/**
 * How long a creation holds its new wallet's row against another request for the same agent, at
 * most: past the longest it can take to answer (its provisioning waits up to PROVISION_WAIT_MS
 * behind another sync), so that only a process that died leaves a hold to lapse.
 */
const CREATING_HOLD_MS = 60_000;

/** How long a creation waits for another sync that is creating the same vault. */
const PROVISION_WAIT_MS = 10_000;
const PROVISION_POLL_MS = 50;

/** The wallet once its vault exists on chain (created now when it does not yet). */
export async function provisionedWallet(ctx: Ctx, orgId: string, walletId: string): Promise<WalletWithPolicy> {
  const wallet = await getWallet(ctx.db, orgId, walletId);
  if (wallet.provisioned_at !== null) return wallet;
  try {
    if (!(await syncWalletToChain(ctx, orgId, walletId))) {
      // Another sync (the wallets.sync job, or this request's own earlier try) is creating it.
      const deadline = Date.now() + PROVISION_WAIT_MS;
      while (Date.now() < deadline) {
        await new Promise((resolve) => setTimeout(resolve, PROVISION_POLL_MS));
        const current = await getWallet(ctx.db, orgId, walletId);
        if (current.provisioned_at !== null) return current;
      }
      throw new Error('another sync of the wallet has not created its vault yet');
    }
  } catch (error) {
    ctx.log.warn({ err: error, walletId }, 'vault provisioning did not finish; wallets.sync will retry');
    throw new ServiceError('service_unavailable',
      'The vault could not be created on chain yet; retry the same request (it resumes) or wait for it to appear.');
  }
  return getWallet(ctx.db, orgId, walletId);
}

export function normaliseTags(tags: string[]): string[] {
  return [...new Set(tags)].sort();
}

// ---------------------------------------------------------------------------------------------
// The chain catches up with the database

/**
 * How long one sync holds its wallet after its last send: past the 60 s (150 slots of 400 ms) in
 * which a transaction it sent can still land, so that a sync that stopped halfway (its process
 * died, a chain call failed with the transaction perhaps sent) is taken over only once nothing it
 * sent can land. The service clock does not measure block heights (longer slots, a test clock
 * moved forward), so each send also notes its last valid block height (migration 0040), and a
 * takeover waits for the chain to be past it as the reconciler does (EXPIRY_MARGIN_BLOCKS).
 */
export const WALLET_SYNC_LEASE_MS = 90_000;
/** Passes of one sync over a wallet that changes while it runs; the wallets.sync job does the rest. */
const SYNC_PASSES_MAX = 3;

/** The sync's lease was taken over (it lapsed): it stops, sending nothing more. */
class SyncLeaseLost extends Error {}

/**
 * Brings the vault account on chain to the wallet's state: created when missing; the attached
 * policy; frozen when the wallet is frozen or archived. One sync at a time per wallet, under a
 * lease (migration 0024) renewed before each send: two at once could each send what the other
 * undid, a freeze landing after an unfreeze's sync had found nothing to send. The wallet is
 * marked `ready` only by the lease's holder, only if the vault read back after the pass's sends
 * is what the pass wanted, and only if nothing changed in the database since the pass read it;
 * otherwise the holder makes another pass. Returns false when another sync
 * holds the wallet (it stays `pending` for that sync or the wallets.sync job), or took it over.
 * A chain refusal (settled: nothing in flight) releases the lease; a call that failed otherwise
 * keeps it until it lapses, since what it sent may still land.
 *
 * Runs whatever the wallet's back-off (migration 0029): a user's change tries at once. A sync
 * that ends refused, failed, or with a vault that still disagrees after its last pass counts one
 * more failure and puts the wallets.sync job's next try later (syncRetryDelayMs); one whose
 * sends the chain took clears the count.
 */
export async function syncWalletToChain(ctx: Ctx, orgId: string, walletId: string): Promise<boolean> {
  const holder = randomUUID();
  const claimedAt = ctx.clock.nowMs();
  // The last send of a sync whose lease lapsed may still be in flight: taken over only once the
  // chain has its outcome or is past its last valid height (and the reconciler's margin). The
  // claim then requires the same last send, so a sync that sent again meanwhile is not taken.
  const [held] = await ctx.db.query<{ sync_signature: string | null; sync_valid_height: bigint | null }>(
    'SELECT sync_signature, sync_valid_height FROM wallets WHERE org_id = $1 AND id = $2', [orgId, walletId]);
  if (!held) return false;
  if (held.sync_signature !== null && !(await sendSettled(ctx, held.sync_signature, held.sync_valid_height!))) return false;
  const [claimed] = await ctx.db.query<WalletRow>(
    `UPDATE wallets SET sync_holder = $3, sync_lease_until = $4, sync_signature = NULL, sync_valid_height = NULL
     WHERE org_id = $1 AND id = $2 AND (sync_lease_until IS NULL OR sync_lease_until <= $5)
       AND sync_signature IS NOT DISTINCT FROM $6 RETURNING *`,
    [orgId, walletId, holder, new Date(claimedAt + WALLET_SYNC_LEASE_MS), new Date(claimedAt), held.sync_signature]);
  if (!claimed) return false;
  /** Before each send: the lease renewed, and the send noted (each waits for the one before it). */
  const renew = async (prepared: PreparedTransaction) => {
    const renewed = await ctx.db.query(
      `UPDATE wallets SET sync_lease_until = $3, sync_signature = $4, sync_valid_height = $5
       WHERE id = $1 AND sync_holder = $2 RETURNING id`,
      [walletId, holder, new Date(ctx.clock.nowMs() + WALLET_SYNC_LEASE_MS), prepared.signature, prepared.lastValidBlockHeight]);
    if (!renewed.length) throw new SyncLeaseLost();
  };
  /**
   * The back-off this sync leaves: cleared, or one failure more (only the lease's holder writes
   * the count, so the claimed row's is still current) and the time the job may try again.
   */
  const backOff = (why: string | null): [number, Date | null] => {
    if (why === null) return [0, null];
    const failures = claimed.sync_failures + 1;
    const retryAt = new Date(ctx.clock.nowMs() + syncRetryDelayMs(failures));
    if (failures >= SYNC_FAILURES_WARNED) {
      ctx.log.warn({ walletId, vault: claimed.chain_address, failures, retryAt, why },
        'the vault of a wallet keeps failing to sync on chain; trying again later and later');
    }
    return [failures, retryAt];
  };
  /** Gives the wallet up, the back-off cleared (why null) or counted. */
  const release = (q: Queryable, why: string | null) =>
    q.query(`UPDATE wallets SET sync_holder = NULL, sync_lease_until = NULL, sync_signature = NULL, sync_valid_height = NULL, sync_failures = $3, sync_retry_at = $4
             WHERE id = $1 AND sync_holder = $2`, [walletId, holder, ...backOff(why)]);
  let wallet = claimed;
  for (let pass = 1; ; pass += 1) {
    let sent: VaultPass;
    try {
      sent = await sendVaultChanges(ctx, orgId, wallet, renew);
    } catch (error) {
      if (error instanceof SyncLeaseLost) return false;
      // What it sent may still land: the lease is kept until it lapses; the failure is counted.
      await ctx.db.query('UPDATE wallets SET sync_failures = $3, sync_retry_at = $4 WHERE id = $1 AND sync_holder = $2',
        [walletId, holder, ...backOff(error instanceof Error ? error.message : String(error))]);
      throw error;
    }
    if ('refused' in sent) {
      await release(ctx.db, sent.refused);
      throw new Error(sent.refused);
    }
    if (!sent.agrees) {
      ctx.log.warn({ walletId, vault: wallet.chain_address, pass },
        'the vault read back after its update is not what the wallet asks; another pass');
    }
    const outcome = await ctx.db.transaction(async (tx) => {
      const nowMs = ctx.clock.nowMs();
      const [current] = await tx.query<WalletRow & { sync_holder: string | null }>('SELECT * FROM wallets WHERE id = $1 FOR UPDATE', [walletId]);
      if (!current) return 'done';
      // Taken over (the lease lapsed): the sync holding it now decides.
      if (current.sync_holder !== holder) return 'lost';
      if (current.provisioned_at === null) {
        await tx.query('UPDATE wallets SET provisioned_at = $2 WHERE id = $1', [walletId, new Date(nowMs)]);
        await recordEvent(tx, nowMs, {
          orgId, type: 'wallet.created', walletId,
          summary: `Wallet created for agent ${current.agent_id}`,
          payload: { wallet_id: walletId, agent_id: current.agent_id, chain_address: current.chain_address, label: current.label,
            policy_id: current.policy_id },
        });
      }
      // What the pass sent is what the row asks now: its status and policy, compared as values
      // (two changes in one millisecond share an updated_at, so that is no version).
      if (!sent.agrees || current.status !== wallet.status || current.policy_id !== wallet.policy_id) return current;
      await tx.query(`UPDATE wallets SET chain_status = 'ready' WHERE id = $1`, [walletId]);
      await release(tx, null);
      return 'done';
    });
    if (outcome === 'done') return true;
    if (outcome === 'lost') return false;
    if (pass === SYNC_PASSES_MAX) {
      // Out of passes: a wallet that kept changing is no failure of the chain's; a vault that
      // still disagrees after the chain took the last pass's sends is.
      await release(ctx.db, sent.agrees ? null : `vault ${wallet.chain_address} read back still disagrees after ${pass} passes`);
      return true;
    }
    wallet = outcome;
  }
}

/** The first failed sync of a wallet is tried again by the job after a second, each next one after twice as long, at most an hour. */
const SYNC_RETRY_FIRST_MS = 1_000;
const SYNC_RETRY_MAX_MS = 60 * 60 * 1000;
/** From this many failed syncs of one wallet in a row on, each is logged as a warning. */
const SYNC_FAILURES_WARNED = 5;

export function syncRetryDelayMs(failures: number): number {
  return backoffMs(failures, SYNC_RETRY_FIRST_MS, SYNC_RETRY_MAX_MS);
}

/** Whether a vault update a sync sent can no longer land: the chain has its outcome, or is past its last valid height. */
async function sendSettled(ctx: Ctx, signature: string, validHeight: bigint): Promise<boolean> {
  // The height first, as the reconciler reads them: a status read after it is at least as recent.
  const height = await ctx.chain.getBlockHeight();
  if (height > validHeight + EXPIRY_MARGIN_BLOCKS) return true;
  const [outcome] = await ctx.chain.getOutcomes([signature as Signature]);
  return outcome !== null && outcome !== undefined;
}

/** How long a sync waits for a vault update's outcome before it gives up (keeping its lease). */
const VAULT_UPDATE_WAIT_MS = 30_000;

/** A pass's end: the chain refused (why), or the vault as read after its sends agrees with the row or not. */
type VaultPass = { refused: string } | { agrees: boolean };

/**
 * The reference of one vault update's memo, `<wallet id>:<attempt>`: 64 random bits per send,
 * so no two attempts, from this process or another sharing the chain, make the same message.
 * A counter would not do: each process would count alike. Within the memo's 64 bytes:
 * `agent-vault:` (12) + wallet id (30) + `:` + 11 base64url characters.
 */
function vaultUpdateReference(walletId: string): string {
  return `${walletId}:${randomBytes(8).toString('base64url')}`;
}

/**
 * One pass: the vault created if missing, then the policy and the frozen flag the wallet row
 * asks for, each sent only if the chain differs, after `beforeSend` (which renews the lease); the
 * vault is then read back.
 *
 * A vault update carries a memo unique to its attempt. Without it, the same change under the
 * same blockhash (freeze, unfreeze, freeze again from two processes, each caching its blockhash
 * and remembering only its own signatures) is the same transaction byte for byte: the chain
 * answers with the earlier signature and its earlier success, and the vault stays as the
 * unfreeze left it. The read back is the second guard: whatever the outcome said, the wallet is
 * in sync only if the account is what the row asks.
 *
 * The creation needs no memo: a vault is never closed, so a creation answered with an earlier
 * identical one's success tells the truth (the vault exists), and its state is read and
 * compared after it like any other.
 */
async function sendVaultChanges(
  ctx: Ctx, orgId: string, wallet: WalletRow, beforeSend: (prepared: PreparedTransaction) => Promise<void>,
): Promise<VaultPass> {
  /** Signed, then noted by `beforeSend`, then sent, and its outcome waited for (30 s at most). */
  const send = async (instructions: Instruction[]) => {
    const prepared = await ctx.chain.prepare(instructions);
    await beforeSend(prepared);
    await ctx.chain.submit(prepared);
    return ctx.chain.waitForOutcome(prepared.signature, VAULT_UPDATE_WAIT_MS);
  };
  const vaultAddress = address(wallet.chain_address);
  let vault = await ctx.chain.getVault(vaultAddress);
  if (!vault) {
    const created = await send([await ctx.chain.createVaultIx(orgId, wallet.agent_id, wallet.policy_id)]);
    // AlreadyInitialized: created by a sync before this one (its lease lapsed).
    if (created.err && created.err.name !== 'AlreadyInitialized') return { refused: `creating vault ${wallet.chain_address} failed: ${created.err.name}` };
    vault = await readVault(ctx, vaultAddress);
  }
  const want = {
    frozen: wallet.status !== 'active', policy: await ctx.chain.policyAddress(orgId, wallet.policy_id),
  };
  const instructions = [];
  if (vault.policy !== want.policy) instructions.push(await ctx.chain.attachPolicyIx(orgId, wallet.agent_id, wallet.policy_id));
  if (vault.frozen !== want.frozen) instructions.push(await ctx.chain.setFrozenIx(orgId, wallet.agent_id, want.frozen));
  if (instructions.length) {
    const outcome = await send([referenceMemoIx(vaultUpdateReference(wallet.id)), ...instructions]);
    if (outcome.err) return { refused: `updating vault ${wallet.chain_address} failed: ${outcome.err.name}` };
    vault = await readVault(ctx, vaultAddress);
  }
  return { agrees: vault.policy === want.policy && vault.frozen === want.frozen };
}

/** The vault account, known to exist (created by this pass or before it; vaults are never closed). */
async function readVault(ctx: Ctx, vault: Address) {
  const account = await ctx.chain.getVault(vault);
  if (!account) throw new Error(`vault ${vault} missing after its creation`);
  return account;
}

const SYNC_BATCH_MAX = 50;
/** A run of the `wallets.sync` job starts no wallet's sync after this. */
export const WALLET_SYNC_LIMITS: Readonly<{ runBudgetMs: number }> = { runBudgetMs: 10_000 };

/**
 * The `wallets.sync` job: every wallet whose chain state lags, a bounded batch per run. Only
 * wallets whose retry time has come (a failed sync puts it later: syncRetryDelayMs) and that no
 * sync holds, the one due longest first: its retry time, or for one that has not failed since
 * it became pending, its last change. Before, the 50 oldest changes were taken on every run
 * and a refusal changed nothing about them, so 50 vaults the chain keeps refusing held every
 * place of every batch and no other wallet synced again.
 */
export async function syncPendingWallets(ctx: Ctx, limits: { runBudgetMs: number } = WALLET_SYNC_LIMITS): Promise<number> {
  const deadlineMs = performance.now() + limits.runBudgetMs;
  const now = new Date(ctx.clock.nowMs());
  const pending = await ctx.db.query<{ id: string; org_id: string }>(
    `SELECT id, org_id FROM wallets
     WHERE chain_status = 'pending' AND (sync_retry_at IS NULL OR sync_retry_at <= $1)
       AND (sync_lease_until IS NULL OR sync_lease_until <= $1)
     ORDER BY COALESCE(sync_retry_at, updated_at), id LIMIT ${SYNC_BATCH_MAX}`, [now]);
  let synced = 0;
  for (const wallet of pending) {
    // A slow chain (each sync up to three passes, each waiting for a confirmation) ends the run
    // here rather than holding every later wallet, and the job's next run, behind it.
    if (performance.now() > deadlineMs) break;
    try {
      if (await syncWalletToChain(ctx, wallet.org_id, wallet.id)) synced += 1;
    } catch (error) {
      // Counted in its back-off, and a warning from the fifth failure in a row on (syncWalletToChain).
      ctx.log.info({ err: error, walletId: wallet.id }, 'wallet chain sync failed; retrying at its retry time');
    }
  }
  return synced;
}

// ---------------------------------------------------------------------------------------------
// Update, archive

export interface UpdateWalletInput {
  label?: string;
  policyId?: string;
  tags?: string[];
  status?: 'active' | 'frozen';
  /** null turns balance.low off */
  lowBalanceThreshold?: bigint | null;
}

export async function updateWallet(
  ctx: Ctx, orgId: string, walletId: string, input: UpdateWalletInput, actingKeyId?: string,
): Promise<WalletWithPolicy> {
  const nowMs = ctx.clock.nowMs();
  const chainChanged = await ctx.db.transaction(async (tx) => {
    const wallet = await lockWallet(tx, orgId, walletId);
    await assertActingKeyLive(tx, orgId, actingKeyId);
    assertNotArchived(wallet);
    if (input.policyId !== undefined && input.policyId !== wallet.policy_id) await assertPolicyUsable(tx, orgId, input.policyId, ctx.clock);
    const next = {
      label: input.label ?? wallet.label,
      policyId: input.policyId ?? wallet.policy_id,
      tags: input.tags === undefined ? wallet.tags : normaliseTags(input.tags),
      status: input.status ?? wallet.status,
    };
    const chainChange = next.policyId !== wallet.policy_id || next.status !== wallet.status;
    await tx.query(
      `UPDATE wallets SET label = $2, policy_id = $3, tags = $4, status = $5, updated_at = $6,
         chain_status = CASE WHEN $7::boolean THEN 'pending' ELSE chain_status END,
         sync_retry_at = CASE WHEN $7::boolean THEN NULL ELSE sync_retry_at END,
         sync_failures = CASE WHEN $7::boolean THEN 0 ELSE sync_failures END,
         policy_violation_at = CASE WHEN policy_id = $3 THEN policy_violation_at END,
         low_balance_threshold = CASE WHEN $8::boolean THEN $9::bigint ELSE low_balance_threshold END,
         low_balance_fired_at = CASE WHEN $8::boolean THEN NULL ELSE low_balance_fired_at END,
         low_balance_crossed_balance = CASE WHEN $8::boolean THEN NULL ELSE low_balance_crossed_balance END
       WHERE id = $1`,
      [walletId, next.label, next.policyId, next.tags, next.status, new Date(nowMs), chainChange,
        input.lowBalanceThreshold !== undefined, input.lowBalanceThreshold ?? null]);
    if (next.status !== wallet.status) {
      const frozen = next.status === 'frozen';
      await recordEvent(tx, nowMs, {
        orgId, type: frozen ? 'wallet.frozen' : 'wallet.unfrozen', walletId,
        summary: frozen ? `Wallet ${wallet.label} frozen by an operator` : `Wallet ${wallet.label} unfrozen`,
        payload: { wallet_id: walletId, agent_id: wallet.agent_id, reason: 'manual' },
      });
    }
    return chainChange;
  });
  if (chainChanged) await syncQuietly(ctx, orgId, walletId);
  return getWallet(ctx.db, orgId, walletId);
}

/** The database already decided; a chain hiccup is finished by the wallets.sync job. */
async function syncQuietly(ctx: Ctx, orgId: string, walletId: string): Promise<void> {
  try {
    await syncWalletToChain(ctx, orgId, walletId);
  } catch (error) {
    ctx.log.warn({ err: error, walletId }, 'vault update on chain did not finish; wallets.sync will retry');
  }
}

/** Archives a wallet with a zero balance and nothing in flight; the vault is frozen on chain. */
export async function archiveWallet(ctx: Ctx, orgId: string, walletId: string): Promise<WalletWithPolicy> {
  // A payment answered `confirmed` is settled in the index just after its answer: what the chain
  // has already decided is settled first, so "pay the rest, then archive" does not find it in flight.
  await settlePendingOf(ctx, orgId, walletId);
  // USDC sent to the vault's address from outside, which the service does not record, refuses the
  // archiving (src/wallets/unrecorded.ts): a frozen vault could never move it on. The chain is
  // read outside the transaction; the row must not have changed since.
  const matching = await balanceMatchingChain(ctx, orgId, walletId);
  const nowMs = ctx.clock.nowMs();
  await ctx.db.transaction(async (tx) => {
    const wallet = await lockWallet(tx, orgId, walletId);
    assertNotArchived(wallet);
    const changed = () => new ServiceError('wallet_balance_not_zero', `Wallet ${walletId} changed while it was checked; archive it again.`,
      { wallet_id: walletId });
    if (matching !== null && 'version' in matching) {
      const [row] = await tx.query<{ version: string }>('SELECT xmin::text AS version FROM wallets WHERE id = $1', [walletId]);
      if (row!.version !== matching.version) throw changed();
    }
    // An escrow still open pays this vault back (a refund) or pays it (a release) later: an
    // archived vault could never move that money on.
    // A payment awaiting its co-signature is in flight too, but waits for an operator, not the chain.
    const [{ in_flight: inFlight, escrow: escrowed, awaiting }] = await tx.query<{ in_flight: boolean; escrow: boolean; awaiting: number }>(
      `SELECT ${inFlightSql('$1')} AS in_flight, ${openEscrowSql('$1')} AS escrow,
         (SELECT count(*)::int FROM transactions t WHERE t.wallet_id = $1 AND t.status = 'pending' AND t.approval->>'status' = 'awaiting') AS awaiting`,
      [walletId]) as [{ in_flight: boolean; escrow: boolean; awaiting: number }];
    // Busy when the chain was to be read and settled since: the balances were not compared.
    if (matching !== null && 'busy' in matching && !inFlight && !escrowed) throw changed();
    if (wallet.balance !== 0n || inFlight || escrowed) {
      throw new ServiceError('wallet_balance_not_zero',
        awaiting > 0 ? `Wallet ${walletId} has ${awaiting} payment${awaiting === 1 ? '' : 's'} awaiting co-signature: `
          + 'approve or reject them (POST /v1/payments/{tx_id}/reject), then archive it.'
          : inFlight ? `Wallet ${walletId} has transactions in flight; archive it once they settle.`
          : escrowed ? `Wallet ${walletId} is a party to an escrow still open; archive it once the escrow is released, refunded or resolved.`
            : `Wallet ${walletId} holds ${formatUsdc(wallet.balance)} USDC: withdraw it first (amount "all").`,
        { wallet_id: walletId });
    }
    await tx.query(
      `UPDATE wallets SET status = 'archived', archived_at = $2, updated_at = $2, chain_status = 'pending', sync_retry_at = NULL, sync_failures = 0,
         session_public_key = NULL, session_expires_at = NULL, auto_topup_enabled = FALSE WHERE id = $1`,
      [walletId, new Date(nowMs)]);
    await recordEvent(tx, nowMs, {
      orgId, type: 'wallet.archived', walletId,
      summary: `Wallet ${wallet.label} archived`,
      payload: { wallet_id: walletId, agent_id: wallet.agent_id, chain_address: wallet.chain_address },
    });
  });
  await syncQuietly(ctx, orgId, walletId);
  return getWallet(ctx.db, orgId, walletId);
}

// ---------------------------------------------------------------------------------------------
// Session authority, auto-topup

export async function rotateSessionToken(
  ctx: Ctx, orgId: string, walletId: string, ttlSeconds: number, actingKeyId?: string,
): Promise<{ wallet_id: string; session_token: string; expires_at: string }> {
  const nowMs = ctx.clock.nowMs();
  const authority = newSessionAuthority();
  const expiresAt = new Date(nowMs + ttlSeconds * 1000);
  await ctx.db.transaction(async (tx) => {
    const wallet = await lockWallet(tx, orgId, walletId);
    assertNotArchived(wallet);
    // A key revoked while this waited for the vault mints no credential.
    await assertActingKeyLive(tx, orgId, actingKeyId);
    // The previous token stops working with this commit: only the new public key is kept.
    await tx.query('UPDATE wallets SET session_public_key = $2, session_expires_at = $3, updated_at = $4 WHERE id = $1',
      [walletId, authority.publicKey, expiresAt, new Date(nowMs)]);
  });
  return { wallet_id: walletId, session_token: authority.token, expires_at: expiresAt.toISOString() };
}

export interface AutoTopupInput {
  enabled: boolean;
  triggerBelow: bigint | null;
  topupAmount: bigint | null;
}

export async function setAutoTopup(
  ctx: Ctx, orgId: string, walletId: string, input: AutoTopupInput, actingKeyId?: string,
): Promise<WalletWithPolicy> {
  const nowMs = ctx.clock.nowMs();
  await ctx.db.transaction(async (tx) => {
    const wallet = await lockWallet(tx, orgId, walletId);
    await assertActingKeyLive(tx, orgId, actingKeyId);
    assertNotArchived(wallet);
    // Turned on, or given another trigger: a new episode, so a vault already below fires again —
    // unless its topup is still in flight (an auto-topup funding pending): that one is the
    // episode's, and freeing its latch would pay the vault a second time. Its latch re-arms as
    // usual when it lands (the balance back), or when it expires unsent (the funding's failure
    // rule). 'auto-topup' is AUTO_TOPUP_MEMO (src/transactions/settlement.ts). Under the vault's
    // lock, which the automation takes too before it records a funding: no topup slips between.
    await tx.query(
      `UPDATE wallets SET auto_topup_enabled = $2, auto_topup_trigger_below = $3, auto_topup_amount = $4, updated_at = $5,
         topup_fired_at = CASE WHEN (NOT auto_topup_enabled OR auto_topup_trigger_below IS DISTINCT FROM $3)
             AND NOT EXISTS (SELECT 1 FROM transactions t WHERE t.wallet_id = $1 AND t.type = 'funding'
               AND t.memo = 'auto-topup' AND t.status = 'pending')
           THEN NULL ELSE topup_fired_at END
       WHERE id = $1`,
      [walletId, input.enabled, input.triggerBelow, input.topupAmount, new Date(nowMs)]);
  });
  return getWallet(ctx.db, orgId, walletId);
}
