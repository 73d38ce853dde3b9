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
import { address, type Signature } from '@solana/kit';
import { ConfirmationTimeoutError, type PreparedTransaction } from '../chain/client.ts';
import type { AppContext } from '../http/context.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

export interface EscrowCloseLimits {
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
  /** A run sends no new close after this, so it ends within the job's timeout. */
  runBudgetMs: number;
  /** How long a run waits for a close's outcome; still unknown then, a later run asks the chain. */
  waitMs: number;
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

export interface EscrowCloseRun {
  /** escrows recorded closed (their accounts gone, by this run's closes or before) */
  closed: number;
  /** escrows whose close the program refused, recorded and not tried again */
  refused: number;
}

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
  const run: EscrowCloseRun = { closed: 0, refused: 0 };
  if (claimed.length === 0) return run;
  try {
    const sending: Sending = { claimedUntil, limits, deadlineMs: performance.now() + limits.runBudgetMs };
    for (const group of groupsOf(await closesToSend(ctx, claimed, run), limits.perTransactionMax)) {
      await sendCloses(ctx, group, sending, run);
    }
  } finally {
    // Compare-and-set: a claim taken over meanwhile (it lapsed) is its new holder's.
    await ctx.db.query(
      'UPDATE escrows SET chain_close_claimed_until = NULL WHERE id = ANY($1::text[]) AND chain_close_claimed_until = $2',
      [claimed.map((escrow) => escrow.id), claimedUntil]);
  }
  return run;
}

/**
 * The claimed escrows that need a close sent: not those whose account is gone (recorded closed
 * now), nor those whose close noted by an earlier run can still land (a later run looks again).
 * A noted close that failed is sent again: its failure may have been another escrow's of the
 * same transaction, and a refusal of this one's is recorded only from an outcome of its own.
 */
async function closesToSend(ctx: Ctx, claimed: readonly ClaimedEscrow[], run: EscrowCloseRun): Promise<ClaimedEscrow[]> {
  // The height before the statuses, and both before the accounts, as the reconciler reads them:
  // what is read later is at least as recent, so a close it does not find had not landed by that
  // height, and one that landed shows as its account gone.
  const height = await ctx.chain.getBlockHeight();
  const noted = claimed.filter((escrow) => escrow.chain_close_signature !== null);
  const outcomes = noted.length > 0
    ? await ctx.chain.getOutcomes(noted.map((escrow) => escrow.chain_close_signature as Signature)) : [];
  const landing = new Set(noted.filter((escrow, i) => outcomes[i] === null
    && height <= escrow.chain_close_valid_height! + EXPIRY_MARGIN_BLOCKS).map((escrow) => escrow.id));
  const owned = await ctx.chain.getProgramOwned(claimed.map((escrow) => address(escrow.chain_address)));
  // An account gone is recorded closed, unless by a close whose outcome is not known yet: a local
  // validator shows its accounts before the slot that changed them is saved, and a close lost
  // with it would leave the escrow recorded closed, its rent for ever on chain. A later run sees.
  run.closed += await recordClosed(ctx, claimed.filter((escrow, i) => !owned[i] && !landing.has(escrow.id)).map((escrow) => escrow.id));
  return claimed.filter((escrow, i) => owned[i] && !landing.has(escrow.id));
}

interface Sending {
  claimedUntil: Date;
  limits: EscrowCloseLimits;
  /** performance.now() after which nothing more is sent */
  deadlineMs: number;
}

/**
 * One transaction closing `group`. Noted first, under the claim; then sent and its outcome waited
 * for. A group refused as a whole (one of its closes failed, so none took effect) is sent again
 * one escrow per transaction, so that each refusal is known to be that escrow's own.
 */
