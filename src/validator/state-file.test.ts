/**
 * The snapshot files: two written in turn, each overwritten in place behind a CRC-32; a torn one
 * is passed over for the other; an earlier version's single file still loads.
 */
import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { LEGACY_SNAPSHOT_FILE, SNAPSHOT_FILES, readSnapshot, writeSnapshot, type SnapshotMeta } from './state-file.ts';

const meta = (seq: number, wallMs = 1_000): SnapshotMeta => ({
  version: 1, seq, slot: seq, genesisSlot: 0, wallMs, seedHex: '00', usdcMint: 'mint', programId: 'program', authority: 'authority',
  lastUnixTimestamp: 0,
});
const stateOf = (length: number, fill: number) => new Uint8Array(length).fill(fill);

describe('validator snapshot files', () => {
  let root: string;
  before(() => { root = mkdtempSync(join(tmpdir(), 'av-snapshots-')); });
  after(() => rmSync(root, { recursive: true, force: true }));
  const fresh = () => mkdtempSync(join(root, 'data-'));

  test('the newest of the two files is read; a shorter snapshot over a longer one reads exactly', async () => {
    const path = fresh();
    assert.equal(readSnapshot(path), null, 'none yet');
    await writeSnapshot(path, 0, meta(5), stateOf(3_000, 1));
    await writeSnapshot(path, 1, meta(9), stateOf(2_000, 2));
    let loaded = readSnapshot(path)!;
    assert.equal(loaded.file, 1);
    assert.equal(loaded.meta.seq, 9);
    await writeSnapshot(path, 0, meta(12), stateOf(1_000, 3));
    loaded = readSnapshot(path)!;
    assert.equal(loaded.file, 0);
    assert.deepEqual([loaded.state.length, loaded.state[0], loaded.state.at(-1)], [1_000, 3, 3], 'the old tail is not read');
    assert.ok(statSync(join(path, SNAPSHOT_FILES[0])).size > 3_000, 'the file kept its size (and slack)');
    // Only the clock moved: the same sequence, a later slot (the wall clock stepped back).
    await writeSnapshot(path, 1, { ...meta(12, 500), slot: 13 }, stateOf(1_000, 4));
    assert.equal(readSnapshot(path)!.file, 1);
  });

  test('a file is made whole before it is ever overwritten: a crash while it is first made leaves no snapshot', async () => {
    const path = fresh();
    // The first write fails (its temporary file cannot be opened): the file is not there at all.
    mkdirSync(join(path, `${SNAPSHOT_FILES[0]}.tmp`));
    await assert.rejects(writeSnapshot(path, 0, meta(1), stateOf(100, 1)));
    assert.equal(existsSync(join(path, SNAPSHOT_FILES[0])), false);
    assert.equal(readSnapshot(path), null, 'a fresh chain, since nothing was ever visible');
    rmSync(join(path, `${SNAPSHOT_FILES[0]}.tmp`), { recursive: true });
    writeFileSync(join(path, `${SNAPSHOT_FILES[0]}.tmp`), 'the first write, torn by a crash');
    assert.equal(readSnapshot(path), null);
    await writeSnapshot(path, 0, meta(1), stateOf(100, 1));
    assert.deepEqual(readdirSync(path).sort(), [SNAPSHOT_FILES[0]]);
    assert.equal(readSnapshot(path)!.meta.seq, 1);
  });

  test('a file torn by a crash mid-write is passed over for the other; none intact is an error, not a fresh chain', async () => {
    const path = fresh();
    await writeSnapshot(path, 0, meta(5), stateOf(4_000, 1));
    await writeSnapshot(path, 1, meta(9), stateOf(4_000, 2));
    const newest = join(path, SNAPSHOT_FILES[1]);
    const bytes = readFileSync(newest);
    bytes[2_000] = 1; // a block of the old content left in the middle
    writeFileSync(newest, bytes);
    const loaded = readSnapshot(path)!;
    assert.deepEqual([loaded.file, loaded.meta.seq, loaded.state[0]], [0, 5, 1], 'the snapshot before');
    assert.deepEqual(loaded.damaged, [SNAPSHOT_FILES[1]], 'and says which it passed over');
    const other = join(path, SNAPSHOT_FILES[0]);
    writeFileSync(other, readFileSync(other).subarray(0, 100));
    assert.throws(() => readSnapshot(path), /no intact validator snapshot/);
  });

  test('an earlier version\'s single file loads until the first of the two files is made, which removes it', async () => {
    const path = fresh();
    const metaBytes = Buffer.from(JSON.stringify(meta(7)), 'utf8');
    const length = Buffer.alloc(4);
    length.writeUInt32LE(metaBytes.length, 0);
    const legacy = Buffer.concat([Buffer.from('AVSNAP01', 'latin1'), length, metaBytes, stateOf(500, 9)]);
    writeFileSync(join(path, LEGACY_SNAPSHOT_FILE), legacy);
    const loaded = readSnapshot(path)!;
    assert.deepEqual([loaded.file, loaded.meta.seq, loaded.state.length, loaded.state[0]], [null, 7, 500, 9]);
    await writeSnapshot(path, 0, meta(8), stateOf(500, 1));
    assert.equal(existsSync(join(path, LEGACY_SNAPSHOT_FILE)), false);
    // Put back beside a damaged file of the two, the old file is not taken instead.
    writeFileSync(join(path, LEGACY_SNAPSHOT_FILE), legacy);
    writeFileSync(join(path, SNAPSHOT_FILES[0]), readFileSync(join(path, SNAPSHOT_FILES[0])).subarray(0, 50));
    assert.throws(() => readSnapshot(path), /no intact validator snapshot/);
  });
});
