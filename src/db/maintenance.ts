/**
 * Table statistics (and, on PGlite, dead rows) where no autovacuum keeps them: PGlite runs none,
 * and a PostgreSQL server may have it turned off (docs/operations.md "PostgreSQL's
 * statistics"). Without statistics the planner guesses, and one guess walks a whole index per
 * row: a slot's settlement looked each signature up together with every entry of the pending
 * transactions' index (dead ones included), 65 ms a signature after 150,000 payments, and fell
 * minutes behind the payments it settles (a soak review on a server with autovacuum off).
 *
 * The `db.maintain` job does what autovacuum's defaults would: it analyzes a table never analyzed,
 * or once more than 50 + 10% of its rows changed since it was last analyzed (counted by the
 * statistics collector: with `track_counts` off nothing is counted, and only tables never
 * analyzed are), and, on PGlite, vacuums one whose dead rows pass 50 + 20% (one a run: PGlite's
 * one connection, on the event loop, waits for it). On PostgreSQL it leaves vacuuming to the
 * server's operator, and with autovacuum on it does nothing.
 */
import type { Database } from './database.ts';

/** autovacuum_analyze_threshold and autovacuum_analyze_scale_factor's defaults. */
const ANALYZE_BASE = 50;
const ANALYZE_SCALE = 0.1;
/** PGlite's statistics target for the job's ANALYZE (PostgreSQL's default is 100: 300 rows sampled per unit). */
const PGLITE_STATISTICS_TARGET = 10;
/** autovacuum_vacuum_threshold and autovacuum_vacuum_scale_factor's defaults. */
const VACUUM_BASE = 50;
const VACUUM_SCALE = 0.2;

interface TableStats {
  table: string;
  live: number;
  dead: number;
  changed: number;
  /** never analyzed (`reltuples` -1): a new table, or one whose counts were lost (PGlite's restart, `track_counts` off) */
  never: boolean;
}

/** Whether this database has no autovacuum of its own keeping its statistics. */
async function autovacuumMissing(db: Database): Promise<boolean> {
  if (db.kind === 'pglite') return true;
  const [row] = await db.query<{ on: boolean }>(`SELECT current_setting('autovacuum') = 'on' AND current_setting('track_counts') = 'on' AS on`);
  return !row?.on;
}

/**
 * The tables analyzed and vacuumed by this run (none where autovacuum runs). A table whose
 * statement fails does not hold up the others: the first failure is thrown once all are done.
 */
export async function maintainTables(db: Database): Promise<{ analyzed: string[]; vacuumed: string[] }> {
  const done = { analyzed: [] as string[], vacuumed: [] as string[] };
  if (!(await autovacuumMissing(db))) return done;
  const tables = await db.query<TableStats>(
    `SELECT c.relname AS table, COALESCE(s.n_live_tup, 0)::float8 AS live, COALESCE(s.n_dead_tup, 0)::float8 AS dead,
            COALESCE(s.n_mod_since_analyze, 0)::float8 AS changed, c.reltuples < 0 AS never
     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
     WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') ORDER BY c.relname`);
  const failures: unknown[] = [];
  const run = async (sql: string, table: string, into: string[]) => {
    try {
      await db.query(sql);
      into.push(table);
    } catch (error) {
      failures.push(error);
    }
  };
  const due = tables.filter((stats) => stats.never || stats.changed > ANALYZE_BASE + ANALYZE_SCALE * stats.live);
  // PGlite analyzes on the event loop, the service waiting: a sample of 3,000 rows a table
  // instead of 30,000 (130–220 ms → 19 ms for 42,000 rows on disk; a review saw four full-sample
  // ANALYZEs in one run hold requests for 2.4 s and the service shed them).
  const sampled = db.kind === 'pglite' && due.length > 0;
  if (sampled) await db.query(`SET default_statistics_target = ${PGLITE_STATISTICS_TARGET}`);
  try {
    for (const stats of due) {
      // SKIP_LOCKED: a table another process is analyzing (or a migration altering) is left to the next run.
      await run(`ANALYZE (SKIP_LOCKED) ${quoted(stats.table)}`, stats.table, done.analyzed);
    }
  } finally {
    if (sampled) await db.query('RESET default_statistics_target');
  }
  if (db.kind === 'pglite') {
    const bloated = tables.filter((stats) => stats.dead > VACUUM_BASE + VACUUM_SCALE * stats.live)
      .sort((a, b) => b.dead - a.dead)[0];
    if (bloated) await run(`VACUUM (SKIP_LOCKED) ${quoted(bloated.table)}`, bloated.table, done.vacuumed);
  }
  if (failures.length) throw failures[0];
  return done;
}

function quoted(identifier: string): string {
  return `"${identifier.replace(/"/g, '""')}"`;
}
