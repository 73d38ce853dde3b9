/**
 * Closing the chain accounts of records that no longer need them, their rent back to the operator
 * key: what the `escrows.close` (src/escrow/close.ts) and `policies.close` (src/policies/close.ts)
 * jobs share once a run has claimed its records. Each job keeps its own claim, its own conditions
 * and its own columns (migrations 0041 and 0043); this file sends the closes.
 *
 * For the claimed records: those whose account is already gone are recorded closed (unless a
 * transaction of their own whose outcome is not known can still land); the rest are closed several
 * per transaction, each transaction noted on its records (under their claim, by the job) before it
 * is sent; a transaction refused as a whole is sent again one record per transaction, so that a
 * refusal is known to be that record's own, and it is then recorded and not tried again.
 */
import type { Address, Instruction, Signature } from '@solana/kit';
import { ConfirmationTimeoutError, type PreparedTransaction } from './client.ts';
import type { AppContext } from '../http/context.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';

type Ctx = Pick<AppContext, 'chain' | 'log'>;

/** A transaction sent for a record whose outcome may not be known: its signature and last valid block height. */
export interface SentTransaction {
  signature: string;
  validHeight: bigint;
}

export interface AccountCloseLimits {
  /** Closes in one transaction. */
  perTransactionMax: number;
  /** A run sends no new close after this (ms of its own), so it ends within the job's timeout. */
  runBudgetMs: number;
  /** How long a run waits for a close's outcome; still unknown then, a later run asks the chain. */
  waitMs: number;
}

export interface AccountCloser<T> {
  /** what a record is, in the logs: 'escrow', 'policy' */
  noun: string;
  limits: AccountCloseLimits;
  /** the account whose ownership by the program says whether it is still open */
  accountOf(record: T): Address;
  /** what names the record in a log line */
  logFields(record: T): Record<string, unknown>;
  /** the record's transactions that may still land (its noted close, and any other of its own) */
  sentOf(record: T): readonly SentTransaction[];
  closeIx(record: T): Promise<Instruction>;
  /**
   * Notes `prepared` on the group's records this run still holds and that may still be closed,
   * and returns them; notes nothing unless that is every one of the group.
   */
  note(group: readonly T[], prepared: PreparedTransaction): Promise<T[]>;
  /** Records them closed; returns how many were not yet. */
  recordClosed(records: readonly T[]): Promise<number>;
  /** Records the program's refusal; true when this call recorded it (so it is logged once). */
  recordRefused(record: T, error: string): Promise<boolean>;
  /** Logs a refusal just recorded (`fields`: the record's, the transaction's signature, the error's name). */
  logRefused(record: T, fields: Record<string, unknown>): void;
}

export interface AccountCloseRun {
  /** records recorded closed (their accounts gone, by this run's closes or before) */
  closed: number;
  /** records whose close the program refused, recorded and not tried again */
  refused: number;
}

/** Signatures asked about in one getSignatureStatuses call (JSON-RPC allows 256). */
const STATUS_BATCH_MAX = 200;

/** Closes the accounts of the claimed records (the claim and its release are the job's). */
export async function closeAccounts<T>(ctx: Ctx, claimed: readonly T[], closer: AccountCloser<T>): Promise<AccountCloseRun> {
  const run: AccountCloseRun = { closed: 0, refused: 0 };
  if (claimed.length === 0) return run;
  const deadlineMs = performance.now() + closer.limits.runBudgetMs;
  for (const group of groupsOf(await closesToSend(ctx, claimed, closer, run), closer.limits.perTransactionMax)) {
    await sendCloses(ctx, group, closer, deadlineMs, run);
  }
  return run;
}

/**
 * The claimed records that need a close sent: not those whose account is gone (recorded closed
 * now), nor those with a transaction of their own that can still land (a later run looks again).
 * A noted close that failed is sent again: its failure may have been another record's of the same
 * transaction, and a refusal of this one's is recorded only from an outcome of its own.
 */
