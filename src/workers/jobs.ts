/**
 * The job catalogue: every background job of the service, in one visible list.
 */
import type { Job } from './runner.ts';

export const JOBS: readonly Job[] = [
  {
    name: 'clock.refresh',
    intervalMs: 1_000,
    timeoutMs: 5_000,
    run: (ctx) => ctx.clock.refresh(),
  },
];
