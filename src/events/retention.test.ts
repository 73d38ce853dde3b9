/**
 * The `events.retention` job: events older than 90 days of the service clock are deleted, as
 * many batches as it takes; younger ones stay, in the feed and in the table.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { fundedWallet } from '../../test/fixtures.ts';
import { deleteExpiredEvents } from './events.ts';

describe('event retention', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  const advanceDays = async (days: number) => {
    const response = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: days * 86_400 } });
    assert.equal(response.status, 200, JSON.stringify(response.body));
  };
  const stored = async (walletId: string) => (await t.service.ctx.db.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM events WHERE wallet_id = $1', [walletId]))[0]!.n;
  const inFeed = async (walletId: string) => (await t.request('GET', `/v1/events?walletId=${walletId}&limit=100`)).body.data.length;

  test('events older than 90 days are deleted, in as many batches as it takes; younger ones stay', async () => {
    const old = await fundedWallet(t, '1');
    for (const label of ['a', 'b', 'c']) {
      assert.equal((await t.request('PATCH', `/v1/wallets/${old.wallet_id}`, { body: { label } })).status, 200);
      assert.equal((await t.request('PATCH', `/v1/wallets/${old.wallet_id}`, { body: { status: 'frozen' } })).status, 200);
      assert.equal((await t.request('PATCH', `/v1/wallets/${old.wallet_id}`, { body: { status: 'active' } })).status, 200);
    }
    const oldCount = await stored(old.wallet_id);
    assert.ok(oldCount >= 8, `the old vault has several events (${oldCount})`);
    await advanceDays(60);
    const young = await fundedWallet(t, '1');
    const youngCount = await stored(young.wallet_id);
    assert.ok(youngCount >= 2, `the young vault has events (${youngCount})`);
    await advanceDays(29);
    const nowMs = t.service.ctx.clock.nowMs();
    assert.equal(await deleteExpiredEvents(t.service.ctx.db, nowMs, { batch: 3 }), 0, 'nothing is 90 days old yet');
    assert.equal(await stored(old.wallet_id), oldCount);

    await advanceDays(2);
    const deleted = await deleteExpiredEvents(t.service.ctx.db, t.service.ctx.clock.nowMs(), { batch: 3 });
    assert.ok(deleted >= oldCount, `every old event went, 3 at a time (${deleted} deleted)`);
    assert.equal(await stored(old.wallet_id), 0);
    assert.equal(await stored(young.wallet_id), youngCount, 'the 31-day-old events stay');
    assert.equal(await inFeed(young.wallet_id), youngCount);

    await advanceDays(60);
    await t.service.jobs.runOnce();
    assert.equal(await stored(young.wallet_id), 0, 'the job deletes them once they are 91 days old');
  });
});
