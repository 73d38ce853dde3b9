/**
 * Results of executed transactions, by signature: what getSignatureStatuses and getTransaction
 * answer. Bounded: the newest `capacity` signatures (default 1,000,000) keep their status; the
 * newest `detailCapacity` (default 20,000) also keep their wire bytes, logs and balances.
 *
 * Persisted as JSON-lines segment files under `<dataDir>/transactions/`: `<n>.jsonl` holds the
 * status lines, `<n>.detail.jsonl` the details, each segment `segmentEntries` transactions.
 * Whole old segments are deleted once the newer ones hold `capacity` entries. A batch is
 * appended and flushed before the chain snapshot that contains its effects is written, and
 * lines newer than the snapshot (a crash in between) are cut off at load.
 */
import { mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { open, unlink, type FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import type { TransactionErrorJson } from './transaction-error.ts';

export interface TransactionRecord {
  /** Execution order, increasing across restarts. */
  seq: number;
  signature: string;
  slot: number;
  /** Unix seconds of the slot's clock. */
  blockTime: number;
  err: TransactionErrorJson | null;
  computeUnits: number;
  fee: number;
}

export interface TransactionDetail {
  wire: Uint8Array;
  logs: string[];
  preBalances: bigint[];
  postBalances: bigint[];
}

export interface ExecutedTransaction {
  record: TransactionRecord;
  detail: TransactionDetail;
}

export interface TransactionStoreOptions {
  capacity?: number;
  detailCapacity?: number;
}

const DEFAULT_CAPACITY = 1_000_000;
const DEFAULT_DETAIL_CAPACITY = 20_000;
/** Segments per capacity: the bound is exceeded by at most one segment's worth on disk. */
const SEGMENTS_PER_CAPACITY = 50;

interface StatusLine { q: number; s: string; sl: number; t: number; e: TransactionErrorJson | null; cu: number; f: number }
interface DetailLine { s: string; q: number; tx: string; l: string[]; pre: string[]; post: string[] }

export class TransactionStore {
  readonly capacity: number;
  readonly detailCapacity: number;
  readonly segmentEntries: number;
  readonly #records = new Map<string, TransactionRecord>();
  readonly #details = new Map<string, TransactionDetail>();
  readonly #dir: string | null;
  #segments: number[] = [];
  #segmentCount = 0;
  #statusHandle: FileHandle | null = null;
  #detailHandle: FileHandle | null = null;

  constructor(dir: string | null, options: TransactionStoreOptions = {}) {
    this.capacity = options.capacity ?? DEFAULT_CAPACITY;
    this.detailCapacity = Math.min(options.detailCapacity ?? DEFAULT_DETAIL_CAPACITY, this.capacity);
    this.segmentEntries = Math.max(100, Math.ceil(this.capacity / SEGMENTS_PER_CAPACITY));
    this.#dir = dir;
  }

  get size(): number {
    return this.#records.size;
  }

  get(signature: string): TransactionRecord | undefined {
    return this.#records.get(signature);
  }

  detail(signature: string): TransactionDetail | undefined {
    return this.#details.get(signature);
  }

  has(signature: string): boolean {
    return this.#records.has(signature);
  }

  /** Makes a batch visible (after it has been persisted). */
  publish(batch: readonly ExecutedTransaction[]): void {
    for (const { record, detail } of batch) {
      this.#records.set(record.signature, record);
      this.#details.set(record.signature, detail);
    }
    this.#evict();
  }

  #evict(): void {
    // Maps iterate in insertion order, which is execution order: the oldest go first.
    if (this.#records.size > this.capacity) {
      let excess = this.#records.size - this.capacity;
      for (const key of this.#records.keys()) {
        if (excess-- <= 0) break;
        this.#records.delete(key);
      }
    }
    if (this.#details.size > this.detailCapacity) {
      let excess = this.#details.size - this.detailCapacity;
      for (const key of this.#details.keys()) {
        if (excess-- <= 0) break;
        this.#details.delete(key);
      }
    }
  }

  /**
   * Reads the segments back, dropping every line whose transaction is newer than `maxSeq` (the
   * last one the chain snapshot contains) and any torn last line.
   */
  load(maxSeq: number): void {
    if (!this.#dir) return;
    mkdirSync(this.#dir, { recursive: true, mode: 0o700 });
    this.#segments = readdirSync(this.#dir)
      .map((name) => /^(\d{8})\.jsonl$/.exec(name)?.[1])
      .filter((n): n is string => n !== undefined)
      .map(Number)
      .sort((a, b) => a - b);
    const detailFrom = Math.max(0, this.#segments.length - Math.ceil(this.detailCapacity / this.segmentEntries) - 1);
    this.#segments.forEach((segment, index) => {
      let dropped = false;
      const statusLines = this.#readLines(this.#statusPath(segment), (line: StatusLine) => line.q <= maxSeq, () => {
        dropped = true;
      });
      for (const line of statusLines) {
        this.#records.set(line.s, {
          seq: line.q, signature: line.s, slot: line.sl, blockTime: line.t, err: line.e, computeUnits: line.cu, fee: line.f,
        });
      }
      if (index === this.#segments.length - 1) this.#segmentCount = statusLines.length;
      // Old segments' details are not kept in memory, and are only read to cut stale lines.
      const keepDetails = index >= detailFrom;
      if (!keepDetails && !dropped) return;
      const detailLines = this.#readLines(this.#detailPath(segment), (line: DetailLine) => line.q <= maxSeq);
      if (!keepDetails) return;
      for (const line of detailLines) {
        this.#details.set(line.s, {
          wire: Buffer.from(line.tx, 'base64'),
          logs: line.l,
          preBalances: line.pre.map(BigInt),
          postBalances: line.post.map(BigInt),
        });
      }
    });
    this.#evict();
  }

  /** Parses a JSON-lines file, rewriting it when lines had to be dropped. */
  #readLines<T>(path: string, keep: (line: T) => boolean, onDrop?: () => void): T[] {
    let text: string;
    try {
      text = readFileSync(path, 'utf8');
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'ENOENT') return [];
      throw error;
    }
    const rawLines = text.split('\n');
    if (rawLines.at(-1) === '') rawLines.pop();
    const lines: T[] = [];
    const keptRaw: string[] = [];
    for (const raw of rawLines) {
      let line: T;
      try {
        line = JSON.parse(raw) as T;
      } catch {
        continue; // a torn write at a crash
      }
      if (!keep(line)) continue;
      lines.push(line);
      keptRaw.push(raw);
    }
    if (keptRaw.length !== rawLines.length) {
      onDrop?.();
      writeFileSync(path, keptRaw.map((l) => `${l}\n`).join(''), { mode: 0o600 });
    }
    return lines;
  }

  #statusPath(segment: number): string {
    return join(this.#dir!, `${String(segment).padStart(8, '0')}.jsonl`);
  }

  #detailPath(segment: number): string {
    return join(this.#dir!, `${String(segment).padStart(8, '0')}.detail.jsonl`);
  }

  /** Appends a batch to the segment files and flushes them to disk. */
  async append(batch: readonly ExecutedTransaction[]): Promise<void> {
    if (!this.#dir || batch.length === 0) return;
    let start = 0;
    while (start < batch.length) {
      if (!this.#statusHandle || this.#segmentCount >= this.segmentEntries) await this.#rotate();
      const room = this.segmentEntries - this.#segmentCount;
      const part = batch.slice(start, start + room);
      let statusText = '';
      let detailText = '';
      for (const { record: r, detail: d } of part) {
        const status: StatusLine = { q: r.seq, s: r.signature, sl: r.slot, t: r.blockTime, e: r.err, cu: r.computeUnits, f: r.fee };
        statusText += `${JSON.stringify(status)}\n`;
        const detailLine: DetailLine = {
          s: r.signature, q: r.seq, tx: Buffer.from(d.wire.buffer, d.wire.byteOffset, d.wire.byteLength).toString('base64'),
          l: d.logs, pre: d.preBalances.map(String), post: d.postBalances.map(String),
        };
        detailText += `${JSON.stringify(detailLine)}\n`;
      }
      await Promise.all([this.#statusHandle!.appendFile(statusText), this.#detailHandle!.appendFile(detailText)]);
      await Promise.all([this.#statusHandle!.datasync(), this.#detailHandle!.datasync()]);
      this.#segmentCount += part.length;
      start += part.length;
    }
  }

  async #rotate(): Promise<void> {
    const current = this.#segments.at(-1);
    if (this.#statusHandle && current !== undefined && this.#segmentCount < this.segmentEntries) return;
    await this.#closeHandles();
    mkdirSync(this.#dir!, { recursive: true, mode: 0o700 });
    let segment = current ?? 0;
    if (current === undefined || this.#segmentCount >= this.segmentEntries) {
      segment = (current ?? 0) + 1;
      this.#segments.push(segment);
      this.#segmentCount = 0;
    }
    this.#statusHandle = await open(this.#statusPath(segment), 'a', 0o600);
    this.#detailHandle = await open(this.#detailPath(segment), 'a', 0o600);
    // Whole segments beyond the capacity are no longer needed.
    const keep = Math.ceil(this.capacity / this.segmentEntries) + 1;
    while (this.#segments.length > keep) {
      const old = this.#segments.shift()!;
      await Promise.all([unlink(this.#statusPath(old)).catch(() => {}), unlink(this.#detailPath(old)).catch(() => {})]);
    }
  }

  async #closeHandles(): Promise<void> {
    const handles = [this.#statusHandle, this.#detailHandle];
    this.#statusHandle = null;
    this.#detailHandle = null;
    await Promise.all(handles.map((h) => h?.close()));
  }

  async close(): Promise<void> {
    await this.#closeHandles();
  }

  /** Deletes every segment (a fresh chain must not inherit another chain's results). */
  static reset(dir: string): void {
    rmSync(dir, { recursive: true, force: true });
  }
}
