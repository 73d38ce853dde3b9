/**
 * A fixed number of slots for work that must not pile up: holders take one and give it back;
 * `acquire` waits its turn (first come, first served) for at most a deadline; `tryAcquire` does
 * not wait at all.
 */
export class Slots {
  #free: number;
  readonly #waiting: Array<{ grant(): void }> = [];

  constructor(count: number) {
    if (!Number.isInteger(count) || count < 1) throw new RangeError('Slots needs a positive integer count');
    this.#free = count;
  }

  /** Takes a slot if one is free now. */
  tryAcquire(): boolean {
    if (this.#free === 0) return false;
    this.#free -= 1;
    return true;
  }

  /** Resolves true once a slot is taken, or false when `timeoutMs` passes first (nothing taken). */
  acquire(timeoutMs: number): Promise<boolean> {
    if (this.tryAcquire()) return Promise.resolve(true);
    return new Promise((resolve) => {
      const waiter = {
        grant: () => {
          clearTimeout(timer);
          resolve(true);
        },
      };
      const timer = setTimeout(() => {
        this.#waiting.splice(this.#waiting.indexOf(waiter), 1);
        resolve(false);
      }, Math.max(0, timeoutMs));
      this.#waiting.push(waiter);
    });
  }

  /** Gives a slot back: to the longest waiter, or to the free ones. */
  release(): void {
    const next = this.#waiting.shift();
    if (next) next.grant();
    else this.#free += 1;
  }
}
