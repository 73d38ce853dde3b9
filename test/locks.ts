/**
 * Lock waits on PostgreSQL, for tests that hold a lock in one connection and need to know when
 * the work under test has queued behind it (PGlite has one connection: these tests skip there).
 */
import assert from 'node:assert/strict';
import type { Database } from '../src/db/database.ts';

/** Resolves once `count` backends wait, directly or behind another waiter, for locks backend `holderPid` holds. */
export async function queuedBehind(db: Database, holderPid: number, count: number): Promise<void> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const [{ n }] = await db.query<{ n: number }>(
      `WITH RECURSIVE queued(pid) AS (
         SELECT pid FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))
         UNION
         SELECT a.pid FROM pg_stat_activity a JOIN queued q ON q.pid = ANY (pg_blocking_pids(a.pid))
       )
       SELECT count(*)::int AS n FROM queued`, [holderPid]) as [{ n: number }];
    if (n >= count) return;
    assert.ok(Date.now() < deadline, `${count} transactions never queued behind the held locks (${n} did)`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}
