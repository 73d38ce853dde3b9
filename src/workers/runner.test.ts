/**
 * The job runner: a job never overlaps itself, also past its timeout, and a shutdown waits for
 * running jobs only so long.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { AppContext } from '../http/context.ts';
import { beforeDeadline } from '../../test/deadline.ts';
import { eventually } from '../validator/testing.ts';
import { startJobs, type Job } from './runner.ts';

/** The runner needs only a logger from the context; this one keeps what is logged. */
function contextLogging(): { ctx: AppContext; logged: string[] } {
  const logged: string[] = [];
  const keep = (_data: unknown, message: string) => logged.push(message);
  const log = { error: keep, warn: keep, info: keep };
  return { ctx: { log } as unknown as AppContext, logged };
}

test('a run past its timeout is reported and still waited for: the next run never starts beside it', async () => {
  const { ctx, logged } = contextLogging();
  let active = 0;
  let most = 0;
  let runs = 0;
  let finish!: () => void;
  const held = new Promise<void>((resolve) => { finish = resolve; });
  const job: Job = {
    name: 'slow', intervalMs: 60_000, timeoutMs: 30,
    run: async () => {
      runs += 1;
      active += 1;
      most = Math.max(most, active);
      await held; // until the test lets it end
      active -= 1;
    },
  };
  const runner = startJobs(ctx, [job], { schedule: false });
  const first = runner.runOnce();
  // Past its timeout (30 ms), and still running.
  await eventually(async () => (logged.some((message) => /has run for more than 30 ms/.test(message)) ? true : null), 'the timeout report');
  const second = runner.runOnce();
  finish();
  await Promise.all([first, second]);
  assert.equal(most, 1, 'never two at once');
  assert.equal(runs, 1, 'the second asked for the run still going');
  assert.ok(logged.some((message) => /has run for more than 30 ms/.test(message)), logged.join('\n'));
  await runner.stop();
});

test('stop waits for running jobs at most its limit, then leaves them', async () => {
  const { ctx, logged } = contextLogging();
  const runner = startJobs(ctx, [{ name: 'stuck', intervalMs: 60_000, timeoutMs: 60_000, run: () => new Promise(() => {}) }],
    { schedule: false, stopWaitMs: 100 });
  void runner.runOnce();
  // The job never ends: stop returns after its limit (100 ms), long before the deadline.
  assert.equal(await beforeDeadline(runner.stop().then(() => 'stopped'), 10_000), 'stopped');
  assert.ok(logged.some((message) => /left to end with the process/.test(message)), logged.join('\n'));
});

// The guarantee: an outage does not flood the log. A job failing at each run (most run every
// second or few) is logged once, then at most once a minute, and once when it runs again.
test('a job failing run after run is logged once, at warn when a dependency is down, and once when it runs again', async () => {
  const { ctx, logged } = contextLogging();
  let down = true;
  const job: Job = {
    name: 'chained', intervalMs: 60_000, timeoutMs: 60_000,
    run: async () => {
      if (down) throw Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:8899'), { code: 'ECONNREFUSED' });
    },
  };
  const bug: Job = { name: 'buggy', intervalMs: 60_000, timeoutMs: 60_000, run: async () => { throw new TypeError('x is undefined'); } };
  const levels: string[] = [];
  for (const level of ['error', 'warn', 'info'] as const) {
    const keep = (ctx.log as unknown as Record<string, (data: unknown, message: string) => void>)[level]!;
    (ctx.log as unknown as Record<string, unknown>)[level] = (data: unknown, message: string) => { levels.push(level); keep(data, message); };
  }
  const runner = startJobs(ctx, [job, bug], { schedule: false });
  for (let run = 0; run < 20; run += 1) await runner.runOnce();
  down = false;
  await runner.runOnce();
  await runner.runOnce();
  assert.deepEqual(logged, [
    'job chained failed: the database or the chain is not answering; tried again at each run',
    'job failed',
    'job chained ran again after 20 failed runs',
  ]);
  assert.deepEqual(levels, ['warn', 'error', 'info']);
  await runner.stop();
});
