/**
 * The `wallets.automation` job (auto-topups and balance.low, every second) against a large fleet
 * on PostgreSQL: how long one run takes when no vault is due, when some are, and again after.
 * What it should cost is what happens to the fleet, not its size. Prints figures; asserts nothing.
 *
 *   npm run bench:automation -- [--vaults 50000] [--due 100] [--runs 30]
 *                               [--database-url postgres://postgres@127.0.0.1:5432/postgres]
 *
 * The service is built in this process on a fresh schema of that database (as the tests do). Two
 * vaults are made through the API, one with auto-topup and one with a low-balance threshold,
 * both well above their triggers; `--vaults` copies of them (half each) are written with SQL
 * (the API would take minutes to make them), then `ANALYZE`. `--due` of the copies with a
 * threshold are then written below it, as a payment would, and the runs that tell them are timed.
 */
import { parseArgs } from 'node:util';
import { performance } from 'node:perf_hooks';
import { runWalletAutomation } from '../src/automation/automation.ts';
import { startTestService } from '../test/harness.ts';
import { fundedWallet } from '../test/fixtures.ts';
import { positiveInteger } from './args.ts';

const { values } = parseArgs({
  options: {
    vaults: { type: 'string', default: '50000' },
    due: { type: 'string', default: '100' },
    runs: { type: 'string', default: '30' },
    'database-url': { type: 'string', default: process.env.DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres' },
  },
  strict: true,
});

const vaults = positiveInteger('vaults', values.vaults);
const due = positiveInteger('due', values.due);
const runs = positiveInteger('runs', values.runs);
if (due > vaults / 2) throw new Error('--due must be at most half of --vaults');

process.env.DATABASE_URL = values['database-url'];
const t = await startTestService({ workers: false });
try {
  const { db } = t.service.ctx;
  const topup = await fundedWallet(t, '100');
  const put = await t.request('PUT', `/v1/wallets/${topup.wallet_id}/auto-topup`, { body: { enabled: true, triggerBelow: '5', topupAmount: '10' } });
  if (put.status !== 200) throw new Error(`auto-topup: ${JSON.stringify(put.body)}`);
  const watched = await fundedWallet(t, '100');
  const patch = await t.request('PATCH', `/v1/wallets/${watched.wallet_id}`, { body: { lowBalanceThreshold: '5' } });
  if (patch.status !== 200) throw new Error(`threshold: ${JSON.stringify(patch.body)}`);

  // Copies of the two vaults: every column as the template's but the ones that name a vault.
  const columns = (await db.query<{ column_name: string }>(
    `SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = 'wallets'
     ORDER BY ordinal_position`)).map((row) => row.column_name);
  const renamed: Record<string, string> = {
    id: `w.id || '_' || g`, agent_id: `w.agent_id || '_' || g`,
    chain_address: `w.chain_address || '_' || g`, token_address: `w.token_address || '_' || g`,
  };
  const copy = async (template: string, count: number) => db.query(
    `INSERT INTO wallets (${columns.join(', ')})
     SELECT ${columns.map((column) => renamed[column] ?? `w.${column}`).join(', ')}
     FROM wallets w CROSS JOIN generate_series(1, $2::int) g WHERE w.id = $1`, [template, count]);
  const started = performance.now();
  await copy(topup.wallet_id, Math.floor(vaults / 2));
  await copy(watched.wallet_id, vaults - Math.floor(vaults / 2));
  await db.query('ANALYZE wallets');
  console.log(`${vaults} vaults with auto-topup or a low-balance threshold (half each), none due; written in ${Math.round(performance.now() - started)} ms`);
  console.log(`wallets.automation, ${runs} runs each, ms per run:`);

  const measure = async (label: string, count: number) => {
    const times: number[] = [];
    let told = 0;
    for (let i = 0; i < count; i += 1) {
      const start = performance.now();
      told += (await runWalletAutomation(t.service.ctx)).lowBalance;
      times.push(performance.now() - start);
    }
    if (count <= 3) {
      console.log(`  ${label.padEnd(34)} ${times.map((ms) => ms.toFixed(1)).join(', ')}  balance.low told: ${told}`);
      return;
    }
    times.sort((a, b) => a - b);
    const at = (q: number) => times[Math.min(times.length - 1, Math.floor(q * times.length))]!.toFixed(1);
    console.log(`  ${label.padEnd(34)} p50 ${at(0.5).padStart(7)}  p90 ${at(0.9).padStart(7)}  max ${at(1).padStart(7)}  balance.low told: ${told}`);
  };
  await measure('none due', runs);
  // As a payment writes a balance below the threshold.
  await db.query(
    `UPDATE wallets SET balance = 1000000 WHERE id IN (
       SELECT id FROM wallets WHERE id LIKE $1 ORDER BY id LIMIT $2)`, [`${watched.wallet_id}_%`, due]);
  await measure(`${due} due: each run`, Math.min(3, Math.ceil(due / 100) + 1));
  await measure('none due, after', runs);
} finally {
  await t.close();
}
