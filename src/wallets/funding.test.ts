/**
 * Funding, batch funding and withdrawal: exact amounts, the index equal to the chain, money
 * conserved, no overdraw under concurrency, safe retries, and crash recovery.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address, generateKeyPairSigner } from '@solana/kit';
import { startTestService, type TestService } from '../../test/harness.ts';
import { queuedBehind } from '../../test/locks.ts';
import { unique } from '../../test/fixtures.ts';
import { openDatabase } from '../db/database.ts';
import { requestHash } from '../http/idempotency.ts';
import { recordEvent } from '../events/events.ts';
import { EXPIRY_MARGIN_BLOCKS, insertTransaction, reconcilePending, settleBehind, settleSignatures } from '../transactions/settlement.ts';
import { MAX_MICRO_USDC, formatUsdc } from '../money/money.ts';

let agentCounter = 0;

async function newWallet(t: TestService, key?: string): Promise<{ wallet_id: string; chain_address: string; token_account: string }> {
  const response = await t.request('POST', '/v1/wallets', {
    key, body: { agentId: `fund-${process.pid}-${(agentCounter += 1)}`, label: 'Funded agent', policyId: 'pol_moderate' },
  });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

async function deposit(t: TestService, amount: string, key?: string): Promise<void> {
  const response = await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount } });
  assert.equal(response.status, 200);
}

/** The service's index against the chain, and reserve + Σ vaults = Σ deposits − Σ payments (all that left the organisation). */
async function assertIndexEqualsChainAndConserved(t: TestService, orgId = t.orgId): Promise<void> {
  const { db, chain } = t.service.ctx;
  const [org] = await db.query<{ reserve_balance: bigint; reserve_token_address: string }>(
    'SELECT reserve_balance, reserve_token_address FROM organizations WHERE id = $1', [orgId]);
  assert.equal(await chain.getTokenBalance(address(org!.reserve_token_address)), org!.reserve_balance, 'reserve: index = chain');
  const wallets = await db.query<{ balance: bigint; token_address: string }>(
    'SELECT balance, token_address FROM wallets WHERE org_id = $1', [orgId]);
  let vaults = 0n;
  for (const wallet of wallets) {
    assert.equal(await chain.getTokenBalance(address(wallet.token_address)), wallet.balance, 'vault: index = chain');
    vaults += wallet.balance;
  }
  const [deposits] = await db.query<{ total: bigint }>('SELECT COALESCE(SUM(amount), 0)::bigint AS total FROM deposits WHERE org_id = $1', [orgId]);
  // Payments are the only money leaving the organisation here (a payment still pending has left its vault).
  const [paid] = await db.query<{ total: bigint }>(
    `SELECT COALESCE(SUM(amount), 0)::bigint AS total FROM transactions WHERE org_id = $1 AND type = 'payment' AND status IN ('confirmed', 'pending')`,
    [orgId]);
  assert.equal(org!.reserve_balance + vaults, deposits!.total - paid!.total, 'money is conserved');
}

