/**
 * The validator's files in its data directory: the lock that gives one process ownership, and
 * the chain snapshot (LiteSVM's own serialisation of every account and sysvar, behind a small
 * JSON header of ours), replaced atomically (write a temporary file, flush it, rename).
 */
import { closeSync, openSync, readFileSync, unlinkSync, writeSync } from 'node:fs';
import { open, rename } from 'node:fs/promises';
import { join } from 'node:path';

export const LOCK_FILE = 'validator.lock';
export const SNAPSHOT_FILE = 'chain.snapshot';
const SNAPSHOT_MAGIC = Buffer.from('AVSNAP01', 'latin1');
/** A header larger than this is not ours. */
const META_BYTES_MAX = 64 * 1024;

export class ValidatorLockedError extends Error {
  constructor(readonly dataDir: string, readonly pid: number, what = 'validator state') {
    super(`${what} at ${dataDir} is in use by pid ${pid}`);
    this.name = 'ValidatorLockedError';
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
 * Takes the data directory's lock, or throws ValidatorLockedError naming the owner. A lock left
 * by a dead process is taken over. Returns the function that releases it.
 *
 * The same process opening the directory twice is refused too: two LiteSVM instances would
 * overwrite each other's snapshot.
 */
export function acquireLock(dataDir: string, { file = LOCK_FILE, what = 'validator state' } = {}): () => void {
  const path = join(dataDir, file);
  for (let attempt = 0; attempt < 3; attempt++) {
    let fd: number;
    try {
      fd = openSync(path, 'wx', 0o600);
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== 'EEXIST') throw error;
      let owner = NaN;
      try {
        owner = Number.parseInt(readFileSync(path, 'utf8').trim(), 10);
      } catch (readError) {
        if ((readError as NodeJS.ErrnoException).code === 'ENOENT') continue;
        throw readError;
      }
      // An empty or unreadable pid is a lock whose writer died between create and write.
      if (Number.isInteger(owner) && owner > 0 && processIsAlive(owner)) throw new ValidatorLockedError(dataDir, owner, what);
      try {
        unlinkSync(path);
      } catch (unlinkError) {
        if ((unlinkError as NodeJS.ErrnoException).code !== 'ENOENT') throw unlinkError;
      }
      continue;
    }
    writeSync(fd, `${process.pid}\n`);
    closeSync(fd);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      try {
        if (Number.parseInt(readFileSync(path, 'utf8').trim(), 10) === process.pid) unlinkSync(path);
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

export async function writeSnapshot(dataDir: string, meta: SnapshotMeta, state: Uint8Array): Promise<void> {
  const path = join(dataDir, SNAPSHOT_FILE);
  const temporary = `${path}.tmp`;
  const metaBytes = Buffer.from(JSON.stringify(meta), 'utf8');
  const length = Buffer.alloc(4);
  length.writeUInt32LE(metaBytes.length, 0);
  const handle = await open(temporary, 'w', 0o600);
  try {
    await handle.writev([SNAPSHOT_MAGIC, length, metaBytes, state]);
    await handle.datasync();
  } finally {
    await handle.close();
  }
  await rename(temporary, path);
}

export function readSnapshot(dataDir: string): { meta: SnapshotMeta; state: Uint8Array } | null {
  const path = join(dataDir, SNAPSHOT_FILE);
  let file: Buffer;
  try {
    file = readFileSync(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw error;
  }
  if (file.length < 12 || !file.subarray(0, 8).equals(SNAPSHOT_MAGIC)) throw new Error(`${path} is not a validator snapshot`);
  const metaLength = file.readUInt32LE(8);
  if (metaLength > META_BYTES_MAX || 12 + metaLength > file.length) throw new Error(`${path} has a damaged header`);
  const meta = JSON.parse(file.subarray(12, 12 + metaLength).toString('utf8')) as SnapshotMeta;
  if (meta.version !== 1) throw new Error(`${path} has snapshot version ${String(meta.version)}, expected 1`);
  return { meta, state: file.subarray(12 + metaLength) };
}