async function closesToSend<T>(ctx: Ctx, claimed: readonly T[], closer: AccountCloser<T>, run: AccountCloseRun): Promise<T[]> {
  // The height before the statuses, and both before the accounts, as the reconciler reads them:
  // what is read later is at least as recent, so a transaction it does not find had not landed
  // by that height, and one that landed shows in the account.
  const height = await ctx.chain.getBlockHeight();
  const sent = claimed.flatMap((record) => closer.sentOf(record).map((each) => ({ record, ...each })));
  const landing = new Set<T>();
  for (let start = 0; start < sent.length; start += STATUS_BATCH_MAX) {
    const batch = sent.slice(start, start + STATUS_BATCH_MAX);
    const outcomes = await ctx.chain.getOutcomes(batch.map((each) => each.signature as Signature));
    for (const [i, each] of batch.entries()) {
      if (outcomes[i] === null && height <= each.validHeight + EXPIRY_MARGIN_BLOCKS) landing.add(each.record);
    }
  }
  const owned = await ctx.chain.getProgramOwned(claimed.map((record) => closer.accountOf(record)));
  // An account gone is recorded closed, unless a transaction of its own whose outcome is not known
  // can still land: a local validator shows its accounts before the slot that changed them is
  // saved, and a close lost with it would leave the record closed, its rent for ever on chain
  // (a policy's SetPolicy landing later would create its account again). A later run sees.
  run.closed += await closer.recordClosed(claimed.filter((record, i) => !owned[i] && !landing.has(record)));
  return claimed.filter((record, i) => owned[i] && !landing.has(record));
}

/**
 * One transaction closing `group`: noted first (by the job, under the claim); then sent and its
 * outcome waited for. A group refused as a whole (one of its closes failed, so none took effect)
 * is sent again one record per transaction.
 */
async function sendCloses<T>(ctx: Ctx, group: readonly T[], closer: AccountCloser<T>, deadlineMs: number, run: AccountCloseRun): Promise<void> {
  // A slow chain ends the run here: the claims are released and a later run goes on.
  if (performance.now() > deadlineMs) return;
  const prepared = await ctx.chain.prepare(await Promise.all(group.map((record) => closer.closeIx(record))));
  const noted = await closer.note(group, prepared);
  if (noted.length === 0) return;
  if (noted.length < group.length) {
    // One no longer to be closed by this run: the others are signed again without it.
    await sendCloses(ctx, noted, closer, deadlineMs, run);
    return;
  }
  let outcome;
  try {
    await ctx.chain.submit(prepared);
    outcome = await ctx.chain.waitForOutcome(prepared.signature, closer.limits.waitMs);
  } catch (error) {
    // It may still land: noted, so a later run waits for it to land or expire before sending again.
    if (!(error instanceof ConfirmationTimeoutError)) {
      ctx.log.warn({ err: error, signature: prepared.signature }, `sending a close of ${closer.noun} accounts failed; a later run asks the chain`);
    }
    return;
  }
  if (outcome.err === null) {
    run.closed += await closer.recordClosed(group);
    return;
  }
  if (group.length > 1) {
    for (const record of group) await sendCloses(ctx, [record], closer, deadlineMs, run);
    return;
  }
  const [record] = group as [T];
  const [owned] = await ctx.chain.getProgramOwned([closer.accountOf(record)]);
  if (!owned) {
    run.closed += await closer.recordClosed([record]);
  } else if (outcome.err.instructionIndex === null) {
    // Not the program's answer (the transaction as a whole): a later run tries again.
    ctx.log.warn({ ...closer.logFields(record), signature: prepared.signature, error: outcome.err.name },
      `a close of ${closer.noun} accounts failed on chain; a later run tries again`);
  } else if (await closer.recordRefused(record, outcome.err.name)) {
    run.refused += 1;
    closer.logRefused(record, { ...closer.logFields(record), signature: prepared.signature, error: outcome.err.name });
  }
}

function groupsOf<T>(items: readonly T[], size: number): T[][] {
  const groups: T[][] = [];
  for (let start = 0; start < items.length; start += size) groups.push(items.slice(start, start + size));
  return groups;
}
