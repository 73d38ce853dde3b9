/**
 * A whole service for a test: real database (PGlite in memory, or a fresh schema of the
 * PostgreSQL at DATABASE_URL), the embedded local validator with our program (slots of 0 ms
 * by default, on the test's thread), the default organisation with a known admin key. Requests go through
 * Fastify's inject, i.e. the real HTTP stack without a socket.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type { Role } from '../src/auth/api-keys.ts';
import { loadConfig, type Config } from '../src/config/config.ts';
import { applicationName, openDatabase, quoteIdentifier, type Database } from '../src/db/database.ts';
import { createOrganization, insertApiKey } from '../src/organizations/organizations.ts';
import { buildService, type Service } from '../src/server.ts';
import { settlementsWritten } from '../src/transactions/settlement.ts';

export const ADMIN_KEY = 'av_admin_testtesttesttesttesttesttest0001';

export interface TestResponse<T = any> {
  status: number;
  body: T;
  headers: Record<string, string | string[] | number | undefined>;
}

export interface RequestOptions {
  key?: string | null;
  body?: unknown;
  headers?: Record<string, string>;
}

export interface TestService {
  service: Service;
  config: Config;
  orgId: string;
  adminKey: string;
  request<T = any>(method: string, url: string, options?: RequestOptions): Promise<TestResponse<T>>;
  /** a new API key of the given role in the default organisation (or `orgId`) */
  createKey(role: Role, orgId?: string): Promise<string>;
  /** a second organisation with its admin key, for isolation tests */
  createOrganization(name?: string): Promise<{ orgId: string; adminKey: string }>;
  /**
   * Resolves once the service has written every settlement it started: a confirmed payment is
   * answered before its settlement (its index row and events) is written, as a client would
   * otherwise see by polling.
   */
  settled(): Promise<void>;
  /**
   * PostgreSQL: resolves once the write transactions of the server open now (but this service's
   * own) have ended, at most 10 s: then the webhook dispatcher's horizon has passed every event
   * written so far (othersWritesEnded below). A run of the jobs waits for this itself; a test
   * calling the dispatcher's steps directly waits for it after writing its events. PGlite: at once.
   */
  othersWritesEnded(): Promise<void>;
  close(): Promise<void>;
}

export async function startTestService(
  options: { env?: Record<string, string>; workers?: boolean; logger?: pino.Logger; wallNowMs?: () => number } = {},
): Promise<TestService> {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-test-'));
  const databaseUrl = process.env.DATABASE_URL;
  const schema = databaseUrl ? `t_${randomBytes(6).toString('hex')}` : undefined;
  const config = loadConfig({
    AGENT_VAULT_DATA_DIR: dataDir,
    AGENT_VAULT_SLOT_MS: '0',
    // On this thread, where a test can reach it (ctx.validator); src/validator/thread.test.ts
    // runs the service with it in its own thread, as `serve` does by default.
    AGENT_VAULT_VALIDATOR_THREAD: 'off',
    AGENT_VAULT_BOOTSTRAP_KEY: ADMIN_KEY,
    AGENT_VAULT_RATE_LIMIT_PER_MINUTE: '100000',
    // The test and the service share one event loop, which a test's own bursts keep busy: load
    // shedding is for a process serving clients (src/http/shedding.test.ts turns it on).
    AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS: '0',
    AGENT_VAULT_DOCS_URL: 'https://docs.agent-vault.test',
    LOG_LEVEL: 'silent',
    ...(databaseUrl ? { DATABASE_URL: databaseUrl } : {}),
    ...options.env,
  });
  const service = await buildService(config, {
    inMemoryDatabase: true, schema, scheduleJobs: false, workers: options.workers ?? true, logger: options.logger ?? pino({ level: process.env.TEST_LOG ?? 'silent' }),
    wallNowMs: options.wallNowMs,
  });
  const { ctx, app } = service;
  const writesEnded = async () => { if (schema) await othersWritesEnded(ctx.db, applicationName(schema)); };
  const runOnce = service.jobs.runOnce.bind(service.jobs);
  service.jobs.runOnce = async () => {
    await writesEnded();
    await runOnce();
  };

  const request = async <T>(method: string, url: string, opts: RequestOptions = {}): Promise<TestResponse<T>> => {
    const key = opts.key === undefined ? ADMIN_KEY : opts.key;
    const headers: Record<string, string> = { ...opts.headers };
    if (key !== null) headers.authorization = `Bearer ${key}`;
    const response = await app.inject({
      method: method as 'GET', url, headers,
      ...(opts.body === undefined ? {} : { payload: typeof opts.body === 'string' ? opts.body : JSON.stringify(opts.body) }),
      ...(opts.body !== undefined && !headers['content-type'] ? { headers: { ...headers, 'content-type': 'application/json' } } : {}),
    });
    let body: unknown = response.body;
    if (String(response.headers['content-type'] ?? '').includes('json') && response.body.length) body = response.json();
    return { status: response.statusCode, body: body as T, headers: response.headers };
  };

  return {
    service, config, orgId: service.defaultOrgId, adminKey: ADMIN_KEY, request,
    async createKey(role, orgId = service.defaultOrgId) {
      return (await insertApiKey(ctx.db, ctx.clock.nowMs(), orgId, role, `test ${role}`)).key;
    },
    async createOrganization(name = 'Other organization') {
      const { org, adminKey } = await createOrganization(ctx, { name });
      return { orgId: org.id, adminKey: adminKey.key };
    },
    settled: () => settlementsWritten(ctx.db),
    othersWritesEnded: writesEnded,
    async close() {
      await service.close();
      rmSync(dataDir, { recursive: true, force: true });
      if (databaseUrl && schema) await onDatabase(databaseUrl, `DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    },
  };
}

/**
 * On PostgreSQL the suite runs two test files at once, each in a schema of its own, but the
 * webhook dispatcher's horizon is the oldest write transaction of the whole server
 * (docs/webhooks.md): another file holding one open (a row lock, say) would hold back the
 * deliveries of a run of the jobs. So a run first waits, up to 10 s, for the write transactions
 * open when it was asked for but this test service's own (a test's second connection to its
 * schema holding one is the test's doing).
 */
async function othersWritesEnded(db: Database, ownName: string): Promise<void> {
  const open = () => db.query<{ pid: number; xid: string }>(
    `SELECT pid, backend_xid::text AS xid FROM pg_stat_activity
     WHERE backend_xid IS NOT NULL AND application_name <> $1`, [ownName]);
  const before = new Set((await open()).map(({ pid, xid }) => `${pid}:${xid}`));
  const endMs = performance.now() + 10_000;
  while (before.size && performance.now() < endMs) {
    await new Promise((resolve) => setTimeout(resolve, 20));
    const now = new Set((await open()).map(({ pid, xid }) => `${pid}:${xid}`));
    for (const transaction of before) if (!now.has(transaction)) before.delete(transaction);
  }
}

/** Runs one statement on the PostgreSQL server of `databaseUrl`, outside any service (creating or dropping a test's schema). */
export async function onDatabase(databaseUrl: string, sql: string): Promise<void> {
  const admin = await openDatabase({ databaseUrl, dataDir: null });
  try {
    await admin.query(sql);
  } finally {
    await admin.close();
  }
}
