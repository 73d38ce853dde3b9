/**
 * The one source of business time. Every component that needs "now" takes a Clock, so tests
 * and the test clock can move time, and the local validator's Clock sysvar follows it.
 */
export interface Clock {
  /** Milliseconds since the Unix epoch. */
  nowMs(): number;
}

/**
 * Wall time plus an offset that only ever moves forward (the test clock advances it). The
 * offset lives in shared memory: a clock made over another clock's `offsetCell` in a worker
 * thread (the embedded validator's) reads and moves the very same offset.
 */
export class OffsetClock implements Clock {
  readonly #offset: BigInt64Array;

  /** `offset`: a starting offset in ms, or another clock's `offsetCell` to share. */
  constructor(offset: number | SharedArrayBuffer = 0) {
    if (typeof offset === 'number') {
      this.#offset = new BigInt64Array(new SharedArrayBuffer(BigInt64Array.BYTES_PER_ELEMENT));
      this.#offset[0] = BigInt(Math.ceil(offset));
    } else {
      this.#offset = new BigInt64Array(offset, 0, 1);
    }
  }

  nowMs(): number {
    return Date.now() + this.offsetMs;
  }

  get offsetMs(): number {
    return Number(Atomics.load(this.#offset, 0));
  }

  /** The memory the offset lives in, for a clock in another thread (`new OffsetClock(cell)`). */
  get offsetCell(): SharedArrayBuffer {
    return this.#offset.buffer as SharedArrayBuffer;
  }

  advance(seconds: number): void {
    if (!Number.isInteger(seconds) || seconds < 0) throw new RangeError('seconds must be a non-negative integer');
    Atomics.add(this.#offset, 0, BigInt(seconds) * 1000n);
  }

  /** Raises the offset to `offsetMs`; a lower value leaves it as it is (whichever thread moves it). */
  protected raiseOffsetTo(offsetMs: number): void {
    const target = BigInt(Math.ceil(offsetMs));
    for (;;) {
      const current = Atomics.load(this.#offset, 0);
      if (target <= current || Atomics.compareExchange(this.#offset, 0, current, target) === current) return;
    }
  }

  /** Moves the clock so that now is at least `targetMs`; never moves it backwards. */
  setAtLeast(targetMs: number): void {
    this.raiseOffsetTo(targetMs - Date.now());
  }
}

/** A clock that stands still until told to move: for deterministic tests. */
export class ManualClock implements Clock {
  #nowMs: number;

  constructor(startMs: number) {
    this.#nowMs = startMs;
  }

  nowMs(): number {
    return this.#nowMs;
  }

  advance(seconds: number): void {
    this.#nowMs += seconds * 1000;
  }

  set(ms: number): void {
    this.#nowMs = ms;
  }
}
