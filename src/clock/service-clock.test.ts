/**
 * The service clock across processes: an advance made through one is every process's time,
 * also an API process that runs no workers (`serve --no-workers`).
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { onDatabase } from '../../test/harness.ts';
import { startSharedChain } from '../../test/shared-chain.ts';
import { quoteIdentifier } from '../db/database.ts';
import type { Service } from '../server.ts';

test('an advance made through one process is the time of another that runs no workers, within a second or so', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has one process per data dir)');
    return;
  }
  const schema = `t_${randomBytes(6).toString('hex')}`;
  const dirs = [mkdtempSync(join(tmpdir(), 'av-clock-')), mkdtempSync(join(tmpdir(), 'av-clock-'))];
  const chain = await startSharedChain();
  const start = (dataDir: string, scheduleJobs: boolean): Promise<Service> => chain.start({ databaseUrl, schema, dataDir, scheduleJobs });
  const advancing = await start(dirs[0]!, false);
  const apiOnly = await start(dirs[1]!, true);
  try {
    const before = apiOnly.ctx.clock.nowMs();
    await (advancing.ctx.clock as unknown as { advanceBy(seconds: number): Promise<number> }).advanceBy(3_600);
    const deadline = Date.now() + 5_000;
    while (apiOnly.ctx.clock.nowMs() < before + 3_600_000) {
      assert.ok(Date.now() < deadline, 'the API-only process never saw the advance');
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  } finally {
    await apiOnly.close();
    await advancing.close();
    await chain.close();
    await onDatabase(databaseUrl, `DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
  }
});
