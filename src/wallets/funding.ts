/**
 * Moving USDC inside an organisation: funding (reserve → vault), batch funding (several vaults,
 * one chain transaction: all or nothing) and withdrawal (vault → reserve).
 *
 * DESIGN §5's flow: the chain transaction is signed first; one database transaction checks,
 * debits the source in the index and records the move `pending` with that signature; then it
 * is sent and its outcome settled (src/transactions/settlement.ts). No lock is held across the
 * chain round trip, and a source can never be overdrawn however many requests race.
 */
import type { Instruction } from '@solana/kit';
import { referenceMemoIx, type PreparedTransaction } from '../chain/client.ts';
import type { Queryable } from '../db/database.ts';
import { ServiceError, retryShortly } from '../errors/errors.ts';
import type { AppContext } from '../http/context.ts';
import type { RecordMarker } from '../http/idempotency.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';
import { awaitSettlement, insertTransaction, sendUntilTaken, settleInBackground, type TransactionRow } from '../transactions/settlement.ts';
import { assertNotArchived, assertOrganizationReady, lockWallet, walletNotFound, type WalletRow } from './wallets.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

/** How long a request waits for the chain before answering `pending` (the reconciler settles it). */
export const SETTLEMENT_WAIT_MS = 20_000;
/**
 * Fund instructions that fit in one chain transaction (1,232 bytes) with room to spare: a batch
 * is one transaction so that it is atomic on chain too.
 */
export const FUND_BATCH_MAX = 10;

export interface MoveResult {
  transactions: TransactionRow[];
  /** settled rows as the chain decided; `pending` when the chain did not answer in time */
  status: 'confirmed' | 'failed' | 'pending';
}

/**
 * Locks the organisation's reserve, refused while the organisation is not set up on chain (a
 * funding from it would be recorded, sent and refused there). NO KEY UPDATE: it serialises
 * reserve moves as well, but lets other transactions insert rows that reference the
 * organisation (their foreign-key check takes a key-share lock) — one that holds a vault this
 * funding waits for, writing an event, would otherwise wait for the reserve in turn: a deadlock.
 */
async function lockReserve(tx: Queryable, orgId: string): Promise<bigint> {
  const rows = await tx.query<{ reserve_balance: bigint; chain_status: string }>(
    'SELECT reserve_balance, chain_status FROM organizations WHERE id = $1 FOR NO KEY UPDATE', [orgId]);
  assertOrganizationReady(rows[0]!);
  return rows[0]!.reserve_balance;
}

async function settle(ctx: Ctx, prepared: PreparedTransaction, recorded: TransactionRow[]): Promise<MoveResult> {
  const waiting = { over: false };
  await sendUntilTaken(ctx, prepared, waiting, performance.now() + SETTLEMENT_WAIT_MS).first;
  const settlement = await awaitSettlement(ctx, prepared.signature, SETTLEMENT_WAIT_MS).finally(() => { waiting.over = true; });
  const ids = recorded.map((row) => row.id);
  const rows = await ctx.db.query<TransactionRow>('SELECT * FROM transactions WHERE id = ANY($1) ORDER BY id', [ids]);
  return { transactions: rows, status: settlement === null ? 'pending' : settlement.outcome.err ? 'failed' : 'confirmed' };
}

/** A move as recorded under its chain signature (an idempotent retry's answer after a crash). */
export async function recordedMove(db: Queryable, orgId: string, signature: string): Promise<MoveResult> {
  const rows = await db.query<TransactionRow>(
    'SELECT * FROM transactions WHERE org_id = $1 AND tx_signature = $2 ORDER BY id', [orgId, signature]);
  const status = rows[0]?.status;
  return { transactions: rows, status: status === 'confirmed' || status === 'failed' ? status : 'pending' };
}

export interface Allocation {
  walletId: string;
  amount: bigint;
}