describe('funding and withdrawal', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('funding moves exactly the amount from the reserve to the vault, confirmed on chain', async () => {
    await deposit(t, '100');
    const wallet = await newWallet(t);
    const funded = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '30.25', currency: 'USDC' } });
    assert.equal(funded.status, 200, JSON.stringify(funded.body));
    assert.equal(funded.body.funded_amount, '30.25');
    assert.equal(funded.body.usdc_balance, '30.25');
    assert.equal(funded.body.org_balance_remaining, '69.75');
    assert.equal(funded.body.status, 'confirmed');
    assert.equal(typeof funded.body.on_chain_slot, 'number');
    assert.equal(await t.service.ctx.chain.getTokenBalance(address(wallet.token_account)), 30_250_000n);
    const [row] = await t.service.ctx.db.query<{ type: string; status: string; tx_signature: string }>(
      'SELECT type, status, tx_signature FROM transactions WHERE id = $1', [funded.body.tx_id]);
    assert.deepEqual(row, { type: 'funding', status: 'confirmed', tx_signature: funded.body.tx_signature });
    const events = await t.service.ctx.db.query<{ payload: Record<string, unknown> }>(
      `SELECT payload FROM events WHERE type = 'wallet.funded' AND wallet_id = $1`, [wallet.wallet_id]);
    assert.equal(events.length, 1);
    assert.equal(events[0]!.payload.amount, '30.25');
    assert.equal(events[0]!.payload.source, 'reserve');
    const read = await t.request('GET', `/v1/wallets/${wallet.wallet_id}`);
    assert.equal(read.body.usdc_balance, '30.25');
    assert.ok(read.body.last_transaction_at, 'last_transaction_at is set');
    await assertIndexEqualsChainAndConserved(t);
  });

  // Guarantee: a funding or withdrawal whose send the chain did not take (it did not answer for
  // a moment) is sent again while the service waits for it, and lands.
  test('a funding and a withdrawal whose first send fails are sent again and confirmed', async () => {
    await deposit(t, '10');
    const wallet = await newWallet(t);
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    const failOnce = () => {
      chain.submit = async (...args: Parameters<typeof submit>) => {
        chain.submit = submit;
        throw Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:8899'), { code: 'ECONNREFUSED' });
      };
    };
    try {
      failOnce();
      const funded = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '3', currency: 'USDC' } });
      assert.deepEqual([funded.status, funded.body.status], [200, 'confirmed'], JSON.stringify(funded.body));
      failOnce();
      const withdrawn = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: '1', currency: 'USDC' } });
      assert.deepEqual([withdrawn.status, withdrawn.body.status], [200, 'confirmed'], JSON.stringify(withdrawn.body));
    } finally {
      chain.submit = submit;
    }
    assert.equal(await t.service.ctx.chain.getTokenBalance(address(wallet.token_account)), 2_000_000n);
    await assertIndexEqualsChainAndConserved(t);
  });

  test('funding beyond the reserve, bad amounts and bad currencies change nothing', async () => {
    const wallet = await newWallet(t);
    const org = await t.request('GET', '/v1/organization');
    const over = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '1000000' } });
    assert.equal(over.status, 422);
    assert.equal(over.body.error.code, 'org_insufficient_balance');
    for (const [body, code] of [
      [{ amount: '0' }, 'invalid_amount'], [{ amount: '-5' }, 'invalid_amount'], [{ amount: '1.0000001' }, 'invalid_amount'],
      [{ amount: '1e3' }, 'invalid_amount'], [{ amount: ' 1' }, 'invalid_amount'], [{ amount: 5 }, 'invalid_amount'], [{ amount: '1', currency: 5 }, 'invalid_currency'],
      [{ amount: '1', currency: 'USD' }, 'invalid_currency'],
    ] as const) {
      const response = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body });
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, code);
    }
    assert.equal((await t.request('POST', '/v1/wallets/wal_missing/fund', { body: { amount: '1' } })).body.error.code, 'wallet_not_found');
    const viewer = await t.createKey('viewer');
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { key: viewer, body: { amount: '1' } })).status, 403);
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, org.body.reserve.usdc_balance);
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '0.00');
  });

  test('a funding retried with its idempotency key happens once', async () => {
    await deposit(t, '10');
    const wallet = await newWallet(t);
    const body = { amount: '2', idempotencyKey: `fund-once-${wallet.wallet_id}` };
    const first = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body });
    const replay = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body });
    assert.equal(replay.status, 200);
    assert.equal(replay.headers['idempotency-replayed'], 'true');
    assert.deepEqual(replay.body, first.body);
    const viaHeader = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, {
      body: { amount: '2' }, headers: { 'idempotency-key': body.idempotencyKey },
    });
    assert.equal(viaHeader.body.tx_id, first.body.tx_id);
    const conflict = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { ...body, amount: '3' } });
    assert.equal(conflict.status, 409);
    assert.equal(conflict.body.error.code, 'idempotency_conflict');
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '2.00');
  });

  test('an unknown wallet is not an idempotency key\'s answer: the corrected funding or withdrawal runs under it', async () => {
    await deposit(t, '10');
    const wallet = await newWallet(t);
    for (const [path, amount] of [['fund', '2'], ['withdraw', '1']] as const) {
      const key = unique(`mistyped-${path}`);
      for (let i = 0; i < 2; i += 1) {
        const missing = await t.request('POST', `/v1/wallets/wal_missing/${path}`, { body: { amount }, headers: { 'idempotency-key': key } });
        assert.equal(missing.status, 404, JSON.stringify(missing.body));
        assert.equal(missing.body.error.param, 'wallet_id');
        assert.equal(missing.headers['idempotency-replayed'], undefined, 'not kept, so not replayed');
      }
      const corrected = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/${path}`, { body: { amount }, headers: { 'idempotency-key': key } });
      assert.equal(corrected.status, 200, JSON.stringify(corrected.body));
    }
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '1.00');
  });

  test('20 concurrent identical idempotent fundings make one funding', async () => {
    await deposit(t, '10');
    const wallet = await newWallet(t);
    const body = { amount: '1', idempotencyKey: `burst-${wallet.wallet_id}` };
    const responses = await Promise.all(Array.from({ length: 20 }, () =>
      t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body })));
    const ok = responses.filter((r) => r.status === 200);
    assert.ok(ok.length >= 1, 'at least one request succeeded');
    assert.deepEqual(responses.filter((r) => r.status !== 200).map((r) => r.body.error.code).filter((c) => c !== 'idempotency_conflict'), []);
    assert.equal(new Set(ok.map((r) => r.body.tx_id)).size, 1);
    const rows = await t.service.ctx.db.query('SELECT 1 FROM transactions WHERE wallet_id = $1', [wallet.wallet_id]);
    assert.equal(rows.length, 1);
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '1.00');
  });

  test('withdrawal of an amount, of "all", and beyond the balance', async () => {
    await deposit(t, '20');
    const wallet = await newWallet(t);
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '12' } });
    const reserveBefore = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance;
    const part = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: '2.5' } });
    assert.equal(part.status, 200, JSON.stringify(part.body));
    assert.equal(part.body.withdrawn_amount, '2.50');
    assert.equal(part.body.usdc_balance, '9.50');
    assert.equal(part.body.status, 'confirmed');
    assert.equal(Number(part.body.org_balance), Number(reserveBefore) + 2.5);
    const over = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: '9.500001' } });
    assert.equal(over.status, 422);
    assert.equal(over.body.error.code, 'withdrawal_exceeds_balance');
    const all = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    assert.equal(all.body.withdrawn_amount, '9.50');
    assert.equal(all.body.usdc_balance, '0.00');
    const nothing = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    assert.equal(nothing.body.error.code, 'withdrawal_exceeds_balance');
    const types = await t.service.ctx.db.query<{ type: string }>('SELECT type FROM transactions WHERE wallet_id = $1 ORDER BY id', [wallet.wallet_id]);
    assert.deepEqual(types.map((r) => r.type), ['funding', 'withdrawal', 'withdrawal']);
    const withdrawn = await t.service.ctx.db.query<{ summary: string }>(
      `SELECT summary FROM events WHERE type = 'wallet.withdrawn' AND wallet_id = $1 ORDER BY id`, [wallet.wallet_id]);
    assert.equal(withdrawn.length, 2);
    assert.deepEqual(withdrawn.map((e) => e.summary), [
      '2.50 USDC returned from wallet Funded agent to the reserve', '9.50 USDC returned from wallet Funded agent to the reserve',
    ], 'the feed names the vault');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a withdrawal of "all" from a wallet paying all the while is 503 with Retry-After and records nothing; the retry empties it', async () => {
    await deposit(t, '10');
    const wallet = await newWallet(t);
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '10' } });
    // A payment lands between each read of the balance and the lock, as an agent paying all the
    // while would: five times, the most a withdrawal of "all" signs again.
    const { chain } = t.service.ctx;
    const prepare = chain.prepare;
    let paid = 0;
    let paying = false; // the payment's own signing is not the withdrawal's
    chain.prepare = async (instructions) => {
      if (paid < 5 && !paying) {
        paid += 1;
        paying = true;
        try {
          const payment = await t.request('POST', '/v1/payments', {
            body: { walletId: wallet.wallet_id, to: (await generateKeyPairSigner()).address, amount: '0.01', currency: 'USDC' } });
          assert.equal(payment.status, 200, JSON.stringify(payment.body));
        } finally {
          paying = false;
        }
      }
      return prepare.call(chain, instructions);
    };
    let busy;
    try {
      busy = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    } finally {
      chain.prepare = prepare;
    }
    assert.deepEqual([busy.status, busy.body.error?.code, busy.headers['retry-after']], [503, 'service_unavailable', '1'], JSON.stringify(busy.body));
    const withdrawals = async () => (await t.service.ctx.db.query(`SELECT 1 FROM transactions WHERE wallet_id = $1 AND type = 'withdrawal'`, [wallet.wallet_id])).length;
    assert.equal(await withdrawals(), 0, 'nothing recorded');
    const retried = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    assert.deepEqual([retried.body.withdrawn_amount, retried.body.usdc_balance], ['9.95', '0.00']);
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a test deposit that would take the organisation past the largest amount is refused before minting; index = chain', async () => {
    const whale = await t.createOrganization('Whale');
    await deposit(t, formatUsdc(MAX_MICRO_USDC - 1_000_000n), whale.adminKey);
    const wallet = await newWallet(t, whale.adminKey);
    const funded = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { key: whale.adminKey, body: { amount: '1000' } });
    assert.equal(funded.status, 200, JSON.stringify(funded.body));
    // Reserve and vault together: the reserve alone would still take it, and a funding would then overflow the vault.
    for (const amount of ['1.000001', '9223372036854.775807']) {
      const over = await t.request('POST', '/v1/test_helpers/deposits', { key: whale.adminKey, body: { amount } });
      assert.equal(over.status, 400, JSON.stringify(over.body));
      assert.equal(over.body.error.code, 'invalid_amount');
    }
    await deposit(t, '1', whale.adminKey);
    await assertIndexEqualsChainAndConserved(t, whale.orgId);
  });

  test('a frozen wallet can still be funded and emptied (money stays inside the organisation)', async () => {
    await deposit(t, '3');
    const wallet = await newWallet(t);
    await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } });
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '3' } })).body.status, 'confirmed');
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } })).body.status, 'confirmed');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('batch funding is atomic: all allocations in one chain transaction, or none', async () => {
    await deposit(t, '50');
    const wallets = await Promise.all([newWallet(t), newWallet(t), newWallet(t)]);
    const reserve = async () => (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance as string;
    const before = await reserve();
    const tooMuch = await t.request('POST', '/v1/wallets/fund-batch', {
      body: { allocations: wallets.map((w) => ({ walletId: w.wallet_id, amount: '1000000' })) },
    });
    assert.equal(tooMuch.body.error.code, 'org_insufficient_balance');
    // Refused before their idempotency key is taken: the corrected batch below uses the same key.
    const batchKey = `batch-${Date.now()}`;
    const oneMissing = await t.request('POST', '/v1/wallets/fund-batch', {
      headers: { 'idempotency-key': batchKey },
      body: { allocations: [{ walletId: wallets[0]!.wallet_id, amount: '1' }, { walletId: 'wal_missing', amount: '1' }] },
    });
    assert.equal(oneMissing.body.error.code, 'wallet_not_found');
    assert.equal(oneMissing.body.error.param, 'allocations.1.wallet_id', 'the allocation that names it');
    const duplicate = await t.request('POST', '/v1/wallets/fund-batch', {
      headers: { 'idempotency-key': batchKey },
      body: { allocations: [{ walletId: wallets[0]!.wallet_id, amount: '1' }, { walletId: wallets[0]!.wallet_id, amount: '1' }] },
    });
    assert.equal(duplicate.body.error.code, 'invalid_request');
    const badAmount = await t.request('POST', '/v1/wallets/fund-batch', {
      body: { allocations: [{ walletId: wallets[0]!.wallet_id, amount: '1' }, { walletId: wallets[1]!.wallet_id, amount: 'x' }] },
    });
    assert.equal(badAmount.body.error.code, 'invalid_amount');
    assert.equal(badAmount.body.error.param, 'allocations.1.amount');
    const tooMany = await t.request('POST', '/v1/wallets/fund-batch', {
      body: { allocations: Array.from({ length: 11 }, () => ({ walletId: wallets[0]!.wallet_id, amount: '1' })) },
    });
    assert.equal(tooMany.status, 400);
    assert.equal(await reserve(), before, 'refused batches moved nothing');
    for (const wallet of wallets) assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '0.00');

    const batch = await t.request('POST', '/v1/wallets/fund-batch', {
      headers: { 'idempotency-key': batchKey },
      body: { allocations: wallets.map((w, i) => ({ walletId: w.wallet_id, amount: `${i + 1}.5` })) },
    });
    assert.equal(batch.status, 200, JSON.stringify(batch.body));
    assert.equal(batch.body.status, 'confirmed');
    assert.equal(batch.body.total_amount, '7.50');
    assert.deepEqual(batch.body.allocations.map((a: { usdc_balance: string }) => a.usdc_balance), ['1.50', '2.50', '3.50']);
    const signatures = await t.service.ctx.db.query<{ tx_signature: string }>(
      'SELECT DISTINCT tx_signature FROM transactions WHERE batch_id = $1', [batch.body.batch_id]);
    assert.equal(signatures.length, 1, 'one chain transaction');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a batch of one is a batch: its own batch_id, recorded on its funding', async () => {
    await deposit(t, '2');
    const wallet = await newWallet(t);
    const batch = await t.request('POST', '/v1/wallets/fund-batch', { body: { allocations: [{ walletId: wallet.wallet_id, amount: '1' }] } });
    assert.equal(batch.status, 200, JSON.stringify(batch.body));
    assert.match(batch.body.batch_id, /^batch_/);
    const funding = await t.request('GET', `/v1/transactions/${batch.body.allocations[0].tx_id}`);
    assert.equal(funding.body.batch_id, batch.body.batch_id, 'the funding names its batch');
    // A funding of one vault on its own is no batch.
    const single = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '1', currency: 'USDC' } });
    assert.equal(single.status, 200, JSON.stringify(single.body));
    assert.equal((await t.request('GET', `/v1/transactions/${single.body.tx_id}`)).body.batch_id, null);
  });

  test('the largest batch fits in one chain transaction', async () => {
    await deposit(t, '10');
    const wallets = [];
    for (let i = 0; i < 10; i += 1) wallets.push(await newWallet(t));
    const batch = await t.request('POST', '/v1/wallets/fund-batch', {
      body: { allocations: wallets.map((w) => ({ walletId: w.wallet_id, amount: '1' })) },
    });
    assert.equal(batch.status, 200, JSON.stringify(batch.body));
    assert.equal(batch.body.status, 'confirmed');
    const signatures = await t.service.ctx.db.query<{ tx_signature: string }>(
      'SELECT DISTINCT tx_signature FROM transactions WHERE batch_id = $1', [batch.body.batch_id]);
    assert.deepEqual(signatures.map((row) => row.tx_signature), [batch.body.tx_signature], 'ten fundings, one chain transaction');
    for (const wallet of wallets) assert.equal(await t.service.ctx.chain.getUsdcBalance(address(wallet.chain_address)), 1_000_000n);
    await assertIndexEqualsChainAndConserved(t);
  });
});

describe('funding under concurrency', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('30 concurrent fundings against a reserve that covers exactly 12: exactly 12 succeed', async () => {
    await deposit(t, '12');
    const wallets = await Promise.all(Array.from({ length: 5 }, () => newWallet(t)));
    const responses = await Promise.all(Array.from({ length: 30 }, (_v, i) =>
      t.request('POST', `/v1/wallets/${wallets[i % 5]!.wallet_id}/fund`, { body: { amount: '1' } })));
    const ok = responses.filter((r) => r.status === 200);
    assert.equal(ok.length, 12);
    assert.deepEqual(new Set(responses.filter((r) => r.status !== 200).map((r) => r.body.error.code)), new Set(['org_insufficient_balance']));
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, '0.00');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('25 concurrent withdrawals of 1 from a balance of 7: exactly 7 succeed, never negative', async () => {
    await deposit(t, '7');
    const wallet = await newWallet(t);
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '7' } });
    const responses = await Promise.all(Array.from({ length: 25 }, () =>
      t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: '1' } })));
    assert.equal(responses.filter((r) => r.status === 200).length, 7);
    assert.deepEqual(new Set(responses.filter((r) => r.status !== 200).map((r) => r.body.error.code)), new Set(['withdrawal_exceeds_balance']));
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '0.00');
    await assertIndexEqualsChainAndConserved(t);
  });

  /**
   * A job that holds vault locks while it writes events (each event checks its organisation's
   * row, a key-share lock) beside a funding that holds the reserve (that row) and waits for the
   * vault: the reserve's lock must not block the event's check, or the two deadlock.
   */
  test('a funding waiting for a vault held by a writer of events does not deadlock with it', async (context) => {
    if (!process.env.DATABASE_URL) {
      context.skip('needs DATABASE_URL (PGlite has a single connection: no lock can be held beside another)');
      return;
    }
    await deposit(t, '3');
    const wallet = await newWallet(t);
    const [{ schema }] = await t.service.ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
    const holding = await openDatabase({ databaseUrl: process.env.DATABASE_URL!, dataDir: null, schema });
    try {
      let held!: (pid: number) => void;
      const isHeld = new Promise<number>((resolve) => { held = resolve; });
      let funding!: Promise<{ status: number; body: any }>;
      const holder = holding.transaction(async (tx) => {
        await tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]);
        held((await tx.query<{ pid: number }>('SELECT pg_backend_pid() AS pid'))[0]!.pid);
        await queuedBehind(holding, await isHeld, 1);
        await recordEvent(tx, t.service.ctx.clock.nowMs(), {
          orgId: t.orgId, type: 'balance.low', walletId: wallet.wallet_id, summary: 'written while the funding waits', payload: {},
        });
      });
      await isHeld;
      funding = t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '3' } });
      const outcomes = await Promise.allSettled([holder, funding]);
      assert.deepEqual(outcomes.map((outcome) => (outcome.status === 'rejected' ? String(outcome.reason) : 'ok')), ['ok', 'ok']);
      const funded = await funding;
      assert.equal(funded.status, 200, JSON.stringify(funded.body));
      assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '3.00');
    } finally {
      await holding.close();
    }
  });

  /**
   * A settlement batch that credits one vault and moves a reserve (a withdrawal confirmed),
   * beside a funding of that vault, which holds the reserve and waits for the vault: the batch
   * must take the reserve before any vault, or the two deadlock.
   */
  test('a settlement moving a reserve and a funding of one of its vaults do not deadlock', async (context) => {
    if (!process.env.DATABASE_URL) {
      context.skip('needs DATABASE_URL (PGlite has a single connection: no lock can be held beside another)');
      return;
    }
    const org = await t.createOrganization('Settled beside a funding');
    await deposit(t, '5', org.adminKey);
    const [first, second] = [await newWallet(t, org.adminKey), await newWallet(t, org.adminKey)].sort((a, b) => a.wallet_id.localeCompare(b.wallet_id));
    const { ctx } = t.service;
    // Recorded as their requests would have them (the chain is not needed: the outcomes are given).
    const signatures = [`credit-${first!.wallet_id}`, `withdraw-${second!.wallet_id}`];
    await ctx.db.transaction(async (tx) => {
      await insertTransaction(tx, ctx.clock.nowMs(), {
        orgId: org.orgId, walletId: first!.wallet_id, type: 'funding', amount: 1n, recipient: first!.chain_address,
        signature: signatures[0]!, lastValidBlockHeight: null,
      });
      await insertTransaction(tx, ctx.clock.nowMs(), {
        orgId: org.orgId, walletId: second!.wallet_id, type: 'withdrawal', amount: 1n, recipient: null,
        signature: signatures[1]!, lastValidBlockHeight: null,
      });
    });
    const [{ schema }] = await ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
    const holding = await openDatabase({ databaseUrl: process.env.DATABASE_URL!, dataDir: null, schema });
    let release = () => {};
    const released = new Promise<void>((resolve) => { release = resolve; });
    try {
      let held!: (pid: number) => void;
      const isHeld = new Promise<number>((resolve) => { held = resolve; });
      const holder = holding.transaction(async (tx) => {
        await tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [first!.wallet_id]);
        held((await tx.query<{ pid: number }>('SELECT pg_backend_pid() AS pid'))[0]!.pid);
        await released;
      });
      const holderPid = await isHeld;
      const settled = settleSignatures(ctx.db, ctx.clock.nowMs(), signatures.map((signature) => ({ signature, outcome: { slot: 1n, err: null } })));
      await queuedBehind(holding, holderPid, 1);
      const funding = t.request('POST', `/v1/wallets/${first!.wallet_id}/fund`, { key: org.adminKey, body: { amount: '2' } });
      await queuedBehind(holding, holderPid, 2);
      release();
      const outcomes = await Promise.allSettled([holder, settled, funding]);
      assert.deepEqual(outcomes.map((outcome) => (outcome.status === 'rejected' ? String(outcome.reason) : 'ok')), ['ok', 'ok', 'ok']);
      const funded = await funding;
      assert.equal(funded.status, 200, JSON.stringify(funded.body));
      assert.deepEqual((await settled).map((rows) => rows.map((row) => row.status)), [['confirmed'], ['confirmed']]);
    } finally {
      release();
      await holding.close();
    }
  });
});

describe('crash recovery', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  /**
   * What fundWallets does up to a crash: sign a funding of a new vault, record it pending with the
   * reserve debited (with its signed bytes when `wire`), nothing sent.
   */
  async function recordFunding(micro: bigint, { wire = false } = {}) {
    const wallet = await newWallet(t);
    const { ctx } = t.service;
    const [row] = await ctx.db.query<{ agent_id: string }>('SELECT agent_id FROM wallets WHERE id = $1', [wallet.wallet_id]);
    const prepared = await ctx.chain.prepare([await ctx.chain.fundIx(t.orgId, row!.agent_id, micro)]);
    const recorded = await ctx.db.transaction(async (tx) => {
      await tx.query('UPDATE organizations SET reserve_balance = reserve_balance - $2 WHERE id = $1', [t.orgId, micro]);
      return insertTransaction(tx, ctx.clock.nowMs(), {
        orgId: t.orgId, walletId: wallet.wallet_id, type: 'funding', amount: micro, recipient: wallet.chain_address,
        signature: prepared.signature, lastValidBlockHeight: prepared.lastValidBlockHeight, wire: wire ? prepared.wire : null,
      });
    });
    return { wallet, prepared, recorded };
  }

  test('a funding recorded and sent, then abandoned by a crash, is settled by the reconciler', async () => {
    await deposit(t, '5');
    const { ctx } = t.service;
    const { wallet, prepared } = await recordFunding(2_000_000n);
    await ctx.chain.submit(prepared);
    await ctx.chain.waitForOutcome(prepared.signature);
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '0.00', 'not yet settled');
    assert.equal(await reconcilePending(ctx, 0), 1);
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '2.00');
    assert.equal(await reconcilePending(ctx, 0), 0, 'settled once');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a funding and a withdrawal the chain lost after taking them are sent again by the reconciler, from the bytes recorded with them', async () => {
    await deposit(t, '5');
    const wallet = await newWallet(t);
    const { ctx } = t.service;
    for (const [kind, path, amount] of [['funding', 'fund', '3'], ['withdrawal', 'withdraw', '1']] as const) {
      const submit = ctx.chain.submit;
      // Taken, and never run: a node that crashed before its slot, a leader that dropped it.
      let sent = false;
      ctx.chain.submit = async () => { sent = true; };
      let answer: Promise<{ status: number; body: any }>;
      try {
        answer = t.request('POST', `/v1/wallets/${wallet.wallet_id}/${path}`, { body: { amount, currency: 'USDC' } });
        while (!sent) await new Promise((resolve) => setTimeout(resolve, 20));
      } finally {
        ctx.chain.submit = submit;
      }
      const [row] = await ctx.db.query<{ id: string; wire: string | null }>(
        `SELECT id, wire FROM transactions WHERE wallet_id = $1 AND type = $2 AND status = 'pending'`, [wallet.wallet_id, kind]);
      assert.ok(row, `the ${kind} is pending`);
      assert.notEqual(row.wire, null, `the ${kind} is recorded with its signed bytes`);
      assert.equal(await reconcilePending(ctx, 0), 0, 'sent again, not yet settled');
      const answered = await answer;
      assert.deepEqual([answered.status, answered.body.status], [200, 'confirmed'], `${kind}: ${JSON.stringify(answered.body)}`);
    }
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '2.00');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a settlement behind an answer, past the settler\'s backlog, is left to the reconciler; below it, written', async () => {
    await deposit(t, '3');
    const { ctx } = t.service;
    const left = await recordFunding(1_000_000n);
    const written = await recordFunding(2_000_000n);
    for (const { prepared } of [left, written]) await ctx.chain.submit(prepared);
    const outcomeOf = async (prepared: typeof left.prepared) => (await ctx.chain.waitForOutcome(prepared.signature))!;
    assert.equal(settleBehind(ctx, { signature: left.prepared.signature, outcome: await outcomeOf(left.prepared) }, 0), null, 'not queued');
    const rows = await settleBehind(ctx, { signature: written.prepared.signature, outcome: await outcomeOf(written.prepared) });
    assert.deepEqual(rows?.map((row) => [row.id, row.status]), [[written.recorded.id, 'confirmed']]);
    const balance = async (walletId: string) => (await t.request('GET', `/v1/wallets/${walletId}`)).body.usdc_balance;
    assert.equal(await balance(left.wallet.wallet_id), '0.00', 'left pending');
    assert.equal(await balance(written.wallet.wallet_id), '2.00');
    assert.equal(await reconcilePending(ctx, 0), 1, 'the reconciler settles the one left');
    assert.equal(await balance(left.wallet.wallet_id), '1.00');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a funding recorded with its signed bytes but never sent (a crash before the send) is sent by the reconciler and lands', async () => {
    await deposit(t, '3');
    const { ctx } = t.service;
    const { wallet, prepared, recorded } = await recordFunding(3_000_000n, { wire: true });
    assert.deepEqual(await ctx.chain.getOutcomes([prepared.signature]), [null], 'the chain never saw it');
    assert.equal(await reconcilePending(ctx, 0), 0, 'nothing to settle yet: it was sent');
    assert.equal((await ctx.chain.waitForOutcome(prepared.signature))?.err, null, 'it landed');
    assert.equal(await reconcilePending(ctx, 0), 1);
    const [settled] = await ctx.db.query<{ status: string; wire: string | null }>('SELECT status, wire FROM transactions WHERE id = $1', [recorded.id]);
    assert.deepEqual({ ...settled }, { status: 'confirmed', wire: null }, 'confirmed, its bytes no longer kept');
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.usdc_balance, '3.00');
    await assertIndexEqualsChainAndConserved(t);
  });

  test('the reconciler sends again at most so many a run, the oldest first; the rest at the next runs', async () => {
    await deposit(t, '2');
    const { ctx } = t.service;
    const older = await recordFunding(1_000_000n, { wire: true });
    const newer = await recordFunding(1_000_000n, { wire: true });
    assert.equal(await reconcilePending(ctx, 0, 1), 0);
    assert.equal((await ctx.chain.waitForOutcome(older.prepared.signature))?.err, null, 'the oldest was sent');
    assert.deepEqual(await ctx.chain.getOutcomes([newer.prepared.signature]), [null], 'the other waits for the next run');
    assert.equal(await reconcilePending(ctx, 0, 1), 1, 'the oldest settled; the other sent');
    assert.equal((await ctx.chain.waitForOutcome(newer.prepared.signature))?.err, null);
    assert.equal(await reconcilePending(ctx, 0, 1), 1);
    await assertIndexEqualsChainAndConserved(t);
  });

  test('a funding recorded but never sent fails once it can no longer land, and the reserve gets it back', async () => {
    const wallet = await newWallet(t);
    const { ctx } = t.service;
    const reserveBefore = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance;
    const [row] = await ctx.db.query<{ agent_id: string }>('SELECT agent_id FROM wallets WHERE id = $1', [wallet.wallet_id]);
    const prepared = await ctx.chain.prepare([await ctx.chain.fundIx(t.orgId, row!.agent_id, 1_000_000n)]);
    // Past its last valid height by more than the reconciler's margin (see EXPIRY_MARGIN_BLOCKS).
    const expiredHeight = (await ctx.chain.getBlockHeight()) - 1n - EXPIRY_MARGIN_BLOCKS;
    const recorded = await ctx.db.transaction(async (tx) => {
      await tx.query('UPDATE organizations SET reserve_balance = reserve_balance - 1000000 WHERE id = $1', [t.orgId]);
      return insertTransaction(tx, ctx.clock.nowMs(), {
        orgId: t.orgId, walletId: wallet.wallet_id, type: 'funding', amount: 1_000_000n, recipient: wallet.chain_address,
        signature: prepared.signature, lastValidBlockHeight: expiredHeight,
      });
    });
    // As a process killed after recording leaves its idempotency key: running, lease over, the move named.
    const key = `crashed-${recorded.id}`;
    const nowMs = ctx.clock.nowMs();
    await ctx.db.query(
      `INSERT INTO idempotency_keys (org_id, key, request_hash, state, created_at, expires_at, lease_until, resource_id)
       VALUES ($1, $2, $3, 'running', $4, $5, $6, $7)`,
      [t.orgId, key, requestHash('wallets.fund', { walletId: wallet.wallet_id, amount: 1_000_000n }), new Date(nowMs - 1),
        new Date(nowMs + 3_600_000), new Date(Date.now() - 1), prepared.signature]); // a lease is wall time
    assert.equal(await reconcilePending(ctx, 0), 1);
    const [settled] = await ctx.db.query<{ status: string }>('SELECT status FROM transactions WHERE id = $1', [recorded.id]);
    assert.equal(settled!.status, 'failed');
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, reserveBefore);
    // Told, as a failed payment is: a client answered `pending` learns how it ended.
    const failed = (await t.request('GET', `/v1/events?type=transaction.failed&walletId=${wallet.wallet_id}`)).body.data;
    assert.deepEqual(failed.map((e: { details: Record<string, unknown> }) => [e.details.tx_id, e.details.type, e.details.amount, e.details.reason]),
      [[recorded.id, 'funding', '1.00', 'Expired']]);
    assert.match(failed[0].summary, /failed: it never landed on chain before its blockhash expired \(Expired\); its amount is back$/,
      'it never reached the chain: not "failed on chain"');
    // The retry learns how it ended: failed (expired unsent), its amount back in the reserve.
    for (let i = 0; i < 2; i += 1) {
      const retried = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '1' }, headers: { 'idempotency-key': key } });
      assert.equal(retried.status, 200, JSON.stringify(retried.body));
      assert.equal(retried.body.status, 'failed');
      assert.equal(retried.body.tx_id, recorded.id);
      assert.equal(retried.headers['idempotency-replayed'], 'true', 'the crashed request\'s funding, not this one\'s');
      assert.equal(retried.body.org_balance_remaining, reserveBefore);
    }
    await assertIndexEqualsChainAndConserved(t);
  });
});
