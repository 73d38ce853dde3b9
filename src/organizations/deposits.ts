/**
 * Deposits into an organisation's reserve. Confirmed on chain first, then indexed once per
 * organisation (one chain transaction may pay several reserves: `deposits` is unique on the
 * organisation and the signature), with `org.deposit_confirmed` in the same database transaction.
 */
import { address, type Signature } from '@solana/kit';
import { RPC_CALL_TIMEOUT_MS } from '../chain/client.ts';
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';
import { recordEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { newId } from '../ids/ids.ts';
import { MAX_MICRO_USDC, formatUsdc } from '../money/money.ts';
import { assertOrganizationReady } from '../wallets/wallets.ts';
import { getOrganization } from './organizations.ts';

export interface DepositRow {
  id: string;
  org_id: string;
  amount: bigint;
  tx_signature: string;
  on_chain_slot: bigint | null;
  status: string;
  created_at: Date;
}

/** Indexes a confirmed deposit; a second call for the same organisation and signature changes nothing. */
export async function recordConfirmedDeposit(
  tx: Queryable, nowMs: number, orgId: string, deposit: { amount: bigint; signature: string; slot: bigint },
): Promise<DepositRow> {
  const id = newId('dep', nowMs);
  const inserted = await tx.query<DepositRow>(
    `INSERT INTO deposits (id, org_id, amount, tx_signature, on_chain_slot, status, created_at)
     VALUES ($1, $2, $3, $4, $5, 'confirmed', $6) ON CONFLICT (org_id, tx_signature) DO NOTHING RETURNING *`,
    [id, orgId, deposit.amount, deposit.signature, deposit.slot, new Date(nowMs)]);
  if (!inserted[0]) {
    const rows = await tx.query<DepositRow>('SELECT * FROM deposits WHERE org_id = $1 AND tx_signature = $2', [orgId, deposit.signature]);
    return rows[0]!;
  }
  const balance = await tx.query<{ reserve_balance: bigint }>(
    'UPDATE organizations SET reserve_balance = reserve_balance + $2 WHERE id = $1 RETURNING reserve_balance',
    [orgId, deposit.amount]);
  await recordEvent(tx, nowMs, {
    orgId,
    type: 'org.deposit_confirmed',
    summary: `Deposit of ${formatUsdc(deposit.amount)} USDC confirmed`,
    payload: {
      deposit_id: id, amount: formatUsdc(deposit.amount), tx_signature: deposit.signature,
      on_chain_slot: Number(deposit.slot), org_balance: formatUsdc(balance[0]!.reserve_balance),
    },
  });
  return inserted[0];
}

/**
 * Test helper (local validator only): mints local USDC to the reserve on chain, waits for the
 * confirmation, indexes the deposit.
 */
export async function depositTestUsdc(ctx: AppContext, orgId: string, amount: bigint): Promise<DepositRow> {
  if (!ctx.cheatcodes) throw new ServiceError('not_found', 'Test helpers need the local validator.');
  const org = await getOrganization(ctx.db, orgId);
  if (!org) throw new ServiceError('not_found', 'No such organisation.');
  // A reserve not yet checked to be the service's own (another key may have made it) gets nothing.
  assertOrganizationReady(org);
  // Refused before minting: the chain's u64 would take it, and the index's BIGINT columns (the
  // reserve, then a vault it funds) would not, leaving the two apart for good.
  const [held] = await ctx.db.query<{ total: string }>(
    `SELECT (o.reserve_balance::numeric + COALESCE((SELECT sum(w.balance) FROM wallets w WHERE w.org_id = o.id), 0))::text AS total
     FROM organizations o WHERE o.id = $1`, [orgId]);
  if (BigInt(held?.total ?? '0') + amount > MAX_MICRO_USDC) {
    throw new ServiceError('invalid_amount',
      `The organisation would hold more than ${formatUsdc(MAX_MICRO_USDC)} USDC, the most the service keeps account of.`, { param: 'amount' });
  }
  const signature = await ctx.cheatcodes.agentVault_mintUsdc(address(org.reserve_address), amount.toString())
    .send({ abortSignal: AbortSignal.timeout(RPC_CALL_TIMEOUT_MS) });
  const outcome = await ctx.chain.waitForOutcome(signature as Signature);
  if (outcome.err) throw new Error(`minting test USDC failed: ${outcome.err.name}`);
  return ctx.db.transaction((tx) =>
    recordConfirmedDeposit(tx, ctx.clock.nowMs(), orgId, { amount, signature, slot: outcome.slot }));
}
