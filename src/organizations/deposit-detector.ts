/**
 * Deposits anyone sends to an organisation's reserve token account, on any cluster. The detector
 * reads the account's signatures newer than the organisation's cursor (getSignaturesForAddress),
 * oldest first, and indexes every transaction that raised the account's USDC balance as a
 * deposit of the amount it raised it by: once per organisation (`deposits` is unique on the
 * organisation and the signature; a transaction paying several reserves is a deposit for each),
 * with `org.deposit_confirmed`, and with the cursor moved in the same database transaction.
 *
 * Not deposits: failed transactions; the service's own transactions (a withdrawal credits the
 * reserve through its settlement, and its signature is in `transactions` before it is sent);
 * transactions that did not raise the balance (fundings, the reserve's creation).
 *
 * Several processes may run it at once. An organisation is claimed for a bounded time in one
 * short statement (FOR UPDATE SKIP LOCKED over a lease column), because no lock may be held
 * across a chain round trip; and every cursor move is a compare-and-set, so a process whose
 * claim ran out stops at its next move instead of moving the cursor back.
 */
import { address, type Address, type Signature, type TokenBalance } from '@solana/kit';
import type { Database, Queryable } from '../db/database.ts';
import { dependencyDown } from '../http/app.ts';
import type { AppContext } from '../http/context.ts';
import { recordConfirmedDeposit } from './deposits.ts';

export interface DetectionLimits {
  /** Organisations claimed by one run. */
  organizationsPerRun: number;
  /** Signatures per getSignaturesForAddress call (1..1000). */
  pageSize: number;
  /** Calls per organisation and run (at least 2, so a scan too long for one run still progresses). */
  pagesPerOrganization: number;
  /** How long a claim holds; longer than the job's timeout, so a run never outlives its claims. */
  claimMs: number;
  /** A run stops starting chain reads after this, so it ends within the job's timeout. */
  runBudgetMs: number;
  /** Each JSON-RPC call. */
  rpcTimeoutMs: number;
}

export const DETECTION_LIMITS: Readonly<DetectionLimits> = {
  organizationsPerRun: 100,
  pageSize: 1_000,
  pagesPerOrganization: 10,
  claimMs: 30_000,
  runBudgetMs: 15_000,
  rpcTimeoutMs: 10_000,
};

export interface DetectionSummary {
  organizations: number;
  deposits: number;
}

type DetectorContext = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

interface ClaimedOrganization {
  id: string;
  reserve_token_address: string;
  deposit_cursor: string | null;
  deposit_scan_before: string | null;
  deposit_claimed_until: Date;
}

/** Another process moved the cursor: this one's claim ran out, it leaves the organisation alone. */
class ClaimLostError extends Error {
  constructor(orgId: string) {
    super(`deposit detection of ${orgId} was taken over by another process`);
    this.name = 'ClaimLostError';
  }
}

/** Finds and indexes new deposits of a batch of organisations. Safe to run anywhere, any number of times. */
export async function detectDeposits(ctx: DetectorContext, limits: DetectionLimits = DETECTION_LIMITS): Promise<DetectionSummary> {
  if (limits.pagesPerOrganization < 2) throw new RangeError('pagesPerOrganization must be at least 2');
  if (limits.pageSize < 1 || limits.pageSize > 1_000) throw new RangeError('pageSize must be within 1..1000');
  const deadlineMs = performance.now() + limits.runBudgetMs;
  const claimed = await claimOrganizations(ctx.db, ctx.clock.nowMs(), limits);
  let deposits = 0;
  /** the chain or the database down: the other organisations would fail alike, so they wait for the next run */
  let unavailable: unknown = null;
  for (const org of claimed) {
    try {
      if (unavailable === null && performance.now() < deadlineMs) deposits += await scanOrganization(ctx, org, limits, deadlineMs);
    } catch (error) {
      if (error instanceof ClaimLostError) ctx.log.info({ orgId: org.id }, error.message);
      else if (dependencyDown(error)) unavailable = error;
      else ctx.log.warn({ err: error, orgId: org.id }, 'deposit detection failed; retried at the next run');
    } finally {
      await releaseClaim(ctx.db, ctx.clock.nowMs(), org);
    }
  }
  // Failed once for the run, not once per organisation: the job runner logs it, at most once a
  // minute while the outage lasts (docs/operations.md).
  if (unavailable !== null) throw unavailable;
  return { organizations: claimed.length, deposits };
}

