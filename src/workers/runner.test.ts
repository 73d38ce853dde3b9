/**
 * The job runner: a job never overlaps itself, also past its timeout, and a shutdown waits for
 * running jobs only so long.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { AppContext } from '../http/context.ts';
import { beforeDeadline } from '../../test/deadline.ts';
import { eventually } from '../validator/testing.ts';
import { ChainUnavailableError } from '../chain/client.ts';
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
// second or few) is logged once, then at most once a minute, and once when it runs again; a job
// failing one run in two (a dependency answering one call in two) no more than that.
test('a job failing run after run is logged once, at warn when a dependency is down, then once a minute, and once when it runs again', async () => {
  const { ctx, logged } = contextLogging();
  const levels: string[] = [];
  for (const level of ['error', 'warn', 'info'] as const) {
    const keep = (ctx.log as unknown as Record<string, (data: unknown, message: string) => void>)[level]!;
    (ctx.log as unknown as Record<string, unknown>)[level] = (data: unknown, message: string) => { levels.push(level); keep(data, message); };
  }
  let wallMs = 1_000_000;
  let fails = (_run: number) => true;
  let runs = 0;
  const chained: Job = {
    name: 'chained', intervalMs: 60_000, timeoutMs: 60_000,
    run: async () => {
      runs += 1;
      if (fails(runs)) throw Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:8899'), { code: 'ECONNREFUSED' });
    },
  };
  const hung: Job = { name: 'hung', intervalMs: 60_000, timeoutMs: 60_000, run: async () => { throw new ChainUnavailableError('getSignatureStatuses', 10_000); } };
  const bug: Job = { name: 'buggy', intervalMs: 60_000, timeoutMs: 60_000, run: async () => { throw new TypeError('x is undefined'); } };
  const runner = startJobs(ctx, [chained, hung, bug], { schedule: false, wallNowMs: () => wallMs });
  const runFor = async (seconds: number) => {
    for (let second = 0; second < seconds; second += 1) {
      await runner.runOnce();
      wallMs += 1_000;
    }
  };
  await runFor(30);
  assert.deepEqual(logged.splice(0), [
    'job failed: the database or the chain is not answering; tried again at each run',
    'job failed: the database or the chain is not answering; tried again at each run',
    'job failed',
  ], 'the first failure of each, a hung chain told as a dependency too');
  assert.deepEqual(levels.splice(0), ['warn', 'warn', 'error']);
  await runFor(31);
  assert.deepEqual(logged.splice(0), [
    'job chained still failing: the database or the chain is not answering; tried again at each run',
    'job hung still failing: the database or the chain is not answering; tried again at each run',
    'job buggy still failing',
  ], 'a minute on, once more');
  fails = () => false;
  await runFor(2);
  assert.deepEqual(logged.splice(0), ['job chained ran again after 61 failed runs']);
  assert.deepEqual(levels.splice(-1), ['info']);
  // One run in two failing, for two minutes: a failure and its recovery, at most once a minute.
  runs = 0;
  fails = (run) => run % 2 === 1;
  await runFor(120);
  const chainedLines = logged.filter((message) => message.includes('chained') || message.startsWith('job failed:'));
  assert.ok(chainedLines.length <= 5, `a line or two a minute, not one a run:\n${chainedLines.join('\n')}`);
  await runner.stop();
});
