/**
 * The `db.maintain` job keeps table statistics where no autovacuum does (PGlite; this machine's
 * PostgreSQL runs with autovacuum off), and vacuums PGlite's dead rows.
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { maintainTables } from './maintenance.ts';

let t: TestService;
before(async () => { t = await startTestService({ workers: false }); });
after(async () => { await t.close(); });

/** Polls until the statistics collector has seen the changes made (it reports them within seconds). */
async function changesSeen(table: string, atLeast: number): Promise<void> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    const [row] = await t.service.ctx.db.query<{ changed: number }>(
      `SELECT n_mod_since_analyze::int AS changed FROM pg_stat_user_tables WHERE schemaname = current_schema() AND relname = $1`, [table]);
    if ((row?.changed ?? 0) >= atLeast) return;
    if (Date.now() > deadline) throw new Error(`the statistics never showed ${atLeast} changes to ${table}`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

test('a table changed past autovacuum\'s threshold is analyzed, and on PGlite its dead rows vacuumed', async (context) => {
  const { db } = t.service.ctx;
  const [setting] = await db.query<{ on: boolean }>(`SELECT current_setting('autovacuum') = 'on' AS on`);
  if (db.kind === 'postgres' && setting!.on) {
    assert.deepEqual(await maintainTables(db), { analyzed: [], vacuumed: [] }, 'the server\'s autovacuum is left to do it');
    context.skip('this PostgreSQL runs autovacuum: the job leaves it to it');
    return;
  }
  await db.query('CREATE TABLE maintained (id int PRIMARY KEY, note text)');
  // Never analyzed, and never changed: its statistics are unknown, not fresh (a new table; PGlite's
  // change counts after a restart; PostgreSQL with track_counts off).
  await db.query('CREATE TABLE untouched (id int PRIMARY KEY)');
  await db.query(`INSERT INTO maintained SELECT i, 'new' FROM generate_series(1, 2000) i`);
  await db.query(`UPDATE maintained SET note = 'changed' WHERE id <= 1500`);
  const statistics = async () => (await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'maintained'`))[0]!.n;
  assert.equal(await statistics(), 0, 'no statistics before');
  await changesSeen('maintained', 3500);

  const done = await maintainTables(db);
  assert.ok(done.analyzed.includes('maintained') && done.analyzed.includes('untouched'), `analyzed: ${done.analyzed.join(', ')}`);
  assert.equal(await statistics(), 2, 'both columns have statistics');
  // PGlite samples less (it analyzes on the event loop), and puts its setting back.
  const [bounds] = await db.query<{ bounds: string }>(
    `SELECT histogram_bounds::text AS bounds FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'maintained' AND attname = 'id'`);
  assert.equal(bounds!.bounds.split(',').length, db.kind === 'pglite' ? 11 : 101, 'histogram buckets: the statistics target + 1');
  assert.equal((await db.query<{ target: string }>('SELECT current_setting(\'default_statistics_target\') AS target'))[0]!.target, '100');
  assert.deepEqual(done.vacuumed, db.kind === 'pglite' ? ['maintained'] : [], 'PGlite\'s most bloated table is vacuumed; PostgreSQL\'s are left to its operator');

  // Analyzed, the table is not analyzed again until it changes again.
  const again = await maintainTables(db);
  assert.ok(!again.analyzed.includes('maintained') && !again.analyzed.includes('untouched'), `analyzed again: ${again.analyzed.join(', ')}`);
});
