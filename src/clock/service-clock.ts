/**
 * The service clock: wall time plus an offset kept in the database, so the test clock moves
 * time for every process (each re-reads the offset) and for the chain's Clock sysvar.
 */
import type { Queryable } from '../db/database.ts';
import { OffsetClock } from './clock.ts';

export class ServiceClock extends OffsetClock {
  readonly #db: Queryable;

  private constructor(db: Queryable, offsetMs: number) {
    super(offsetMs);
    this.#db = db;
  }

  static async load(db: Queryable): Promise<ServiceClock> {
    return new ServiceClock(db, await readOffsetMs(db));
  }

  /** Picks up an advance made by another process. */
  async refresh(): Promise<void> {
    this.raiseOffsetTo(await readOffsetMs(this.#db));
  }

  /**
   * Moves business time forward for every process; returns the new offset, or null (nothing
   * moved) when the offset would pass `maxOffsetMs`.
   */
  async advanceBy(seconds: number, maxOffsetMs = Number.MAX_SAFE_INTEGER): Promise<number | null> {
    const rows = await this.#db.query<{ offset_ms: bigint }>(
      'UPDATE service_clock SET offset_ms = offset_ms + $1 WHERE id AND offset_ms + $1 <= $2 RETURNING offset_ms',
      [BigInt(seconds) * 1000n, BigInt(maxOffsetMs)]);
    if (rows.length === 0) return null;
    const offsetMs = Number(rows[0]!.offset_ms);
    this.raiseOffsetTo(offsetMs);
    return offsetMs;
  }
}

async function readOffsetMs(db: Queryable): Promise<number> {
  const rows = await db.query<{ offset_ms: bigint }>('SELECT offset_ms FROM service_clock WHERE id');
  return Number(rows[0]?.offset_ms ?? 0n);
}
