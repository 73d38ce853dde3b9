/**
 * USDC sent to a vault's address from outside the service: archiving reads the chain and refuses
 * while it is there, so it is never frozen away unnoticed.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address, generateKeyPairSigner, lamports } from '@solana/kit';
import { fundedWallet, type FundedWallet } from '../../test/fixtures.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { holdLocks, queuedRequest, withSecondConnection } from '../../test/locks.ts';
import { newId } from '../ids/ids.ts';
import { confirmed, signedTransaction, transferToken } from '../validator/testing.ts';

describe('USDC sent to a vault from outside the service', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(() => t.close());

  const ctx = () => t.service.ctx;

  /** A plain SPL Token transfer to the vault's token account from a holder outside the service. */
  const sendFromOutside = async (wallet: FundedWallet, micro: bigint): Promise<void> => {
    const rpc = ctx().chain.rpc;
    const holder = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(holder.address, lamports(1_000_000_000n)).send());
    await ctx().chain.waitForOutcome(await ctx().cheatcodes!.agentVault_mintUsdc(holder.address, String(micro)).send());
    const source = await ctx().validator!.associatedTokenAddress(holder.address);
    const transfer = await signedTransaction(rpc, holder, [transferToken(source, address(wallet.token_account), holder, micro)]);
    await rpc.sendTransaction(transfer.wire, { encoding: 'base64' }).send();
    assert.equal((await ctx().chain.waitForOutcome(transfer.signature)).err, null);
  };
  const emptied = async (balance: string): Promise<FundedWallet> => {
    const wallet = await fundedWallet(t, balance);
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } })).status, 200);
    return wallet;
  };
  const statusOf = async (wallet: FundedWallet) => (await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.status as string;

  test('archiving refuses while USDC sent from outside is on the vault\'s token account, saying how much', async () => {
    const wallet = await emptied('1');
    await sendFromOutside(wallet, 750_000n);
    const refused = await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`);
    assert.equal(refused.status, 422, JSON.stringify(refused.body));
    assert.equal(refused.body.error.code, 'wallet_balance_not_zero');
    assert.match(refused.body.error.message, /0\.75 USDC more on chain than recorded/);
    assert.notEqual(await statusOf(wallet), 'archived');
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '0.00', 'not recorded');
    const untouched = await emptied('1');
    assert.equal((await t.request('DELETE', `/v1/wallets/${untouched.wallet_id}`)).status, 200, 'a vault holding nothing archives');
  });

  test('a vault whose row changed between the chain\'s read and the archive\'s lock is not archived: archive again', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const wallet = await emptied('1');
      const held = await holdLocks(other, (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]),
        (tx) => tx.query('UPDATE wallets SET last_transaction_at = last_transaction_at WHERE id = $1', [wallet.wallet_id]));
      const answer = await queuedRequest(ctx().db, held, () => t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`));
      assert.equal(answer.status, 422, JSON.stringify(answer.body));
      assert.match(answer.body.error.message, /changed while it was checked/);
      assert.equal((await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`)).status, 200, 'archived the second time');
    });
  });

  test('a vault busy when the chain was to be read and settled before the archive\'s lock is not archived unchecked', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const wallet = await emptied('1');
      // A move in flight (as a withdrawal sent and not yet settled would be), settled by the transaction holding the vault.
      const txId = newId('tx', ctx().clock.nowMs());
      await ctx().db.query(
        `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, created_at, updated_at)
         VALUES ($1, $2, $3, 'withdrawal', 'pending', 1, 'reserve', now(), now())`, [txId, t.orgId, wallet.wallet_id]);
      const held = await holdLocks(other, (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]),
        (tx) => tx.query(`UPDATE transactions SET status = 'failed', failure_reason = 'test' WHERE id = $1`, [txId]));
      const answer = await queuedRequest(ctx().db, held, () => t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`));
      assert.equal(answer.status, 422, JSON.stringify(answer.body));
      assert.match(answer.body.error.message, /changed while it was checked/);
      assert.notEqual(await statusOf(wallet), 'archived');
    });
  });
});
