/**
 * Results of executed transactions, by signature: what getSignatureStatuses and getTransaction
 * answer, and by account address: what getSignaturesForAddress answers. Bounded: the newest
 * `capacity` signatures (default 1,000,000) keep their status and their place in the address
 * index; the newest `detailCapacity` (default 20,000) also keep their wire bytes, logs and
 * balances.
 *
 * Persisted as JSON-lines segment files under `<dataDir>/transactions/`: `<n>.jsonl` holds the
 * status lines, `<n>.detail.jsonl` the details, each segment `segmentEntries` transactions.
 * Whole old segments are deleted once the newer ones hold `capacity` entries, and their detail
 * files once the newer ones hold `detailCapacity` (so on disk: at most `capacity` statuses and
 * `detailCapacity` details, each plus up to two segments' worth). A batch is
 * appended and flushed before the chain snapshot that contains its effects is written, and
 * lines newer than the snapshot (a crash in between) are cut off at load. Status lines carry the
 * message's account keys, so the address index is rebuilt at load without the detail files.
 */
import { closeSync, fsyncSync, mkdirSync, openSync, readdirSync, readFileSync, renameSync, rmSync, writeSync } from 'node:fs';
import { open, unlink, type FileHandle } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import type { TransactionErrorJson } from './transaction-error.ts';
import { parseWireTransaction } from './wire.ts';

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

/**
 * An SPL token account among the message's keys, before or after the transaction, as Solana
 * reports it. Keys stay bytes here: they are encoded when asked for, not on the hot path.
 */
export interface TokenBalance {
  accountIndex: number;
  mint: Uint8Array;
  owner: Uint8Array;
  /** The token program that owns the account (base58). */
  programId: string;
  amount: bigint;
  decimals: number;
}

export interface TransactionDetail {
  wire: Uint8Array;
  logs: string[];
  preBalances: bigint[];
  postBalances: bigint[];
  preTokenBalances: TokenBalance[];
  postTokenBalances: TokenBalance[];
}

export interface ExecutedTransaction {
  record: TransactionRecord;
  detail: TransactionDetail;
  /**
   * The message's static account keys, as `addressKey` spells them: the addresses the
   * transaction is found by.
   */
  accountKeys: readonly string[];
}

/** Newest first, at most `limit`, strictly older than `before` and strictly newer than `until`. */
export interface AddressQuery {
  limit: number;
  before?: string;
  until?: string;
}

export interface TransactionStoreOptions {
  capacity?: number;
  detailCapacity?: number;
}

const DEFAULT_CAPACITY = 1_000_000;
const DEFAULT_DETAIL_CAPACITY = 20_000;
/** Segments per capacity: the bound is exceeded by at most one segment's worth on disk. */
const SEGMENTS_PER_CAPACITY = 50;

/** `k` (account keys) is absent from lines written before the address index existed. */
interface StatusLine { q: number; s: string; sl: number; t: number; e: TransactionErrorJson | null; cu: number; f: number; k?: string[] }
interface TokenBalanceLine { i: number; m: string; o: string; p: string; a: string; d: number }
/** `tpre`/`tpost` are absent from lines written before token balances were recorded. */
interface DetailLine {
  s: string; q: number; tx: string; l: string[]; pre: string[]; post: string[]; tpre?: TokenBalanceLine[]; tpost?: TokenBalanceLine[];
}

/**
 * How the index and the status lines spell a 32-byte address: base64, about four times cheaper
 * to compute than base58 for every key of every transaction.
 */
export function addressKey(key: Uint8Array): string {
  return Buffer.from(key.buffer, key.byteOffset, key.byteLength).toString('base64');
}

function tokenBalanceLine(b: TokenBalance): TokenBalanceLine {
  return { i: b.accountIndex, m: addressKey(b.mint), o: addressKey(b.owner), p: b.programId, a: b.amount.toString(), d: b.decimals };
}

function tokenBalanceOf(line: TokenBalanceLine): TokenBalance {
  return {
    accountIndex: line.i, mint: Buffer.from(line.m, 'base64'), owner: Buffer.from(line.o, 'base64'), programId: line.p,
    amount: BigInt(line.a), decimals: line.d,
  };
}

/**
 * One address's transactions in execution order. The store evicts its oldest transactions
 * first, so they leave from the front: a start offset, compacted now and then, keeps that O(1).
 */
class AddressHistory {
  records: TransactionRecord[] = [];
  start = 0;

  constructor(readonly address: string) {}

  get size(): number {
    return this.records.length - this.start;
  }

  dropOldest(record: TransactionRecord): void {
    if (this.records[this.start] !== record) throw new Error(`address index out of order for ${this.address}`);
    this.records[this.start] = undefined as unknown as TransactionRecord;
    this.start += 1;
    if (this.start >= 1024 && this.start * 2 >= this.records.length) {
      this.records = this.records.slice(this.start);
      this.start = 0;
    }
  }

  /** The index of the first record whose seq is at least `seq` (binary search: seqs increase). */
  lowerBound(seq: number): number {
    let low = this.start;
    let high = this.records.length;
    while (low < high) {
      const middle = (low + high) >>> 1;
      if (this.records[middle]!.seq < seq) low = middle + 1;
      else high = middle;
    }
    return low;
  }
}

