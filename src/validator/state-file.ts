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
import { closeSync, openSync, readFileSync, statSync, unlinkSync, utimesSync, writeSync } from 'node:fs';
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
 * Takes the data directory's lock, or throws ValidatorLockedError naming the owner (and the
 * `remedy`, what the one refused can do about it). A lock left by a dead process is taken over. Returns the function that releases it.
 *
 * The same process opening the directory twice is refused too: two LiteSVM instances would
 * overwrite each other's snapshot. The lock names its holder's pid and pid namespace, and the
 * holder touches it every LOCK_HEARTBEAT_MS: a lock from another namespace (another container
 * or host on a shared volume) is held while it is touched, and stale once it has not been for
 * LOCK_STALE_MS (a container restarted after a crash waits that long for its own old lock).
 */
export function acquireLock(dataDir: string, { file = LOCK_FILE, what = 'validator state', remedy = '' } = {}): () => void {
  const path = join(dataDir, file);
  for (let attempt = 0; attempt < 3; attempt++) {
    let fd: number;
    try {
      fd = openSync(path, 'wx', 0o600);
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== 'EEXIST') throw error;
      let owner = NaN;
      let namespace = '';
      try {
        const [pidLine = '', namespaceLine = ''] = readFileSync(path, 'utf8').split('\n');
        owner = Number.parseInt(pidLine.trim(), 10);
        namespace = namespaceLine.trim();
      } catch (readError) {
        if ((readError as NodeJS.ErrnoException).code === 'ENOENT') continue;
        throw readError;
      }
      // Another namespace's pid cannot be looked up here: its lock lives while it is touched.
      // (A lock of an earlier version names no namespace: judged by its pid, as then.)
      const elsewhere = namespace !== '' && namespace !== PID_NAMESPACE;
      // An empty or unreadable pid is a lock whose writer died between create and write.
      // A lock naming this process's pid written before it started was left by an earlier run
      // that had the same pid (pid 1 in a container, restarted after a kill): stale. Written
      // since, it is this process's own (another thread's: the validator's, say).
      const held = elsewhere ? heldElsewhere(path)
        : owner === process.pid ? writtenByThisProcess(path) : Number.isInteger(owner) && owner > 0 && processIsAlive(owner);
      if (held) throw new ValidatorLockedError(dataDir, owner, what, elsewhere, remedy);
      try {
        unlinkSync(path);
      } catch (unlinkError) {
        if ((unlinkError as NodeJS.ErrnoException).code !== 'ENOENT') throw unlinkError;
      }
      continue;
    }
    const content = `${process.pid}\n${PID_NAMESPACE}\n`;
    writeSync(fd, content);
    closeSync(fd);
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
