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

  /** Moves business time forward for every process; returns the new offset. */
  async advanceBy(seconds: number): Promise<number> {
    const rows = await this.#db.query<{ offset_ms: bigint }>(
      'UPDATE service_clock SET offset_ms = offset_ms + $1 WHERE id RETURNING offset_ms', [BigInt(seconds) * 1000n]);
    const offsetMs = Number(rows[0]!.offset_ms);
    this.raiseOffsetTo(offsetMs);
    return offsetMs;
  }
}

async function readOffsetMs(db: Queryable): Promise<number> {
  const rows = await db.query<{ offset_ms: bigint }>('SELECT offset_ms FROM service_clock WHERE id');
  return Number(rows[0]?.offset_ms ?? 0n);
}
