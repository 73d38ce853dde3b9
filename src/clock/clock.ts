/**
 * The one source of business time. Every component that needs "now" takes a Clock, so tests
 * and the test clock can move time, and the local validator's Clock sysvar follows it.
 */
export interface Clock {
  /** Milliseconds since the Unix epoch. */
  nowMs(): number;
}

/** Wall time plus an offset that only ever moves forward (the test clock advances it). */
export class OffsetClock implements Clock {
  #offsetMs: number;

  constructor(offsetMs = 0) {
    this.#offsetMs = offsetMs;
  }

  nowMs(): number {
    return Date.now() + this.#offsetMs;
  }

  get offsetMs(): number {
    return this.#offsetMs;
  }

  advance(seconds: number): void {
    if (!Number.isInteger(seconds) || seconds < 0) throw new RangeError('seconds must be a non-negative integer');
    this.#offsetMs += seconds * 1000;
  }

  /** Raises the offset to `offsetMs`; a lower value leaves it as it is. */
  protected raiseOffsetTo(offsetMs: number): void {
    if (offsetMs > this.#offsetMs) this.#offsetMs = offsetMs;
  }

  /** Moves the clock so that now is at least `targetMs`; never moves it backwards. */
  setAtLeast(targetMs: number): void {
    const deltaMs = targetMs - Date.now();
    if (deltaMs > this.#offsetMs) this.#offsetMs = deltaMs;
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
