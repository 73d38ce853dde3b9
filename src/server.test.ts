/**
 * The process's shutdown (`serve`, `worker`): bounded even when a dependency stops answering
 * mid-way, so that a supervisor's SIGTERM or a developer's Ctrl-C always ends the process.
 */
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { test } from 'node:test';
import pino from 'pino';
import { startTestService } from '../test/harness.ts';
import { closeWithin } from './server.ts';

function logLines() {
  const lines: Array<{ level: number; msg: string }> = [];
  const sink = new Writable({ write(chunk, _encoding, done) { lines.push(JSON.parse(String(chunk))); done(); } });
  return { lines, logger: pino({ level: 'info' }, sink) };
}

test('a shutdown held by a database that does not answer ends at its deadline with exit code 1, said in the log', async () => {
  const t = await startTestService({ workers: false });
  // The service's own close, once: the deadline leaves it running, and the test's cleanup waits for it.
  let closing: Promise<void> | undefined;
  const close = t.service.close.bind(t.service);
  t.service.close = () => (closing ??= close());
  // A transaction that never ends: the database's close waits for it, as for a query whose
  // answer never comes.
  let release!: () => void;
  let started!: () => void;
  const begun = new Promise<void>((resolve) => { started = resolve; });
  const held = t.service.ctx.db.transaction(async (tx) => {
    await tx.query('SELECT 1');
    started();
    await new Promise<void>((resolve) => { release = resolve; });
  });
  await begun;
  const { lines, logger } = logLines();
  assert.equal(await closeWithin(t.service, 1_000, logger), 1);
  assert.deepEqual(lines.map((line) => [line.level, line.msg.split(' (')[0]]), [[50, 'shutting down did not end in time']]);
  release();
  await held;
  await t.close();
});

test('a shutdown that ends in time answers 0', async () => {
  const t = await startTestService({ workers: false });
  let closing: Promise<void> | undefined;
  const close = t.service.close.bind(t.service);
  t.service.close = () => (closing ??= close());
  const { lines, logger } = logLines();
  assert.equal(await closeWithin(t.service, 30_000, logger), 0);
  assert.deepEqual(lines.map((line) => line.msg), ['stopped']);
  await t.close();
});
