/**
 * Closing deleted policies: the `policies.close` job. A policy's chain account is created by
 * SetPolicy with the operator key paying its rent (~0.0017 SOL, docs/operations.md "The operator
 * key's SOL"). Deleting the policy only marks its row; left open, the account kept that SOL for
 * ever, and one tenant creating and deleting policies in a loop could drain the key every
 * organisation's payments need. The program's PolicyClose gives every lamport back to the
 * operator key.
 *
 * The program cannot tell which vaults still name a policy: a vault attached to a closed policy
 * can spend nothing until another is attached. So the account of a deleted policy is closed only
 * once nothing can need it any more (docs/policies.md, "A deleted policy's account"). Each of
 * these is checked in the claiming statement and again, under the row's lock, right before the
 * close is noted and sent (`CLOSABLE`):
 * - the policy is deleted, not a preset, and deleted at least `graceMs` ago (service clock): a
 *   payment signed just before the deletion has seen its blockhash expire;
 * - no vault may still point at it on chain: no wallet of the organisation names it unless
 *   archived, and no wallet of the organisation (archived ones included) has a chain change
 *   pending. A wallet is `ready` only once its vault, read back, holds the policy its row names
 *   (src/wallets/wallets.ts), and a deleted policy can never be attached again, so with none
 *   pending no vault's account names this policy but an archived one's, frozen for good;
 * - no chain transaction naming its account may still be sent: no transaction recorded under it
 *   is `pending` (a payment in flight or sent again, one awaiting its co-signature, an escrow's
 *   `a2a_send`), and no escrow whose creation signed it is still being created.
 * Once true, none of these can become false again: a deleted policy is attached to no wallet and
 * signed into no new payment. Before sending, the job also waits for any SetPolicy whose outcome
 * its writer never learned (policies.unsettled_writes) to be known or unable to land: one landing
 * after the close would create the account again, its rent paid once more and never reclaimed.
 * (A write is noted only while the policy is not deleted, so none is sent after the deletion.)
 *
 * Several processes run the job. As for escrows (src/escrow/close.ts), a run claims a bounded
 * batch in one short statement (FOR UPDATE SKIP LOCKED over `chain_close_claimed_until`,
 * migration 0043): no lock is held across the chain. Each close is noted under the claim (its
 * signature and last valid block height) before it is sent, and a run that takes over a lapsed
 * claim sends nothing while that close can still land. A policy whose account is not there (a
 * close that landed before a crash; an account never created, the policy deleted before it
 * reached the chain) is recorded closed without a transaction, once no noted close or SetPolicy
 * of its own can still land. A close the program refuses is recorded with its error and not sent
 * again: a deterministic refusal (a program deployed before PolicyClose) would cost a fee at
 * every run for ever.
 *
 * Nothing of the policy's API view, audit log or events changes: a deleted policy answers 404 as
 * before, and the rent is the operator's, not an organisation's money.
 */
import { address, type Signature } from '@solana/kit';
import { ConfirmationTimeoutError, type PreparedTransaction } from '../chain/client.ts';
import type { Queryable } from '../db/database.ts';
import type { AppContext } from '../http/context.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';
import type { UnsettledWrite } from './policies.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

export interface PolicyCloseLimits {
  /** Policies claimed by one run. */
  batchMax: number;
  /**
   * Closes in one transaction. A transaction is 1,232 bytes at most; one of n closes takes about
   * 200 + 37·n (each close one account and an instruction), so 27 would fit; 20 leave room.
   */
  perTransactionMax: number;
  /**
   * How long a claim holds: past the job's timeout. A run that outlives it sends nothing more:
   * each close is noted only under a claim still held.
   */
  claimMs: number;
  /** A run sends no new close after this, so it ends within the job's timeout. */
  runBudgetMs: number;
  /** How long a run waits for a close's outcome; still unknown then, a later run asks the chain. */
  waitMs: number;
  /**
   * How long after its deletion (service clock) a policy's account is left alone: a blockhash
   * lives about a minute, so a transaction signed before the deletion can no longer land by then.
   */
  graceMs: number;
}

