/**
 * The service process: configuration, database and migrations, the chain (embedded validator
 * or a cluster), the default organisation, the HTTP API and the workers; graceful shutdown.
 * buildService assembles without listening, so tests use the very same wiring.
 */
import { createServer, type AddressInfo } from 'node:net';
import type pino from 'pino';
import { connectChain, type ChainConnection } from './chain/connect.ts';
import { ServiceClock } from './clock/service-clock.ts';
import { defaultDocsUrl, type Config } from './config/config.ts';
import { openDatabase, type Database } from './db/database.ts';
import { migrate } from './db/migrate.ts';
import { buildApp, type App } from './http/app.ts';
import type { AppContext } from './http/context.ts';
import { serviceLogger } from './http/logger.ts';
import { bootstrapOrganizations } from './organizations/organizations.ts';
import { settlementsWritten } from './transactions/settlement.ts';
import { AttemptSender } from './webhooks/sender.ts';
import { CLOCK_REFRESH_JOB, JOBS } from './workers/jobs.ts';
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
  /** told the default organisation's generated admin key on the first start, as soon as it is stored */
  onAdminKey?: (orgId: string, adminKey: string) => void;
  /** how long close() lets requests in flight finish before it cuts their connections */
  httpCloseWaitMs?: number;
  /** the wall clock of the logs' once-a-minute lines during an outage (tests) */
  wallNowMs?: () => number;
}

/**
 * Requests in flight when the service closes (a payment waiting for its slot, an export being
 * downloaded) get this long to finish; then their connections are cut, so that a stalled client
 * cannot hold the shutdown — and with it the validator's last snapshot and the database's close.
 */
export const HTTP_CLOSE_WAIT_MS = 10_000;

/** Closes the listener, letting requests in flight finish for `waitMs` at most. */
async function closeHttp(app: App, waitMs: number): Promise<void> {
  const closed = app.close();
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<boolean>((resolve) => { timer = setTimeout(() => resolve(true), waitMs); });
  try {
    if (await Promise.race([closed.then(() => false), late])) {
      app.log.warn({ waitedMs: waitMs }, 'requests still in flight at shutdown: their connections are cut');
      app.server.closeAllConnections();
      await closed;
    }
  } finally {
    clearTimeout(timer);
  }
}

export async function buildService(config: Config, options: BuildServiceOptions = {}): Promise<Service> {
  const logger = options.logger ?? serviceLogger(config.logLevel);
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
    const bootstrap = await bootstrapOrganizations(ctx, config.bootstrapKey, {
      onAdminKey: options.onAdminKey,
      onPendingFailed: (orgId, error) => logger.error({ err: error, orgId }, 'organisation not set up on chain: it stays pending until a start sets it up'),
    });
    const app = await buildApp(ctx, { logger, wallNowMs: options.wallNowMs });
    // Without the workers (`serve --no-workers`) the clock is still re-read each second, so a
    // test-clock advance made through another process is this one's time too.
    const jobs = startJobs(ctx, options.workers === false ? JOBS.filter((job) => job.name === CLOCK_REFRESH_JOB) : JOBS,
      { schedule: options.scheduleJobs ?? true, wallNowMs: options.wallNowMs });
    const openedDb = db;
    const openedChain = chain;
    return {
      ctx, app, jobs, bootstrapAdminKey: bootstrap.adminKey, defaultOrgId: bootstrap.orgId,
      /**
       * Closes in order; a step that fails does not skip the ones after it (the database is
       * closed, and its lock released, even when the validator's last snapshot could not be
       * written). The first failure is thrown at the end.
       */
      async close() {
        const failures: unknown[] = [];
        const step = async (run: () => Promise<unknown>) => {
          try {
            await run();
          } catch (error) {
            failures.push(error);
          }
        };
        await step(() => closeHttp(app, options.httpCloseWaitMs ?? HTTP_CLOSE_WAIT_MS));
        await step(() => jobs.stop());
        await step(() => ctx.webhookSender.close());
        await step(() => openedChain.close());
        // Settlements written behind their answers (or whose outcome came as the chain closed).
        await step(() => settlementsWritten(openedDb));
        await step(() => openedDb.close());
        if (failures.length) throw failures[0];
      },
    };
  } catch (error) {
    await chain?.close().catch(() => {});
    await db?.close().catch(() => {});
    throw error;
  }
}

/**
 * A shutdown that has not ended after this long ends the process anyway: its steps each wait a
 * bounded time for requests and jobs, but a database or a chain that stops answering mid-way
 * (a network partition) would hold the rest until TCP gives up, a quarter of an hour.
 */
