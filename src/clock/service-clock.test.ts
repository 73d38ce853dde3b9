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
import pino from 'pino';
import { loadConfig } from '../config/config.ts';
import { openDatabase, quoteIdentifier } from '../db/database.ts';
import { buildService, type Service } from '../server.ts';

test('an advance made through one process is the time of another that runs no workers, within a second or so', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has one process per data dir)');
    return;
  }
  const schema = `t_${randomBytes(6).toString('hex')}`;
  const dirs = [mkdtempSync(join(tmpdir(), 'av-clock-')), mkdtempSync(join(tmpdir(), 'av-clock-'))];
  const start = (dir: string, scheduleJobs: boolean): Promise<Service> => buildService(loadConfig({
    AGENT_VAULT_DATA_DIR: dir, AGENT_VAULT_SLOT_MS: '0', AGENT_VAULT_VALIDATOR_THREAD: 'off', DATABASE_URL: databaseUrl, LOG_LEVEL: 'silent',
  }), { schema, scheduleJobs, workers: false, logger: pino({ level: 'silent' }) });
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
    const admin = await openDatabase({ databaseUrl, dataDir: null });
    await admin.query(`DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    await admin.close();
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
  }
});
