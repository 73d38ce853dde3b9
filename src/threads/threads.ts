/**
 * Worker threads of the service: each runs one TypeScript module (through src/threads/entry.mjs)
 * and is given its data as `workerData`.
 */
import { Worker } from 'node:worker_threads';

const ENTRY = new URL('./entry.mjs', import.meta.url);

/** Starts a thread running `module` (a file URL), which finds `data` in its `workerData`. */
export function startThread(module: URL, data: object): Worker {
  return new Worker(ENTRY, { workerData: { ...data, module: module.href } });
}