/**
 * Funds one or more vaults of the organisation from its reserve in one chain transaction:
 * every allocation succeeds or none does. `wait: false` returns once it is recorded and sent,
 * `pending`, for a caller that must not wait for the chain (the automation job, which funds
 * vault after vault): a read, that job's next run or the reconciler settles it.
 */
/** Refuses allocations naming a wallet twice. The route asks before the idempotency key is taken. */
export function assertDistinctWallets(allocations: readonly Allocation[]): void {
  const seen = new Set<string>();
  for (const allocation of allocations) {
    if (seen.has(allocation.walletId)) {
      throw new ServiceError('invalid_request', `Wallet ${allocation.walletId} appears twice in the allocations.`, { param: 'allocations' });
    }
    seen.add(allocation.walletId);
  }
}

export async function fundWallets(
  ctx: Ctx, orgId: string, allocations: Allocation[], mark?: RecordMarker,
  options: { memo?: string; wait?: boolean; /** a batch's id even for one allocation (fund-batch) */ batch?: boolean } = {},
): Promise<MoveResult> {
  assertDistinctWallets(allocations);
  const wallets = await ctx.db.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = ANY($2)',
    [orgId, allocations.map((a) => a.walletId)]);
  const byId = new Map(wallets.map((w) => [w.id, w]));
  const nowMs = ctx.clock.nowMs();
  const txIds = new Map(allocations.map((a) => [a.walletId, newId('tx', nowMs)]));
  const batchId = allocations.length > 1 || options.batch ? newId('tx', nowMs).replace(/^tx_/, 'batch_') : null;
  const instructions: Instruction[] = [referenceMemoIx(batchId ?? txIds.get(allocations[0]!.walletId)!)];
  for (const allocation of allocations) {
    const wallet = byId.get(allocation.walletId);
    if (!wallet) throw walletNotFound(allocation.walletId);
    assertNotArchived(wallet);
    instructions.push(await ctx.chain.fundIx(orgId, wallet.agent_id, allocation.amount));
  }
  const prepared = await ctx.chain.prepare(instructions);
  const recorded = await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const total = allocations.reduce((sum, a) => sum + a.amount, 0n);
    const reserve = await lockReserve(tx, orgId);
    if (reserve < total) {
      throw new ServiceError('org_insufficient_balance',
        `The reserve holds ${formatUsdc(reserve)} USDC; ${formatUsdc(total)} USDC was asked.`,
        { available: formatUsdc(reserve), requested: formatUsdc(total) });
    }
    const rows: TransactionRow[] = [];
    for (const allocation of [...allocations].sort((a, b) => a.walletId.localeCompare(b.walletId))) {
      const wallet = await lockWallet(tx, orgId, allocation.walletId);
      assertNotArchived(wallet);
      if (!wallet.provisioned_at) {
        throw new ServiceError('service_unavailable', `Wallet ${wallet.id} is still being created on chain; retry shortly.`);
      }
      rows.push(await insertTransaction(tx, nowMs, {
        id: txIds.get(wallet.id)!, orgId, walletId: wallet.id, type: 'funding', amount: allocation.amount, recipient: wallet.chain_address,
        signature: prepared.signature, lastValidBlockHeight: prepared.lastValidBlockHeight, wire: prepared.wire, batchId, memo: options.memo ?? null,
      }));
    }
    await tx.query('UPDATE organizations SET reserve_balance = reserve_balance - $2 WHERE id = $1', [orgId, total]);
    await mark?.(tx, prepared.signature);
    return rows;
  });
  if (options.wait === false) {
    // Answered after the first send; it is sent again in the background until its outcome comes,
    // which settles it (the reconciler covers a process that stops before).
    const waiting = { over: false };
    await sendUntilTaken(ctx, prepared, waiting, performance.now() + SETTLEMENT_WAIT_MS).first;
    settleInBackground(ctx, prepared.signature, SETTLEMENT_WAIT_MS, waiting);
    return { transactions: recorded, status: 'pending' };
  }
  return settle(ctx, prepared, recorded);
}

