/**
 * Webhook attempts are made on a thread of their own (docs/webhooks.md "The sending thread"):
 * an HTTP request costs its sender more CPU than the claim and the record around it, and on the
 * service's event loop that CPU is taken from the API's requests. The dispatcher claims and
 * records on the event loop as before and hands each batch of attempts to this thread, which
 * makes them (SSRF guard, 5 s deadline, keep-alive connections per destination) and answers
 * with their outcomes, timed on the service clock, whose offset it shares.
 *
 * The thread starts with the first batch. If it fails, or a batch outlasts every deadline it
 * could meet, its batches reject (their attempts were perhaps made: the dispatcher's leases
 * make them `lost`, retried on schedule) and the next batch starts a new thread.
 */
import type { Worker } from 'node:worker_threads';
import type { OffsetClock } from '../clock/clock.ts';
import { startThread } from '../threads/threads.ts';
import { DELIVERY_TIMEOUT_MS, type AttemptRequest, type SendOptions, type SentAttempt } from './attempt.ts';

export interface SenderThreadData {
  /** the service clock's offset (OffsetClock.offsetCell) */
  offsetCell: SharedArrayBuffer;
}
export interface SenderRequest {
  id: number;
  requests: readonly AttemptRequest[];
  options: SendOptions;
}
export type SenderReply = { id: number; sent: SentAttempt[] } | { id: number; error: string };

const MODULE = new URL('./sender-worker.ts', import.meta.url);
/** Allowed beyond a batch's rounds of 5 s deadlines before its thread counts as stuck. */
const STUCK_MARGIN_MS = 10_000;

export class AttemptSenderError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'AttemptSenderError';
  }
}

interface Pending {
  resolve(sent: SentAttempt[]): void;
  reject(error: Error): void;
  timer: NodeJS.Timeout;
}

export class AttemptSender {
  readonly #offsetCell: SharedArrayBuffer;
  #worker: Worker | null = null;
  readonly #pending = new Map<number, Pending>();
  #nextId = 1;
  #closed = false;

  constructor(clock: OffsetClock) {
    this.#offsetCell = clock.offsetCell;
  }

  /** Makes every attempt, at most `options.concurrency` at a time; the outcomes in the requests' order. */
  send(requests: readonly AttemptRequest[], options: SendOptions): Promise<SentAttempt[]> {
    if (this.#closed) return Promise.reject(new AttemptSenderError('the webhook sender is closed'));
    if (requests.length === 0) return Promise.resolve([]);
    const worker = this.#worker ?? this.#start();
    const id = this.#nextId++;
    const rounds = Math.ceil(requests.length / Math.max(1, options.concurrency));
    const limitMs = rounds * DELIVERY_TIMEOUT_MS + STUCK_MARGIN_MS;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => this.#fail(worker, new AttemptSenderError(`the webhook sender did not answer within ${limitMs} ms`)), limitMs);
      this.#pending.set(id, { resolve, reject, timer });
      // An idle thread does not keep the process alive; one with attempts in flight does.
      worker.ref();
      worker.postMessage({ id, requests, options } satisfies SenderRequest);
    });
  }

  /** Ends the thread; batches still in flight reject. */
  async close(): Promise<void> {
    this.#closed = true;
    const worker = this.#worker;
    if (worker) {
      this.#fail(worker, new AttemptSenderError('the webhook sender was closed'));
      await worker.terminate();
    }
  }

  #start(): Worker {
    const worker = startThread(MODULE, { offsetCell: this.#offsetCell } satisfies SenderThreadData);
    worker.on('message', (reply: SenderReply) => {
      const pending = this.#pending.get(reply.id);
      if (!pending) return;
      this.#pending.delete(reply.id);
      clearTimeout(pending.timer);
      if (this.#pending.size === 0) worker.unref();
      if ('error' in reply) pending.reject(new AttemptSenderError(reply.error));
      else pending.resolve(reply.sent);
    });
    worker.on('error', (error) => this.#fail(worker, new AttemptSenderError(`the webhook sender failed: ${error.message}`)));
    worker.on('exit', (code) => this.#fail(worker, new AttemptSenderError(`the webhook sender stopped (exit code ${code})`)));
    this.#worker = worker;
    return worker;
  }

  /** Rejects everything the thread held and lets it go; the next batch starts another. */
  #fail(worker: Worker, error: Error): void {
    if (this.#worker !== worker) return;
    this.#worker = null;
    for (const pending of this.#pending.values()) {
      clearTimeout(pending.timer);
      pending.reject(error);
    }
    this.#pending.clear();
    void worker.terminate();
  }
}
