/**
 * The group commit queue: what arrives while a batch is being written goes into the next one,
 * in order; an idle queue writes at once (or, gathering, once the callbacks queued with it have
 * run); one item's refusal is its own; a failed batch is written again item by item, so only
 * the item that failed it fails.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { GroupCommit, type BatchOutcome } from './group-commit.ts';

/** A write that records its batches and finishes each only when told to. */
function controlledWrite() {
  const batches: number[][] = [];
  const finish: Array<() => void> = [];
  const write = async (items: number[]): Promise<Array<BatchOutcome<string>>> => {
    batches.push(items);
    await new Promise<void>((resolve) => finish.push(resolve));
    if (items.includes(-1)) throw new Error('the database went away');
    return items.map((item) => (item % 2 === 0 ? { ok: true, value: `wrote ${item}` } : { ok: false, error: new Error(`refused ${item}`) }));
  };
  const settle = async () => { for (let i = 0; i < 10; i += 1) await new Promise((resolve) => setImmediate(resolve)); };
  return { batches, finish, write, settle };
}

test('an idle queue writes at once; what arrives meanwhile is written together next, in order', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 100, concurrency: 1 });
  const first = queue.submit(0);
  await w.settle();
  assert.deepEqual(w.batches, [[0]], 'the first item did not wait for company');
  const rest = [2, 4, 6, 8].map((n) => queue.submit(n));
  await w.settle();
  assert.deepEqual(w.batches, [[0]], 'nothing else is written while the first batch runs');
  w.finish.shift()!();
  assert.equal(await first, 'wrote 0');
  await w.settle();
  assert.deepEqual(w.batches, [[0], [2, 4, 6, 8]], 'the waiting items went together, in arrival order');
  w.finish.shift()!();
  assert.deepEqual(await Promise.all(rest), ['wrote 2', 'wrote 4', 'wrote 6', 'wrote 8']);
});

test('gathering, an idle queue writes what was submitted together (waiters woken by one answer) as one batch', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 100, concurrency: 1, gather: true });
  // Many waiters woken by one answer, each submitting from its own microtask.
  const woken = [0, 2, 4, 6].map((n) => Promise.resolve().then(() => queue.submit(n)));
  await w.settle();
  assert.deepEqual(w.batches, [[0, 2, 4, 6]], 'the first did not go alone ahead of the others');
  w.finish.shift()!();
  assert.deepEqual(await Promise.all(woken), ['wrote 0', 'wrote 2', 'wrote 4', 'wrote 6']);
  const later = queue.submit(8);
  await w.settle();
  assert.deepEqual(w.batches, [[0, 2, 4, 6], [8]], 'an item submitted alone is written alone');
  w.finish.shift()!();
  assert.equal(await later, 'wrote 8');
});

test('batches are capped, and run side by side up to the concurrency', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 3, concurrency: 2 });
  const all = [0, 2, 4, 6, 8, 10, 12, 14].map((n) => queue.submit(n));
  await w.settle();
  assert.deepEqual(w.batches, [[0], [2]], 'two batches at once, each taken as soon as a slot was free');
  w.finish.shift()!();
  await w.settle();
  assert.deepEqual(w.batches.slice(2), [[4, 6, 8]], 'a freed slot takes at most 3 of the waiting items');
  while (w.finish.length) { w.finish.shift()!(); await w.settle(); }
  assert.deepEqual(w.batches.slice(3), [[10, 12, 14]]);
  assert.equal((await Promise.all(all)).length, 8);
});

test('a refused item is refused alone; a failed batch is written again item by item', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 10, concurrency: 1 });
  const blocker = queue.submit(0);
  const mixed = [queue.submit(2), queue.submit(3), queue.submit(4)];
  await w.settle();
  w.finish.shift()!();
  await blocker;
  await w.settle();
  const doomed = queue.submit(-1);
  const innocent = queue.submit(6);
  w.finish.shift()!();
  const outcomes = await Promise.allSettled(mixed);
  assert.deepEqual(outcomes.map((o) => (o.status === 'fulfilled' ? o.value : (o.reason as Error).message)), ['wrote 2', 'refused 3', 'wrote 4']);
  await w.settle();
  assert.deepEqual(w.batches.at(-1), [-1, 6], 'the next two went together');
  w.finish.shift()!(); // that write fails: each item is written again, on its own
  await w.settle();
  assert.deepEqual(w.batches.slice(-2), [[-1], [6]]);
  w.finish.shift()!();
  w.finish.shift()!();
  await assert.rejects(doomed, /the database went away/, 'the item that failed the batch gets the error');
  assert.equal(await innocent, 'wrote 6', 'the other item of the failed batch is written');
  const later = queue.submit(8);
  await w.settle();
  w.finish.shift()!();
  assert.equal(await later, 'wrote 8', 'the queue goes on');
});

test('idle resolves at once on an empty queue, and otherwise once everything queued and running is written', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 100, concurrency: 1, gather: true });
  await queue.idle();
  const written: string[] = [];
  const items = [0, 2].map((n) => queue.submit(n).then((value) => { written.push(value); }));
  let idle = false;
  const idled = queue.idle().then(() => { idle = true; });
  await w.settle();
  const late = queue.submit(4).then((value) => { written.push(value); });
  w.finish.shift()!();
  await w.settle();
  assert.equal(idle, false, 'the item that came during the first batch is still to be written');
  w.finish.shift()!();
  await idled;
  assert.deepEqual(written, ['wrote 0', 'wrote 2', 'wrote 4'], 'idle came after every write');
  await Promise.all([...items, late]);
});

test('the backlog counts the items waiting for a batch, not those being written', async () => {
  const w = controlledWrite();
  const queue = new GroupCommit(w.write, { maxBatch: 2, concurrency: 1 });
  assert.equal(queue.backlog, 0);
  const written = [0, 2, 4, 6, 8].map((n) => queue.submit(n));
  await w.settle();
  assert.deepEqual(w.batches, [[0]], 'the first went at once');
  assert.equal(queue.backlog, 4, 'four wait behind the batch being written');
  w.finish.shift()!();
  await w.settle();
  assert.deepEqual(w.batches, [[0], [2, 4]]);
  assert.equal(queue.backlog, 2);
  w.finish.shift()!();
  await w.settle();
  assert.equal(queue.backlog, 0, 'the last batch is being written');
  w.finish.shift()!();
  assert.equal((await Promise.all(written)).length, 5);
});