export const POLICY_CLOSE_LIMITS: Readonly<PolicyCloseLimits> = {
  batchMax: 50, perTransactionMax: 20, claimMs: 60_000, runBudgetMs: 10_000, waitMs: 10_000, graceMs: 10 * 60_000,
};

/**
 * Whether the policy `p` may be closed (besides its claim): the conditions of the file's comment.
 * `$deletedBefore` is the placeholder of the newest deletion time that qualifies.
 */
function closableSql(deletedBefore: string): string {
  return `p.deleted_at IS NOT NULL AND p.deleted_at <= ${deletedBefore} AND NOT p.is_preset
    AND p.chain_closed_at IS NULL AND p.chain_close_refused IS NULL
    AND NOT EXISTS (SELECT 1 FROM wallets w WHERE w.org_id = p.org_id
      AND ((w.policy_id = p.id AND w.status <> 'archived') OR w.chain_status = 'pending'))
    AND NOT EXISTS (SELECT 1 FROM transactions t WHERE t.status = 'pending' AND t.org_id = p.org_id AND t.policy_id = p.id)
    AND NOT EXISTS (SELECT 1 FROM escrows e JOIN transactions t ON t.escrow_id = e.id AND t.type = 'a2a_send'
      WHERE e.closing = 'create' AND e.org_id = p.org_id AND t.policy_id = p.id)`;
}

interface ClaimedPolicy {
  org_id: string;
  id: string;
  chain_address: string;
  unsettled_writes: UnsettledWrite[];
  chain_close_signature: string | null;
  chain_close_valid_height: bigint | null;
}

export interface PolicyCloseRun {
  /** policies recorded closed (their accounts gone, by this run's closes or before, or never created) */
  closed: number;
  /** policies whose close the program refused, recorded and not tried again */
  refused: number;
}

/**
 * The `policies.close` job: claims up to `batchMax` deleted policies that nothing can need any
 * more and whose account may still be open, the longest deleted first, and closes them, several
 * per transaction.
 */
export async function closeDeletedPolicies(ctx: Ctx, limits: PolicyCloseLimits = POLICY_CLOSE_LIMITS): Promise<PolicyCloseRun> {
  const nowMs = ctx.clock.nowMs();
  const claimedUntil = new Date(nowMs + limits.claimMs);
  const claimed = await ctx.db.query<ClaimedPolicy>(
    `UPDATE policies SET chain_close_claimed_until = $2
     WHERE (org_id, id) IN (
       SELECT p.org_id, p.id FROM policies p
       WHERE ${closableSql('$4')}
         AND (p.chain_close_claimed_until IS NULL OR p.chain_close_claimed_until <= $1)
       ORDER BY p.deleted_at, p.org_id, p.id LIMIT $3
       FOR UPDATE SKIP LOCKED)
     RETURNING org_id, id, chain_address, unsettled_writes, chain_close_signature, chain_close_valid_height`,
    [new Date(nowMs), claimedUntil, limits.batchMax, new Date(nowMs - limits.graceMs)]);
  const run: PolicyCloseRun = { closed: 0, refused: 0 };
  if (claimed.length === 0) return run;
  try {
    const sending: Sending = { claimedUntil, limits, deadlineMs: performance.now() + limits.runBudgetMs };
    for (const group of groupsOf(await closesToSend(ctx, claimed, run), limits.perTransactionMax)) {
      await sendCloses(ctx, group, sending, run);
    }
  } finally {
    // Compare-and-set: a claim taken over meanwhile (it lapsed) is its new holder's.
    await ctx.db.query(
      `UPDATE policies SET chain_close_claimed_until = NULL
       WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND chain_close_claimed_until = $3`,
      [claimed.map((policy) => policy.org_id), claimed.map((policy) => policy.id), claimedUntil]);
  }
  return run;
}

/**
 * The claimed policies that need a close sent: not those whose account is not there (recorded
 * closed now), nor those whose close noted by an earlier run, or a SetPolicy whose outcome its
 * writer never learned, can still land (a later run looks again). A noted close that failed is
 * sent again: its failure may have been another policy's of the same transaction, and a refusal
 * of this one's is recorded only from an outcome of its own.
 */