export const SHUTDOWN_DEADLINE_MS = 30_000;

/**
 * Closes the service and answers the exit code: 0 once closed, 1 when a step failed (said, and
 * told to the supervisor: a validator snapshot or a database close that failed) or when the
 * close has not ended within `deadlineMs`; what is left is recovered at the next start, as
 * after a crash.
 */
export async function closeWithin(service: Pick<Service, 'close'>, deadlineMs: number, logger: pino.Logger): Promise<number> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'late'>((resolve) => { timer = setTimeout(() => resolve('late'), deadlineMs); });
  const closed = service.close().then(() => 'closed' as const);
  closed.catch(() => {}); // a failure after the deadline: the process is ending anyway
  try {
    if (await Promise.race([closed, late]) === 'late') {
      logger.error({ deadlineMs }, 'shutting down did not end in time (a database or chain not answering?): exiting; the next start recovers what was left, as after a crash');
      return 1;
    }
    logger.info('stopped');
    return 0;
  } catch (error) {
    logger.error({ err: error }, 'shutting down failed');
    return 1;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * `agent-vault serve` (the HTTP API, with the workers unless `workers: false`) and
 * `agent-vault worker` (`http: false`: the workers alone, no listener): runs until
 * SIGTERM/SIGINT, then closes in order.
 */
export async function serve(config: Config, { workers = true, http = true } = {}): Promise<void> {
  const logger = serviceLogger(config.logLevel);
  // A port taken or a host not this machine's is said before anything is set up: on a first start,
  // before the default organisation is made and its key printed.
  if (http) await assertListenable(config.host, config.port);
  // Printed once, on the first start, as soon as it is stored (before the chain setup, which
  // may fail and be finished at the next start): the only time this key is ever shown.
  const service = await buildService(config, {
    workers, logger,
    onAdminKey: (orgId, adminKey) => process.stdout.write(
      `\nDefault organisation ${orgId} created.\nAdmin API key (shown once, store it now):\n\n  ${adminKey}\n\n`),
  });
  // Before the listener: a signal that comes while it starts (just after its "listening" line,
  // say) is a graceful shutdown too, not the default's immediate end.
  let closing = false;
  const shutdown = async (signal: string) => {
    if (closing) {
      logger.info({ signal }, 'already shutting down');
      return;
    }
    closing = true;
    logger.info({ signal }, 'shutting down');
    process.exit(await closeWithin(service, SHUTDOWN_DEADLINE_MS, logger));
  };
  // `on`, not `once`: a second signal (Ctrl-C twice, npm forwarding the terminal's SIGINT, a
  // supervisor's SIGTERM after a kill) must not fall back on the default's immediate end.
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
  process.on('SIGINT', () => void shutdown('SIGINT'));
  if (http) {
    try {
      await service.app.listen({ port: config.port, host: config.host });
      // PORT=0: the errors' `docs` links name the port the system chose.
      if (config.port === 0 && config.docsUrl === defaultDocsUrl(config.host, 0)) {
        config.docsUrl = defaultDocsUrl(config.host, (service.app.server.address() as AddressInfo).port);
      }
    } catch (caught) {
      const error = listenError(caught, config.host, config.port);
      // The port taken, a host that is not this machine's: nothing is left running (the workers,
      // the validator's thread, the data dir's locks), so the process ends with the error.
      closing = true;
      await service.close().catch((closeError: unknown) => logger.error({ err: closeError }, 'closing after a failed start failed'));
      process.removeAllListeners('SIGTERM');
      process.removeAllListeners('SIGINT');
      throw error;
    }
  } else {
    logger.info({ jobs: JOBS.map((job) => job.name) }, 'workers running (no HTTP listener)');
  }
}

/** A listen that failed, saying which variables chose the address (the error's `code` kept). */
function listenError(error: unknown, host: string, port: number): unknown {
  if (!(error instanceof Error)) return error;
  return Object.assign(new Error(`cannot listen on HOST=${host} PORT=${port}: ${error.message}`), { code: (error as { code?: unknown }).code });
}

/** Binds the address once and lets it go: a port taken or a host that is not this machine's throws, naming HOST and PORT. */
async function assertListenable(host: string, port: number): Promise<void> {
  const probe = createServer();
  try {
    await new Promise<void>((resolve, reject) => {
      probe.once('error', reject);
      probe.listen({ host, port, exclusive: true }, resolve);
    });
  } catch (error) {
    throw listenError(error, host, port);
  } finally {
    await new Promise<void>((resolve) => { if (probe.listening) probe.close(() => resolve()); else resolve(); });
  }
}