/**
 * Claims the organisations scanned least recently whose claim is free. The one query of this
 * feature across organisations: the detector works for all of them.
 */
async function claimOrganizations(db: Queryable, nowMs: number, limits: DetectionLimits): Promise<ClaimedOrganization[]> {
  const rows = await db.query<ClaimedOrganization>(
    `UPDATE organizations SET deposit_claimed_until = $2
     WHERE id IN (
       SELECT id FROM organizations
       WHERE chain_status = 'ready' AND (deposit_claimed_until IS NULL OR deposit_claimed_until <= $1)
       ORDER BY deposit_claimed_until NULLS FIRST, id
       LIMIT $3
       FOR UPDATE SKIP LOCKED)
     RETURNING id, reserve_token_address, deposit_cursor, deposit_scan_before, deposit_claimed_until`,
    [new Date(nowMs), new Date(nowMs + limits.claimMs), limits.organizationsPerRun]);
  return rows.sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
}

/** Ends a claim, recording when; a claim already taken over is left to its new holder. */
async function releaseClaim(db: Queryable, nowMs: number, org: ClaimedOrganization): Promise<void> {
  await db.query(
    'UPDATE organizations SET deposit_claimed_until = $3 WHERE id = $1 AND deposit_claimed_until = $2',
    [org.id, org.deposit_claimed_until, new Date(nowMs)]);
}

/** Reads the organisation's new signatures and indexes its deposits; returns how many it indexed. */
async function scanOrganization(
  ctx: DetectorContext, org: ClaimedOrganization, limits: DetectionLimits, deadlineMs: number,
): Promise<number> {
  const reserveToken = address(org.reserve_token_address);
  const scan = await readNewSignatures(ctx, reserveToken, org, limits);
  if (!scan.complete) {
    // The oldest new signatures lie below what this run could read, and they must be handled
    // first: remember how deep the scan got and go on from there at the next run.
    await moveCursor(ctx.db, org.id, org.deposit_cursor, org.deposit_cursor, scan.resumeBefore);
    return 0;
  }
  const oldestFirst = scan.signatures.reverse();
  const known = await knownSignatures(ctx.db, org.id, oldestFirst.filter((s) => s.err === null).map((s) => s.signature), limits);
  let cursor = org.deposit_cursor;
  /** The newest signature handled without a deposit and not saved yet. */
  let handled: string | null = null;
  let finished = true;
  let deposits = 0;
  for (const { signature, err } of oldestFirst) {
    if (performance.now() >= deadlineMs) {
      finished = false;
      break;
    }
    if (err !== null || known.has(signature)) {
      handled = signature;
      continue;
    }
    const transaction = await ctx.chain.rpc.getTransaction(signature, {
      encoding: 'json', maxSupportedTransactionVersion: 0, commitment: 'finalized',
    }).send({ abortSignal: AbortSignal.timeout(limits.rpcTimeoutMs) });
    if (!transaction?.meta) {
      // Listed but not readable yet (a node behind its peers): the cursor waits here.
      ctx.log.warn({ orgId: org.id, signature }, 'reserve transaction not available yet; deposit detection retries it');
      finished = false;
      break;
    }
    const amount = reserveUsdcDelta(transaction, reserveToken, ctx.chain.usdcMint);
    if (amount <= 0n) {
      handled = signature;
      continue;
    }
    const previous = cursor;
    await ctx.db.transaction(async (tx) => {
      await recordConfirmedDeposit(tx, ctx.clock.nowMs(), org.id, { amount, signature, slot: transaction.slot });
      await moveCursor(tx, org.id, previous, signature, org.deposit_scan_before);
    });
    deposits += 1;
    cursor = signature;
    handled = null;
  }
  if (finished && (handled !== null || org.deposit_scan_before !== null)) {
    await moveCursor(ctx.db, org.id, cursor, handled ?? cursor, null);
  } else if (!finished && handled !== null) {
    await moveCursor(ctx.db, org.id, cursor, handled, org.deposit_scan_before);
  }
  return deposits;
}

