/**
 * Closing settled escrows: the `escrows.close` job. An escrow's two chain accounts, its PDA and
 * its USDC token account, are created with the operator key paying their rent (~0.005 SOL,
 * docs/operations.md "The operator key's SOL"). Once the escrow is released, refunded or resolved
 * nothing reads them again, and the program's EscrowClose gives every lamport they hold back to
 * the operator key. Left open, each escrow kept that SOL for ever, and one tenant opening tiny
 * escrows in a loop could drain the key every organisation's payments need.
 *
 * Several processes run the job. A run claims a bounded batch in one short statement (FOR UPDATE
 * SKIP LOCKED over `chain_close_claimed_until`, migration 0041): no lock is held across the chain.
 * The closes are sent by src/chain/account-close.ts, which the `policies.close` job shares.
 * Each close is noted under the claim (its signature and last valid block height) before it is
 * sent, and a run that takes over a lapsed claim sends nothing while that close can still land;
 * so no two runs send the same close. An escrow whose account is already gone (a close that
 * landed before a crash) is recorded closed without a transaction. A close the program refuses
 * is recorded with its error and not sent again: a deterministic refusal (a program deployed
 * before EscrowClose, USDC someone sent to the escrow's token account) would cost a fee at every
 * run for ever.
 *
 * Nothing of the escrow's API view or transactions changes: the rent is the operator's, not an
 * organisation's money.
 */
import { address } from '@solana/kit';
import { closeAccounts, type AccountCloseLimits, type AccountCloseRun, type AccountCloser } from '../chain/account-close.ts';
import type { AppContext } from '../http/context.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

export interface EscrowCloseLimits extends AccountCloseLimits {
  /** Escrows claimed by one run. */
  batchMax: number;
  /**
   * Closes in one transaction. A transaction is 1,232 bytes at most and one of n closes takes
   * 200 + 72·n (each close two accounts and an instruction), so 14 fit; 12 leave room. Each
   * close costs ~3,100 compute units.
   */
  perTransactionMax: number;
  /**
   * How long a claim holds: past the job's timeout. A run that outlives it (the runner reports a
   * late run, never stops it) sends nothing more: each close is noted only under a claim still held.
   */
  claimMs: number;
}

export const ESCROW_CLOSE_LIMITS: Readonly<EscrowCloseLimits> = {
  batchMax: 50, perTransactionMax: 12, claimMs: 60_000, runBudgetMs: 10_000, waitMs: 10_000,
};

interface ClaimedEscrow {
  id: string;
  chain_address: string;
  chain_close_signature: string | null;
  chain_close_valid_height: bigint | null;
}

export type EscrowCloseRun = AccountCloseRun;

/**
 * The `escrows.close` job: claims up to `batchMax` settled escrows still open on chain, the longest
 * settled first, and closes them, several per transaction.
 */
export async function closeSettledEscrows(ctx: Ctx, limits: EscrowCloseLimits = ESCROW_CLOSE_LIMITS): Promise<EscrowCloseRun> {
  const nowMs = ctx.clock.nowMs();
  const claimedUntil = new Date(nowMs + limits.claimMs);
  const claimed = await ctx.db.query<ClaimedEscrow>(
    `UPDATE escrows SET chain_close_claimed_until = $2
     WHERE id IN (
       SELECT id FROM escrows
       WHERE status IN ('released', 'refunded', 'resolved') AND chain_closed_at IS NULL AND chain_close_refused IS NULL
         AND (chain_close_claimed_until IS NULL OR chain_close_claimed_until <= $1)
       ORDER BY settled_at, id LIMIT $3
       FOR UPDATE SKIP LOCKED)
     RETURNING id, chain_address, chain_close_signature, chain_close_valid_height`,
    [new Date(nowMs), claimedUntil, limits.batchMax]);
  if (claimed.length === 0) return { closed: 0, refused: 0 };
  try {
    return await closeAccounts(ctx, claimed, escrowCloser(ctx, limits, claimedUntil));
  } finally {
    // Compare-and-set: a claim taken over meanwhile (it lapsed) is its new holder's.
    await ctx.db.query(
      'UPDATE escrows SET chain_close_claimed_until = NULL WHERE id = ANY($1::text[]) AND chain_close_claimed_until = $2',
      [claimed.map((escrow) => escrow.id), claimedUntil]);
  }
}

function escrowCloser(ctx: Ctx, limits: EscrowCloseLimits, claimedUntil: Date): AccountCloser<ClaimedEscrow> {
  const ids = (escrows: readonly ClaimedEscrow[]) => escrows.map((escrow) => escrow.id);
  return {
    noun: 'escrow',
    limits,
    accountOf: (escrow) => address(escrow.chain_address),
    logFields: (escrow) => ({ escrowId: escrow.id, escrowAddress: escrow.chain_address }),
    sentOf: (escrow) => (escrow.chain_close_signature === null ? []
      : [{ signature: escrow.chain_close_signature, validHeight: escrow.chain_close_valid_height! }]),
    closeIx: (escrow) => ctx.chain.escrowCloseIx(escrow.id),
    // Noted on the escrows whose claim this run still holds (one that lapsed may be another
    // run's now, which would then send a close of its own), and only if it holds every one's.
    note: (group, prepared) => ctx.db.transaction(async (tx) => {
      const held = await tx.query<{ id: string }>(
        'SELECT id FROM escrows WHERE id = ANY($1::text[]) AND chain_close_claimed_until = $2 ORDER BY id FOR UPDATE',
        [ids(group), claimedUntil]);
      const kept = group.filter((escrow) => held.some((row) => row.id === escrow.id));
      if (kept.length === group.length) {
        await tx.query('UPDATE escrows SET chain_close_signature = $2, chain_close_valid_height = $3 WHERE id = ANY($1::text[])',
          [ids(group), prepared.signature, prepared.lastValidBlockHeight]);
      }
      return kept;
    }),
    recordClosed: async (escrows) => {
      if (escrows.length === 0) return 0;
      const rows = await ctx.db.query(
        'UPDATE escrows SET chain_closed_at = $2 WHERE id = ANY($1::text[]) AND chain_closed_at IS NULL RETURNING id',
        [ids(escrows), new Date(ctx.clock.nowMs())]);
      return rows.length;
    },
    recordRefused: async (escrow, error) => (await ctx.db.query(
      'UPDATE escrows SET chain_close_refused = $2 WHERE id = $1 AND chain_close_refused IS NULL AND chain_closed_at IS NULL RETURNING id',
      [escrow.id, error])).length > 0,
    logRefused: (_escrow, fields) => {
      if (fields.error === 'InvalidEscrowState') {
        // Settled in the database, not on chain: not a matter of rent.
        ctx.log.error(fields, 'the chain says a settled escrow is not settled: the database and the chain disagree; not closed');
      } else {
        ctx.log.warn(fields, fields.error === 'InvalidInstruction'
          ? 'the deployed program does not know EscrowClose (a local validator keeps the program its data dir was created with): '
            + 'this escrow\'s accounts stay open, their rent with them; not tried again (docs/operations.md)'
          : 'the program refused to close a settled escrow\'s accounts: they stay open, their rent with them; not tried again');
      }
    },
  };
}
