/**
 * The activity feed, wallet states and what the service does on its own — policy expiry,
 * auto-topup, balance.low, alerts — through HTTP on the test clock, each firing exactly once.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test, type TestContext } from 'node:test';
import type { Signature } from '@solana/kit';
import { beforeDeadline } from '../../test/deadline.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { balanceOf, fundedWallet, newPolicy, newRecipient } from '../../test/fixtures.ts';
import { holdLocks, queuedBehind, queuedRequest, withSecondConnection, type HeldLocks } from '../../test/locks.ts';
import { encodeBase58 } from '../chain/base58.ts';
import { ChainUnavailableError } from '../chain/client.ts';
import { AUTO_TOPUP_MEMO, EXPIRY_MARGIN_BLOCKS, insertTransaction, reconcilePending } from '../transactions/settlement.ts';
import { expirePolicies, largeTransactionAlerts, runWalletAutomation, scanAlerts } from './automation.ts';
import { EVENT_TYPES } from '../events/events.ts';

describe('events, wallet states and automation', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  const advance = (seconds: number) => t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } });
  const pay = (walletId: string, amount: string, to?: string) => newRecipient().then((recipient) =>
    t.request('POST', '/v1/payments', { body: { walletId, to: to ?? recipient, amount, currency: 'USDC' } }));
  // A confirmed payment is answered before its settlement's events are written.
  const eventsOf = async (type: string, walletId?: string) => (await t.settled(), await t.request('GET',
    `/v1/events?type=${type}&limit=100${walletId ? `&walletId=${walletId}` : ''}`)).body.data as Array<{
      type: string; severity: string; wallet_id: string | null; summary: string; details: Record<string, unknown>; timestamp: string;
    }>;
  /**
   * The chain's outcome of the vault's auto-topups sent and not settled yet: the automation job
   * sends a topup without waiting for it, and its next run settles what the chain has then.
   */
  const topupsOnChain = async (walletId: string) => {
    const sent = await t.service.ctx.db.query<{ tx_signature: string }>(
      `SELECT tx_signature FROM transactions WHERE wallet_id = $1 AND memo = $2 AND status = 'pending'`, [walletId, AUTO_TOPUP_MEMO]);
    await Promise.all(sent.map((row) => t.service.ctx.chain.waitForOutcome(row.tx_signature as Signature, 10_000)));
  };
  /** `times` runs of every job, each followed by the chain's outcome of the topups it sent for `walletId`. */
  const tick = async (walletId: string, times = 2) => {
    for (let i = 0; i < times; i += 1) {
      await t.service.jobs.runOnce();
      await topupsOnChain(walletId);
    }
  };
  const statusOf = async (walletId: string) => (await t.request('GET', `/v1/wallets/${walletId}`)).body.status;
  const listed = async (status: string, walletId: string) => (await t.request('GET', `/v1/wallets?status=${status}&limit=100`)).body.data
    .some((w: { wallet_id: string }) => w.wallet_id === walletId);

  test('the activity feed filters by type, vault, severity and time, 90 days back at most, organisation only', async () => {
    const wallet = await fundedWallet(t, '5');
    await pay(wallet.wallet_id, '1');
    await t.settled();
    const all = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}`);
    assert.equal(all.status, 200, JSON.stringify(all.body));
    assert.deepEqual(all.body.data.map((e: { type: string }) => e.type),
      ['transaction.completed', 'transaction.pending', 'wallet.funded', 'wallet.created'], 'newest first');
    const aliased = await t.request('GET', `/v1/events?wallet_id=${wallet.wallet_id}`);
    assert.deepEqual(aliased.body.data, all.body.data, 'wallet_id, as SPEC spells it, is walletId');
    const both = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&wallet_id=${wallet.wallet_id}`);
    assert.equal(both.body.error?.param, 'wallet_id');
    const created = all.body.data.at(-1);
    assert.match(created.timestamp, /\.\d{3}Z$/, 'millisecond timestamps');
    assert.equal(created.severity, 'info');
    assert.equal(created.details.wallet_id, wallet.wallet_id);
    assert.ok(created.summary.length > 0, 'a summary text');
    assert.equal((await eventsOf('wallet.funded', wallet.wallet_id)).length, 1);
    assert.equal((await eventsOf('wallet.created,wallet.funded', wallet.wallet_id)).length, 2);
    const page1 = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&limit=3`);
    const page2 = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&limit=3&cursor=${page1.body.next_cursor}`);
    assert.equal(page1.body.has_more, true);
    assert.deepEqual(page2.body.data.map((e: { type: string }) => e.type), ['wallet.created']);
    // A warning (balance.low) and a critical (a manual freeze) of another vault, among infos.
    const low = await fundedWallet(t, '1');
    await t.request('PATCH', `/v1/wallets/${low.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await t.service.jobs.runOnce();
    await t.request('PATCH', `/v1/wallets/${low.wallet_id}`, { body: { status: 'frozen' } });
    const bySeverity = async (severity: string) => ((await t.request('GET', `/v1/events?severity=${severity}&walletId=${low.wallet_id}`)).body.data as
      Array<{ type: string; severity: string }>).map((e) => [e.type, e.severity]);
    assert.deepEqual(await bySeverity('warning'), [['balance.low', 'warning']]);
    assert.deepEqual(await bySeverity('critical'), [['wallet.frozen', 'critical']]);
    assert.deepEqual(await bySeverity('info'), [['wallet.funded', 'info'], ['wallet.created', 'info']]);
    const future = await t.request('GET', `/v1/events?from=${new Date(t.service.ctx.clock.nowMs() + 60_000).toISOString()}`);
    assert.deepEqual(future.body.data, []);
    // A `to` alone, before the horizon: nothing, not a complaint about a `from` never sent.
    const toOnly = await t.request('GET', '/v1/events?to=2020-01-01T00:00:00Z');
    assert.equal(toOnly.status, 200, JSON.stringify(toOnly.body));
    assert.deepEqual(toOnly.body.data, []);
    // Every event type named, some twice: a filter, not a refusal.
    const everyType = [...EVENT_TYPES, ...EVENT_TYPES.slice(0, 3)].join(',');
    const typed = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&type=${everyType}`);
    assert.equal(typed.status, 200, JSON.stringify(typed.body));
    assert.equal(typed.body.data.length, 4);
    // "The last 90 days" as a client computes it, a moment before the service reads its clock, and
    // anything earlier: the feed starts where it ends, 90 days back.
    for (const days of [90, 91, 3650]) {
      const since = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&from=${new Date(t.service.ctx.clock.nowMs() - days * 86_400_000).toISOString()}`);
      assert.equal(since.status, 200, JSON.stringify(since.body));
      assert.equal(since.body.data.length, 4, `${days} days back`);
    }
    for (const [query, param] of [
      ['type=payment.made', 'type'], ['from=2026-01-01T00:00:00', 'from'], ['severity=loud', 'severity'],
      ['from=2026-04-02&to=2026-04-01', 'to'], ['from=0000-01-01', 'from'], [`to=${encodeURIComponent('9999-12-31T23:00:00-02:00')}`, 'to'],
      ['walletId=%00', 'wallet_id'],
    ]) {
      const response = await t.request('GET', `/v1/events?${query}`);
      assert.equal(response.status, 400, query);
      assert.equal(response.body.error.code, 'invalid_request');
      assert.equal(response.body.error.param, param, query);
    }
    const other = await t.createOrganization();
    const theirs = await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}`, { key: other.adminKey });
    assert.equal(theirs.status, 404, 'another organisation\'s vault answers as a missing one');
    assert.equal(theirs.body.error.code, 'wallet_not_found');
    assert.deepEqual((await t.request('GET', '/v1/events', { key: other.adminKey })).body.data
      .filter((e: { wallet_id: string | null }) => e.wallet_id === wallet.wallet_id), [], 'another organisation sees none of them');
    const unknown = await t.request('GET', '/v1/events?walletId=wal_typo');
    assert.equal(unknown.status, 404, 'a mistyped vault id is not an empty feed');
    assert.equal(unknown.body.error.code, 'wallet_not_found');
  });

  test('events older than 90 days are deleted by the retention job', async () => {
    const wallet = await fundedWallet(t, '1');
    await advance(91 * 24 * 3600);
    await t.service.jobs.runOnce();
    const [{ count }] = await t.service.ctx.db.query<{ count: number }>(
      'SELECT COUNT(*)::int AS count FROM events WHERE wallet_id = $1', [wallet.wallet_id]) as [{ count: number }];
    assert.equal(count, 0);
  });

  test('wallet states: unfunded at zero after holding money, idle after 7 days without a transaction; both listed', async () => {
    const wallet = await fundedWallet(t, '2');
    assert.equal(await statusOf(wallet.wallet_id), 'active');
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    assert.equal(await statusOf(wallet.wallet_id), 'unfunded');
    assert.equal(await listed('unfunded', wallet.wallet_id), true, 'listed as unfunded');
    assert.equal(await listed('active', wallet.wallet_id), false, 'not as active');
    const busy = await fundedWallet(t, '2');
    await advance(7 * 24 * 3600 + 1);
    assert.equal(await statusOf(busy.wallet_id), 'idle');
    assert.equal(await listed('idle', busy.wallet_id), true, 'listed as idle');
    assert.equal((await pay(busy.wallet_id, '1')).status, 200);
    assert.equal(await statusOf(busy.wallet_id), 'active', 'a transaction makes it active again');
    const fresh = await t.request('POST', '/v1/wallets', { body: { agentId: `fresh-${process.pid}`, label: 'Fresh', policyId: 'pol_permissive' } });
    assert.equal(fresh.body.status, 'active', 'a new vault is active at 0.00 (SPEC)');
  });

  test('a policy\'s expiry freezes its vaults once and writes policy.expired', async () => {
    const expiry = new Date(t.service.ctx.clock.nowMs() + 3_600_000).toISOString();
    const policyId = await newPolicy(t, { expiry });
    const [a, b] = [await fundedWallet(t, '3', policyId), await fundedWallet(t, '3', policyId)];
    await t.service.jobs.runOnce();
    assert.equal(await statusOf(a.wallet_id), 'active', 'not before its time');
    await advance(3601);
    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    assert.equal(await statusOf(a.wallet_id), 'frozen');
    assert.equal(await statusOf(b.wallet_id), 'frozen');
    const expired = (await eventsOf('policy.expired')).filter((e) => e.details.policy_id === policyId);
    assert.equal(expired.length, 1, 'written once');
    assert.equal(expired[0]!.severity, 'warning');
    assert.deepEqual([...(expired[0]!.details.frozen_wallets as string[])].sort(), [a.wallet_id, b.wallet_id].sort());
    const frozen = await eventsOf('wallet.frozen', a.wallet_id);
    assert.equal(frozen[0]!.details.reason, 'policy_expired');
    assert.equal(frozen[0]!.severity, 'warning', 'not a manual freeze');
    const payment = await pay(a.wallet_id, '1');
    assert.equal(payment.body.error.code, 'wallet_frozen');
    const vault = await t.service.ctx.chain.getVault((await import('@solana/kit')).address(a.chain_address));
    assert.equal(vault!.frozen, true, 'frozen on chain too');
  });

  test('a vault moved to a policy while its expiry passes and the job runs is refused, not left active on it', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const policyId = await newPolicy(t, { expiry: new Date(t.service.ctx.clock.nowMs() + 3_600_000).toISOString() });
      const wallet = await fundedWallet(t, '3');
      // The move waits for the vault's lock; meanwhile the expiry passes and the job freezes the policy's vaults.
      const held = await holdLocks(other, (tx) => tx.query('SELECT 1 FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]));
      const moved = await queuedRequest(t.service.ctx.db, held,
        () => t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { policyId } }),
        async () => {
          await advance(3601);
          assert.equal(await expirePolicies(t.service.ctx), 1);
        });
      assert.equal(moved.status, 400, JSON.stringify(moved.body));
      assert.equal(moved.body.error.param, 'policy_id');
      const after = await t.request('GET', `/v1/wallets/${wallet.wallet_id}`);
      assert.equal(after.body.policy.policy_id, 'pol_permissive', 'left on its policy');
      assert.equal(after.body.status, 'active');
    });
  });

  test('an expiry moved later is a new expiry, which freezes again; an expired policy takes no vault', async () => {
    const inAnHour = () => new Date(t.service.ctx.clock.nowMs() + 3_600_000).toISOString();
    const policyId = await newPolicy(t, { expiry: inAnHour() });
    const a = await fundedWallet(t, '3', policyId);
    await advance(3601);
    await t.service.jobs.runOnce();
    assert.equal(await statusOf(a.wallet_id), 'frozen');
    const expiredEvents = async () => (await eventsOf('policy.expired')).filter((e) => e.details.policy_id === policyId);
    assert.equal((await expiredEvents()).length, 1);

    const refused = await t.request('POST', '/v1/wallets', { body: { agentId: `late-${process.pid}`, label: 'Late', policyId } });
    assert.equal(refused.status, 400, JSON.stringify(refused.body));
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.equal(refused.body.error.param, 'policy_id');
    assert.equal((await t.request('GET', `/v1/wallets?limit=100`)).body.data.some((w: { agent_id: string }) => w.agent_id === `late-${process.pid}`),
      false, 'no vault was created');
    const other = await fundedWallet(t, '3');
    const moved = await t.request('PATCH', `/v1/wallets/${other.wallet_id}`, { body: { policyId } });
    assert.equal(moved.status, 400, JSON.stringify(moved.body));
    assert.equal(moved.body.error.param, 'policy_id');
    assert.equal((await t.request('GET', `/v1/wallets/${other.wallet_id}`)).body.policy.policy_id, 'pol_permissive', 'left on its policy');

    assert.equal((await t.request('PATCH', `/v1/policies/${policyId}`, { body: { expiry: inAnHour() } })).status, 200);
    assert.equal((await t.request('PATCH', `/v1/wallets/${a.wallet_id}`, { body: { status: 'active' } })).status, 200);
    assert.equal((await t.request('PATCH', `/v1/wallets/${other.wallet_id}`, { body: { policyId } })).status, 200, 'not expired now');
    await t.service.jobs.runOnce();
    assert.equal(await statusOf(a.wallet_id), 'active', 'not before the new expiry');
    await advance(3601);
    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    assert.equal(await statusOf(a.wallet_id), 'frozen', 'frozen again by the new expiry');
    assert.equal(await statusOf(other.wallet_id), 'frozen');
    const events = await expiredEvents();
    assert.equal(events.length, 2, 'once per expiry');
    assert.deepEqual([...(events[0]!.details.frozen_wallets as string[])].sort(), [a.wallet_id, other.wallet_id].sort());
  });

  test('auto-topup funds once per crossing; a reserve too small raises balance.low instead, never a loop', async () => {
    const wallet = await fundedWallet(t, '10');
    const set = await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`, { body: { enabled: true, triggerBelow: '5', topupAmount: '10' } });
    assert.equal(set.status, 200, JSON.stringify(set.body));
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '10' } });
    assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
    await tick(wallet.wallet_id, 3);
    assert.equal(await balanceOf(t, wallet.wallet_id), '14.00', '4.00 + one topup of 10.00');
    const funded = await eventsOf('wallet.funded', wallet.wallet_id);
    assert.deepEqual(funded.map((e) => e.details.source), ['auto_topup', 'reserve']);
    assert.deepEqual(funded.map((e) => e.summary), [
      'Wallet Agent topped up automatically with 10.00 USDC from the reserve (auto-topup)', 'Wallet Agent funded with 10.00 USDC from the reserve',
    ], 'an auto-topup is told apart from a funding in the feed too');

    const reserve = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance;
    const hungry = await fundedWallet(t, '6');
    await t.request('PUT', `/v1/wallets/${hungry.wallet_id}/auto-topup`, { body: { enabled: true, triggerBelow: '5', topupAmount: '100000' } });
    await pay(hungry.wallet_id, '2');
    for (let i = 0; i < 3; i += 1) await t.service.jobs.runOnce();
    const low = await eventsOf('balance.low', hungry.wallet_id);
    assert.equal(low.length, 1, 'said once');
    assert.equal(low[0]!.details.reason, 'auto_topup_reserve_insufficient');
    assert.equal(low[0]!.details.current_balance, '4.00');
    assert.equal(low[0]!.summary,
      `Auto-topup of 100000.00 USDC for wallet Agent not funded: the reserve holds ${low[0]!.details.org_balance} USDC (wallet balance 4.00 USDC, below 5.00 USDC)`,
      'told apart from the vault\'s own low-balance warning');
    assert.equal(await balanceOf(t, hungry.wallet_id), '4.00');
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, reserve, 'the reserve was not touched');

    // Turned on for a vault already below the trigger: topped up at the next tick, once, with the
    // reserve holding enough for three (so that only the latch stops the second).
    const low2 = await fundedWallet(t, '1');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '9' } });
    const reserveBefore = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance;
    assert.equal((await t.request('PUT', `/v1/wallets/${low2.wallet_id}/auto-topup`,
      { body: { enabled: true, triggerBelow: '5', topupAmount: '3' } })).status, 200);
    await tick(low2.wallet_id, 3);
    assert.equal(await balanceOf(t, low2.wallet_id), '4.00', 'one topup, though 4.00 is still below the trigger');
    assert.equal(Number((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance), Number(reserveBefore) - 3);
  });

  // The guarantee: a topup is sent again while its outcome has not come, so one the chain took
  // and lost (a node restarted before its slot) lands once the chain has it, in seconds, rather
  // than failing when its blockhash expires.
  test('an auto-topup the chain took and lost is sent again and lands', async () => {
    const wallet = await fundedWallet(t, '10');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '10' } });
    assert.equal((await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
      { body: { enabled: true, triggerBelow: '5', topupAmount: '10' } })).status, 200);
    assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    // As on a chain of its own (AGENT_VAULT_RPC_URL): the embedded validator loses what it took
    // only with the process.
    const external = chain as { embedded: boolean };
    external.embedded = false;
    chain.submit = async () => { chain.submit = submit; }; // "taken": answered, and never run
    let landed: boolean | null;
    try {
      await runWalletAutomation(t.service.ctx);
      landed = await beforeDeadline((async () => {
        while (await balanceOf(t, wallet.wallet_id) !== '14.00') await new Promise((resolve) => setTimeout(resolve, 50));
        return true;
      })(), 10_000);
    } finally {
      chain.submit = submit;
      external.embedded = true;
    }
    assert.ok(landed, 'topped up within seconds');
    const topups = await t.service.ctx.db.query<{ status: string }>(
      'SELECT status FROM transactions WHERE wallet_id = $1 AND memo = $2', [wallet.wallet_id, AUTO_TOPUP_MEMO]);
    assert.deepEqual(topups.map((row) => row.status), ['confirmed'], 'one topup, confirmed');
  });

  // The guarantee: workers on one database that run the automation job at the same moment make a
  // vault's topup once. Both read the vault as due; its latch, taken again under the vault's lock
  // in the funding's transaction, lets one through.
  test('two automation runs at once (two workers) make one topup', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const wallet = await fundedWallet(t, '10');
      await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '30' } });
      assert.equal((await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
        { body: { enabled: true, triggerBelow: '5', topupAmount: '10' } })).status, 200);
      assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
      const reserveBefore = Number((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance);
      // The vault held elsewhere until both runs wait for it, so both have read it as due.
      const held = await holdLocks(other, (tx) => tx.query('SELECT 1 FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]));
      let runs: Array<ReturnType<typeof runWalletAutomation>>;
      try {
        runs = [runWalletAutomation(t.service.ctx), runWalletAutomation(t.service.ctx)];
        await queuedBehind(other, held.pid, 2);
      } finally {
        held.release();
        await held.done;
      }
      const done = await Promise.all(runs);
      assert.equal(done.reduce((sum, run) => sum + run.topups, 0), 1, 'one topup between the two runs');
      await tick(wallet.wallet_id);
      assert.equal(await balanceOf(t, wallet.wallet_id), '14.00');
      assert.equal(Number((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance), reserveBefore - 10);
      const sources = (await eventsOf('wallet.funded', wallet.wallet_id)).map((e) => e.details.source);
      assert.equal(sources.filter((source) => source === 'auto_topup').length, 1);
    });
  });

  test('a latch re-arms when the balance comes back, even if it falls again before the next tick', async () => {
    // Topped up, then spent below the trigger again before the job looks: topped up again.
    const wallet = await fundedWallet(t, '9');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '30' } });
    assert.equal((await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
      { body: { enabled: true, triggerBelow: '10', topupAmount: '10' } })).status, 200);
    await tick(wallet.wallet_id);
    assert.equal(await balanceOf(t, wallet.wallet_id), '19.00');
    assert.equal((await pay(wallet.wallet_id, '10')).status, 200);
    await tick(wallet.wallet_id);
    assert.equal(await balanceOf(t, wallet.wallet_id), '19.00', 'a second topup');
    const sources = (await eventsOf('wallet.funded', wallet.wallet_id)).map((e) => e.details.source);
    assert.equal(sources.filter((source) => source === 'auto_topup').length, 2);

    // Turned off and on again while still below the trigger: a new episode, topped up again.
    const low = await fundedWallet(t, '1');
    const setTopup = (enabled: boolean) => t.request('PUT', `/v1/wallets/${low.wallet_id}/auto-topup`,
      { body: { enabled, triggerBelow: '5', topupAmount: '1' } });
    assert.equal((await setTopup(true)).status, 200);
    await tick(low.wallet_id, 3);
    assert.equal(await balanceOf(t, low.wallet_id), '2.00', 'once, though still below the trigger');
    assert.equal((await setTopup(false)).status, 200);
    assert.equal((await setTopup(true)).status, 200);
    await tick(low.wallet_id);
    assert.equal(await balanceOf(t, low.wallet_id), '3.00', 'again once turned on again');

    // balance.low: funded back above the threshold and spent below it between two ticks.
    const watched = await fundedWallet(t, '10');
    await t.request('PATCH', `/v1/wallets/${watched.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await pay(watched.wallet_id, '6');
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', watched.wallet_id)).length, 1);
    assert.equal((await t.request('POST', `/v1/wallets/${watched.wallet_id}/fund`, { body: { amount: '5' } })).status, 200);
    await pay(watched.wallet_id, '5');
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', watched.wallet_id)).length, 2, 'the crossing after the funding is told too');
  });

  test('a fall below the threshold that a funding undid before the job looked is told, with the balance it left', async () => {
    const wallet = await fundedWallet(t, '10');
    assert.equal((await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '19' } })).status, 200);
    await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    assert.equal((await pay(wallet.wallet_id, '7')).status, 200);
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '7' } })).status, 200);
    await t.service.jobs.runOnce();
    const told = await eventsOf('balance.low', wallet.wallet_id);
    assert.deepEqual(told.map((e) => [e.details.current_balance, e.details.threshold]), [['3.00', '5.00']]);
    assert.deepEqual(told.map((e) => e.summary), ['Wallet Agent\'s balance 3.00 USDC is below 5.00 USDC']);
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', wallet.wallet_id)).length, 1, 'told once');
    // Not latched by that telling: the balance was back, so the next fall is told too.
    assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
    await t.service.jobs.runOnce();
    assert.deepEqual((await eventsOf('balance.low', wallet.wallet_id)).map((e) => e.details.current_balance), ['4.00', '3.00']);
    // Setting the threshold starts afresh: a fall noted under the old one is not told.
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '6' } })).status, 200);
    assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
    assert.equal((await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '6' } })).status, 200);
    await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', wallet.wallet_id)).length, 2);
  });

  /** One run of every job while the database refuses balance.low events, as a full disk or a lost connection would. */
  const runJobsRefusingBalanceLowEvents = async () => {
    const db = t.service.ctx.db;
    await db.query(`CREATE FUNCTION refuse_balance_low() RETURNS TRIGGER LANGUAGE plpgsql AS $$
      BEGIN IF NEW.type = 'balance.low' THEN RAISE EXCEPTION 'refused for the test'; END IF; RETURN NEW; END $$`);
    await db.query('CREATE TRIGGER refuse_balance_low BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse_balance_low()');
    try {
      await t.service.jobs.runOnce();
    } finally {
      await db.query('DROP TRIGGER refuse_balance_low ON events');
      await db.query('DROP FUNCTION refuse_balance_low()');
    }
  };

  test('a latch and its event are written together: an event that cannot be written leaves the latch unset', async () => {
    const wallet = await fundedWallet(t, '10');
    await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await pay(wallet.wallet_id, '6');
    await runJobsRefusingBalanceLowEvents();
    assert.equal((await eventsOf('balance.low', wallet.wallet_id)).length, 0);
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', wallet.wallet_id)).length, 1, 'told at the next tick: the crossing was not lost');
  });

  test('an auto-topup the reserve cannot cover is told even if the first telling fails', async () => {
    const wallet = await fundedWallet(t, '6');
    const reserve = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance as string;
    assert.equal((await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`, {
      body: { enabled: true, triggerBelow: '5', topupAmount: String(Number(reserve) + 1_000_000) },
    })).status, 200);
    await pay(wallet.wallet_id, '2');
    await runJobsRefusingBalanceLowEvents();
    assert.equal((await eventsOf('balance.low', wallet.wallet_id)).length, 0);
    for (let i = 0; i < 3; i += 1) await t.service.jobs.runOnce();
    const told = await eventsOf('balance.low', wallet.wallet_id);
    assert.deepEqual(told.map((e) => e.details.reason), ['auto_topup_reserve_insufficient'], 'told once, at the next tick');
    assert.equal(await balanceOf(t, wallet.wallet_id), '4.00');
  });

  // Guarantee: a vault whose topup the reserve could not cover is topped up as soon as the
  // reserve can (an operator's deposit), not left below its trigger until its balance happens to
  // come back; and the shortfall is told once, however many ticks find the reserve still short.
  test('an auto-topup the reserve could not cover is made once a deposit covers it; the shortfall is told once', async () => {
    const { adminKey: key } = await t.createOrganization('Short reserve');
    const deposit = async (amount: string) => {
      const deposited = await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount } });
      assert.equal(deposited.status, 200, JSON.stringify(deposited.body));
    };
    const reserve = async () => (await t.request('GET', '/v1/organization', { key })).body.reserve.usdc_balance as string;
    const eventsOfVault = async (type: string) => (await t.settled(), await t.request('GET',
      `/v1/events?type=${type}&walletId=${wallet.wallet_id}&limit=100`, { key })).body.data as Array<{ details: Record<string, unknown> }>;

    const wallet = await fundedWallet(t, '15', 'pol_permissive', key); // the whole reserve, into the vault
    const other = await fundedWallet(t, '1', 'pol_permissive', key);
    await deposit('20');
    const set = await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
      { key, body: { enabled: true, triggerBelow: '10', topupAmount: '50' } });
    assert.equal(set.status, 200, JSON.stringify(set.body));
    const paid = await t.request('POST', '/v1/payments',
      { key, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '10', currency: 'USDC' } });
    assert.equal(paid.status, 200, JSON.stringify(paid.body));
    await tick(wallet.wallet_id, 3);
    assert.equal(await balanceOf(t, wallet.wallet_id, key), '5.00', 'the reserve (20.00) cannot cover 50.00');
    const shortfall = [['auto_topup_reserve_insufficient', '5.00', '50.00', '20.00']];
    const told = async () => (await eventsOfVault('balance.low'))
      .map((e) => [e.details.reason, e.details.current_balance, e.details.topup_amount, e.details.org_balance]);
    assert.deepEqual(await told(), shortfall);

    await deposit('10');
    await tick(wallet.wallet_id, 3);
    assert.equal(await balanceOf(t, wallet.wallet_id, key), '5.00', 'still short (30.00): nothing made');
    assert.deepEqual(await told(), shortfall, 'nor told again');

    // A deposit covers it, but another funding spends the reserve between the job's look and the
    // topup's funding (held as the topup is being signed): refused again, and not told again.
    await deposit('1000');
    const { chain } = t.service.ctx;
    const prepare = chain.prepare;
    let tried = false;
    chain.prepare = async (...args: Parameters<typeof prepare>) => {
      chain.prepare = prepare;
      tried = true;
      const spent = await t.request('POST', `/v1/wallets/${other.wallet_id}/fund`, { key, body: { amount: '1000' } });
      assert.equal(spent.status, 200, JSON.stringify(spent.body));
      return prepare.apply(chain, args);
    };
    try {
      assert.deepEqual(await runWalletAutomation(t.service.ctx), { topups: 0, lowBalance: 0 });
    } finally {
      chain.prepare = prepare;
    }
    assert.equal(tried, true, 'the reserve covered it: the topup was tried again');
    assert.equal(await reserve(), '30.00', 'the other funding took it');
    assert.deepEqual(await told(), shortfall, 'the same shortfall: not told again');

    await deposit('100');
    await tick(wallet.wallet_id, 3);
    assert.equal(await balanceOf(t, wallet.wallet_id, key), '55.00', '5.00 + one topup of 50.00');
    assert.equal(await reserve(), '80.00');
    assert.deepEqual((await eventsOfVault('wallet.funded')).map((e) => e.details.source), ['auto_topup', 'reserve']);
    assert.deepEqual(await told(), shortfall, 'one balance.low for the whole shortfall');
  });

  // Guarantee: auto-topup set again (turned off and on, or given another trigger) while the
  // vault's topup is still on its way to the chain starts no second topup: the vault would be paid
  // twice for one crossing. The topup is held deterministically at its submission to the chain,
  // recorded pending with its latch taken, while the settings change and the job runs again.
  test('auto-topup set again while its topup is in flight pays one topup, not two', async () => {
    const { ctx } = t.service;
    const wallet = await fundedWallet(t, '10');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '30' } });
    const setTopup = async (enabled: boolean, triggerBelow: string) => {
      const set = await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`, { body: { enabled, triggerBelow, topupAmount: '10' } });
      assert.equal(set.status, 200, JSON.stringify(set.body));
    };
    await setTopup(true, '5');
    assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
    const submit = ctx.chain.submit;
    let reached!: () => void;
    const inFlight = new Promise<void>((resolve) => { reached = resolve; });
    let letGo!: () => void;
    const gate = new Promise<void>((resolve) => { letGo = resolve; });
    ctx.chain.submit = async (...args: Parameters<typeof submit>) => {
      ctx.chain.submit = submit;
      reached();
      await gate;
      return submit.apply(ctx.chain, args);
    };
    let first: ReturnType<typeof runWalletAutomation> | undefined;
    try {
      first = runWalletAutomation(ctx);
      await inFlight;
      await setTopup(false, '5');
      await setTopup(true, '5');
      assert.deepEqual(await runWalletAutomation(ctx), { topups: 0, lowBalance: 0 }, 'turned off and on: no second topup');
      await setTopup(true, '6');
      assert.deepEqual(await runWalletAutomation(ctx), { topups: 0, lowBalance: 0 }, 'another trigger: no second topup');
      letGo();
      assert.deepEqual(await first, { topups: 1, lowBalance: 0 });
    } finally {
      ctx.chain.submit = submit;
      letGo();
      await first?.catch(() => {});
    }
    await tick(wallet.wallet_id);
    assert.equal(await balanceOf(t, wallet.wallet_id), '14.00', '4.00 + one topup of 10.00');
    const sources = (await eventsOf('wallet.funded', wallet.wallet_id)).map((e) => e.details.source);
    assert.deepEqual(sources, ['auto_topup', 'reserve']);
  });

  /**
   * Runs `check` with a vault at 4.00, below its trigger of 5.00 with a topup of `topupAmount`
   * due, and a run of the automation whose funding waits for the reserve's lock (as lockReserve
   * takes it), held on a second connection: the run has read its candidates and taken nothing
   * yet. `check` lets the lock go (`held.release()`); whatever happens, it is let go after.
   * PostgreSQL only (PGlite has one connection).
   */
  const withTopupHeldAtReserve = async (context: TestContext, topupAmount: string, check: (topup: {
    wallet: { wallet_id: string }; held: HeldLocks; automation: ReturnType<typeof runWalletAutomation>;
    setTopup(amount: string): ReturnType<TestService['request']>;
  }) => Promise<void>) => withSecondConnection(t, context, async (other) => {
    const db = t.service.ctx.db;
    let held: HeldLocks | undefined;
    try {
      const wallet = await fundedWallet(t, '10');
      await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '10' } });
      const setTopup = (amount: string) => t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
        { body: { enabled: true, triggerBelow: '5', topupAmount: amount } });
      assert.equal((await setTopup(topupAmount)).status, 200);
      assert.equal((await pay(wallet.wallet_id, '6')).status, 200);
      const [{ org_id: orgId }] = await db.query<{ org_id: string }>('SELECT org_id FROM wallets WHERE id = $1', [wallet.wallet_id]) as [{ org_id: string }];
      held = await holdLocks(other, (tx) => tx.query('SELECT id FROM organizations WHERE id = $1 FOR NO KEY UPDATE', [orgId]));
      const automation = runWalletAutomation(t.service.ctx);
      await queuedBehind(db, held.pid, 1);
      await check({ wallet, held, automation, setTopup });
    } finally {
      held?.release();
      await held?.done.catch(() => {});
    }
  });

  // Guarantee: a process killed in the middle of an auto-topup loses no topup. The topup is held
  // half way (its funding waits for the reserve's lock, which the test holds); at that moment the
  // vault must not be marked as topped up, or a process killed then would never top it up.
  test('an auto-topup held half way has not taken its latch: a kill there loses no topup', (context) =>
    withTopupHeldAtReserve(context, '10', async ({ wallet, held, automation }) => {
      const [state] = await t.service.ctx.db.query<{ latched: boolean; fundings: number }>(
        `SELECT topup_fired_at IS NOT NULL AS latched,
           (SELECT count(*)::int FROM transactions WHERE wallet_id = $1 AND type = 'funding' AND memo = 'auto-topup') AS fundings
         FROM wallets WHERE id = $1`, [wallet.wallet_id]);
      assert.deepEqual({ ...state }, { latched: false, fundings: 0 }, 'nothing of the topup is written until its funding is');
      held.release();
      await held.done;
      assert.deepEqual(await automation, { topups: 1, lowBalance: 0 });
      await topupsOnChain(wallet.wallet_id);
      await runWalletAutomation(t.service.ctx);
      assert.equal(await balanceOf(t, wallet.wallet_id), '14.00', '4.00 + one topup of 10.00');
    }));

  test('an auto-topup amount changed while the topup waits for the reserve: the new amount is funded, not the one read before', (context) =>
    withTopupHeldAtReserve(context, '10', async ({ wallet, held, automation, setTopup }) => {
      assert.equal((await setTopup('3')).status, 200, 'the same trigger, a smaller amount');
      held.release();
      await held.done;
      assert.deepEqual(await automation, { topups: 0, lowBalance: 0 }, 'the amount read before is not funded');
      await runWalletAutomation(t.service.ctx);
      await topupsOnChain(wallet.wallet_id);
      await runWalletAutomation(t.service.ctx);
      assert.equal(await balanceOf(t, wallet.wallet_id), '7.00', '4.00 + one topup of 3.00');
    }));

  // Guarantee: an auto-topup recorded but never sent (its process died right after recording it)
  // gives its amount back to the reserve once it expires, and the vault is topped up again —
  // unless a later topup of the vault holds the latch by then: then nothing more is made.
  test('an auto-topup funding that never ran is settled failed and tried again, once', async () => {
    const db = t.service.ctx.db;
    const reserveMicro = async () => (await db.query<{ reserve_balance: bigint }>(
      'SELECT reserve_balance FROM organizations WHERE id = (SELECT org_id FROM wallets WHERE id = $1)', [lost.wallet_id]))[0]!.reserve_balance;
    const fundingsOf = async (walletId: string) => (await db.query<{ status: string; failure_reason: string | null }>(
      'SELECT status, failure_reason FROM transactions WHERE wallet_id = $1 AND memo = $2 ORDER BY created_at', [walletId, AUTO_TOPUP_MEMO]))
      .map((row) => [row.status, row.failure_reason]);
    /**
     * What the automation writes when it records a topup of 10.00 (the funding pending, the reserve
     * debited, the latch taken), as a process that died before sending it leaves it: a signature
     * the chain never saw; `expired`: its last valid block long past, recorded a minute ago.
     */
    const recordTopup = async (walletId: string, expired: boolean) => {
      const [{ org_id: orgId, chain_address: chainAddress }] = await db.query<{ org_id: string; chain_address: string }>(
        'SELECT org_id, chain_address FROM wallets WHERE id = $1', [walletId]) as [{ org_id: string; chain_address: string }];
      const height = await t.service.ctx.chain.getBlockHeight();
      const recordedMs = t.service.ctx.clock.nowMs() - (expired ? 60_000 : 0);
      await db.transaction(async (tx) => {
        await insertTransaction(tx, recordedMs, {
          orgId, walletId, type: 'funding', amount: 10_000_000n, recipient: chainAddress, memo: AUTO_TOPUP_MEMO,
          signature: encodeBase58(randomBytes(64)), lastValidBlockHeight: expired ? height - EXPIRY_MARGIN_BLOCKS - 1n : height + 1_000n,
        });
        await tx.query('UPDATE organizations SET reserve_balance = reserve_balance - 10000000 WHERE id = $1', [orgId]);
        await tx.query(`UPDATE wallets SET auto_topup_enabled = true, auto_topup_trigger_below = 5000000, auto_topup_amount = 10000000,
          topup_fired_at = $2 WHERE id = $1`, [walletId, new Date(recordedMs)]);
      });
    };

    const lost = await fundedWallet(t, '10');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '40' } });
    assert.equal((await pay(lost.wallet_id, '6')).status, 200);
    const before = await reserveMicro();
    await recordTopup(lost.wallet_id, true);
    await tick(lost.wallet_id); // the reconciler fails it; the automation, later in the same run, tops up
    assert.deepEqual(await fundingsOf(lost.wallet_id), [['failed', 'Expired'], ['confirmed', null]]);
    assert.equal(await balanceOf(t, lost.wallet_id), '14.00', '4.00 + one topup of 10.00');
    assert.equal(await reserveMicro(), before - 10_000_000n, 'the expired topup\'s amount came back; the real one was taken');

    // The lost topup's latch was re-armed and taken again by a later topup, still in flight when
    // the lost one expires: the later one keeps it, and no third topup is made.
    const later = await fundedWallet(t, '10');
    assert.equal((await pay(later.wallet_id, '6')).status, 200);
    await recordTopup(later.wallet_id, true);
    await recordTopup(later.wallet_id, false);
    await reconcilePending(t.service.ctx);
    await runWalletAutomation(t.service.ctx);
    assert.deepEqual(await fundingsOf(later.wallet_id), [['failed', 'Expired'], ['pending', null]]);

    // The operator empties the vault (to archive it) while the lost topup waits to expire: the
    // withdrawal's latch is its own, and the expiry does not free it to refill the vault.
    const emptied = await fundedWallet(t, '10');
    assert.equal((await pay(emptied.wallet_id, '6')).status, 200);
    await recordTopup(emptied.wallet_id, true);
    const withdrawn = await t.request('POST', `/v1/wallets/${emptied.wallet_id}/withdraw`, { body: { amount: 'all' } });
    assert.equal(withdrawn.body.status, 'confirmed', JSON.stringify(withdrawn.body));
    await tick(emptied.wallet_id);
    assert.deepEqual(await fundingsOf(emptied.wallet_id), [['failed', 'Expired']], 'no topup after the withdrawal');
    assert.equal(await balanceOf(t, emptied.wallet_id), '0.00');
    assert.equal((await t.request('DELETE', `/v1/wallets/${emptied.wallet_id}`)).status, 200, 'it can be archived');
  });

  /** An organisation of its own, its reserve holding `reserve`, with `count` vaults of 10.00 whose auto-topup (10.00 below 5.00) a payment of 6.00 made due. */
  const dueVaults = async (name: string, count: number, reserve: string) => {
    const { adminKey: key } = await t.createOrganization(name);
    const ids: string[] = [];
    for (let i = 0; i < count; i += 1) {
      const wallet = await fundedWallet(t, '10', 'pol_permissive', key);
      const set = await t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`,
        { key, body: { enabled: true, triggerBelow: '5', topupAmount: '10' } });
      assert.equal(set.status, 200, JSON.stringify(set.body));
      const paid = await t.request('POST', '/v1/payments',
        { key, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '6', currency: 'USDC' } });
      assert.equal(paid.status, 200, JSON.stringify(paid.body));
      ids.push(wallet.wallet_id);
    }
    assert.equal((await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount: reserve } })).status, 200);
    return { key, ids };
  };
  const topupsOf = async (ids: string[]) => t.service.ctx.db.query<{ wallet_id: string; status: string; tx_signature: string }>(
    'SELECT wallet_id, status, tx_signature FROM transactions WHERE wallet_id = ANY($1) AND memo = $2 ORDER BY wallet_id', [ids, AUTO_TOPUP_MEMO]);

  // Guarantee: one run of the job records and sends every due vault's topup without waiting for
  // the chain to confirm any (the next run settles them): a run costs no slot per vault, so a
  // chain slow to confirm holds up neither the other vaults' topups nor balance.low.
  test('one run sends every due vault\'s topup without waiting for any to confirm; the next run settles them', async () => {
    const { ctx } = t.service;
    const { key, ids } = await dueVaults('Many topups', 3, '30');
    await runWalletAutomation(ctx);
    const sent = await topupsOf(ids);
    assert.deepEqual(sent.map((row) => [row.wallet_id, row.status]), ids.sort().map((id) => [id, 'pending']),
      'every topup recorded and sent, none waited for');
    assert.equal((await t.request('GET', '/v1/organization', { key })).body.reserve.usdc_balance, '0.00', 'the reserve debited for each');
    await Promise.all(sent.map((row) => ctx.chain.waitForOutcome(row.tx_signature as Signature, 10_000)));
    await runWalletAutomation(ctx);
    assert.deepEqual((await topupsOf(ids)).map((row) => row.status), ['confirmed', 'confirmed', 'confirmed']);
    for (const id of ids) {
      assert.equal(await balanceOf(t, id, key), '14.00', '4.00 + one topup of 10.00');
      const funded = (await t.request('GET', `/v1/events?type=wallet.funded&walletId=${id}`, { key })).body.data;
      assert.deepEqual(funded.map((e: { details: { source: string } }) => e.details.source), ['auto_topup', 'reserve']);
    }
  });

  // Guarantee: a chain that does not answer costs a run of the job one call's timeout, not one
  // per due vault; nothing is recorded, and the vaults are topped up once it answers again.
  test('a chain that does not answer ends the run\'s topups at the first; the next tick makes them all', async () => {
    const { ctx } = t.service;
    const { ids } = await dueVaults('Chain away', 3, '30');
    const prepare = ctx.chain.prepare;
    let asked = 0;
    ctx.chain.prepare = async () => {
      asked += 1;
      throw new ChainUnavailableError('getLatestBlockhash', 10_000);
    };
    try {
      assert.deepEqual(await runWalletAutomation(ctx), { topups: 0, lowBalance: 0 });
    } finally {
      ctx.chain.prepare = prepare;
    }
    assert.equal(asked, 1, 'the other vaults did not wait out the same timeout');
    assert.deepEqual(await topupsOf(ids), [], 'nothing recorded');
    await runWalletAutomation(ctx);
    assert.deepEqual((await topupsOf(ids)).map((row) => row.wallet_id), ids.sort());
  });

  // Guarantee: money withdrawn to the reserve is not a spend: auto-topup does not refill a vault
  // its operator emptied (to archive it, say), whether its topup was free to fire or waiting for
  // the reserve to cover it; after a credit, the next spend below the trigger tops up as before.
  test('a withdrawal below the trigger starts no auto-topup: the vault can be archived; a spend after a credit tops up again', async () => {
    const { adminKey: key } = await t.createOrganization('Archiving with auto-topup');
    const deposit = async (amount: string) =>
      assert.equal((await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount } })).status, 200);
    const setTopup = async (walletId: string, topupAmount: string) => assert.equal((await t.request('PUT',
      `/v1/wallets/${walletId}/auto-topup`, { key, body: { enabled: true, triggerBelow: '5', topupAmount } })).status, 200);
    const withdraw = async (walletId: string, amount: string) => {
      const withdrawn = await t.request('POST', `/v1/wallets/${walletId}/withdraw`, { key, body: { amount } });
      assert.equal(withdrawn.body.status, 'confirmed', JSON.stringify(withdrawn.body));
    };
    const spend = async (walletId: string, amount: string) => t.request('POST', '/v1/payments',
      { key, body: { walletId, to: await newRecipient(), amount, currency: 'USDC' } });
    const fundings = async (walletId: string) => (await t.request('GET',
      `/v1/wallets/${walletId}/transactions?type=funding&limit=100`, { key })).body.data.length;

    const emptied = await fundedWallet(t, '10', 'pol_permissive', key);
    await deposit('50');
    await setTopup(emptied.wallet_id, '10');
    await withdraw(emptied.wallet_id, 'all');
    await tick(emptied.wallet_id);
    assert.equal(await balanceOf(t, emptied.wallet_id, key), '0.00', 'not refilled');
    assert.equal(await fundings(emptied.wallet_id), 1, 'its first funding only');
    const archived = await t.request('DELETE', `/v1/wallets/${emptied.wallet_id}`, { key });
    assert.equal(archived.status, 200, JSON.stringify(archived.body));
    assert.equal(archived.body.status, 'archived');

    // A vault whose topup waits for the reserve (a shortfall), emptied: a deposit does not refill it.
    const waiting = await fundedWallet(t, '10', 'pol_permissive', key);
    await setTopup(waiting.wallet_id, '1000');
    assert.equal((await spend(waiting.wallet_id, '6')).status, 200);
    await tick(waiting.wallet_id);
    assert.equal((await t.request('GET', `/v1/events?type=balance.low&walletId=${waiting.wallet_id}`, { key })).body.data[0].details.reason,
      'auto_topup_reserve_insufficient');
    await withdraw(waiting.wallet_id, 'all');
    await deposit('1000');
    await tick(waiting.wallet_id);
    assert.equal(await balanceOf(t, waiting.wallet_id, key), '0.00', 'not refilled by the deposit');
    assert.equal((await t.request('DELETE', `/v1/wallets/${waiting.wallet_id}`, { key })).status, 200);

    const kept = await fundedWallet(t, '10', 'pol_permissive', key);
    await setTopup(kept.wallet_id, '10');
    await withdraw(kept.wallet_id, '6');
    await tick(kept.wallet_id);
    assert.equal(await balanceOf(t, kept.wallet_id, key), '4.00', 'not refilled after a partial withdrawal either');
    assert.equal((await t.request('POST', `/v1/wallets/${kept.wallet_id}/fund`, { key, body: { amount: '2' } })).body.status, 'confirmed');
    assert.equal((await spend(kept.wallet_id, '2')).status, 200);
    await tick(kept.wallet_id);
    assert.equal(await balanceOf(t, kept.wallet_id, key), '14.00', '4.00 + one topup of 10.00');
  });

  // Guarantee: a policy's expiry writes its vaults' events in one statement however many vaults
  // it freezes, so their locks are held for that statement, not for a round trip per vault.
  // Counted by a statement trigger on events, as src/db/database.test.ts counts writes.
  test('a policy\'s expiry writes every frozen vault\'s event and policy.expired in one statement', async () => {
    const { ctx } = t.service;
    const policyId = await newPolicy(t, { expiry: new Date(ctx.clock.nowMs() + 3_600_000).toISOString() });
    const wallets = [await fundedWallet(t, '1', policyId), await fundedWallet(t, '1', policyId), await fundedWallet(t, '1', policyId)];
    await ctx.db.query('CREATE TABLE expiry_statements (events int NOT NULL)');
    await ctx.db.query(`CREATE FUNCTION count_expiry_statements() RETURNS TRIGGER LANGUAGE plpgsql AS $$
      BEGIN
        INSERT INTO expiry_statements SELECT count(*) FROM inserted WHERE payload->>'policy_id' = '${policyId}' HAVING count(*) > 0;
        RETURN NULL;
      END $$`);
    await ctx.db.query(`CREATE TRIGGER count_expiry_statements AFTER INSERT ON events REFERENCING NEW TABLE AS inserted
      FOR EACH STATEMENT EXECUTE FUNCTION count_expiry_statements()`);
    try {
      await advance(3601);
      assert.ok(await expirePolicies(ctx) >= 1);
      const statements = await ctx.db.query<{ events: number }>('SELECT events FROM expiry_statements');
      assert.deepEqual(statements.map((row) => row.events), [4], 'three wallet.frozen and policy.expired, in one statement');
    } finally {
      await ctx.db.query('DROP TRIGGER count_expiry_statements ON events');
      await ctx.db.query('DROP FUNCTION count_expiry_statements()');
      await ctx.db.query('DROP TABLE expiry_statements');
    }
    for (const wallet of wallets) {
      assert.equal(await statusOf(wallet.wallet_id), 'frozen');
      assert.deepEqual((await eventsOf('wallet.frozen', wallet.wallet_id)).map((e) => e.details.reason), ['policy_expired']);
    }
    const expired = (await eventsOf('policy.expired')).filter((e) => e.details.policy_id === policyId);
    assert.deepEqual(expired.map((e) => [...(e.details.frozen_wallets as string[])].sort()), [wallets.map((w) => w.wallet_id).sort()]);
  });

  test('balance.low fires once each time the balance falls below the vault\'s threshold', async () => {
    const wallet = await fundedWallet(t, '10');
    const set = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    assert.equal(set.body.low_balance_threshold, '5.00');
    await pay(wallet.wallet_id, '6');
    await t.service.jobs.runOnce();
    await pay(wallet.wallet_id, '1');
    await t.service.jobs.runOnce();
    let low = await eventsOf('balance.low', wallet.wallet_id);
    assert.equal(low.length, 1);
    assert.deepEqual({ ...low[0]!.details }, { wallet_id: wallet.wallet_id, current_balance: '4.00', threshold: '5.00' });
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '5' } });
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '5' } });
    await t.service.jobs.runOnce();
    await pay(wallet.wallet_id, '4');
    await t.service.jobs.runOnce();
    low = await eventsOf('balance.low', wallet.wallet_id);
    assert.equal(low.length, 2, 'again after the balance was back above');
  });

  test('a vault made due by a write that moves no money is acted on: a threshold set over its balance, a vault unfrozen below its trigger', async () => {
    // Threshold over the balance, set, taken back before the job looked, then set again.
    const watched = await fundedWallet(t, '3');
    await t.request('PATCH', `/v1/wallets/${watched.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await t.request('PATCH', `/v1/wallets/${watched.wallet_id}`, { body: { lowBalanceThreshold: null } });
    await t.service.jobs.runOnce();
    assert.equal((await eventsOf('balance.low', watched.wallet_id)).length, 0, 'no threshold when the job looked');
    await t.request('PATCH', `/v1/wallets/${watched.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    const low = await eventsOf('balance.low', watched.wallet_id);
    assert.deepEqual(low.map((e) => e.details.current_balance), ['3.00'], 'told once');

    // Auto-topup turned on while frozen below the trigger: nothing until the vault is unfrozen.
    const frozen = await fundedWallet(t, '1');
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '4' } });
    assert.equal((await t.request('PATCH', `/v1/wallets/${frozen.wallet_id}`, { body: { status: 'frozen' } })).status, 200);
    assert.equal((await t.request('PUT', `/v1/wallets/${frozen.wallet_id}/auto-topup`,
      { body: { enabled: true, triggerBelow: '5', topupAmount: '4' } })).status, 200);
    await tick(frozen.wallet_id, 2);
    assert.equal(await balanceOf(t, frozen.wallet_id), '1.00', 'a frozen vault is not topped up');
    assert.equal((await t.request('PATCH', `/v1/wallets/${frozen.wallet_id}`, { body: { status: 'active' } })).status, 200);
    await tick(frozen.wallet_id, 3);
    assert.equal(await balanceOf(t, frozen.wallet_id), '5.00', 'one topup once active');
  });

  test('large-transaction alerts follow each organisation\'s own threshold when their payments settle together', async () => {
    const other = await t.createOrganization('Alerts elsewhere');
    const setThreshold = (key: string, amount: string) => t.request('PUT', '/v1/alerts', {
      key, body: { policyViolation: true, inactivityHours: null, velocityPerHour: null, largeTransactionAbove: amount },
    });
    assert.equal((await setThreshold(t.adminKey, '5')).status, 200);
    assert.equal((await setThreshold(other.adminKey, '1')).status, 200);
    try {
      const ours = await fundedWallet(t, '40');
      const theirs = await fundedWallet(t, '40', 'pol_permissive', other.adminKey);
      const recipient = await newRecipient();
      const payFrom = (key: string, walletId: string, amount: string) => t.request('POST', '/v1/payments', {
        key, body: { walletId, to: recipient, amount, currency: 'USDC', waitForConfirmation: false },
      });
      // 3 USDC is large for the other organisation only; 6 USDC is large for both.
      const answers = await Promise.all([
        ...Array.from({ length: 4 }, () => payFrom(t.adminKey, ours.wallet_id, '3')),
        ...Array.from({ length: 4 }, () => payFrom(other.adminKey, theirs.wallet_id, '3')),
        payFrom(t.adminKey, ours.wallet_id, '6'), payFrom(other.adminKey, theirs.wallet_id, '6'),
      ]);
      assert.deepEqual(answers.map((a) => a.status), Array(10).fill(200), JSON.stringify(answers.map((a) => a.body)));
      const alerts = async (key: string, walletId: string) => {
        const confirmed = async () => (await t.request('GET', `/v1/wallets/${walletId}/transactions?status=confirmed&type=payment&limit=100`, { key })).body.data.length;
        for (let i = 0; i < 200 && await confirmed() < 5; i++) await new Promise((resolve) => setTimeout(resolve, 20));
        assert.equal(await confirmed(), 5, 'all five payments confirmed');
        return ((await t.request('GET', `/v1/events?type=alert.raised&walletId=${walletId}&limit=100`, { key })).body.data as Array<{
          details: { alert: string; amount: string; threshold: string };
        }>).filter((e) => e.details.alert === 'large_transaction').map((e) => `${e.details.amount} > ${e.details.threshold}`).sort();
      };
      assert.deepEqual(await alerts(t.adminKey, ours.wallet_id), ['6.00 > 5.00']);
      assert.deepEqual(await alerts(other.adminKey, theirs.wallet_id), [...Array(4).fill('3.00 > 1.00'), '6.00 > 1.00'].sort());

      // The same through one call, as a settlement batch of both organisations makes it.
      const row = (orgId: string, id: string, amount: bigint) => ({ org_id: orgId, wallet_id: 'wal_x', id, amount, type: 'payment' as const });
      const raised = await largeTransactionAlerts(t.service.ctx.db, [
        row(t.orgId, 'tx_a', 3_000_000n), row(other.orgId, 'tx_b', 3_000_000n), row(t.orgId, 'tx_c', 6_000_000n), row('org_none', 'tx_d', 9_000_000n),
      ]);
      assert.deepEqual(raised.map((e) => [e.orgId, e.payload.tx_id, e.payload.threshold]),
        [[other.orgId, 'tx_b', '1.00'], [t.orgId, 'tx_c', '5.00']], 'each organisation\'s own threshold; none without settings');
    } finally {
      await t.request('PUT', '/v1/alerts', { body: { policyViolation: true, inactivityHours: null, velocityPerHour: null, largeTransactionAbove: null } });
    }
  });

  test('a velocity spike is alerted however many vaults of other organisations once spiked and went quiet', async () => {
    // Another organisation's vaults that spiked two hours ago and have not paid since: their
    // stored hour counts are stale (the window slides only at a vault's next payment).
    const quiet = await t.createOrganization('Quiet spikers');
    assert.equal((await t.request('PUT', '/v1/alerts', {
      key: quiet.adminKey, body: { policyViolation: true, inactivityHours: null, velocityPerHour: 2, largeTransactionAbove: null },
    })).status, 200);
    const twoHoursAgo = new Date(t.service.ctx.clock.nowMs() - 2 * 3600_000);
    await t.service.ctx.db.query(
      `INSERT INTO wallets (id, org_id, agent_id, label, policy_id, status, chain_address, token_address, last_transaction_at,
         created_at, updated_at)
       SELECT 'wal_quiet_' || k, $1, 'quiet-' || k, 'Quiet', 'pol_permissive', 'active', 'quiet-vault-' || k, 'quiet-token-' || k, $2, $2, $2
       FROM generate_series(1, 150) k`, [quiet.orgId, twoHoursAgo]);
    await t.service.ctx.db.query(
      `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count, hour_removed_through_ms,
         month_key, month_sum)
       SELECT 'wal_quiet_' || k, 500, 50, 0, 500, 50, 0, '2000-01', 0 FROM generate_series(1, 150) k`);
    const busy = await t.createOrganization('Busy payer');
    assert.equal((await t.request('PUT', '/v1/alerts', {
      key: busy.adminKey, body: { policyViolation: true, inactivityHours: null, velocityPerHour: 2, largeTransactionAbove: null },
    })).status, 200);
    const wallet = await fundedWallet(t, '10', 'pol_permissive', busy.adminKey);
    for (let k = 0; k < 3; k += 1) {
      const paid = await t.request('POST', '/v1/payments', {
        key: busy.adminKey, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' },
      });
      assert.equal(paid.status, 200, JSON.stringify(paid.body));
    }
    await t.service.jobs.runOnce();
    await t.settled();
    const alerts = (await t.request('GET', `/v1/events?type=alert.raised&walletId=${wallet.wallet_id}`, { key: busy.adminKey })).body.data;
    assert.deepEqual(alerts.map((e: { details: { alert: string } }) => e.details.alert), ['velocity_spike']);
  });

  // Guarantee: a spike is a spike however briefly it lasted: more payments than the setting within
  // an hour, though by the next scan the first of them has left the hour before it.
  test('a velocity spike that ended before the scan is alerted, with its peak count', async () => {
    const { adminKey: key } = await t.createOrganization('Brief spike');
    assert.equal((await t.request('PUT', '/v1/alerts', {
      key, body: { policyViolation: true, inactivityHours: null, velocityPerHour: 2, largeTransactionAbove: null },
    })).status, 200);
    const wallet = await fundedWallet(t, '3', 'pol_permissive', key);
    const pay = async () => {
      const paid = await t.request('POST', '/v1/payments', { key, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' } });
      assert.equal(paid.status, 200, JSON.stringify(paid.body));
    };
    await pay();
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 3590 } });
    await pay();
    await pay();
    // Three within the hour; 15 s on, the first has left the hour before now.
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 15 } });
    await t.settled();
    await scanAlerts(t.service.ctx);
    const raised = (await t.request('GET', `/v1/events?type=alert.raised&walletId=${wallet.wallet_id}`, { key })).body.data
      .map((e: { details: { alert: string; count: number } }) => [e.details.alert, e.details.count]);
    assert.deepEqual(raised, [['velocity_spike', 3]]);
  });

  // Guarantee: an escrow moves money out of a vault as a payment does: a large one is alerted.
  test('an escrow above the large-transaction threshold raises the alert once its lock is confirmed', async () => {
    const { adminKey: key } = await t.createOrganization('Large escrow');
    assert.equal((await t.request('PUT', '/v1/alerts', {
      key, body: { policyViolation: true, inactivityHours: null, velocityPerHour: null, largeTransactionAbove: '0.5' },
    })).status, 200);
    const from = await fundedWallet(t, '5', 'pol_permissive', key);
    const to = await fundedWallet(t, '0.1', 'pol_permissive', key);
    const escrow = await t.request('POST', '/v1/payments/a2a', {
      key, body: { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '3', currency: 'USDC', taskDescription: 'Summarise' },
    });
    assert.equal(escrow.body.status, 'locked', JSON.stringify(escrow.body));
    await t.settled();
    const raised = (await t.request('GET', `/v1/events?type=alert.raised&walletId=${from.wallet_id}`, { key })).body.data
      .map((e: { summary: string; details: { alert: string; amount: string } }) => [e.details.alert, e.details.amount, e.summary]);
    assert.deepEqual(raised, [['large_transaction', '3.00', 'Escrow of 3.00 USDC above the 0.50 USDC alert threshold']]);
  });

  // Guarantee: a velocity spike is not alerted for an archived vault (nobody acts on it, and it
  // can pay no more); a frozen vault's is, as the spike happened.
  test('a burst of payments raises no velocity alert for a vault archived since; a frozen one\'s does', async () => {
    const { adminKey: key } = await t.createOrganization('Burst then archive');
    assert.equal((await t.request('PUT', '/v1/alerts', {
      key, body: { policyViolation: true, inactivityHours: null, velocityPerHour: 2, largeTransactionAbove: null },
    })).status, 200);
    const burst = async () => {
      const wallet = await fundedWallet(t, '3', 'pol_permissive', key);
      for (let k = 0; k < 3; k += 1) {
        const paid = await t.request('POST', '/v1/payments', {
          key, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' },
        });
        assert.equal(paid.status, 200, JSON.stringify(paid.body));
      }
      return wallet.wallet_id;
    };
    const [archived, frozen] = [await burst(), await burst()];
    await t.settled();
    const deleted = await t.request('DELETE', `/v1/wallets/${archived}`, { key });
    assert.equal(deleted.status, 200, JSON.stringify(deleted.body));
    assert.equal((await t.request('PATCH', `/v1/wallets/${frozen}`, { key, body: { status: 'frozen' } })).status, 200);
    await scanAlerts(t.service.ctx);
    const alerts = async (walletId: string) => (await t.request('GET', `/v1/events?type=alert.raised&walletId=${walletId}`, { key }))
      .body.data.map((e: { details: { alert: string } }) => e.details.alert);
    assert.deepEqual(await alerts(archived), []);
    assert.deepEqual(await alerts(frozen), ['velocity_spike']);
  });

  test('a velocity alert turned off while a scan counts the vault\'s payments is not raised', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const { adminKey: key } = await t.createOrganization('Velocity turned off mid-scan');
      const setVelocity = (perHour: number | null) => t.request('PUT', '/v1/alerts', {
        key, body: { policyViolation: true, inactivityHours: null, velocityPerHour: perHour, largeTransactionAbove: null } });
      assert.equal((await setVelocity(2)).status, 200);
      const wallet = await fundedWallet(t, '3', 'pol_permissive', key);
      for (let k = 0; k < 3; k += 1) {
        assert.equal((await t.request('POST', '/v1/payments', {
          key, body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' } })).status, 200);
      }
      await t.settled();
      // The scan counts the burst, then waits for the vault's row to claim the alert; meanwhile
      // the organisation turns the alert off.
      const held = await holdLocks(other, (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [wallet.wallet_id]));
      await queuedRequest(other, held, () => scanAlerts(t.service.ctx), async () => assert.equal((await setVelocity(null)).status, 200));
      const alerts = (await t.request('GET', `/v1/events?type=alert.raised&walletId=${wallet.wallet_id}`, { key })).body.data;
      assert.deepEqual(alerts, []);
    });
  });

  test('alerts: settings read back; large transaction, velocity spike, inactivity and policy violation raise alert.raised once', async () => {
    const defaults = await t.request('GET', '/v1/alerts');
    assert.deepEqual(defaults.body, {
      policy_violation: true, inactivity_hours: null, velocity_per_hour: null, large_transaction_above: null,
      balance_low: 'per vault: lowBalanceThreshold',
    });
    const viewer = await t.createKey('viewer');
    assert.equal((await t.request('PUT', '/v1/alerts', { key: viewer, body: { policyViolation: true, inactivityHours: null, velocityPerHour: null, largeTransactionAbove: null } })).status, 403);
    const bad = await t.request('PUT', '/v1/alerts', { body: { policyViolation: true, inactivityHours: 0, velocityPerHour: null, largeTransactionAbove: null } });
    assert.equal(bad.status, 400);
    const saved = await t.request('PUT', '/v1/alerts', {
      body: { policyViolation: true, inactivityHours: 2, velocityPerHour: 2, largeTransactionAbove: '5' },
    });
    assert.equal(saved.body.large_transaction_above, '5.00');

    const policyId = await newPolicy(t, { maxPerTx: '8' });
    const wallet = await fundedWallet(t, '30', policyId);
    const alertsOf = async (kind: string) => (await eventsOf('alert.raised', wallet.wallet_id)).filter((e) => e.details.alert === kind);
    await pay(wallet.wallet_id, '6');
    assert.equal((await alertsOf('large_transaction')).length, 1);
    await pay(wallet.wallet_id, '1');
    assert.equal((await alertsOf('large_transaction')).length, 1, 'not for a small one');
    await pay(wallet.wallet_id, '1');
    await t.service.jobs.runOnce();
    await pay(wallet.wallet_id, '1');
    await t.service.jobs.runOnce();
    assert.deepEqual((await alertsOf('velocity_spike')).map((e) => e.summary), ['Wallet Agent made 3 payments within an hour (alert above 2)'],
      'once in the hour, naming the vault by its label');
    const blocked = await pay(wallet.wallet_id, '9');
    assert.equal(blocked.status, 402);
    const violations = await alertsOf('policy_violation');
    assert.equal(violations.length, 1);
    assert.equal(violations[0]!.severity, 'warning');
    assert.equal(violations[0]!.summary, 'Policy violation (max_per_tx) on wallet Agent');
    await advance(3 * 3600);
    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    assert.deepEqual((await alertsOf('inactivity')).map((e) => e.summary), ['Wallet Agent inactive for more than 2 h'], 'once per inactivity');
    await t.request('PUT', '/v1/alerts', { body: { policyViolation: false, inactivityHours: null, velocityPerHour: null, largeTransactionAbove: null } });
    await pay(wallet.wallet_id, '9');
    assert.equal((await alertsOf('policy_violation')).length, 1, 'off: no alert');
  });
});