interface SignatureScan {
  /** Newest first. */
  signatures: Array<{ signature: Signature; err: unknown }>;
  /** Whether the scan reached the cursor (or the oldest signature the node has). */
  complete: boolean;
  /** Where an incomplete scan goes on: one page above its end, so the next run reads that page again. */
  resumeBefore: string | null;
}

async function readNewSignatures(
  ctx: DetectorContext, reserveToken: Address, org: ClaimedOrganization, limits: DetectionLimits,
): Promise<SignatureScan> {
  const signatures: SignatureScan['signatures'] = [];
  let before = (org.deposit_scan_before ?? undefined) as Signature | undefined;
  const until = (org.deposit_cursor ?? undefined) as Signature | undefined;
  let pageBefore = before;
  for (let page = 0; page < limits.pagesPerOrganization; page++) {
    pageBefore = before;
    const found = await ctx.chain.rpc.getSignaturesForAddress(reserveToken, {
      limit: limits.pageSize, commitment: 'finalized', ...(before ? { before } : {}), ...(until ? { until } : {}),
    }).send({ abortSignal: AbortSignal.timeout(limits.rpcTimeoutMs) });
    for (const item of found) signatures.push({ signature: item.signature, err: item.err });
    if (found.length < limits.pageSize) return { signatures, complete: true, resumeBefore: null };
    before = found.at(-1)!.signature;
  }
  return { signatures, complete: false, resumeBefore: pageBefore ?? null };
}

/** Which of these signatures are already deposits or the service's own transactions, for this organisation. */
async function knownSignatures(db: Queryable, orgId: string, signatures: readonly string[], limits: DetectionLimits): Promise<Set<string>> {
  const known = new Set<string>();
  for (let start = 0; start < signatures.length; start += limits.pageSize) {
    const chunk = signatures.slice(start, start + limits.pageSize);
    const rows = await db.query<{ tx_signature: string }>(
      `SELECT tx_signature FROM deposits WHERE org_id = $1 AND tx_signature = ANY($2::text[])
       UNION SELECT tx_signature FROM transactions WHERE org_id = $1 AND tx_signature = ANY($2::text[])`,
      [orgId, chunk]);
    for (const row of rows) known.add(row.tx_signature);
  }
  return known;
}

/**
 * Moves the cursor from `expected` to `next`, and sets where an unfinished scan goes on. Throws
 * ClaimLostError when another process moved the cursor meanwhile.
 */
async function moveCursor(
  q: Queryable | Database, orgId: string, expected: string | null, next: string | null, scanBefore: string | null,
): Promise<void> {
  const rows = await q.query(
    `UPDATE organizations SET deposit_cursor = $3, deposit_scan_before = $4
     WHERE id = $1 AND deposit_cursor IS NOT DISTINCT FROM $2::text RETURNING id`,
    [orgId, expected, next, scanBefore]);
  if (rows.length === 0) throw new ClaimLostError(orgId);
}

/** What getTransaction (encoding json) says about token balances. */
export interface TransactionTokenBalances {
  transaction: { message: { accountKeys: readonly string[] } };
  meta: {
    loadedAddresses?: { writable: readonly string[]; readonly: readonly string[] };
    preTokenBalances?: readonly TokenBalance[];
    postTokenBalances?: readonly TokenBalance[];
  } | null;
}

/**
 * The change of a token account's balance of `mint` in a transaction (post − pre, 0 when the
 * account is not in it). Balances index the static keys followed by the loaded addresses, as
 * Solana numbers them; an account created by the transaction has no pre balance (0).
 */
export function reserveUsdcDelta(transaction: TransactionTokenBalances, tokenAccount: string, mint: string): bigint {
  const keys = [
    ...transaction.transaction.message.accountKeys,
    ...(transaction.meta?.loadedAddresses?.writable ?? []),
    ...(transaction.meta?.loadedAddresses?.readonly ?? []),
  ];
  const index = keys.indexOf(tokenAccount);
  if (index < 0 || !transaction.meta) return 0n;
  const amountIn = (balances: readonly TokenBalance[] | undefined): bigint =>
    BigInt(balances?.find((b) => b.accountIndex === index && b.mint === mint)?.uiTokenAmount.amount ?? '0');
  return amountIn(transaction.meta.postTokenBalances) - amountIn(transaction.meta.preTokenBalances);
}
