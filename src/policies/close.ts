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
 * migration 0043): no lock is held across the chain; the closes are sent by
 * src/chain/account-close.ts, shared with the escrows. Each close is noted under the claim (its
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
import { address } from '@solana/kit';
import { closeAccounts, type AccountCloseLimits, type AccountCloseRun, type AccountCloser } from '../chain/account-close.ts';
import type { Queryable } from '../db/database.ts';
import type { AppContext } from '../http/context.ts';
import type { UnsettledWrite } from './policies.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

export interface PolicyCloseLimits extends AccountCloseLimits {
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

export type PolicyCloseRun = AccountCloseRun;

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
  if (claimed.length === 0) return { closed: 0, refused: 0 };
  try {
    return await closeAccounts(ctx, claimed, policyCloser(ctx, limits, claimedUntil));
  } finally {
    // Compare-and-set: a claim taken over meanwhile (it lapsed) is its new holder's.
    await ctx.db.query(
      `UPDATE policies SET chain_close_claimed_until = NULL
       WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND chain_close_claimed_until = $3`,
      [claimed.map((policy) => policy.org_id), claimed.map((policy) => policy.id), claimedUntil]);
  }
}

function policyCloser(ctx: Ctx, limits: PolicyCloseLimits, claimedUntil: Date): AccountCloser<ClaimedPolicy> {
  const keys = (policies: readonly ClaimedPolicy[]) => [policies.map((policy) => policy.org_id), policies.map((policy) => policy.id)];
  return {
    noun: 'policy',
    limits,
    accountOf: (policy) => address(policy.chain_address),
    logFields: (policy) => ({ orgId: policy.org_id, policyId: policy.id, policyAddress: policy.chain_address }),
    // Its noted close, and any SetPolicy whose outcome its writer never learned: one landing after
    // the close would create the account again.
    sentOf: (policy) => [
      ...(policy.chain_close_signature === null ? []
        : [{ signature: policy.chain_close_signature, validHeight: policy.chain_close_valid_height! }]),
      ...policy.unsettled_writes.map((write) => ({ signature: write.signature, validHeight: BigInt(write.valid_height) })),
    ],
    closeIx: (policy) => ctx.chain.policyCloseIx(policy.org_id, policy.id),
    // Noted on the group's policies this run still holds and that are still closable (the claim's
    // conditions read again under the rows' locks), and only if that is every one of them.
    note: (group, prepared) => ctx.db.transaction(async (tx: Queryable) => {
      const held = await tx.query<{ org_id: string; id: string }>(
        `SELECT p.org_id, p.id FROM policies p
         WHERE (p.org_id, p.id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND p.chain_close_claimed_until = $3
           AND ${closableSql('$4')}
         ORDER BY p.org_id, p.id FOR UPDATE`,
        [...keys(group), claimedUntil, new Date(ctx.clock.nowMs() - limits.graceMs)]);
      const kept = group.filter((policy) => held.some((row) => row.org_id === policy.org_id && row.id === policy.id));
      if (kept.length === group.length) {
        await tx.query(
          `UPDATE policies SET chain_close_signature = $3, chain_close_valid_height = $4
           WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[]))`,
          [...keys(group), prepared.signature, prepared.lastValidBlockHeight]);
      }
      return kept;
    }),
    recordClosed: async (policies) => {
      if (policies.length === 0) return 0;
      const rows = await ctx.db.query(
        `UPDATE policies SET chain_closed_at = $3
         WHERE (org_id, id) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND chain_closed_at IS NULL RETURNING id`,
        [...keys(policies), new Date(ctx.clock.nowMs())]);
      return rows.length;
    },
    recordRefused: async (policy, error) => (await ctx.db.query(
      `UPDATE policies SET chain_close_refused = $3
       WHERE org_id = $1 AND id = $2 AND chain_close_refused IS NULL AND chain_closed_at IS NULL RETURNING id`,
      [policy.org_id, policy.id, error])).length > 0,
    logRefused: (_policy, fields) => {
      if (fields.error === 'Unauthorized') {
        // Created by another key than the operator (anyone may create it first: its address derives
        // from the ids alone): its rent is not the operator's.
        ctx.log.error(fields, 'a deleted policy\'s account on chain is not the operator\'s: not closed');
      } else {
        ctx.log.warn(fields, fields.error === 'InvalidInstruction'
          ? 'the deployed program does not know PolicyClose (a local validator keeps the program its data dir was created with): '
            + 'this deleted policy\'s account stays open, its rent with it; not tried again (docs/operations.md)'
          : 'the program refused to close a deleted policy\'s account: it stays open, its rent with it; not tried again');
      }
    },
  };
}
