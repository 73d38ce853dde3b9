/**
 * Settlement of the money moves the service records (DESIGN §5): a transaction row is written
 * `pending` with its chain signature before anything is sent, and settled exactly once from the
 * chain's outcome — by the request that sent it, or by the reconciler after a crash.
 *
 * Each type says what confirmation and failure mean for the balances it touched when it was
 * recorded: the source was debited at once (so concurrent requests can never overdraw it); a
 * confirmation credits the destination, a failure gives the source its amount back.
 *
 * Lock order, everywhere: the organisation row before wallet rows, wallet rows by id. A
 * settlement touches one side only, so it can never close a cycle with a recording.
 */
import type { Signature } from '@solana/kit';
import type { TransactionOutcome } from '../chain/client.ts';
import type { Database, Queryable } from '../db/database.ts';
import { recordEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';

/** The memo of a funding made by auto-topup (its `wallet.funded` says `source: auto_topup`). */
export const AUTO_TOPUP_MEMO = 'auto-topup';

export type TransactionType =
  | 'payment' | 'funding' | 'withdrawal' | 'a2a_send' | 'a2a_receive' | 'escrow_lock' | 'escrow_release' | 'escrow_refund';
export type TransactionStatus = 'pending' | 'confirmed' | 'blocked' | 'failed';

export interface TransactionRow {
  id: string;
  org_id: string;
  wallet_id: string | null;
  type: TransactionType;
  status: TransactionStatus;
  amount: bigint;
  currency: string;
  recipient: string | null;
  policy_id: string | null;
  policy_triggered: boolean;
  violation: unknown;
  memo: string | null;
  attestation_hash: string | null;
  tx_signature: string | null;
  last_valid_block_height: bigint | null;
  on_chain_slot: bigint | null;
  failure_reason: string | null;
  batch_id: string | null;
  escrow_id: string | null;
  created_at: Date;
  updated_at: Date;
  settled_at: Date | null;
}

export interface NewTransaction {
  /** chosen before signing when the chain transaction names it (referenceMemoIx) */
  id?: string;
  orgId: string;
  walletId: string;
  type: TransactionType;
  status?: TransactionStatus;
  amount: bigint;
  recipient: string | null;
  policyId?: string | null;
  memo?: string | null;
  attestationHash?: string | null;
  signature: string | null;
  lastValidBlockHeight: bigint | null;
  batchId?: string | null;
  /** the escrow an escrow or A2A transaction belongs to */
  escrowId?: string | null;
  /** a payment's resolved recipient address and category */
  recipientAddress?: string | null;
  category?: string | null;
  policyTriggered?: boolean;
  /** co-signature state (JSON) and when it lapses */
  approval?: unknown;
  approvalExpiresAt?: Date | null;
  /** when the amount started counting toward the policy windows (ms of the service clock) */
  spendAtMs?: number | null;
  /** the rule a blocked spend broke */
  violation?: unknown;
}

export async function insertTransaction(tx: Queryable, nowMs: number, t: NewTransaction): Promise<TransactionRow> {
  const now = new Date(nowMs);
  const rows = await tx.query<TransactionRow>(
    `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, policy_id, memo, attestation_hash,
       tx_signature, last_valid_block_height, batch_id, escrow_id, created_at, updated_at,
       recipient_address, category, policy_triggered, approval, approval_expires_at, spend_at_ms, violation)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $15, $16, $17, $18, $19, $20, $21, $22) RETURNING *`,
    [t.id ?? newId('tx', nowMs), t.orgId, t.walletId, t.type, t.status ?? 'pending', t.amount, t.recipient, t.policyId ?? null,
      t.memo ?? null, t.attestationHash ?? null, t.signature, t.lastValidBlockHeight, t.batchId ?? null, t.escrowId ?? null, now,
      t.recipientAddress ?? null, t.category ?? null, t.policyTriggered ?? false,
      t.approval === undefined || t.approval === null ? null : JSON.stringify(t.approval), t.approvalExpiresAt ?? null, t.spendAtMs ?? null,
      t.violation === undefined || t.violation === null ? null : JSON.stringify(t.violation)]);
  return rows[0]!;
}

/** What a settled transaction does to balances and which event it writes. */
interface SettlementRule {
  confirmed(tx: Queryable, nowMs: number, row: TransactionRow): Promise<void>;
  failed(tx: Queryable, nowMs: number, row: TransactionRow): Promise<void>;
}

async function creditWallet(tx: Queryable, nowMs: number, walletId: string, amount: bigint): Promise<bigint> {
  const rows = await tx.query<{ balance: bigint }>(
    'UPDATE wallets SET balance = balance + $2, last_transaction_at = $3 WHERE id = $1 RETURNING balance',
    [walletId, amount, new Date(nowMs)]);
  return rows[0]!.balance;
}

async function creditReserve(tx: Queryable, orgId: string, amount: bigint): Promise<bigint> {
  const rows = await tx.query<{ reserve_balance: bigint }>(
    'UPDATE organizations SET reserve_balance = reserve_balance + $2 WHERE id = $1 RETURNING reserve_balance',
    [orgId, amount]);
  return rows[0]!.reserve_balance;
}

const RULES: Partial<Record<TransactionType, SettlementRule>> = {
  funding: {
    async confirmed(tx, nowMs, row) {
      const balance = await creditWallet(tx, nowMs, row.wallet_id!, row.amount);
      await recordEvent(tx, nowMs, {
        orgId: row.org_id, type: 'wallet.funded', walletId: row.wallet_id,
        summary: `Wallet funded with ${formatUsdc(row.amount)} USDC from the reserve`,
        payload: {
          wallet_id: row.wallet_id, tx_id: row.id, amount: formatUsdc(row.amount), source: row.memo === AUTO_TOPUP_MEMO ? 'auto_topup' : 'reserve',
          usdc_balance: formatUsdc(balance), tx_signature: row.tx_signature, on_chain_slot: Number(row.on_chain_slot),
          ...(row.batch_id ? { batch_id: row.batch_id } : {}),
        },
      });
    },
    async failed(tx, _nowMs, row) {
      await creditReserve(tx, row.org_id, row.amount);
    },
  },
  withdrawal: {
    async confirmed(tx, nowMs, row) {
      await tx.query('UPDATE wallets SET last_transaction_at = $2 WHERE id = $1', [row.wallet_id, new Date(nowMs)]);
      const reserve = await creditReserve(tx, row.org_id, row.amount);
      const wallet = await tx.query<{ balance: bigint }>('SELECT balance FROM wallets WHERE id = $1', [row.wallet_id]);
      await recordEvent(tx, nowMs, {
        orgId: row.org_id, type: 'wallet.withdrawn', walletId: row.wallet_id,
        summary: `${formatUsdc(row.amount)} USDC returned from the wallet to the reserve`,
        payload: {
          wallet_id: row.wallet_id, tx_id: row.id, amount: formatUsdc(row.amount), destination: 'reserve',
          usdc_balance: formatUsdc(wallet[0]!.balance), org_balance: formatUsdc(reserve),
          tx_signature: row.tx_signature, on_chain_slot: Number(row.on_chain_slot),
        },
      });
    },
    async failed(tx, nowMs, row) {
      await creditWallet(tx, nowMs, row.wallet_id!, row.amount);
    },
  },
};

/** Another feature (payments, escrow) adds what its transaction types mean when settled. */
export function registerSettlementRule(type: TransactionType, rule: SettlementRule): void {
  RULES[type] = rule;
}

/**
 * Settles every pending row carrying this signature (a batch shares one) from the chain's
 * outcome, once: rows already settled are left alone, so the request and the reconciler may
 * both try. Returns the rows this call settled.
 */
export async function settleSignature(
  db: Database, nowMs: number, signature: string, outcome: { slot: bigint | null; err: { name: string } | null },
): Promise<TransactionRow[]> {
  return db.transaction(async (tx) => {
    const status: TransactionStatus = outcome.err ? 'failed' : 'confirmed';
    const rows = await tx.query<TransactionRow>(
      `UPDATE transactions SET status = $2, on_chain_slot = $3, failure_reason = $4, settled_at = $5, updated_at = $5
       WHERE tx_signature = $1 AND status = 'pending' RETURNING *`,
      [signature, status, outcome.slot, outcome.err?.name ?? null, new Date(nowMs)]);
    // Rows sharing a signature are of one type (a batch of fundings): wallets in id order.
    rows.sort((a, b) => (a.wallet_id ?? '').localeCompare(b.wallet_id ?? ''));
    for (const row of rows) {
      const rule = RULES[row.type];
      if (!rule) throw new Error(`no settlement rule for ${row.type}`);
      await rule[status](tx, nowMs, row);
    }
    return rows;
  });
}

/** Waits for the chain's outcome and settles; null when it did not come in time (the reconciler will). */
export async function awaitSettlement(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock'>, signature: string, timeoutMs: number,
): Promise<TransactionOutcome | null> {
  let outcome: TransactionOutcome;
  try {
    outcome = await ctx.chain.waitForOutcome(signature as Signature, timeoutMs);
  } catch {
    return null;
  }
  await settleSignature(ctx.db, ctx.clock.nowMs(), signature, outcome);
  return outcome;
}

/**
 * A transaction never seen is declared expired only this many blocks after its last valid
 * height: one that landed in its very last valid block may take a moment to show its status.
 */
export const EXPIRY_MARGIN_BLOCKS = 32n;

/** A pending row younger than this is left to the request that is still waiting for it. */
export const RECONCILE_GRACE_MS = 10_000;
const RECONCILE_BATCH_MAX = 500;
const STATUS_BATCH_MAX = 256;

/**
 * Settles every pending transaction from the chain (after a crash, a timeout, a lost
 * response): executed → settled with its outcome; never executed and past its last valid
 * block height → failed (it can never land). Returns how many rows were settled.
 */
export async function reconcilePending(ctx: Pick<AppContext, 'db' | 'chain' | 'clock'>, graceMs = RECONCILE_GRACE_MS): Promise<number> {
  const nowMs = ctx.clock.nowMs();
  const pending = await ctx.db.query<{ tx_signature: string; last_valid_block_height: bigint | null }>(
    `SELECT tx_signature, MAX(last_valid_block_height) AS last_valid_block_height FROM transactions
     WHERE status = 'pending' AND tx_signature IS NOT NULL AND created_at < $1
     GROUP BY tx_signature ORDER BY MIN(created_at) LIMIT ${RECONCILE_BATCH_MAX}`,
    [new Date(nowMs - graceMs)]);
  if (!pending.length) return 0;
  const blockHeight = await ctx.chain.getBlockHeight();
  let settled = 0;
  for (let start = 0; start < pending.length; start += STATUS_BATCH_MAX) {
    const batch = pending.slice(start, start + STATUS_BATCH_MAX);
    const outcomes = await ctx.chain.getOutcomes(batch.map((row) => row.tx_signature as Signature));
    for (const [index, row] of batch.entries()) {
      const outcome = outcomes[index];
      if (outcome) {
        settled += (await settleSignature(ctx.db, ctx.clock.nowMs(), row.tx_signature, outcome)).length;
      } else if (row.last_valid_block_height !== null && blockHeight > row.last_valid_block_height + EXPIRY_MARGIN_BLOCKS) {
        settled += (await settleSignature(ctx.db, ctx.clock.nowMs(), row.tx_signature,
          { slot: null, err: { name: 'Expired' } })).length;
      }
    }
  }
  return settled;
}
