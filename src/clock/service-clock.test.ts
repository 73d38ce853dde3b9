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
import { encodeSecretKeyBase58, generateSecretKey } from '../chain/operator-key.ts';
import { loadConfig } from '../config/config.ts';
import { openDatabase, quoteIdentifier } from '../db/database.ts';
import { buildService, type Service } from '../server.ts';
import { startRpcServer } from '../validator/http.ts';
import { DEFAULT_PROGRAM_SO_PATH, LocalValidator } from '../validator/validator.ts';
import { OffsetClock } from './clock.ts';

test('an advance made through one process is the time of another that runs no workers, within a second or so', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has one process per data dir)');
    return;
  }
  const schema = `t_${randomBytes(6).toString('hex')}`;
  const dirs = [mkdtempSync(join(tmpdir(), 'av-clock-')), mkdtempSync(join(tmpdir(), 'av-clock-')), mkdtempSync(join(tmpdir(), 'av-clock-'))];
  // One chain for both, as processes sharing a database share one: a local validator over HTTP.
  const validator = await LocalValidator.open({ dataDir: dirs[2]!, slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
  const rpc = await startRpcServer(validator, { port: 0 });
  const operatorKey = encodeSecretKeyBase58(generateSecretKey());
  const start = (dir: string, scheduleJobs: boolean): Promise<Service> => buildService(loadConfig({
    AGENT_VAULT_DATA_DIR: dir, AGENT_VAULT_RPC_URL: rpc.url, AGENT_VAULT_OPERATOR_KEY: operatorKey, DATABASE_URL: databaseUrl, LOG_LEVEL: 'silent',
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
    await rpc.close();
    await validator.close();
    const admin = await openDatabase({ databaseUrl, dataDir: null });
    await admin.query(`DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    await admin.close();
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
  }
});
