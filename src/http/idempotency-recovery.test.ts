/**
 * A first request that recorded its effect and died before answering: every operation that moves
 * money or makes a chain account names what it recorded under the idempotency key, in the
 * database transaction that records it, so that the retry answers with that record instead of
 * making a second one. Each test makes the first request for real, then puts its key in the state
 * a process killed between its commit and its answer leaves (the answer not stored, the lease
 * run out) — the only thing the first request did not do — and retries.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService, type TestResponse } from '../../test/harness.ts';
import { balanceOf, fundedWallet, newPolicy, newRecipient, unique } from '../../test/fixtures.ts';

describe('a retry after the first request recorded and died before answering', () => {
  let t: TestService;
  before(async () => {
    t = await startTestService();
  });
  after(async () => {
    await t.close();
  });

  /** What a process killed after its commit, before storing its answer, leaves of the key. */
  const forgetAnswer = async (key: string) => {
    const rows = await t.service.ctx.db.query(
      `UPDATE idempotency_keys SET state = 'running', response_status = NULL, response_body = NULL, lease_until = $3
       WHERE org_id = $1 AND key = $2 RETURNING key`,
      [t.orgId, key, new Date(Date.now() - 1)]); // a lease is wall time
    assert.equal(rows.length, 1, 'the first request took the key');
  };

  /** The first request, its answer forgotten, then the retry: the retry is the first's answer, marked replayed. */
  const retriedAfterCrash = async (method: string, url: string, body: unknown): Promise<{ first: TestResponse; retried: TestResponse }> => {
    const key = unique('crash');
    const first = await t.request(method, url, { body, headers: { 'idempotency-key': key } });
    await forgetAnswer(key);
    const retried = await t.request(method, url, { body, headers: { 'idempotency-key': key } });
    assert.equal(retried.headers['idempotency-replayed'], 'true', 'this request made nothing');
    assert.equal(retried.status, first.status, JSON.stringify(retried.body));
    return { first, retried };
  };

  const count = async (sql: string, params: unknown[]) => (await t.service.ctx.db.query<{ n: number }>(sql, params))[0]!.n;
  const transactionsOf = (walletId: string, type: string) =>
    count('SELECT count(*)::int AS n FROM transactions WHERE wallet_id = $1 AND type = $2', [walletId, type]);
  const reserve = async () => (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance as string;

  test('a payment: the one recorded, paid once', async () => {
    const wallet = await fundedWallet(t, '5');
    const { first, retried } = await retriedAfterCrash('POST', '/v1/payments',
      { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' });
    assert.equal(first.status, 200, JSON.stringify(first.body));
    assert.equal(retried.body.tx_id, first.body.tx_id);
    assert.equal(retried.body.status, 'confirmed');
    assert.equal(await transactionsOf(wallet.wallet_id, 'payment'), 1);
    assert.equal(await balanceOf(t, wallet.wallet_id), '4.00');
  });

  test('a payment the policy blocked: the blocked record, once', async () => {
    const wallet = await fundedWallet(t, '5', await newPolicy(t, { maxPerTx: '1' }));
    const { first, retried } = await retriedAfterCrash('POST', '/v1/payments',
      { walletId: wallet.wallet_id, to: await newRecipient(), amount: '2', currency: 'USDC' });
    assert.equal(first.status, 402, JSON.stringify(first.body));
    assert.equal(retried.body.error.code, 'policy_violation');
    assert.equal(retried.body.error.tx_id, first.body.error.tx_id, 'the blocked payment recorded first');
    assert.equal(await transactionsOf(wallet.wallet_id, 'payment'), 1, 'one blocked record');
    assert.equal(await balanceOf(t, wallet.wallet_id), '5.00');
  });

  test('a vault: the one created, one chain account', async () => {
    const agentId = unique('agent');
    const { first, retried } = await retriedAfterCrash('POST', '/v1/wallets', { agentId, label: 'Agent', policyId: 'pol_permissive' });
    assert.equal(first.status, 200, JSON.stringify(first.body));
    assert.equal(retried.body.wallet_id, first.body.wallet_id);
    assert.equal(retried.body.chain_address, first.body.chain_address);
    assert.equal(await count('SELECT count(*)::int AS n FROM wallets WHERE org_id = $1 AND agent_id = $2', [t.orgId, agentId]), 1);
  });

  test('a funding, a batch funding and a withdrawal: each moved once', async () => {
    const wallet = await fundedWallet(t, '5');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '10' } });
    const reserveBefore = Number(await reserve());

    const funded = await retriedAfterCrash('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { amount: '2' });
    assert.equal(funded.first.status, 200, JSON.stringify(funded.first.body));
    assert.equal(funded.retried.body.tx_id, funded.first.body.tx_id);

    const batch = await retriedAfterCrash('POST', '/v1/wallets/fund-batch', { allocations: [{ walletId: wallet.wallet_id, amount: '3' }] });
    assert.equal(batch.first.status, 200, JSON.stringify(batch.first.body));
    assert.deepEqual(batch.retried.body, batch.first.body);

    const withdrawn = await retriedAfterCrash('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { amount: '4' });
    assert.equal(withdrawn.first.status, 200, JSON.stringify(withdrawn.first.body));
    assert.equal(withdrawn.retried.body.tx_id, withdrawn.first.body.tx_id);

    assert.equal(await transactionsOf(wallet.wallet_id, 'funding'), 3, 'the first funding (fundedWallet), the funding and the batch');
    assert.equal(await transactionsOf(wallet.wallet_id, 'withdrawal'), 1);
    assert.equal(await balanceOf(t, wallet.wallet_id), '6.00', '5 + 2 + 3 − 4');
    assert.equal(Number(await reserve()), reserveBefore - 2 - 3 + 4);
  });

  test('an escrow: the one locked, and one the policy blocked', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '1');
    const { first, retried } = await retriedAfterCrash('POST', '/v1/payments/a2a',
      { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '4', currency: 'USDC', taskDescription: 'Summarise the filings' });
    assert.equal(first.status, 200, JSON.stringify(first.body));
    assert.equal(retried.body.escrow_id, first.body.escrow_id);
    assert.equal(retried.body.status, 'locked');
    assert.equal(await count('SELECT count(*)::int AS n FROM escrows WHERE from_wallet_id = $1', [from.wallet_id]), 1);
    assert.equal(await balanceOf(t, from.wallet_id), '6.00');

    // Blocked by a limit, and by a co-sign threshold (an escrow is not held for approval).
    for (const rules of [{ maxPerTx: '1' }, { requireCoSign: '2.5' }]) {
      const limited = await fundedWallet(t, '10', await newPolicy(t, rules));
      const blocked = await retriedAfterCrash('POST', '/v1/payments/a2a',
        { fromWallet: limited.wallet_id, toWallet: to.wallet_id, amount: '4', currency: 'USDC', taskDescription: 'Too much' });
      assert.equal(blocked.first.status, 402, JSON.stringify(blocked.first.body));
      assert.equal(blocked.retried.body.error.tx_id, blocked.first.body.error.tx_id);
      assert.equal(await transactionsOf(limited.wallet_id, 'a2a_send'), 1, 'one blocked record');
      assert.equal(await balanceOf(t, limited.wallet_id), '10.00');
    }
  });
});