/**
 * Returns USDC from a vault to the reserve. `amount: 'all'` takes the whole available balance
 * at the moment the withdrawal is recorded.
 */
export async function withdrawFromWallet(
  ctx: Ctx, orgId: string, walletId: string, amount: bigint | 'all', mark?: RecordMarker,
): Promise<MoveResult> {
  // The amount must be known to sign; for "all" it is read first and re-checked under the lock
  // (a payment in between changes it: sign again, a few times at most).
  for (let attempt = 0; attempt < 5; attempt += 1) {
    // The organisation's state is read with the wallet: a withdrawal goes to its reserve, which
    // must be set up on chain, and it is refused so before an empty wallet's "nothing to withdraw".
    const [wallet] = await ctx.db.query<WalletRow & { org_chain_status: string }>(
      `SELECT w.*, o.chain_status AS org_chain_status FROM wallets w JOIN organizations o ON o.id = w.org_id
       WHERE w.org_id = $1 AND w.id = $2`, [orgId, walletId]);
    if (!wallet) throw walletNotFound(walletId);
    assertOrganizationReady({ chain_status: wallet.org_chain_status });
    assertNotArchived(wallet);
    const wanted = amount === 'all' ? wallet.balance : amount;
    if (wanted === 0n) {
      throw new ServiceError('withdrawal_exceeds_balance', `Wallet ${walletId} holds 0.00 USDC: nothing to withdraw.`, { wallet_id: walletId });
    }
    const txId = newId('tx', ctx.clock.nowMs());
    const prepared = await ctx.chain.prepare([referenceMemoIx(txId), await ctx.chain.withdrawIx(orgId, wallet.agent_id, wanted)]);
    const recorded = await ctx.db.transaction(async (tx) => {
      const locked = await lockWallet(tx, orgId, walletId);
      assertNotArchived(locked);
      if (amount === 'all' && locked.balance !== wanted) return null;
      if (locked.balance < wanted) {
        throw new ServiceError('withdrawal_exceeds_balance',
          `Wallet ${walletId} holds ${formatUsdc(locked.balance)} USDC; ${formatUsdc(wanted)} USDC was asked.`,
          { wallet_id: walletId, available: formatUsdc(locked.balance) });
      }
      // Money going back to the reserve is not a spend: a withdrawal that leaves the balance below
      // the auto-topup trigger takes the episode's latch, as a topup does (not for a reserve
      // shortfall: a deposit must not refill it either), so the vault is not refilled behind an
      // operator emptying it to archive it. The latch re-arms when the balance is back at or
      // above the trigger (migration 0018), so the next spend below it after a credit tops up.
      await tx.query(
        `UPDATE wallets SET balance = balance - $2,
           topup_fired_at = CASE WHEN auto_topup_enabled AND balance - $2 < auto_topup_trigger_below
             THEN COALESCE(topup_fired_at, $3) ELSE topup_fired_at END,
           topup_reserve_short_at = CASE WHEN auto_topup_enabled AND balance - $2 < auto_topup_trigger_below
             THEN NULL ELSE topup_reserve_short_at END
         WHERE id = $1`, [walletId, wanted, new Date(ctx.clock.nowMs())]);
      const org = await tx.query<{ reserve_address: string }>('SELECT reserve_address FROM organizations WHERE id = $1', [orgId]);
      const row = await insertTransaction(tx, ctx.clock.nowMs(), {
        id: txId, orgId, walletId, type: 'withdrawal', amount: wanted, recipient: org[0]!.reserve_address,
        signature: prepared.signature, lastValidBlockHeight: prepared.lastValidBlockHeight, wire: prepared.wire,
      });
      await mark?.(tx, prepared.signature);
      return row;
    });
    if (recorded) return settle(ctx, prepared, [recorded]);
  }
  // Nothing recorded: the same request (with its idempotency key) is safe to send again at once.
  throw retryShortly('The wallet\'s balance kept changing while "all" was signed (payments from it meanwhile); retry the withdrawal.', 1,
    { wallet_id: walletId });
}