async function closesToSend(ctx: Ctx, claimed: readonly ClaimedPolicy[], run: PolicyCloseRun): Promise<ClaimedPolicy[]> {
  // The height before the statuses, and both before the accounts, as the reconciler reads them:
  // what is read later is at least as recent, so a transaction it does not find had not landed
  // by that height, and one that landed shows in the account.
  const height = await ctx.chain.getBlockHeight();
  // Each claimed policy's noted close and unsettled writes: sent, their outcome not known here.
  const pending = claimed.flatMap((policy) => [
    ...(policy.chain_close_signature === null ? []
      : [{ policy, signature: policy.chain_close_signature, validHeight: policy.chain_close_valid_height! }]),
    ...policy.unsettled_writes.map((write) => ({ policy, signature: write.signature, validHeight: BigInt(write.valid_height) })),
  ]);
  const waiting = new Set<ClaimedPolicy>();
  for (let start = 0; start < pending.length; start += STATUS_BATCH_MAX) {
    const batch = pending.slice(start, start + STATUS_BATCH_MAX);
    const outcomes = await ctx.chain.getOutcomes(batch.map((each) => each.signature as Signature));
    for (const [i, each] of batch.entries()) {
      if (outcomes[i] === null && height <= each.validHeight + EXPIRY_MARGIN_BLOCKS) waiting.add(each.policy);
    }
  }
  const owned = await ctx.chain.getProgramOwned(claimed.map((policy) => address(policy.chain_address)));
  // An account not there is recorded closed, unless a close or a SetPolicy of its own can still
  // land: a local validator shows its accounts before the slot that changed them is saved, and a
  // close lost with it would leave the policy recorded closed, its rent for ever on chain; a
  // SetPolicy landing later would create the account again. A later run sees.
  run.closed += await recordClosed(ctx, claimed.filter((policy, i) => !owned[i] && !waiting.has(policy)));
  return claimed.filter((policy, i) => owned[i] && !waiting.has(policy));
}

/** Signatures asked about in one getSignatureStatuses call (JSON-RPC allows 256). */
const STATUS_BATCH_MAX = 200;

interface Sending {
  claimedUntil: Date;
  limits: PolicyCloseLimits;
  /** performance.now() after which nothing more is sent */
  deadlineMs: number;
}

/**
 * One transaction closing `group`. Noted first, under the claim, the conditions checked again;
 * then sent and its outcome waited for. A group refused as a whole (one of its closes failed, so
 * none took effect) is sent again one policy per transaction, so that each refusal is known to be
 * that policy's own.
 */
