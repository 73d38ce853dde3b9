/**
 * The spend windows as stored and moved by PostgreSQL (spendWindowsOf): the spends leaving a
 * window, summed where they are stored, are exactly those a full scan no longer counts, at the
 * window's millisecond edges.
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { newRecipient } from '../../test/fixtures.ts';
import { DAY_MS, HOUR_MS, monthKey, scanWindow, type Spend } from './policy-engine.ts';
import { spendWindowsOf } from './spend-state.ts';

let t: TestService;
before(async () => { t = await startTestService({ workers: false }); });
after(async () => { await t.close(); });

test('the spends leaving the day window at its edges are taken out once, as a full scan counts them', async () => {
  const { db } = t.service.ctx;
  const created = await t.request('POST', '/v1/wallets', { body: { agentId: `edges-${process.pid}`, label: 'Edges', policyId: 'pol_permissive' } });
  assert.equal(created.status, 200, JSON.stringify(created.body));
  const walletId = created.body.wallet_id as string;
  const T0 = Date.UTC(2026, 10, 2, 12);
  // The window last moved through T0, so the spend at T0 is out of it already; three are in.
  const spends: Spend[] = [{ atMs: T0, amount: 8n }, { atMs: T0 + 1, amount: 1n }, { atMs: T0 + 2, amount: 2n }, { atMs: T0 + 5_000, amount: 4n }];
  const recipient = await newRecipient();
  for (const [i, spend] of spends.entries()) {
    await db.query(
      `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, created_at, updated_at, spend_at_ms)
       VALUES ($1, $2, $3, 'payment', 'confirmed', $4, $5, $6, $6, $7)`,
      [`tx_edges_${process.pid}_${i}`, t.orgId, walletId, spend.amount, recipient, new Date(spend.atMs), spend.atMs]);
  }
  await db.query(
    `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count, hour_removed_through_ms, month_key, month_sum)
     VALUES ($1, 7, 3, $2, 0, 0, $3, $4, 15)
     ON CONFLICT (wallet_id) DO UPDATE SET day_sum = 7, day_count = 3, day_removed_through_ms = $2, hour_sum = 0, hour_count = 0,
       hour_removed_through_ms = $3, month_key = $4, month_sum = 15`,
    [walletId, T0, T0 + 5_000, monthKey(T0)]);

  for (const atMs of [T0 + DAY_MS, T0 + 1 + DAY_MS, T0 + 2 + DAY_MS, T0 + 4_999 + DAY_MS, T0 + 5_000 + DAY_MS, T0 + 2 * DAY_MS]) {
    const { day } = (await spendWindowsOf(db, [walletId], atMs)).get(walletId)!;
    const scanned = scanWindow(spends, atMs, DAY_MS);
    assert.deepEqual({ sum: day.sum, count: day.count }, scanned, `at T0 + ${atMs - T0} ms`);
    assert.equal(day.removedThroughMs, Math.max(T0, atMs - DAY_MS));
  }
  // The hour window, moved past every spend already, stays empty.
  const { hour } = (await spendWindowsOf(db, [walletId], T0 + 5_000 + HOUR_MS + 1)).get(walletId)!;
  assert.deepEqual({ sum: hour.sum, count: hour.count }, { sum: 0n, count: 0 });
});
