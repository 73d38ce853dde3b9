import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { address, generateKeyPairSigner, lamports, type Address, type Signature } from '@solana/kit';
import { startTestService, type TestService } from '../../test/harness.ts';
import { newId } from '../ids/ids.ts';
import { confirmed, signedTransaction, transferToken } from '../validator/testing.ts';
import { DETECTION_LIMITS, detectDeposits, reserveUsdcDelta } from './deposit-detector.ts';
import { recordConfirmedDeposit } from './deposits.ts';

describe('deposit detection', () => {
  let t: TestService;
  let other: { orgId: string; adminKey: string };

  before(async () => {
    t = await startTestService();
    other = await t.createOrganization('Organisation B');
  });
  after(() => t.close());

  const ctx = () => t.service.ctx;

  const reserveOf = async (orgId: string): Promise<{ reserve: Address; reserveToken: Address }> => {
    const [row] = await ctx().db.query<{ reserve_address: string; reserve_token_address: string }>(
      'SELECT reserve_address, reserve_token_address FROM organizations WHERE id = $1', [orgId]);
    return { reserve: address(row!.reserve_address), reserveToken: address(row!.reserve_token_address) };
  };

  /** Mints local USDC straight to the reserve, as an outside sender would, bypassing the service. */
  const mintToReserve = async (orgId: string, micro: string): Promise<Signature> => {
    const { reserve } = await reserveOf(orgId);
    const signature = await ctx().cheatcodes!.agentVault_mintUsdc(reserve, micro).send();
    const outcome = await ctx().chain.waitForOutcome(signature);
    assert.equal(outcome.err, null);
    return signature;
  };

  const balanceOf = async (key: string): Promise<string> => {
    const response = await t.request('GET', '/v1/organization', { key });
    assert.equal(response.status, 200);
    return response.body.reserve.usdc_balance;
  };

  const depositEvents = (orgId: string) => ctx().db.query<{ payload: { amount: string; tx_signature: string } }>(
    `SELECT payload FROM events WHERE org_id = $1 AND type = 'org.deposit_confirmed' ORDER BY created_at, id`, [orgId]);

  const cursorOf = async (orgId: string): Promise<string | null> =>
    (await ctx().db.query<{ deposit_cursor: string | null }>('SELECT deposit_cursor FROM organizations WHERE id = $1', [orgId]))[0]!
      .deposit_cursor;

  // Guarantee: USDC arriving on the reserve from outside the service is credited once, with one event.
  it('credits USDC minted straight to the reserve once, however often the job runs', async () => {
    const signature = await mintToReserve(other.orgId, '5000000');
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(other.adminKey), '5.00');
    const events = await depositEvents(other.orgId);
    assert.equal(events.length, 1);
    assert.equal(events[0]!.payload.amount, '5.00');
    assert.equal(events[0]!.payload.tx_signature, signature);
    assert.equal(await cursorOf(other.orgId), signature, 'the cursor stands at the newest handled signature');

    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(other.adminKey), '5.00');
    assert.equal((await depositEvents(other.orgId)).length, 1);
  });

  // Guarantee: a plain SPL Token transfer from any holder is a deposit of exactly its amount;
  // a failed transfer is no deposit and does not hold the cursor back.
  it('credits a plain SPL Token transfer from another holder, and ignores a failed one', async () => {
    const { orgId, adminKey } = await t.createOrganization('Transfer target');
    const { reserveToken } = await reserveOf(orgId);
    const rpc = ctx().chain.rpc;
    const holder = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(holder.address, lamports(1_000_000_000n)).send());
    await ctx().chain.waitForOutcome(await ctx().cheatcodes!.agentVault_mintUsdc(holder.address, '2000000').send());
    const source = await ctx().validator!.associatedTokenAddress(holder.address);

    const transfer = await signedTransaction(rpc, holder, [transferToken(source, reserveToken, holder, 1_250_000n)]);
    await rpc.sendTransaction(transfer.wire, { encoding: 'base64' }).send();
    assert.equal((await ctx().chain.waitForOutcome(transfer.signature)).err, null);
    // More than the holder has left: the transaction lands, fails, and moves nothing.
    const failing = await signedTransaction(rpc, holder, [transferToken(source, reserveToken, holder, 9_000_000n)]);
    await rpc.sendTransaction(failing.wire, { encoding: 'base64', skipPreflight: true }).send();
    assert.notEqual((await ctx().chain.waitForOutcome(failing.signature)).err, null);

    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(adminKey), '1.25');
    const events = await depositEvents(orgId);
    assert.deepEqual(events.map((e) => [e.payload.amount, e.payload.tx_signature]), [['1.25', transfer.signature]]);
    assert.equal(await cursorOf(orgId), failing.signature);
  });

  // Guarantee: the test helper and the detector index the same deposit once, in either order.
  it('counts a deposit made through the test helper once', async () => {
    const { orgId, adminKey } = await t.createOrganization('Helper user');
    const response = await t.request('POST', '/v1/test_helpers/deposits', { key: adminKey, body: { amount: '3' } });
    assert.equal(response.status, 200);
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(adminKey), '3.00');
    assert.equal((await depositEvents(orgId)).length, 1);

    // The other order: the detector first, then the helper's own indexing of the same signature.
    const signature = await mintToReserve(orgId, '2000000');
    await t.service.jobs.runOnce();
    await ctx().db.transaction((tx) =>
      recordConfirmedDeposit(tx, ctx().clock.nowMs(), orgId, { amount: 2_000_000n, signature, slot: 1n }));
    assert.equal(await balanceOf(adminKey), '5.00');
    assert.equal((await depositEvents(orgId)).length, 2);
  });

  // Guarantee: a deposit is credited to the organisation whose reserve received it, never another.
  it('never credits one organisation with another one\'s deposit', async () => {
    const a = await t.createOrganization('Isolated A');
    const b = await t.createOrganization('Isolated B');
    const toA = await mintToReserve(a.orgId, '7000000');
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(a.adminKey), '7.00');
    assert.equal(await balanceOf(b.adminKey), '0.00');
    assert.deepEqual(await depositEvents(b.orgId), []);
    const toB = await mintToReserve(b.orgId, '1000000');
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(a.adminKey), '7.00');
    assert.equal(await balanceOf(b.adminKey), '1.00');
    assert.deepEqual((await depositEvents(a.orgId)).map((e) => e.payload.tx_signature), [toA]);
    assert.deepEqual((await depositEvents(b.orgId)).map((e) => e.payload.tx_signature), [toB]);
  });

  // Guarantee: one chain transaction paying several reserves is a deposit for each of them, of
  // the amount its own reserve received (an exchange's batched payout, say).
  it('credits every organisation whose reserve one transaction paid', async () => {
    const a = await t.createOrganization('Batch payee A');
    const b = await t.createOrganization('Batch payee B');
    const rpc = ctx().chain.rpc;
    const holder = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(holder.address, lamports(1_000_000_000n)).send());
    await ctx().chain.waitForOutcome(await ctx().cheatcodes!.agentVault_mintUsdc(holder.address, '5000000').send());
    const source = await ctx().validator!.associatedTokenAddress(holder.address);
    const transfer = await signedTransaction(rpc, holder, [
      transferToken(source, (await reserveOf(a.orgId)).reserveToken, holder, 1_500_000n),
      transferToken(source, (await reserveOf(b.orgId)).reserveToken, holder, 2_250_000n),
    ]);
    await rpc.sendTransaction(transfer.wire, { encoding: 'base64' }).send();
    assert.equal((await ctx().chain.waitForOutcome(transfer.signature)).err, null);

    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(a.adminKey), '1.50');
    assert.equal(await balanceOf(b.adminKey), '2.25');
    assert.deepEqual((await depositEvents(a.orgId)).map((e) => [e.payload.amount, e.payload.tx_signature]), [['1.50', transfer.signature]]);
    assert.deepEqual((await depositEvents(b.orgId)).map((e) => [e.payload.amount, e.payload.tx_signature]), [['2.25', transfer.signature]]);
  });

  // Guarantee: USDC the service itself moved into the reserve (a withdrawal, credited by its
  // settlement) is not counted again as a deposit.
  it('skips the service\'s own transactions', async () => {
    const { orgId, adminKey } = await t.createOrganization('Own moves');
    const signature = await mintToReserve(orgId, '4000000');
    const nowMs = ctx().clock.nowMs();
    await ctx().db.query(
      `INSERT INTO transactions (id, org_id, type, status, amount, tx_signature, created_at, updated_at)
       VALUES ($1, $2, 'withdrawal', 'confirmed', 4000000, $3, $4, $4)`,
      [newId('tx', nowMs), orgId, signature, new Date(nowMs)]);
    await t.service.jobs.runOnce();
    assert.equal(await balanceOf(adminKey), '0.00');
    assert.deepEqual(await depositEvents(orgId), []);
    assert.equal(await cursorOf(orgId), signature, 'handled, not waiting');
  });

  // Guarantee: two detectors running at once index each deposit once.
  it('a chain that does not answer fails the run once, not once per organisation, and leaves every claim free', async () => {
    const refused = () => Promise.reject(Object.assign(new Error('fetch failed'), { cause: Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }) }));
    const rpc = new Proxy({}, { get: () => () => ({ send: refused }) });
    const chain = new Proxy(ctx().chain, { get: (target, property) => (property === 'rpc' ? rpc : Reflect.get(target, property)) });
    const warned: unknown[] = [];
    const log = { warn: (...args: unknown[]) => { warned.push(args); }, info: () => {} } as unknown as TestService['service']['ctx']['log'];
    await assert.rejects(detectDeposits({ ...ctx(), chain, log }), /fetch failed/);
    assert.deepEqual(warned, [], 'no line per organisation: the job runner logs the run\'s failure');
    // Every organisation's claim was given back: a run with the chain answering scans them all.
    assert.ok((await detectDeposits(ctx())).organizations >= 2);
  });

  it('indexes each deposit once with two detectors running at once', async () => {
    const { orgId, adminKey } = await t.createOrganization('Concurrent');
    for (const micro of ['1000000', '2000000', '3000000']) await mintToReserve(orgId, micro);
    const [first, second] = await Promise.all([detectDeposits(ctx()), detectDeposits(ctx())]);
    assert.equal(first.deposits + second.deposits, 3);
    // Released claims: a later run rescans and finds nothing new.
    assert.equal((await detectDeposits(ctx())).deposits, 0);
    assert.equal(await balanceOf(adminKey), '6.00');
    assert.equal((await depositEvents(orgId)).length, 3);
  });

  // Guarantee: even when claims run out at once, so both detectors scan the same organisation
  // together, each deposit is indexed once and the cursor ends at the newest signature.
  it('indexes each deposit once when two detectors scan the same organisation together', async () => {
    const { orgId, adminKey } = await t.createOrganization('Expired claims');
    const sent: Signature[] = [];
    for (const micro of ['1000000', '2000000', '4000000']) sent.push(await mintToReserve(orgId, micro));
    const expiring = { ...DETECTION_LIMITS, claimMs: 0 };
    // Whether the second claim finds the rows still locked by the first (PostgreSQL) or already
    // committed and expired (PGlite runs them in turn) is up to timing; the outcome is not.
    const runs = await Promise.all([detectDeposits(ctx(), expiring), detectDeposits(ctx(), expiring)]);
    assert.equal(runs[0]!.deposits + runs[1]!.deposits, 3);
    assert.equal(await balanceOf(adminKey), '7.00');
    assert.deepEqual((await depositEvents(orgId)).map((e) => e.payload.tx_signature), sent);
    assert.equal(await cursorOf(orgId), sent[2]);
  });

  // Guarantee: more new signatures than one run may read are all handled, oldest first, over
  // several runs, each run bounded.
  it('catches up over several bounded runs when there are more signatures than one run reads', async () => {
    const { orgId, adminKey } = await t.createOrganization('Backlog');
    const sent: Signature[] = [];
    for (let i = 1; i <= 7; i++) sent.push(await mintToReserve(orgId, `${i}000000`));
    const limits = { ...DETECTION_LIMITS, pageSize: 2, pagesPerOrganization: 2 };
    assert.equal((await detectDeposits(ctx(), limits)).deposits, 0, 'the oldest signatures are out of reach of the first run');
    let runs = 1;
    while ((await depositEvents(orgId)).length < 7 && runs < 40) {
      await detectDeposits(ctx(), limits);
      runs += 1;
    }
    const events = await depositEvents(orgId);
    assert.deepEqual(events.map((e) => e.payload.tx_signature), sent, 'every deposit once, oldest first');
    assert.equal(await balanceOf(adminKey), '28.00');
    await detectDeposits(ctx(), limits);
    assert.equal((await depositEvents(orgId)).length, 7);
  });

  it('refuses limits under which a long scan could not progress', async () => {
    await assert.rejects(detectDeposits(ctx(), { ...DETECTION_LIMITS, pagesPerOrganization: 1 }), RangeError);
    await assert.rejects(detectDeposits(ctx(), { ...DETECTION_LIMITS, pageSize: 1001 }), RangeError);
  });
});

