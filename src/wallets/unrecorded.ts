/**
 * USDC on a vault's token account that the service did not record (docs/wallets.md "USDC sent to
 * a vault's address"): anyone can transfer USDC to the address the wallet view shows, and the
 * service, whose balance is an index of the moves it made, does not see it. Archiving freezes the
 * vault for good, so it first compares the chain's balance with the recorded one and refuses
 * while more is on chain: nothing is frozen away unnoticed.
 *
 * The two are comparable only while no move of the vault's money is under way: every move is a
 * transaction the service records first (debited at record, credited at confirmation), so a vault
 * with none in flight and no open escrow holds on chain exactly its recorded balance plus what
 * arrived from outside.
 */
import { address } from '@solana/kit';
import { ServiceError } from '../errors/errors.ts';
import type { AppContext } from '../http/context.ts';
import { formatUsdc } from '../money/money.ts';

type Ctx = Pick<AppContext, 'db' | 'chain'>;

/** SQL: whether a transaction of the vault (`wallet`, an SQL expression) is recorded and not settled. */
export function inFlightSql(wallet: string): string {
  return `EXISTS (SELECT 1 FROM transactions t WHERE t.wallet_id = ${wallet} AND t.status = 'pending')`;
}

/**
 * SQL: whether an escrow the vault is a party to is open (locked or disputed, or its release,
 * refund or split under way): it pays the vault back or pays it later, written when it settles.
 */
export function openEscrowSql(wallet: string): string {
  return `EXISTS (SELECT 1 FROM escrows e WHERE (e.from_wallet_id = ${wallet} OR e.to_wallet_id = ${wallet})
    AND (e.status IN ('locked', 'disputed') OR e.closing IS NOT NULL))`;
}

/**
 * What `archiveWallet` needs to know before it takes the vault's lock: `version`, the row's version
 * when the chain holds no more than recorded (the archive then requires that version under the
 * lock: the chain was read outside the transaction); `busy` when a transaction of the vault is in
 * flight or an escrow it is a party to is open (a refund or release still to come or under way,
 * written when it settles), so that the balances cannot be compared; null for a vault archived or
 * unknown. Refuses (`wallet_balance_not_zero`) when more is on chain than recorded.
 */
export async function balanceMatchingChain(
  ctx: Ctx, orgId: string, walletId: string,
): Promise<{ version: string } | { busy: 'in_flight' | 'escrow' } | null> {
  const [vault] = await ctx.db.query<{ token_address: string; balance: bigint; version: string; in_flight: boolean; escrow: boolean }>(
    `SELECT w.token_address, w.balance, w.xmin::text AS version, ${inFlightSql('w.id')} AS in_flight, ${openEscrowSql('w.id')} AS escrow
     FROM wallets w WHERE w.org_id = $1 AND w.id = $2 AND w.status <> 'archived'`, [orgId, walletId]);
  if (!vault) return null;
  if (vault.in_flight) return { busy: 'in_flight' };
  if (vault.escrow) return { busy: 'escrow' };
  // A vault not yet on chain has its address too, and its token account can be made and paid by anyone.
  const onChain = await ctx.chain.getTokenBalance(address(vault.token_address));
  if (onChain > vault.balance) {
    throw new ServiceError('wallet_balance_not_zero',
      `Wallet ${walletId} holds ${formatUsdc(onChain - vault.balance)} USDC more on chain than recorded: USDC sent to its address `
      + 'from outside the service, which the service does not record or move (docs/wallets.md). Archiving would freeze it for good.',
      { wallet_id: walletId });
  }
  return { version: vault.version };
}
