/**
 * Background jobs: each a name, an interval, a timeout and a body that calls a use-case. One
 * job never overlaps itself; a failure is logged and the job runs again at its next tick.
 * Several processes may run the same jobs: they coordinate through row locks
 * (FOR UPDATE SKIP LOCKED), never through memory.
 */
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

export function startJobs(ctx: AppContext, jobs: readonly Job[], { schedule = true } = {}): JobRunner {
  const timers = new Map<string, NodeJS.Timeout>();
  const running = new Map<string, Promise<void>>();
  let stopped = false;

  const runJob = (job: Job): Promise<void> => {
    const current = running.get(job.name);
    if (current) return current;
    const promise = (async () => {
      let timer: NodeJS.Timeout | undefined;
      try {
        await Promise.race([
          job.run(ctx),
          new Promise<never>((_resolve, reject) => {
            timer = setTimeout(() => reject(new Error(`job ${job.name} timed out after ${job.timeoutMs} ms`)), job.timeoutMs);
          }),
        ]);
      } catch (error) {
        ctx.log.error({ err: error, job: job.name }, 'job failed');
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
    async stop() {
      stopped = true;
      for (const timer of timers.values()) clearTimeout(timer);
      await Promise.all(running.values());
    },
  };
}
