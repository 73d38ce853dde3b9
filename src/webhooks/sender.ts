/**
 * Webhook attempts are made on a thread of their own (docs/webhooks.md "The sending thread"):
 * an HTTP request costs its sender more CPU than the claim and the record around it, and on the
 * service's event loop that CPU is taken from the API's requests. The dispatcher claims and
 * records on the event loop as before and hands each batch of attempts to this thread, which
 * makes them (SSRF guard, 5 s deadline, keep-alive connections per destination) and answers
 * with their outcomes, timed on the service clock, whose offset it shares.
 *
 * The thread starts with the first batch. If it fails, or a batch outlasts every deadline it
 * could meet, its batches reject with an AttemptSenderError (their attempts were perhaps made)
 * and the next batch starts a new thread. The dispatcher sends such a batch once more
 * (delivery.ts `sendBatch`).
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
/**
 * Allowed beyond a batch's rounds of 5 s deadlines before its thread counts as stuck: the
 * batch's name resolution, which has a 5 s deadline of its own (attempt.ts), plus 10 s.
 */
const STUCK_MARGIN_MS = DELIVERY_TIMEOUT_MS + 10_000;

export interface AttemptSenderOptions {
  /** the thread's module; tests give threads that fail */
  module?: URL;
  /** a batch's thread counts as stuck after its rounds of `roundMs` plus `marginMs` */
  stuckAfter?: { roundMs: number; marginMs: number };
}

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
  readonly #module: URL;
  readonly #stuckAfter: { roundMs: number; marginMs: number };
  #worker: Worker | null = null;
  readonly #pending = new Map<number, Pending>();
  #nextId = 1;
  #closed = false;

  constructor(clock: OffsetClock, options: AttemptSenderOptions = {}) {
    this.#offsetCell = clock.offsetCell;
    this.#module = options.module ?? MODULE;
    this.#stuckAfter = options.stuckAfter ?? { roundMs: DELIVERY_TIMEOUT_MS, marginMs: STUCK_MARGIN_MS };
  }

  /**
   * Makes every attempt, at most `options.concurrency` at a time; the outcomes in the requests'
   * order. Rejects with an AttemptSenderError if the thread fails or gets stuck meanwhile.
   */
  async send(requests: readonly AttemptRequest[], options: SendOptions): Promise<SentAttempt[]> {
    if (this.#closed) throw new AttemptSenderError('the webhook sender is closed');
    if (requests.length === 0) return [];
    // Only what an attempt needs crosses to the thread (a claim carries more).
    const batch: SenderRequest = {
      id: this.#nextId++,
      requests: requests.map(({ deliveryId, eventId, attempt, url, signing, body }) => ({
        deliveryId, eventId, attempt, url, signing: { secret: signing.secret, previousSecret: signing.previousSecret }, body,
      })),
      options: { allowPrivate: options.allowPrivate, concurrency: options.concurrency, startWithinMs: options.startWithinMs },
    };
    let worker: Worker;
    try {
      worker = this.#worker ?? this.#start();
    } catch (error) {
      throw new AttemptSenderError(`the webhook sender could not start: ${error instanceof Error ? error.message : String(error)}`);
    }
    const rounds = Math.ceil(requests.length / Math.max(1, options.concurrency));
    const limitMs = rounds * this.#stuckAfter.roundMs + this.#stuckAfter.marginMs;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => this.#fail(worker, new AttemptSenderError(`the webhook sender did not answer within ${limitMs} ms`)), limitMs);
      this.#pending.set(batch.id, { resolve, reject, timer });
      // An idle thread does not keep the process alive; one with attempts in flight does.
      worker.ref();
      try {
        worker.postMessage(batch);
      } catch (error) {
        this.#settled(worker, batch.id);
        clearTimeout(timer);
        reject(new AttemptSenderError(`the webhook sender could not be given the batch: ${error instanceof Error ? error.message : String(error)}`));
      }
    });
  }

  /** Whether close() was called: nothing more is sent. */
  get closed(): boolean {
    return this.#closed;
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
    const worker = startThread(this.#module, { offsetCell: this.#offsetCell } satisfies SenderThreadData);
    worker.on('message', (reply: SenderReply) => {
      const pending = this.#settled(worker, reply.id);
      if (!pending) return;
      clearTimeout(pending.timer);
      if ('error' in reply) pending.reject(new AttemptSenderError(reply.error));
      else pending.resolve(reply.sent);
    });
    worker.on('error', (error) => this.#fail(worker, new AttemptSenderError(`the webhook sender failed: ${error.message}`)));
    worker.on('exit', (code) => this.#fail(worker, new AttemptSenderError(`the webhook sender stopped (exit code ${code})`)));
    this.#worker = worker;
    return worker;
  }

  /** Takes a batch off the pending ones (a late answer finds none); an idle thread is unref'd. */
  #settled(worker: Worker, id: number): Pending | undefined {
    const pending = this.#pending.get(id);
    this.#pending.delete(id);
    if (this.#pending.size === 0) worker.unref();
    return pending;
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
