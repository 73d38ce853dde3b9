/**
 * The service process: configuration, database and migrations, the chain (embedded validator
 * or a cluster), the default organisation, the HTTP API and the workers; graceful shutdown.
 * buildService assembles without listening, so tests use the very same wiring.
 */
import pino from 'pino';
import { connectChain, type ChainConnection } from './chain/connect.ts';
import { ServiceClock } from './clock/service-clock.ts';
import type { Config } from './config/config.ts';
import { openDatabase, type Database } from './db/database.ts';
import { migrate } from './db/migrate.ts';
import { buildApp, type App } from './http/app.ts';
import type { AppContext } from './http/context.ts';
import { bootstrapOrganizations } from './organizations/organizations.ts';
import { settlementsWritten } from './transactions/settlement.ts';
import { AttemptSender } from './webhooks/sender.ts';
import { JOBS } from './workers/jobs.ts';
import { startJobs, type JobRunner } from './workers/runner.ts';

export interface Service {
  ctx: AppContext;
  app: App;
  jobs: JobRunner;
  /** the default organisation's generated admin key, on the very first start only */
  bootstrapAdminKey: string | null;
  defaultOrgId: string;
  close(): Promise<void>;
}

export interface BuildServiceOptions {
  workers?: boolean;
  /** schedule the workers' timers (tests run them by hand with jobs.runOnce) */
  scheduleJobs?: boolean;
  logger?: pino.Logger;
  /** PostgreSQL schema (tests isolate themselves in one) */
  schema?: string;
  /** PGlite in memory instead of under the data dir (tests) */
  inMemoryDatabase?: boolean;
}

export async function buildService(config: Config, options: BuildServiceOptions = {}): Promise<Service> {
  const logger = options.logger ?? pino({ level: config.logLevel });
  let db: Database | null = null;
  let chain: ChainConnection | null = null;
  try {
    db = await openDatabase({
      databaseUrl: config.databaseUrl, dataDir: options.inMemoryDatabase ? null : config.dataDir, schema: options.schema,
    });
    const applied = await migrate(db);
    if (applied.length) logger.info({ applied }, 'migrations applied');
    const clock = await ServiceClock.load(db);
    chain = await connectChain(config, clock, logger);
    const ctx: AppContext = {
      config, db, clock, chain: chain.chain, validator: chain.validator, cheatcodes: chain.cheatcodes,
      webhookSender: new AttemptSender(clock), log: logger,
    };
    const bootstrap = await bootstrapOrganizations(ctx, config.bootstrapKey);
    const app = await buildApp(ctx, { logger });
    const jobs = startJobs(ctx, options.workers === false ? [] : JOBS, { schedule: options.scheduleJobs ?? true });
    const openedDb = db;
    const openedChain = chain;
    return {
      ctx, app, jobs, bootstrapAdminKey: bootstrap.adminKey, defaultOrgId: bootstrap.orgId,
      async close() {
        await app.close();
        await jobs.stop();
        await ctx.webhookSender.close();
        await openedChain.close();
        // Settlements written behind their answers (or whose outcome came as the chain closed).
        await settlementsWritten(openedDb);
        await openedDb.close();
      },
    };
  } catch (error) {
    await chain?.close().catch(() => {});
    await db?.close().catch(() => {});
    throw error;
  }
}

/**
 * `agent-vault serve` (the HTTP API, with the workers unless `workers: false`) and
 * `agent-vault worker` (`http: false`: the workers alone, no listener): runs until
 * SIGTERM/SIGINT, then closes in order.
 */
export async function serve(config: Config, { workers = true, http = true } = {}): Promise<void> {
  const logger = pino({ level: config.logLevel });
  const service = await buildService(config, { workers, logger });
  if (service.bootstrapAdminKey) {
    // Printed once, on the first start: the only time this key is ever shown.
    process.stdout.write(`\nDefault organisation ${service.defaultOrgId} created.\nAdmin API key (shown once, store it now):\n\n  ${service.bootstrapAdminKey}\n\n`);
  }
  if (http) await service.app.listen({ port: config.port, host: config.host });
  else logger.info({ jobs: JOBS.map((job) => job.name) }, 'workers running (no HTTP listener)');
  let closing = false;
  const shutdown = async (signal: string) => {
    if (closing) return;
    closing = true;
    logger.info({ signal }, 'shutting down');
    try {
      await service.close();
      logger.info('stopped');
    } finally {
      process.exit(0);
    }
  };
  process.once('SIGTERM', () => void shutdown('SIGTERM'));
  process.once('SIGINT', () => void shutdown('SIGINT'));
}