async function sendCloses(ctx: Ctx, group: readonly ClaimedEscrow[], sending: Sending, run: EscrowCloseRun): Promise<void> {
  // A slow chain ends the run here: the claims are released and a later run goes on.
  if (performance.now() > sending.deadlineMs) return;
  const prepared = await ctx.chain.prepare(await Promise.all(group.map((escrow) => ctx.chain.escrowCloseIx(escrow.id))));
  if (!(await noteClose(ctx, group, sending.claimedUntil, prepared))) return;
  let outcome;
  try {
    await ctx.chain.submit(prepared);
    outcome = await ctx.chain.waitForOutcome(prepared.signature, sending.limits.waitMs);
  } catch (error) {
    // It may still land: noted, so a later run waits for it to land or expire before sending again.
    if (!(error instanceof ConfirmationTimeoutError)) {
      ctx.log.warn({ err: error, signature: prepared.signature }, 'sending an escrow close failed; a later run asks the chain');
    }
    return;
  }
  if (outcome.err === null) {
    run.closed += await recordClosed(ctx, group.map((escrow) => escrow.id));
    return;
  }
  if (group.length > 1) {
    for (const escrow of group) await sendCloses(ctx, [escrow], sending, run);
    return;
  }
  const [escrow] = group;
  const [owned] = await ctx.chain.getProgramOwned([address(escrow!.chain_address)]);
  if (!owned) {
    run.closed += await recordClosed(ctx, [escrow!.id]);
  } else if (outcome.err.instructionIndex === null) {
    // Not the program's answer (the transaction as a whole): a later run tries again.
    ctx.log.warn({ escrowId: escrow!.id, signature: prepared.signature, error: outcome.err.name },
      'an escrow close failed on chain; a later run tries again');
  } else if (await recordRefused(ctx, escrow!.id, outcome.err.name)) {
    run.refused += 1;
    const fields = { escrowId: escrow!.id, escrowAddress: escrow!.chain_address, signature: prepared.signature, error: outcome.err.name };
    if (outcome.err.name === 'InvalidEscrowState') {
      // Settled in the database, not on chain: not a matter of rent.
      ctx.log.error(fields, 'the chain says a settled escrow is not settled: the database and the chain disagree; not closed');
    } else {
      ctx.log.warn(fields, outcome.err.name === 'InvalidInstruction'
        ? 'the deployed program does not know EscrowClose (a local validator keeps the program its data dir was created with): '
          + 'this escrow\'s accounts stay open, their rent with them; not tried again (docs/operations.md)'
        : 'the program refused to close a settled escrow\'s accounts: they stay open, their rent with them; not tried again');
    }
  }
}

/**
 * Notes the close on each escrow of the group if this run still holds every one's claim (one
 * that lapsed may be another run's now, which would then send a close of its own); false if not,
 * and nothing is sent.
 */
async function noteClose(ctx: Ctx, group: readonly ClaimedEscrow[], claimedUntil: Date, prepared: PreparedTransaction): Promise<boolean> {
  const ids = group.map((escrow) => escrow.id);
  return ctx.db.transaction(async (tx) => {
    const held = await tx.query(
      'SELECT id FROM escrows WHERE id = ANY($1::text[]) AND chain_close_claimed_until = $2 ORDER BY id FOR UPDATE',
      [ids, claimedUntil]);
    if (held.length !== ids.length) return false;
    await tx.query('UPDATE escrows SET chain_close_signature = $2, chain_close_valid_height = $3 WHERE id = ANY($1::text[])',
      [ids, prepared.signature, prepared.lastValidBlockHeight]);
    return true;
  });
}

async function recordClosed(ctx: Ctx, ids: readonly string[]): Promise<number> {
  if (ids.length === 0) return 0;
  const rows = await ctx.db.query(
    'UPDATE escrows SET chain_closed_at = $2 WHERE id = ANY($1::text[]) AND chain_closed_at IS NULL RETURNING id',
    [ids, new Date(ctx.clock.nowMs())]);
  return rows.length;
}

/** True when this call recorded the refusal (so it is logged once). */
async function recordRefused(ctx: Ctx, id: string, error: string): Promise<boolean> {
  const rows = await ctx.db.query(
    'UPDATE escrows SET chain_close_refused = $2 WHERE id = $1 AND chain_close_refused IS NULL AND chain_closed_at IS NULL RETURNING id',
    [id, error]);
  return rows.length > 0;
}

function groupsOf<T>(items: readonly T[], size: number): T[][] {
  const groups: T[][] = [];
  for (let start = 0; start < items.length; start += size) groups.push(items.slice(start, start + size));
  return groups;
}
