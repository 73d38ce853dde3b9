/**
 * Where an export's file lives: a PostgreSQL large object, referenced by the export's row
 * (docs/exports.md, "Storage"). The same SQL on PostgreSQL and PGlite, so one code path: with
 * PGlite the object sits in the database under the data dir; with PostgreSQL any API process
 * serves a file any worker built, without a shared disk. The file is written in chunks of
 * CHUNK_BYTES (`lo_put`) and read in chunks of READ_CHUNK_BYTES (`lo_get`), so neither side
 * ever holds it whole.
 */
import type { Queryable } from '../db/database.ts';

/** Large enough to keep round trips few (one per megabyte), small enough to keep memory flat. */
export const CHUNK_BYTES = 1024 * 1024;
/** Smaller than a write: the driver reads bytea as hex text, twice the size, before decoding it. */
const READ_CHUNK_BYTES = 256 * 1024;

/**
 * Appends text to a large object through two chunk buffers: one is being stored while the next
 * fills (the database writes while the caller renders), and they are reused, so the text is
 * encoded straight into them: no per-chunk string or buffer is made. A megabyte string would be
 * allocated straight in V8's old generation, where only a full collection frees it.
 */
export class ContentWriter {
  readonly #buffers = [Buffer.allocUnsafe(CHUNK_BYTES), Buffer.allocUnsafe(CHUNK_BYTES)];
  /** which buffer fills, and how far */
  #current = 0;
  #filled = 0;
  #sentBytes = 0;
  /** the store of the other buffer; it may be reused once this settles */
  #inFlight: Promise<unknown> = Promise.resolve();

  constructor(private readonly db: Queryable, private readonly oid: number) {}

  /** Buffers the text, sending a full chunk first when it does not fit. */
  async write(text: string): Promise<void> {
    const length = Buffer.byteLength(text, 'utf8');
    if (this.#filled + length > CHUNK_BYTES) await this.#flush();
    if (length > CHUNK_BYTES) {
      // One record larger than a chunk (a very long memo): sent on its own.
      await this.#send(Buffer.from(text, 'utf8'));
      return;
    }
    this.#filled += this.#buffers[this.#current]!.write(text, this.#filled, 'utf8');
  }

  /** Sends what is left, waits until all of it is stored, and answers the file's size in bytes. */
  async close(): Promise<number> {
    await this.#flush();
    await this.#inFlight;
    return this.#sentBytes;
  }

  async #flush(): Promise<void> {
    if (this.#filled === 0) return;
    const chunk = this.#buffers[this.#current]!.subarray(0, this.#filled);
    await this.#send(chunk);
    this.#current = 1 - this.#current;
    this.#filled = 0;
  }

  async #send(bytes: Buffer): Promise<void> {
    // The previous chunk must be stored (or its failure seen) before this one goes, and before
    // its buffer is filled again.
    await this.#inFlight;
    const offset = this.#sentBytes;
    this.#sentBytes += bytes.length;
    this.#inFlight = this.db.query('SELECT lo_put($1, $2, $3)', [this.oid, offset, bytes]);
    // A failure surfaces at the next send or at close; until then it must not count as unhandled.
    this.#inFlight.catch(() => {});
  }
}

/** The file, chunk by chunk, for streaming to a client; pulled on demand, so a slow reader holds one chunk. */
export async function* readContent(db: Queryable, oid: number, sizeBytes: number): AsyncGenerator<Buffer> {
  for (let offset = 0; offset < sizeBytes; offset += READ_CHUNK_BYTES) {
    const length = Math.min(READ_CHUNK_BYTES, sizeBytes - offset);
    const [row] = await db.query<{ chunk: Uint8Array }>('SELECT lo_get($1, $2, $3) AS chunk', [oid, offset, length]);
    const chunk = row?.chunk;
    if (!chunk || chunk.length !== length) throw new Error(`export content ${oid} is shorter than its recorded size`);
    yield Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
  }
}

/** Deletes large objects; ids that no longer exist are skipped (a retried clean-up is harmless). */
export async function deleteContent(q: Queryable, oids: readonly number[]): Promise<void> {
  if (oids.length === 0) return;
  await q.query(
    `SELECT lo_unlink(m.oid) FROM pg_largeobject_metadata m WHERE m.oid = ANY($1::oid[])`, [oids.map(String)]);
}
