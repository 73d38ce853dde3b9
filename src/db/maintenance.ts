/**
 * Table statistics (and, on PGlite, dead rows) where no autovacuum keeps them: PGlite runs none,
 * and a PostgreSQL server may have it turned off (docs/operations.md "PostgreSQL's
 * statistics"). Without statistics the planner guesses, and one guess walks a whole index per
 * row: a slot's settlement looked each signature up together with every entry of the pending
 * transactions' index (dead ones included), 65 ms a signature after 150,000 payments, and fell
 * minutes behind the payments it settles (a soak review on a server with autovacuum off).
 *
 * The `db.maintain` job does what autovacuum's defaults would: it analyzes a table once more than
 * 50 + 10% of its rows changed since it was last analyzed and, on PGlite, vacuums one whose dead
 * rows pass 50 + 20% (one a run: PGlite's one connection waits for it). On PostgreSQL it leaves
 * vacuuming to the server's operator, and with autovacuum on it does nothing.
 */
import type { Database } from './database.ts';

/** autovacuum_analyze_threshold and autovacuum_analyze_scale_factor's defaults. */
const ANALYZE_BASE = 50;
const ANALYZE_SCALE = 0.1;
/** autovacuum_vacuum_threshold and autovacuum_vacuum_scale_factor's defaults. */
const VACUUM_BASE = 50;
const VACUUM_SCALE = 0.2;

interface TableStats {
  table: string;
  live: number;
  dead: number;
  changed: number;
}

/** Whether this database has no autovacuum of its own keeping its statistics. */
async function autovacuumMissing(db: Database): Promise<boolean> {
  if (db.kind === 'pglite') return true;
  const [row] = await db.query<{ on: boolean }>(`SELECT current_setting('autovacuum') = 'on' AND current_setting('track_counts') = 'on' AS on`);
  return !row?.on;
}

/** The tables analyzed and vacuumed by this run (none where autovacuum runs). */
export async function maintainTables(db: Database): Promise<{ analyzed: string[]; vacuumed: string[] }> {
  const done = { analyzed: [] as string[], vacuumed: [] as string[] };
  if (!(await autovacuumMissing(db))) return done;
  const tables = await db.query<TableStats>(
    `SELECT relname AS table, n_live_tup::float8 AS live, n_dead_tup::float8 AS dead, n_mod_since_analyze::float8 AS changed
     FROM pg_stat_user_tables WHERE schemaname = current_schema() ORDER BY relname`);
  for (const stats of tables) {
    if (stats.changed <= ANALYZE_BASE + ANALYZE_SCALE * stats.live) continue;
    // SKIP_LOCKED: a table another process is analyzing (or a migration altering) is left to the next run.
    await db.query(`ANALYZE (SKIP_LOCKED) ${quoted(stats.table)}`);
    done.analyzed.push(stats.table);
  }
  if (db.kind === 'pglite') {
    const bloated = tables.filter((stats) => stats.dead > VACUUM_BASE + VACUUM_SCALE * stats.live)
      .sort((a, b) => b.dead - a.dead)[0];
    if (bloated) {
      await db.query(`VACUUM (SKIP_LOCKED) ${quoted(bloated.table)}`);
      done.vacuumed.push(bloated.table);
    }
  }
  return done;
}

function quoted(identifier: string): string {
  return `"${identifier.replace(/"/g, '""')}"`;
}
