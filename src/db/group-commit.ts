/**
 * Group commit: work that arrives while earlier work is being written waits, and is written
 * together in the next batch — one database transaction and a fixed handful of statements for
 * many requests, instead of a transaction and a dozen statements each. An idle queue writes the
 * first item at once, so a lone request never waits for company.
 */

/** What one item of a batch came to: its result, or the error its caller gets. */
export type BatchOutcome<Result> = { ok: true; value: Result } | { ok: false; error: unknown };

interface Waiting<Item, Result> {
  item: Item;
  resolve(value: Result): void;
  reject(error: unknown): void;
}

export class GroupCommit<Item, Result> {
  readonly #write: (items: Item[], retried: boolean) => Promise<Array<BatchOutcome<Result>>>;
  readonly #maxBatch: number;
  readonly #concurrency: number;
  readonly #gather: boolean;
  #gathering = false;
  #queue: Array<Waiting<Item, Result>> = [];
  #running = 0;

  /**
   * `write` answers one outcome per item, in order, and must write nothing when it throws (one
   * database transaction) — unless the throw is a lost answer to its COMMIT, which it cannot
   * tell from a failure: each item is then written again on its own with `retried` set, and a
   * write that may find its item already written must look (the payments do). At most
   * `concurrency` batches are written at once, each of at most `maxBatch` items. `gather`: an
   * idle queue waits until the promise callbacks queued meanwhile have run before it writes, so
   * that work submitted together (many waiters woken by one answer) is written as one batch
   * rather than a batch of one and then the rest.
   */
  constructor(
    write: (items: Item[], retried: boolean) => Promise<Array<BatchOutcome<Result>>>,
    options: { maxBatch: number; concurrency: number; gather?: boolean },
  ) {
    this.#write = write;
    this.#maxBatch = options.maxBatch;
    this.#concurrency = options.concurrency;
    this.#gather = options.gather ?? false;
  }

  submit(item: Item): Promise<Result> {
    return new Promise<Result>((resolve, reject) => {
      this.#queue.push({ item, resolve, reject });
      if (!this.#gather) this.#next();
      else if (!this.#gathering) {
        this.#gathering = true;
        // After the promise callbacks queued now have run (they may submit too), without waiting
        // for the event loop to turn: work made of promise callbacks only would hold that off.
        process.nextTick(() => {
          this.#gathering = false;
          this.#next();
        });
      }
    });
  }

  /** Items waiting for a batch (not those being written). */
  get backlog(): number {
    return this.#queue.length;
  }

  /** Resolves once nothing is queued or being written. */
  idle(): Promise<void> {
    if (this.#running === 0 && this.#queue.length === 0 && !this.#gathering) return Promise.resolve();
    return new Promise((resolve) => this.#idleWaiters.push(resolve));
  }

  #idleWaiters: Array<() => void> = [];

  #next(): void {
    if (this.#running === 0 && this.#queue.length === 0) {
      const waiters = this.#idleWaiters;
      this.#idleWaiters = [];
      for (const resolve of waiters) resolve();
      return;
    }
    while (this.#running < this.#concurrency && this.#queue.length > 0) {
      const batch = this.#queue.splice(0, this.#maxBatch);
      this.#running += 1;
      void this.#run(batch).finally(() => {
        this.#running -= 1;
        this.#next();
      });
    }
  }

  /**
   * Writes a batch. When the write fails (it wrote nothing: one database transaction), a batch
   * of several is written again one item per write, side by side (a database that is down fails
   * them all at once, not one after the other), so a failure one item causes is its alone.
   */
  async #run(batch: Array<Waiting<Item, Result>>, retried = false): Promise<void> {
    let outcomes: Array<BatchOutcome<Result>>;
    try {
      outcomes = await this.#write(batch.map((waiting) => waiting.item), retried);
      if (outcomes.length !== batch.length) throw new Error(`a batch of ${batch.length} answered ${outcomes.length} outcomes`);
    } catch (error) {
      if (batch.length === 1) batch[0]!.reject(error);
      else await Promise.all(batch.map((waiting) => this.#run([waiting], true)));
      return;
    }
    batch.forEach((waiting, i) => {
      const outcome = outcomes[i]!;
      if (outcome.ok) waiting.resolve(outcome.value);
      else waiting.reject(outcome.error);
    });
  }
}
