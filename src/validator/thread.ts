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

/**
 * How long the thread may take to open the validator (its snapshot read, its log replayed, a
 * lock of another host waited out for up to LOCK_STALE_MS) before start gives up and ends it.
 */
export const THREAD_OPEN_TIMEOUT_MS = 120_000;
/** How long close may take to execute what is queued and persist it before the thread is ended anyway. */
export const THREAD_CLOSE_TIMEOUT_MS = 30_000;

export type ThreadRequest = { kind: 'rpc'; id: number; payload: unknown } | { kind: 'close' };
export type ThreadReply =
  | { kind: 'loaded' }
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

  /**
   * Starts the thread and opens the validator in it; rejects with the validator's own error when
   * it cannot open, and ends the thread when it has not opened within `openTimeoutMs`.
   */
  static start(options: ValidatorThreadOptions & {
    log?: (entry: Record<string, unknown>) => void; openTimeoutMs?: number;
  }): Promise<ValidatorThread> {
    const { log = () => {}, openTimeoutMs = THREAD_OPEN_TIMEOUT_MS, ...threadOptions } = options;
    const worker = startThread(MODULE, threadOptions);
    return new Promise<ValidatorThread>((resolve, reject) => {
      /** whether the thread's code loaded: a start that times out says which step it was in */
      let loaded = false;
      const fail = (error: Error): void => {
        worker.off('message', early);
        worker.off('exit', exited);
        clearTimeout(timer);
        void worker.terminate();
        reject(error);
      };
      const early = (message: ThreadReply): void => {
        if (message.kind === 'log') log(message.entry);
        else if (message.kind === 'loaded') loaded = true;
        else if (message.kind === 'ready') {
          worker.off('message', early);
          worker.off('exit', exited);
          clearTimeout(timer);
          resolve(new ValidatorThread(worker, message.info, log));
        } else if (message.kind === 'failed') {
          // Its name crosses the thread (a `ValidatorLockedError` is an operator's to fix: one line).
          fail(Object.assign(new Error(message.error), { name: message.name }));
        }
      };
      const exited = (code: number): void => fail(new ValidatorThreadError(`the embedded validator stopped while opening (exit code ${code})`));
      const timer = setTimeout(() => fail(new ValidatorThreadError(`the embedded validator did not open within ${openTimeoutMs} ms `
        + `(${loaded ? 'its thread had loaded and was opening the state' : 'its thread had not loaded its code'}); its thread was ended`)),
      openTimeoutMs);
      worker.on('message', early);
      worker.once('error', fail);
      worker.once('exit', exited);
    });
  }

  /**
   * A @solana/kit transport to this thread's validator. A call whose signal aborts rejects at
   * once with the signal's reason, and its answer, should one come, is dropped.
   */
  transport(): RpcTransport {
    return (({ payload, signal }: { payload: unknown; signal?: AbortSignal }) => {
      signal?.throwIfAborted();
      if (this.#stopped) return Promise.reject(this.#stopped);
      const id = this.#nextId++;
      return new Promise((resolve, reject) => {
        const abandon = (): void => {
          this.#pending.delete(id);
          reject(signal!.reason);
        };
        signal?.addEventListener('abort', abandon, { once: true });
        const settled = <T>(settle: (value: T) => void) => (value: T): void => {
          signal?.removeEventListener('abort', abandon);
          settle(value);
        };
        this.#pending.set(id, { resolve: settled(resolve), reject: settled(reject) });
        this.#worker.postMessage({ kind: 'rpc', id, payload } satisfies ThreadRequest);
      });
    }) as RpcTransport;
  }

  readonly #publishedListeners: Array<(statuses: readonly PublishedStatus[]) => void> = [];

  /** Calls `listener` with the statuses each time the validator has made executed transactions' statuses visible. */
  onPublished(listener: (statuses: readonly PublishedStatus[]) => void): void {
    this.#publishedListeners.push(listener);
  }

  /**
   * Executes what is queued, persists and releases the state, and ends the thread. Rejects when
   * the validator could not close, or when the whole has not happened within `timeoutMs`: the
   * thread is then told to end, but a thread whose disk never answers cannot end (its pending
   * write holds it), and close says so rather than wait with it.
   */
  close(timeoutMs = THREAD_CLOSE_TIMEOUT_MS): Promise<void> {
    this.#closing ??= (async () => {
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<'late'>((resolve) => { timer = setTimeout(() => resolve('late'), timeoutMs); });
      try {
        let error: string | undefined;
        if (!this.#stopped) {
          const closed = new Promise<string | undefined>((resolve) => {
            this.#onClosed = resolve;
            this.#worker.once('exit', () => resolve(undefined));
          });
          this.#worker.postMessage({ kind: 'close' } satisfies ThreadRequest);
          const outcome = await Promise.race([closed, late]);
          error = outcome === 'late' ? `it did not close within ${timeoutMs} ms` : outcome;
        }
        // Ended whatever the close said: a thread left running would keep the process alive.
        const ended = await Promise.race([this.#worker.terminate(), late]);
        if (error) throw new Error(`closing the embedded validator: ${error}`);
        if (ended === 'late') throw new Error(`closing the embedded validator: its thread did not end within ${timeoutMs} ms`);
      } finally {
        clearTimeout(timer);
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