describe('reserveUsdcDelta', () => {
  const usdc = 'USDC111111111111111111111111111111111111111';
  const other = 'MINT111111111111111111111111111111111111111';
  const amount = (accountIndex: number, mint: string, value: string) =>
    ({ accountIndex, mint: mint as Address, uiTokenAmount: { amount: value, decimals: 6, uiAmount: null, uiAmountString: value } }) as never;

  it('is post minus pre of the token account, for the USDC mint only', () => {
    const transaction = {
      transaction: { message: { accountKeys: ['payer', 'source', 'reserve'] } },
      meta: {
        preTokenBalances: [amount(2, usdc, '100'), amount(1, usdc, '50')],
        postTokenBalances: [amount(2, usdc, '130'), amount(1, usdc, '20')],
      },
    };
    assert.equal(reserveUsdcDelta(transaction, 'reserve', usdc), 30n);
    assert.equal(reserveUsdcDelta(transaction, 'source', usdc), -30n);
    assert.equal(reserveUsdcDelta(transaction, 'reserve', other), 0n);
    assert.equal(reserveUsdcDelta(transaction, 'absent', usdc), 0n);
  });

  it('counts an account created by the transaction from zero, and loaded addresses after the static keys', () => {
    assert.equal(reserveUsdcDelta({
      transaction: { message: { accountKeys: ['payer'] } },
      meta: {
        loadedAddresses: { writable: ['reserve'], readonly: [] },
        preTokenBalances: [],
        postTokenBalances: [amount(1, usdc, '75')],
      },
    }, 'reserve', usdc), 75n);
    assert.equal(reserveUsdcDelta({ transaction: { message: { accountKeys: ['reserve'] } }, meta: null }, 'reserve', usdc), 0n);
  });
});
