/**
 * The embedded validator in its own worker thread. Each slot boundary executes every queued
 * transaction at once (LiteSVM, synchronous); on the service's event loop that stalled every
 * request in flight for as long, once a slot. Here it runs beside the event loop; the service
 * talks to it through a @solana/kit transport over the thread's message port (structured clone
 * carries the bigint values the in-process transport carries), and the business clock's offset
 * is shared memory (OffsetClock.offsetCell), so the test clock moves both at once.
 */
import type { Worker } from 'node:worker_threads';
import type { RpcTransport } from '@solana/kit';
import { startThread } from '../threads/threads.ts';
import type { PublishedStatus, ValidatorInfo } from './validator.ts';

export interface ValidatorThreadOptions {
  dataDir?: string;
  slotMs?: number;
  programSoPath?: string | null;
  /** the service clock's offset (OffsetClock.offsetCell) */
  offsetCell: SharedArrayBuffer;
}

export type ThreadRequest = { kind: 'rpc'; id: number; payload: unknown } | { kind: 'close' };
export type ThreadReply =
  | { kind: 'ready'; info: ValidatorInfo }
  | { kind: 'failed'; error: string; name: string }
  | { kind: 'log'; entry: Record<string, unknown> }
  | { kind: 'published'; statuses: readonly PublishedStatus[] }
  | { kind: 'response'; id: number; response?: unknown; error?: string }
  | { kind: 'closed'; error?: string };

const MODULE = new URL('./thread-worker.ts', import.meta.url);

export class ValidatorThreadError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ValidatorThreadError';
  }
}

export class ValidatorThread {
  readonly info: ValidatorInfo;
  readonly #worker: Worker;
  readonly #pending = new Map<number, { resolve(response: unknown): void; reject(error: Error): void }>();
  #nextId = 1;
  /** why the thread can no longer answer; null while it runs */
  #stopped: Error | null = null;
  #closing: Promise<void> | null = null;
  #onClosed: ((error?: string) => void) | null = null;

  private constructor(worker: Worker, info: ValidatorInfo, log: (entry: Record<string, unknown>) => void) {
    this.#worker = worker;
    this.info = info;
    worker.on('message', (message: ThreadReply) => {
      if (message.kind === 'response') this.#settle(message);
      else if (message.kind === 'published') for (const listener of this.#publishedListeners) listener(message.statuses);
      else if (message.kind === 'log') log(message.entry);
      else if (message.kind === 'closed') this.#onClosed?.(message.error);
    });
    worker.on('error', (error) => this.#stop(new ValidatorThreadError(`the embedded validator failed: ${error.message}`)));
    worker.on('exit', (code) => this.#stop(new ValidatorThreadError(`the embedded validator stopped (exit code ${code})`)));
  }

  /** Starts the thread and opens the validator in it; rejects with the validator's own error when it cannot open. */
  static start(options: ValidatorThreadOptions & { log?: (entry: Record<string, unknown>) => void }): Promise<ValidatorThread> {
    const { log = () => {}, ...threadOptions } = options;
    const worker = startThread(MODULE, threadOptions);
    return new Promise((resolve, reject) => {
      const early = (message: ThreadReply): void => {
        if (message.kind === 'log') log(message.entry);
        else if (message.kind === 'ready') {
          worker.off('message', early);
          worker.off('exit', exited);
          resolve(new ValidatorThread(worker, message.info, log));
        } else if (message.kind === 'failed') {
          worker.off('exit', exited);
          void worker.terminate();
          // Its name crosses the thread (a `ValidatorLockedError` is an operator's to fix: one line).
          reject(Object.assign(new Error(message.error), { name: message.name }));
        }
      };
      const exited = (code: number): void => reject(new ValidatorThreadError(`the embedded validator stopped while opening (exit code ${code})`));
      worker.on('message', early);
      worker.once('error', reject);
      worker.once('exit', exited);
    });
  }

  /** A @solana/kit transport to this thread's validator. */
  transport(): RpcTransport {
    return (({ payload, signal }: { payload: unknown; signal?: AbortSignal }) => {
      signal?.throwIfAborted();
      if (this.#stopped) return Promise.reject(this.#stopped);
      const id = this.#nextId++;
      return new Promise((resolve, reject) => {
        this.#pending.set(id, { resolve, reject });
        this.#worker.postMessage({ kind: 'rpc', id, payload } satisfies ThreadRequest);
      });
    }) as RpcTransport;
  }

  readonly #publishedListeners: Array<(statuses: readonly PublishedStatus[]) => void> = [];

  /** Calls `listener` with the statuses each time the validator has made executed transactions' statuses visible. */
  onPublished(listener: (statuses: readonly PublishedStatus[]) => void): void {
    this.#publishedListeners.push(listener);
  }

  /** Executes what is queued, persists and releases the state, and ends the thread. */
  close(): Promise<void> {
    this.#closing ??= (async () => {
      try {
        if (!this.#stopped) {
          const closed = new Promise<string | undefined>((resolve) => {
            this.#onClosed = resolve;
            this.#worker.once('exit', () => resolve(undefined));
          });
          this.#worker.postMessage({ kind: 'close' } satisfies ThreadRequest);
          const error = await closed;
          if (error) throw new Error(`closing the embedded validator: ${error}`);
        }
      } finally {
        // Ended whatever the close said: a thread left running would keep the process alive.
        await this.#worker.terminate();
      }
    })();
    return this.#closing;
  }

  #settle(message: Extract<ThreadReply, { kind: 'response' }>): void {
    const pending = this.#pending.get(message.id);
    if (!pending) return;
    this.#pending.delete(message.id);
    if (message.error !== undefined) pending.reject(new ValidatorThreadError(message.error));
    else pending.resolve(message.response);
  }

  #stop(error: Error): void {
    this.#stopped ??= error;
    for (const pending of this.#pending.values()) pending.reject(this.#stopped);
    this.#pending.clear();
  }
}
