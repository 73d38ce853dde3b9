/**
 * Lock waits on PostgreSQL, for tests that hold a lock in one connection and need to know when
 * the work under test has queued behind it (PGlite has one connection: these tests skip there).
 */
import assert from 'node:assert/strict';
import type { TestContext } from 'node:test';
import { openDatabase, type Database, type Queryable } from '../src/db/database.ts';
import type { TestService } from './harness.ts';

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

/**
 * A second connection to the test service's database and schema, for a transaction that holds
 * locks beside the service's own. On PGlite (one connection) the test is skipped and this is null.
 */
export async function secondConnection(t: TestService, context: TestContext): Promise<Database | null> {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has a single connection: no transaction can stay open beside another)');
    return null;
  }
  const [{ schema }] = await t.service.ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
  return openDatabase({ databaseUrl, dataDir: null, schema });
}

/**
 * Runs `work` with a second connection (secondConnection), closed after it whatever happens; on
 * PGlite the test is skipped and `work` does not run.
 */
export async function withSecondConnection(t: TestService, context: TestContext, work: (other: Database) => Promise<unknown>): Promise<void> {
  const other = await secondConnection(t, context);
  if (!other) return;
  try {
    await work(other);
  } finally {
    await other.close();
  }
}

/** A transaction holding locks on another connection (holdLocks). */
export interface HeldLocks {
  /** its backend, for queuedBehind */
  pid: number;
  /** lets it go on: it runs its `then` and commits */
  release(): void;
  /** settles when it has committed (or failed) */
  done: Promise<void>;
}

/**
 * Opens a transaction on `db` that takes its locks with `take` and holds them until released;
 * then runs `then` (more locks, say) and commits. Resolves once the locks are held.
 */
export async function holdLocks(
  db: Database, take: (tx: Queryable) => Promise<unknown>, then?: (tx: Queryable) => Promise<unknown>,
): Promise<HeldLocks> {
  let release!: () => void;
  const released = new Promise<void>((resolve) => { release = resolve; });
  let held!: (pid: number) => void;
  let failed!: (error: unknown) => void;
  const pid = new Promise<number>((resolve, reject) => { held = resolve; failed = reject; });
  const done = db.transaction(async (tx) => {
    await take(tx);
    held((await tx.query<{ pid: number }>('SELECT pg_backend_pid() AS pid'))[0]!.pid);
    await released;
    await then?.(tx);
  });
  done.catch(failed);
  try {
    return { pid: await pid, release, done };
  } catch (error) {
    release();
    throw error;
  }
}

/**
 * Starts `request` while `held` holds its locks, waits until it queues behind them, runs
 * `meanwhile` (a change the request must not see before it was queued), then lets the locks go
 * (their transaction commits) and answers what `request` gave.
 */
export async function queuedRequest<T>(
  db: Database, held: HeldLocks, request: () => Promise<T>, meanwhile?: () => Promise<unknown>,
): Promise<T> {
  let pending: Promise<T> | undefined;
  try {
    pending = request();
    await queuedBehind(db, held.pid, 1);
    await meanwhile?.();
  } finally {
    held.release();
    await held.done;
  }
  return pending;
}
