/**
 * Background jobs: each a name, an interval, a timeout and a body that calls a use-case. One
 * job never overlaps itself; a failure is logged and the job runs again at its next tick (a job
 * failing run after run is logged at its first failure, then at most once a minute with the
 * count, and once when it runs again: FAILURE_LOG_EVERY_MS).
 * Several processes may run the same jobs: they coordinate through row locks
 * (FOR UPDATE SKIP LOCKED), never through memory.
 */
import { dependencyDown, FAILURE_LOG_EVERY_MS } from '../http/app.ts';
import type { AppContext } from '../http/context.ts';

export interface Job {
  name: string;
  intervalMs: number;
  timeoutMs: number;
  run(ctx: AppContext): Promise<void>;
}

export interface JobRunner {
  /** runs every job once now, in order (tests and start-up) */
  runOnce(): Promise<void>;
  stop(): Promise<void>;
}

/** How long stop() waits for the jobs running then; the rest are left to end with the process. */
export const STOP_WAIT_MS = 10_000;

export function startJobs(
  ctx: AppContext, jobs: readonly Job[],
  { schedule = true, stopWaitMs = STOP_WAIT_MS, wallNowMs = Date.now }: { schedule?: boolean; stopWaitMs?: number; wallNowMs?: () => number } = {},
): JobRunner {
  const timers = new Map<string, NodeJS.Timeout>();
  const running = new Map<string, Promise<void>>();
  /**
   * Each failing job's run of failures (how many, since when, whether a line said so), and when a
   * line about each job's failures last went out (wall clock), kept across its recoveries: a
   * dependency answering one call in two makes a job fail and recover by turns, which logs
   * at most a failure and its recovery a minute too.
   */
  const failing = new Map<string, { failures: number; sinceMs: number; told: boolean }>();
  const toldMs = new Map<string, number>();
  let stopped = false;
  const failed = (job: Job, error: unknown) => {
    const nowMs = wallNowMs();
    const streak = failing.get(job.name) ?? { failures: 0, sinceMs: nowMs, told: false };
    streak.failures += 1;
    failing.set(job.name, streak);
    if (nowMs - (toldMs.get(job.name) ?? -Infinity) < FAILURE_LOG_EVERY_MS) return;
    toldMs.set(job.name, nowMs);
    const data = { err: error, job: job.name, failures: streak.failures, since: new Date(streak.sinceMs).toISOString() };
    const message = streak.told ? `job ${job.name} still failing` : 'job failed';
    streak.told = true;
    // A dependency down (or not answering in time) is the machine around the service, not a fault of it.
    if (dependencyDown(error)) ctx.log.warn(data, `${message}: the database or the chain is not answering; tried again at each run`);
    else ctx.log.error(data, message);
  };
  const succeeded = (job: Job) => {
    const streak = failing.get(job.name);
    if (!streak) return;
    failing.delete(job.name);
    if (!streak.told) return; // its failures were not told either
    ctx.log.info({ job: job.name, failures: streak.failures, since: new Date(streak.sinceMs).toISOString() },
      `job ${job.name} ran again after ${streak.failures} failed run${streak.failures === 1 ? '' : 's'}`);
  };

  const runJob = (job: Job): Promise<void> => {
    const current = running.get(job.name);
    if (current) return current;
    const promise = (async () => {
      // Past its timeout a run is reported, and still waited for: its next run starts only when
      // it has ended, so a job never overlaps itself (a run abandoned at its timeout went on,
      // beside the next one).
      const timer = setTimeout(() => {
        ctx.log.error({ job: job.name, timeoutMs: job.timeoutMs }, `job ${job.name} has run for more than ${job.timeoutMs} ms`);
      }, job.timeoutMs);
      timer.unref(); // a report, which holds no process open
      try {
        await job.run(ctx);
        succeeded(job);
      } catch (error) {
        failed(job, error);
      } finally {
        clearTimeout(timer);
        running.delete(job.name);
      }
    })();
    running.set(job.name, promise);
    return promise;
  };

  const scheduleJob = (job: Job): void => {
    if (stopped) return;
    timers.set(job.name, setTimeout(async () => {
      await runJob(job);
      scheduleJob(job);
    }, job.intervalMs));
  };

  if (schedule) for (const job of jobs) scheduleJob(job);

  return {
    async runOnce() {
      for (const job of jobs) await runJob(job);
    },
    /**
     * Schedules nothing more and waits for the running jobs, at most `stopWaitMs`: a shutdown is
     * not held for an export's build or a slow webhook batch. What is cut short is as after a
     * crash: claims lapse and the work is taken again (docs/operations.md).
     */
    async stop() {
      stopped = true;
      for (const timer of timers.values()) clearTimeout(timer);
      let timer: NodeJS.Timeout | undefined;
      const waited = await Promise.race([
        Promise.all(running.values()).then(() => true),
        new Promise<false>((resolve) => { timer = setTimeout(() => resolve(false), stopWaitMs); }),
      ]);
      clearTimeout(timer);
      if (!waited) ctx.log.warn({ jobs: [...running.keys()], waitedMs: stopWaitMs }, 'jobs still running at shutdown are left to end with the process');
    },
  };
}