async function sendCloses(ctx: Ctx, group: readonly ClaimedPolicy[], sending: Sending, run: PolicyCloseRun): Promise<void> {
  // A slow chain ends the run here: the claims are released and a later run goes on.
  if (performance.now() > sending.deadlineMs) return;
  const prepared = await ctx.chain.prepare(await Promise.all(group.map((policy) => ctx.chain.policyCloseIx(policy.org_id, policy.id))));
  const noted = await noteClose(ctx, group, sending, prepared);
  if (noted.length === 0) return;
  if (noted.length < group.length) {
    // One no longer closable (or its claim lost): the others are signed again without it.
    await sendCloses(ctx, noted, sending, run);
    return;
  }
  let outcome;
  try {
    await ctx.chain.submit(prepared);
    outcome = await ctx.chain.waitForOutcome(prepared.signature, sending.limits.waitMs);
  } catch (error) {
    // It may still land: noted, so a later run waits for it to land or expire before sending again.
    if (!(error instanceof ConfirmationTimeoutError)) {
      ctx.log.warn({ err: error, signature: prepared.signature }, 'sending a policy close failed; a later run asks the chain');
    }
    return;
  }
  if (outcome.err === null) {
    run.closed += await recordClosed(ctx, group);
    return;
  }
  if (group.length > 1) {
    for (const policy of group) await sendCloses(ctx, [policy], sending, run);
    return;
  }
  const [policy] = group as [ClaimedPolicy];
  const [owned] = await ctx.chain.getProgramOwned([address(policy.chain_address)]);
  if (!owned) {
    run.closed += await recordClosed(ctx, [policy]);
  } else if (outcome.err.instructionIndex === null) {
    // Not the program's answer (the transaction as a whole): a later run tries again.
    ctx.log.warn({ policyId: policy.id, signature: prepared.signature, error: outcome.err.name },
      'a policy close failed on chain; a later run tries again');
  } else if (await recordRefused(ctx, policy, outcome.err.name)) {
    run.refused += 1;
    const fields = { orgId: policy.org_id, policyId: policy.id, policyAddress: policy.chain_address, signature: prepared.signature, error: outcome.err.name };
    if (outcome.err.name === 'Unauthorized') {
      // Created by another key than the operator (anyone may create it first: its address derives
      // from the ids alone): its rent is not the operator's.
      ctx.log.error(fields, 'a deleted policy\'s account on chain is not the operator\'s: not closed');
    } else {
      ctx.log.warn(fields, outcome.err.name === 'InvalidInstruction'
        ? 'the deployed program does not know PolicyClose (a local validator keeps the program its data dir was created with): '
          + 'this deleted policy\'s account stays open, its rent with it; not tried again (docs/operations.md)'
        : 'the program refused to close a deleted policy\'s account: it stays open, its rent with it; not tried again');
    }
  }
}

/**
 * Notes the close on each policy of the group that this run still holds and that is still
 * closable (the claim's conditions read again under the rows' locks); returns those noted, and
 * notes nothing unless every one of the group is (the transaction closes them all).
 */
async function noteClose(ctx: Ctx, group: readonly ClaimedPolicy[], sending: Sending, prepared: PreparedTransaction): Promise<ClaimedPolicy[]> {
  return ctx.db.transaction(async (tx: Queryable) => {
    const held = await tx.query<{ org_id: string; id: string }>(
      `SELECT p.org_id, p.id FROM policies p
       WHERE (p.org_id, p.id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND p.chain_close_claimed_until = $3
         AND ${closableSql('$4')}
       ORDER BY p.org_id, p.id FOR UPDATE`,
      [group.map((policy) => policy.org_id), group.map((policy) => policy.id), sending.claimedUntil,
        new Date(ctx.clock.nowMs() - sending.limits.graceMs)]);
    const kept = group.filter((policy) => held.some((row) => row.org_id === policy.org_id && row.id === policy.id));
    if (kept.length !== group.length) return kept;
    await tx.query(
      `UPDATE policies SET chain_close_signature = $3, chain_close_valid_height = $4
       WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[]))`,
      [group.map((policy) => policy.org_id), group.map((policy) => policy.id), prepared.signature, prepared.lastValidBlockHeight]);
    return kept;
  });
}

async function recordClosed(ctx: Ctx, policies: readonly ClaimedPolicy[]): Promise<number> {
  if (policies.length === 0) return 0;
  const rows = await ctx.db.query(
    `UPDATE policies SET chain_closed_at = $3
     WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND chain_closed_at IS NULL RETURNING id`,
    [policies.map((policy) => policy.org_id), policies.map((policy) => policy.id), new Date(ctx.clock.nowMs())]);
  return rows.length;
}

/** True when this call recorded the refusal (so it is logged once). */
async function recordRefused(ctx: Ctx, policy: ClaimedPolicy, error: string): Promise<boolean> {
  const rows = await ctx.db.query(
    `UPDATE policies SET chain_close_refused = $3
     WHERE org_id = $1 AND id = $2 AND chain_close_refused IS NULL AND chain_closed_at IS NULL RETURNING id`,
    [policy.org_id, policy.id, error]);
  return rows.length > 0;
}

function groupsOf<T>(items: readonly T[], size: number): T[][] {
  const groups: T[][] = [];
  for (let start = 0; start < items.length; start += size) groups.push(items.slice(start, start + size));
  return groups;
}
