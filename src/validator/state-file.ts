/**
 * The validator's files in its data directory: the lock that gives one process ownership, and
 * the chain snapshot (LiteSVM's own serialisation of every account and sysvar, behind a small
 * JSON header of ours).
 *
 * Snapshots go to two files in turn, each overwritten in place and flushed, with a CRC-32 over
 * its content: a crash mid-write leaves that file failing its check and the other one, the
 * snapshot before, intact. Overwriting a file's existing blocks flushes no file-system metadata,
 * where a new file renamed over the old one flushed its allocation and the rename: under
 * PostgreSQL's write load here, 3.5 ms against 6.9 ms at the median, 10 against 24 at p99 for
 * 1.5 MB (docs/benchmarks.md, fourteenth round). A file grows with slack, so that it rarely grows.
 */
import { randomBytes } from 'node:crypto';
import { closeSync, fstatSync, linkSync, openSync, readFileSync, rmSync, statSync, unlinkSync, utimesSync, writeFileSync, writeSync } from 'node:fs';
import { open, rename, rm, type FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import { crc32 } from 'node:zlib';

export const LOCK_FILE = 'validator.lock';
/** The two snapshot files, written in turn. */
export const SNAPSHOT_FILES = ['chain.snapshot.0', 'chain.snapshot.1'] as const;
/** The one snapshot file of earlier versions (replaced by rename): read, never written. */
export const LEGACY_SNAPSHOT_FILE = 'chain.snapshot';
const SNAPSHOT_MAGIC = Buffer.from('AVSNAP02', 'latin1');
const LEGACY_SNAPSHOT_MAGIC = Buffer.from('AVSNAP01', 'latin1');
/** magic, meta length, state length */
const HEADER_BYTES = 16;
const CRC_BYTES = 4;
/** A file that must grow grows to this much more than it needs. */
const GROWTH_SLACK = 1.25;
/** A header larger than this is not ours. */
const META_BYTES_MAX = 64 * 1024;

export class ValidatorLockedError extends Error {
  constructor(readonly dataDir: string, readonly pid: number, what = 'validator state', elsewhere = false, remedy = '') {
    super(`${what} at ${dataDir} is in use by pid ${pid}${elsewhere ? ' of another host or container (its lock is still being refreshed)' : ''}`
      + (remedy ? `: ${remedy}` : ''));
    this.name = 'ValidatorLockedError';
  }
}

/** The holder of a lock touches it this often, so that a process that cannot see it can tell it lives. */
export const LOCK_HEARTBEAT_MS = 2_000;
/** A lock of another host or container not touched for this long is stale: its holder is gone. */
export const LOCK_STALE_MS = 15_000;
/** How often a lock of another host or container is looked at again while it may still be held. */
const LOCK_RECHECK_MS = 250;

/**
 * The kernel boot and pid namespace this process runs in: a pid means something only within
 * them. Two containers (or hosts) sharing a data directory each have a pid 1; a lock written in
 * another one is judged by its heartbeat, not by its pid. Empty where /proc has neither.
 */
const PID_NAMESPACE = (() => {
  try {
    return `${readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim()}:${statSync('/proc/self/ns/pid').ino}`;
  } catch {
    return '';
  }
})();

function sleepSync(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

function mtimeMsOf(path: string): number | null {
  try {
    return statSync(path).mtimeMs;
  } catch {
    return null;
  }
}

/**
 * Whether a lock written in another pid namespace is held: it is while its holder touches it.
 * Waits (at most LOCK_STALE_MS) for a touch when the last one is recent.
 */
function heldElsewhere(path: string): boolean {
  const seen = mtimeMsOf(path);
  if (seen === null) return false;
  while (Date.now() - seen < LOCK_STALE_MS) {
    sleepSync(LOCK_RECHECK_MS);
    const now = mtimeMsOf(path);
    if (now === null) return false;
    if (now !== seen) return true;
  }
  return false;
}

/**
 * When this process started, as every thread of it reckons (`process.uptime()` is the
 * process's): a lock naming this pid but written before then was left by an earlier run that
 * had the same pid, not by a thread of this one.
 */
const PROCESS_STARTED_MS = Date.now() - process.uptime() * 1000;
/** Slack for the two clocks read (the file's mtime, this process's start). */
const LOCK_TIME_SLACK_MS = 100;

function writtenByThisProcess(path: string): boolean {
  try {
    return statSync(path).mtimeMs >= PROCESS_STARTED_MS - LOCK_TIME_SLACK_MS;
  } catch {
    return false;
  }
}

function processIsAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    // EPERM: the process exists but belongs to someone else.
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * A takeover lock older than this was left by a process that died taking a stale lock over: it
 * is removed. Longer than the longest judgement made under it (heldElsewhere's wait).
 */
const TAKEOVER_STALE_MS = LOCK_STALE_MS + 15_000;
/** How long a start waits for another process's takeover of the same lock. */
const TAKEOVER_WAIT_MS = TAKEOVER_STALE_MS + 5_000;
const TAKEOVER_RECHECK_MS = 10;
/** An empty lock younger than this is being written; looked at again this often. */
const EMPTY_LOCK_GRACE_MS = 2_000;
const EMPTY_LOCK_RECHECK_MS = 50;

/**
 * Creates `path` holding `content`, or answers false when it exists. Written to a file of its
 * own, then linked in: the lock is never seen without its content (a lock created empty, then
 * written, read as stale by another process in between, was taken twice). A file system
 * without hard links gets the exclusive create, then the write.
 */
function createWithContent(path: string, content: string): boolean {
  const temp = `${path}.${process.pid}.${randomBytes(6).toString('hex')}.tmp`;
  try {
    writeFileSync(temp, content, { flag: 'wx', mode: 0o600 });
    linkSync(temp, path);
    return true;
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    if (code === 'EEXIST') return false;
    if (code !== 'EPERM' && code !== 'ENOTSUP' && code !== 'EOPNOTSUPP') throw error;
  } finally {
    rmSync(temp, { force: true });
  }
  let fd: number;
  try {
    fd = openSync(path, 'wx', 0o600);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'EEXIST') return false;
    throw error;
  }
  writeSync(fd, content);
  closeSync(fd);
  return true;
}

/**
 * Takes the data directory's lock, or throws ValidatorLockedError naming the owner (and the
 * `remedy`, what the one refused can do about it). A lock left by a dead process is taken over. Returns the function that releases it.
 *
 * A lock is only ever removed by its holder, or by a process holding the takeover lock beside it
 * (`<lock>.takeover`), which judges the lock there and removes it only if stale: two processes
 * finding one stale lock at once cannot both take it (one removing the lock the other had just
 * made in its place). A takeover lock is held for the judgement alone.
 *
 * The same process opening the directory twice is refused too: two LiteSVM instances would
 * overwrite each other's snapshot. The lock names its holder's pid and pid namespace, and the
 * holder touches it every LOCK_HEARTBEAT_MS: a lock from another namespace (another container
 * or host on a shared volume) is held while it is touched, and stale once it has not been for
 * LOCK_STALE_MS (a container restarted after a crash waits that long for its own old lock).
 */
export function acquireLock(dataDir: string, { file = LOCK_FILE, what = 'validator state', remedy = '' } = {}): () => void {
  const path = join(dataDir, file);
  const takeover = `${path}.takeover`;
  const content = `${process.pid}\n${PID_NAMESPACE}\n`;
  const waitUntil = Date.now() + TAKEOVER_WAIT_MS;
  for (let attempt = 0; attempt < 3;) {
    if (!createWithContent(path, content)) {
      if (!createWithContent(takeover, content)) {
        // Another process is judging the lock: wait for it, unless it died doing so.
        const since = mtimeMsOf(takeover);
        if (since !== null && Date.now() - since > TAKEOVER_STALE_MS) rmSync(takeover, { force: true });
        else if (Date.now() > waitUntil) throw new Error(`could not take the lock ${path}: ${takeover} stayed held`);
        else sleepSync(TAKEOVER_RECHECK_MS);
        continue;
      }
      attempt += 1;
      try {
        judgeExistingLock(path, dataDir, what, remedy);
      } finally {
        rmSync(takeover, { force: true });
      }
      continue;
    }
    const ours = () => {
      try {
        return readFileSync(path, 'utf8') === content;
      } catch {
        return false;
      }
    };
    const heartbeat = setInterval(() => {
      try {
        if (ours()) utimesSync(path, new Date(), new Date());
      } catch {
        // Gone meanwhile: nothing to touch.
      }
    }, LOCK_HEARTBEAT_MS);
    heartbeat.unref();
    let released = false;
    return () => {
      if (released) return;
      released = true;
      clearInterval(heartbeat);
      try {
        if (ours()) unlinkSync(path);
      } catch {
        // Already gone: nothing to release.
      }
    };
  }
  throw new Error(`could not take the lock ${path}`);
}

/**
 * Under the takeover lock: throws ValidatorLockedError if the lock at `path` is held, removes it
 * if it is stale (or gone already: nothing to do).
 */
function judgeExistingLock(path: string, dataDir: string, what: string, remedy: string): void {
  let owner = NaN;
  let namespace = '';
  let inode = -1;
  for (let waitedMs = 0; ; waitedMs += EMPTY_LOCK_RECHECK_MS) {
    try {
      const fd = openSync(path, 'r');
      try {
        inode = fstatSync(fd).ino;
        const [pidLine = '', namespaceLine = ''] = readFileSync(fd, 'utf8').split('\n');
        owner = Number.parseInt(pidLine.trim(), 10);
        namespace = namespaceLine.trim();
      } finally {
        closeSync(fd);
      }
    } catch (readError) {
      if ((readError as NodeJS.ErrnoException).code === 'ENOENT') return;
      throw readError;
    }
    // Empty and just made: being written (a file system without hard links), not yet stale.
    const madeMs = mtimeMsOf(path);
    if (Number.isInteger(owner) || madeMs === null || Date.now() - madeMs > EMPTY_LOCK_GRACE_MS || waitedMs >= EMPTY_LOCK_GRACE_MS) break;
    sleepSync(EMPTY_LOCK_RECHECK_MS);
  }
  // Another namespace's pid cannot be looked up here: its lock lives while it is touched.
  // (A lock of an earlier version names no namespace: judged by its pid, as then.)
  const elsewhere = namespace !== '' && namespace !== PID_NAMESPACE;
  // An empty or unreadable pid is a lock whose writer died between create and write (an
  // earlier version's, or one made on a file system without hard links).
  // A lock naming this process's pid written before it started was left by an earlier run
  // that had the same pid (pid 1 in a container, restarted after a kill): stale. Written
  // since, it is this process's own (another thread's: the validator's, say).
  const held = elsewhere ? heldElsewhere(path)
    : owner === process.pid ? writtenByThisProcess(path) : Number.isInteger(owner) && owner > 0 && processIsAlive(owner);
  if (held) throw new ValidatorLockedError(dataDir, owner, what, elsewhere, remedy);
  // The very file judged (a takeover lock left by a process that died judging is removed after
  // TAKEOVER_STALE_MS, and two processes may then judge at once: the later one must not remove
  // the lock the earlier one made since).
  if (inodeOf(path) === inode) rmSync(path, { force: true });
}

function inodeOf(path: string): number | null {
  try {
    return statSync(path).ino;
  } catch {
    return null;
  }
}

/** What the validator needs besides LiteSVM's state to continue where it stopped. */
export interface SnapshotMeta {
  version: 1;
  /** Sequence number of the last executed transaction whose effects are in this snapshot. */
  seq: number;
  slot: number;
  genesisSlot: number;
  /** Wall time of the snapshot: on restart, slots resume as if time had passed. */
  wallMs: number;
  /** hex; blockhashes and the genesis hash derive from it. */
  seedHex: string;
  usdcMint: string;
  programId: string;
  authority: string;
  lastUnixTimestamp: number;
}

/** Which of SNAPSHOT_FILES a snapshot is in (0 or 1). */
export type SnapshotFile = 0 | 1;

/**
 * Writes a snapshot over `file`, in place, and flushes it. The other file is not touched, so a
 * crash at any point leaves it as it was. A file that does not exist yet is made whole first
 * (a temporary file, flushed, renamed, the directory flushed), so that a file, once there, was
 * whole once; its making also removes an earlier version's single file, which would otherwise
 * stay behind, stale.
 */
export async function writeSnapshot(dataDir: string, file: SnapshotFile, meta: SnapshotMeta, state: Uint8Array): Promise<void> {
  const path = join(dataDir, SNAPSHOT_FILES[file]);
  const metaBytes = Buffer.from(JSON.stringify(meta), 'utf8');
  const header = Buffer.alloc(HEADER_BYTES);
  SNAPSHOT_MAGIC.copy(header, 0);
  header.writeUInt32LE(metaBytes.length, 8);
  header.writeUInt32LE(state.length, 12);
  const crc = Buffer.alloc(CRC_BYTES);
  crc.writeUInt32LE(crc32(state, crc32(metaBytes, crc32(header))), 0);
  const length = HEADER_BYTES + metaBytes.length + state.length + CRC_BYTES;
  const parts: Uint8Array[] = [header, metaBytes, state, crc];
  let handle;
  try {
    handle = await open(path, 'r+');
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
    await createWhole(dataDir, path, [...parts, Buffer.alloc(Math.ceil(length * GROWTH_SLACK) - length)]);
    return;
  }
  try {
    // Content shorter than the file leaves the old tail there, behind the checked length.
    const { size } = await handle.stat();
    if (size < length) parts.push(Buffer.alloc(Math.ceil(length * GROWTH_SLACK) - length));
    await writeAll(handle, parts);
    await handle.datasync();
  } finally {
    await handle.close();
  }
  // A file made by a process that stopped, or by an attempt that failed, before its directory
  // was flushed: flushed once here, before this snapshot counts.
  if (!directorySynced.has(path)) {
    await syncDirectory(dataDir);
    directorySynced.add(path);
  }
}

/** Snapshot files whose directory entry this process has flushed. */
const directorySynced = new Set<string>();

/** One writev, checked whole: a short write (a full disk) would otherwise pass for a snapshot. */
async function writeAll(handle: FileHandle, parts: readonly Uint8Array[]): Promise<void> {
  const expected = parts.reduce((sum, part) => sum + part.length, 0);
  const { bytesWritten } = await handle.writev(parts, 0);
  if (bytesWritten !== expected) throw new Error(`a snapshot write stopped at ${bytesWritten} of ${expected} bytes`);
}

async function createWhole(dataDir: string, path: string, parts: readonly Uint8Array[]): Promise<void> {
  const temporary = `${path}.tmp`;
  try {
    const handle = await open(temporary, 'w', 0o600);
    try {
      await writeAll(handle, parts);
      await handle.datasync();
    } finally {
      await handle.close();
    }
  } catch (error) {
    await rm(temporary, { force: true }).catch(() => {});
    throw error;
  }
  await rename(temporary, path);
  await syncDirectory(dataDir);
  directorySynced.add(path);
  // Only once the new file is on disk: the old one is read when neither new file exists.
  await rm(join(dataDir, LEGACY_SNAPSHOT_FILE), { force: true });
}

async function syncDirectory(dir: string): Promise<void> {
  const handle = await open(dir, 'r');
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

export interface LoadedSnapshot {
  meta: SnapshotMeta;
  state: Uint8Array;
  /** the file it was read from; null for an earlier version's single file */
  file: SnapshotFile | null;
  /** snapshot files passed over because they failed their check (torn by a crash, or damaged) */
  damaged: string[];
}

/**
 * The newest intact snapshot of the two files (one may be torn by a crash while it was being
 * written: it then fails its check and the other is used), or an earlier version's single file
 * when neither exists. Null when there is none at all; an error when there are snapshot files
 * but none is intact, rather than start a fresh chain over them.
 */
export function readSnapshot(dataDir: string): LoadedSnapshot | null {
  const found: Array<Omit<LoadedSnapshot, 'damaged'>> = [];
  const damaged: string[] = [];
  for (const [file, name] of SNAPSHOT_FILES.entries()) {
    const bytes = readIfExists(join(dataDir, name));
    if (bytes === null) continue;
    const snapshot = parseSnapshot(bytes);
    if (snapshot) found.push({ ...snapshot, file: file as SnapshotFile });
    else damaged.push(name);
  }
  if (found.length === 0 && damaged.length) {
    throw new Error(`no intact validator snapshot in ${dataDir} (${damaged.join(', ')} damaged)`);
  }
  if (found.length === 0) {
    const legacy = readIfExists(join(dataDir, LEGACY_SNAPSHOT_FILE));
    return legacy === null ? null : { ...parseLegacySnapshot(join(dataDir, LEGACY_SNAPSHOT_FILE), legacy), file: null, damaged };
  }
  // Newest in the order they were written: sequence, then slot (a snapshot may only move the
  // clock; slots only go forward, across restarts too), then wall time.
  found.sort((a, b) => b.meta.seq - a.meta.seq || b.meta.slot - a.meta.slot || b.meta.wallMs - a.meta.wallMs);
  return { ...found[0]!, damaged };
}

function readIfExists(path: string): Buffer | null {
  try {
    return readFileSync(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw error;
  }
}

/** A snapshot file's content, or null when it is not whole (torn, or not ours). */
function parseSnapshot(file: Buffer): { meta: SnapshotMeta; state: Uint8Array } | null {
  if (file.length < HEADER_BYTES + CRC_BYTES || !file.subarray(0, 8).equals(SNAPSHOT_MAGIC)) return null;
  const metaLength = file.readUInt32LE(8);
  const stateLength = file.readUInt32LE(12);
  if (metaLength > META_BYTES_MAX) return null;
  const end = HEADER_BYTES + metaLength + stateLength;
  if (end + CRC_BYTES > file.length || crc32(file.subarray(0, end)) !== file.readUInt32LE(end)) return null;
  const meta = JSON.parse(file.subarray(HEADER_BYTES, HEADER_BYTES + metaLength).toString('utf8')) as SnapshotMeta;
  if (meta.version !== 1) throw new Error(`validator snapshot version ${String(meta.version)}, expected 1`);
  return { meta, state: file.subarray(HEADER_BYTES + metaLength, end) };
}

function parseLegacySnapshot(path: string, file: Buffer): { meta: SnapshotMeta; state: Uint8Array } {
  if (file.length < 12 || !file.subarray(0, 8).equals(LEGACY_SNAPSHOT_MAGIC)) throw new Error(`${path} is not a validator snapshot`);
  const metaLength = file.readUInt32LE(8);
  if (metaLength > META_BYTES_MAX || 12 + metaLength > file.length) throw new Error(`${path} has a damaged header`);
  const meta = JSON.parse(file.subarray(12, 12 + metaLength).toString('utf8')) as SnapshotMeta;
  if (meta.version !== 1) throw new Error(`${path} has snapshot version ${String(meta.version)}, expected 1`);
  return { meta, state: file.subarray(12 + metaLength) };
}