/** A stored status with the address histories it appears in (for eviction). */
interface StoredRecord {
  record: TransactionRecord;
  histories: AddressHistory[];
}

export class TransactionStore {
  readonly capacity: number;
  readonly detailCapacity: number;
  readonly segmentEntries: number;
  readonly #records = new Map<string, StoredRecord>();
  readonly #addresses = new Map<string, AddressHistory>();
  readonly #details = new Map<string, TransactionDetail>();
  readonly #dir: string | null;
  #segments: number[] = [];
  #segmentCount = 0;
  #statusHandle: FileHandle | null = null;
  #detailHandle: FileHandle | null = null;
  /** Segments whose status lines lack account keys, read from their details at load. */
  readonly #keysInDetails = new Set<number>();

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
    return this.#records.get(signature)?.record;
  }

  /** Addresses with at least one transaction in the index. */
  get addressCount(): number {
    return this.#addresses.size;
  }

  /**
   * Signatures of the transactions that loaded the address (spelled by `addressKey`), newest
   * first. As on Solana, an unknown `before` gives nothing and an unknown `until` bounds nothing.
   */
  forAddress(key: string, query: AddressQuery): TransactionRecord[] {
    const history = this.#addresses.get(key);
    if (!history) return [];
    let end = history.records.length;
    if (query.before !== undefined) {
      const before = this.#records.get(query.before);
      if (!before) return [];
      end = history.lowerBound(before.record.seq);
    }
    const untilSeq = query.until === undefined ? -1 : (this.#records.get(query.until)?.record.seq ?? -1);
    const found: TransactionRecord[] = [];
    for (let i = end - 1; i >= history.start && found.length < query.limit; i--) {
      const record = history.records[i]!;
      if (record.seq <= untilSeq) break;
      found.push(record);
    }
    return found;
  }

  detail(signature: string): TransactionDetail | undefined {
    return this.#details.get(signature);
  }

  has(signature: string): boolean {
    return this.#records.has(signature);
  }

  /** Makes a batch visible (after it has been persisted). */
  publish(batch: readonly ExecutedTransaction[]): void {
    for (const { record, detail, accountKeys } of batch) {
      this.#add(record, accountKeys);
      this.#details.set(record.signature, detail);
    }
    this.#evict();
  }

  #add(record: TransactionRecord, accountKeys: readonly string[]): void {
    // A sanitised message never repeats a key; the set keeps the index consistent regardless.
    const histories: AddressHistory[] = [];
    for (const key of new Set(accountKeys)) {
      let history = this.#addresses.get(key);
      if (!history) {
        history = new AddressHistory(key);
        this.#addresses.set(key, history);
      }
      history.records.push(record);
      histories.push(history);
    }
    this.#records.set(record.signature, { record, histories });
  }

  #evict(): void {
    // Maps iterate in insertion order, which is execution order: the oldest go first.
    if (this.#records.size > this.capacity) {
      let excess = this.#records.size - this.capacity;
      for (const [key, stored] of this.#records) {
        if (excess-- <= 0) break;
        this.#records.delete(key);
        for (const history of stored.histories) {
          history.dropOldest(stored.record);
          if (history.size === 0) this.#addresses.delete(history.address);
        }
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
    // A replacement a crash interrupted before its rename (the file it was for is whole).
    for (const name of readdirSync(this.#dir)) if (name.endsWith('.tmp')) rmSync(join(this.#dir, name), { force: true });
    this.#segments = readdirSync(this.#dir)
      .map((name) => /^(\d{8})\.jsonl$/.exec(name)?.[1])
      .filter((n): n is string => n !== undefined)
      .map(Number)
      .sort((a, b) => a - b);
    const detailFrom = Math.max(0, this.#segments.length - this.#detailSegments());
    this.#segments.forEach((segment, index) => {
      let dropped = false;
      const statusLines = this.#readLines(this.#statusPath(segment), (line: StatusLine) => line.q <= maxSeq, () => {
        dropped = true;
      });
      if (index === this.#segments.length - 1) this.#segmentCount = statusLines.length;
      // Old segments' details are not kept in memory, and are only read to cut stale lines, or
      // for the account keys of status lines written before the lines carried them.
      const keepDetails = index >= detailFrom;
      const keysMissing = statusLines.some((line) => line.k === undefined);
      if (keysMissing) this.#keysInDetails.add(segment);
      const detailLines = keepDetails || dropped || keysMissing
        ? this.#readLines(this.#detailPath(segment), (line: DetailLine) => line.q <= maxSeq)
        : [];
      const wireKeys = keysMissing ? keysFromDetails(detailLines) : null;
      for (const line of statusLines) {
        // Written twice by a batch retried after a failed write that could not be cut back (append).
        if (this.#records.has(line.s)) continue;
        this.#add({
          seq: line.q, signature: line.s, slot: line.sl, blockTime: line.t, err: line.e, computeUnits: line.cu, fee: line.f,
        }, line.k ?? wireKeys?.get(line.s) ?? []);
      }
      if (!keepDetails) return;
      for (const line of detailLines) {
        this.#details.set(line.s, {
          wire: Buffer.from(line.tx, 'base64'),
          logs: line.l,
          preBalances: line.pre.map(BigInt),
          postBalances: line.post.map(BigInt),
          preTokenBalances: (line.tpre ?? []).map(tokenBalanceOf),
          postTokenBalances: (line.tpost ?? []).map(tokenBalanceOf),
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
      replaceFileDurably(path, keptRaw.map((l) => `${l}\n`).join(''));
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
      for (const { record: r, detail: d, accountKeys } of part) {
        const status: StatusLine = {
          q: r.seq, s: r.signature, sl: r.slot, t: r.blockTime, e: r.err, cu: r.computeUnits, f: r.fee, k: [...accountKeys],
        };
        statusText += `${JSON.stringify(status)}\n`;
        const detailLine: DetailLine = {
          s: r.signature, q: r.seq, tx: Buffer.from(d.wire.buffer, d.wire.byteOffset, d.wire.byteLength).toString('base64'),
          l: d.logs, pre: d.preBalances.map(String), post: d.postBalances.map(String),
          tpre: d.preTokenBalances.map(tokenBalanceLine), tpost: d.postTokenBalances.map(tokenBalanceLine),
        };
        detailText += `${JSON.stringify(detailLine)}\n`;
      }
      const status = this.#statusHandle!;
      const details = this.#detailHandle!;
      const [statusSize, detailSize] = await Promise.all([status.stat(), details.stat()]).then((stats) => stats.map((stat) => stat.size));
      // Both writes (then both flushes) run to their end, failed or not, before the files are cut
      // back: a write still under way would otherwise land past the cut.
      const failure = await firstFailure([status.appendFile(statusText), details.appendFile(detailText)])
        ?? await firstFailure([status.datasync(), details.datasync()]);
      if (failure) {
        await this.#cutBack([[status, statusSize!], [details, detailSize!]]);
        throw failure.error;
      }
      this.#segmentCount += part.length;
      start += part.length;
    }
  }

  /**
   * After a failed write or flush, the files are cut back to where the batch began, so that its
   * retry neither glues its first line onto a torn one (the line then unreadable, a status the
   * service saw lost at the next load) nor writes its lines twice. If they cannot be cut, the
   * segment is given up: the retry goes to a new one (its torn tail dropped, its copies of the
   * batch's lines skipped, at load).
   */
  async #cutBack(files: ReadonlyArray<[FileHandle, number]>): Promise<void> {
    try {
      for (const [handle, size] of files) {
        await handle.truncate(size);
        await handle.datasync();
      }
    } catch {
      await this.#closeHandles().catch(() => {});
      this.#segmentCount = this.segmentEntries;
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
      this.#keysInDetails.delete(old);
      await Promise.all([unlink(this.#statusPath(old)).catch(() => {}), unlink(this.#detailPath(old)).catch(() => {})]);
    }
    // Nor are the details of segments beyond the detail capacity, which load reads no more: kept,
    // they made the data dir hold a million transactions' wire bytes and logs (~2.6 GB) to serve
    // twenty thousand. Except where the status lines lack their account keys (written before
    // they carried them): those are read from the details.
    for (const old of this.#segments.slice(0, -this.#detailSegments())) {
      if (!this.#keysInDetails.has(old)) await unlink(this.#detailPath(old)).catch(() => {});
    }
  }

  /** How many of the newest segments hold the details that are kept (load reads those alone). */
  #detailSegments(): number {
    return Math.ceil(this.detailCapacity / this.segmentEntries) + 1;
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

/** Waits for every promise; the first rejection, if any. */
async function firstFailure(work: ReadonlyArray<Promise<unknown>>): Promise<{ error: unknown } | null> {
  const rejected = (await Promise.allSettled(work)).find((outcome) => outcome.status === 'rejected');
  return rejected ? { error: (rejected as PromiseRejectedResult).reason } : null;
}

/**
 * Replaces a file's content so that a crash at any moment leaves either the old content or the
 * new, whole and on disk: a temporary file written and flushed, renamed over, the directory
 * flushed. (Rewriting in place empties the file first: a crash then lost lines already shown.)
 */
function replaceFileDurably(path: string, content: string): void {
  const temporary = `${path}.tmp`;
  const fd = openSync(temporary, 'w', 0o600);
  try {
    writeSync(fd, content);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  renameSync(temporary, path);
  const dir = openSync(dirname(path), 'r');
  try {
    fsyncSync(dir);
  } finally {
    closeSync(dir);
  }
}

/** Account keys read back from the wire bytes of detail lines, by signature. */
function keysFromDetails(lines: readonly DetailLine[]): Map<string, string[]> {
  const keys = new Map<string, string[]>();
  for (const line of lines) {
    try {
      keys.set(line.s, parseWireTransaction(Buffer.from(line.tx, 'base64')).accountKeys.map(addressKey));
    } catch {
      // A transaction that once executed always parses; a damaged line just stays out of the index.
    }
  }
  return keys;
}
