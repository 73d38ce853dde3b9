/**
 * One chain for several services on one PostgreSQL schema, as processes sharing a database share
 * one (a start against another chain than its database's is refused): a local validator served
 * over HTTP, and one operator key. PostgreSQL only: with PGlite a database has one process.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { encodeSecretKeyBase58, generateSecretKey } from '../src/chain/operator-key.ts';
import { OffsetClock } from '../src/clock/clock.ts';
import { loadConfig } from '../src/config/config.ts';
import { buildService, type Service } from '../src/server.ts';
import { startRpcServer } from '../src/validator/http.ts';
import { DEFAULT_PROGRAM_SO_PATH, LocalValidator } from '../src/validator/validator.ts';

export interface SharedChain {
  /** A service (its own data dir, no workers) on `schema` of `databaseUrl`, settling on this chain. */
  start(options: { databaseUrl: string; schema: string; dataDir: string; scheduleJobs?: boolean }): Promise<Service>;
  close(): Promise<void>;
}

export async function startSharedChain(): Promise<SharedChain> {
  const dir = mkdtempSync(join(tmpdir(), 'av-shared-chain-'));
  const validator = await LocalValidator.open({ dataDir: dir, slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
  const rpc = await startRpcServer(validator, { port: 0 });
  const operatorKey = encodeSecretKeyBase58(generateSecretKey());
  return {
    start: ({ databaseUrl, schema, dataDir, scheduleJobs = false }) => buildService(loadConfig({
      AGENT_VAULT_DATA_DIR: dataDir, AGENT_VAULT_RPC_URL: rpc.url, AGENT_VAULT_OPERATOR_KEY: operatorKey, DATABASE_URL: databaseUrl,
      LOG_LEVEL: 'silent',
    }), { schema, scheduleJobs, workers: false, logger: pino({ level: 'silent' }) }),
    async close() {
      await rpc.close();
      await validator.close();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
