/**
 * Payments per second through the real HTTP API on PostgreSQL, beside pgbench on the same
 * server in the same run. Prints figures and whether each target is met; asserts nothing.
 *
 *   npm run bench -- [--seconds 8] [--connections 32,64,128] [--pgbench-clients 32,64] [--wait-connections 256] [--vaults 64]
 *                    [--busy-payments 100000] [--slot-ms 400] [--settle-seconds 3] [--pgbench-scale 10]
 *                    [--log-level warn] [--database-url postgres://postgres@127.0.0.1:5432/postgres] [--cpu-prof] [--webhooks 1]
 *
 * The service runs as a child process, `node bin/agent-vault.js serve`, as it is deployed
 * (HTTP server, workers, embedded validator, its own event loop and CPU), on a database created
 * for the run and dropped at the end; pgbench gets its own scratch database, also dropped.
 * Each side is measured at its best: the service at the connection count that gave it the most
 * payments per second in a short trial, pgbench at its best client count. Each pgbench figure
 * is taken just before the payment run it is compared with, and the busy
 * and fresh vaults alternate, so that a neighbour's load on a shared machine skews a ratio less.
 * docs/benchmarks.md explains each scenario and the figures measured.
 */
import { spawn, execFile, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { availableParallelism, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs, promisify } from 'node:util';
import { generateKeyPairSigner } from '@solana/kit';
import pg from 'pg';
import { DAY_MS, HOUR_MS, monthKey } from '../src/payments/policy-engine.ts';
import { freePort, stopProcess, waitForHealth } from '../test/processes.ts';
import { RawPostClient } from './raw-post.ts';
import { RawReceiver } from './raw-receiver.ts';
import { positiveInteger } from './args.ts';

// ---------------------------------------------------------------------------------------------
// Options

const { values } = parseArgs({
  options: {
    seconds: { type: 'string', default: '8' },
    connections: { type: 'string', default: '32,64,128' },
    'pgbench-clients': { type: 'string', default: '32,64' },
    'wait-connections': { type: 'string' },
    vaults: { type: 'string', default: '64' },
    'busy-payments': { type: 'string', default: '100000' },
    'slot-ms': { type: 'string', default: '400' },
    'settle-seconds': { type: 'string', default: '3' },
    'pgbench-scale': { type: 'string', default: '10' },
    'log-level': { type: 'string', default: 'warn' },
    'database-url': { type: 'string', default: 'postgres://postgres@127.0.0.1:5432/postgres' },
    'cpu-prof': { type: 'boolean', default: false },
    webhooks: { type: 'string', default: '1' },
  },
  strict: true,
});

const seconds = positiveInteger('seconds', values.seconds);
function positiveIntegers(name: string, text: string | undefined): number[] {
  return (text ?? '').split(',').map((part) => positiveInteger(name, part.trim()));
}

/**
 * The closed-loop connection counts tried: the service answers each payment after a few round
 * trips to PostgreSQL and batches what arrives meanwhile, so its most payments per second take
 * more requests in flight than pgbench's clients. The count with the most is used for every
 * closed-loop run; the first is the base of the waiting run's.
 */
const connectionCounts = positiveIntegers('connections', values.connections);
/** pgbench's client counts tried (each a PostgreSQL connection: keep them under max_connections); its best is compared. */
const pgbenchClientCounts = positiveIntegers('pgbench-clients', values['pgbench-clients']);
/** A request that waits for its slot holds its connection for about a slot: loading the service takes more of them. */
const waitConnections = positiveInteger('wait-connections', values['wait-connections'] ?? String(connectionCounts[0]! * 8));
const vaultCount = positiveInteger('vaults', values.vaults);
const busyPayments = positiveInteger('busy-payments', values['busy-payments']);
const slotMs = positiveInteger('slot-ms', values['slot-ms']);
const settleSeconds = positiveInteger('settle-seconds', values['settle-seconds']);
const pgbenchScale = positiveInteger('pgbench-scale', values['pgbench-scale']);
const logLevel = values['log-level']!;
const cpuProfile = values['cpu-prof']!;
/** Webhooks subscribed to every event in the webhooks run that the target applies to (then three times as many, for reference). */
const WEBHOOKS = positiveInteger('webhooks', values.webhooks);

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const SERVICE_DATABASE = 'agent_vault_bench';
const PGBENCH_DATABASE = 'agent_vault_bench_pgbench';
const ADMIN_KEY = 'av_admin_benchbenchbenchbenchbenchbench01';
/** Each payment moves 0.01 USDC; each vault holds enough for far more payments than a run makes. */
const PAYMENT_AMOUNT = '0.01';
const PAYMENT_MICRO = 10_000n;
const VAULT_FUNDING = '1000';
const RECIPIENT_COUNT = 16;
const FUND_BATCH_MAX = 10;
const CREATE_CONCURRENCY_MAX = 32;
const REQUEST_TIMEOUT_MS = 30_000;
const SETUP_ATTEMPTS_MAX = 5;
const SERVICE_START_TIMEOUT_MS = 120_000;
const SERVICE_STOP_TIMEOUT_MS = 20_000;
/** Length of each closed-loop trial that picks the connection count. */
const TRIAL_SECONDS = 3;
/** Turns the fresh and the busy vault take, one after the other. */
const ALTERNATION_ROUNDS = 4;
/** Linux's USER_HZ: /proc reports CPU time in these ticks. */
const CLOCK_TICKS_PER_SECOND = 100;
/** The targets, as the issue states them. */
const TARGET = {
  manyVsTpcb: 0.5, hotVsSingleRow: 0.3, busyVsFresh: 0.9, p99NoWaitMs: 25, p99WaitExtraMs: 25, webhookDropPct: 15, webhookLagP99Ms: 2000,
};
/** How long after a webhook turn its deliveries may take to arrive before they count as not delivered. */
const WEBHOOK_DRAIN_MS = 5_000;
/** Rounds of the webhook comparison: each a turn with the webhooks on and one with them off. */
const WEBHOOK_ROUNDS = 2;

function databaseUrl(name: string): string {
  const url = new URL(values['database-url']!);
  url.pathname = `/${name}`;
  return url.toString();
}

// autocannon ships no type declarations: these are the parts used here (its README, "API").
interface AutocannonHistogram { p50: number; p99: number }
interface AutocannonResult {
  duration: number; errors: number; non2xx: number;
  statusCodeStats: Record<string, { count: number }>;
  latency: AutocannonHistogram;
}
interface AutocannonRequest { method: string; path: string; body?: string }
interface AutocannonOptions {
  url: string; connections: number; duration: number; timeout: number; headers: Record<string, string>;
  skipAggregateResult: true;
  requests: Array<AutocannonRequest & { setupRequest(request: AutocannonRequest): AutocannonRequest }>;
}
/** A result run with skipAggregateResult: its histograms stay mergeable with other runs'. */
type RawAutocannonResult = Omit<AutocannonResult, 'latency'>;
interface Autocannon {
  (options: AutocannonOptions): Promise<RawAutocannonResult>;
  aggregateResult(results: RawAutocannonResult[], options: { url: string; connections: number }): AutocannonResult;
}
const autocannon = createRequire(import.meta.url)('autocannon') as Autocannon;

// ---------------------------------------------------------------------------------------------
// Databases, pgbench, clean-up

const admin = new pg.Client({ connectionString: values['database-url'] });
admin.on('error', () => {});
await admin.connect();

async function recreateDatabase(name: string): Promise<void> {
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.query(`CREATE DATABASE ${name}`);
}

async function dropDatabase(name: string): Promise<void> {
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
}

const execFileAsync = promisify(execFile);

async function pgbench(args: string[]): Promise<string> {
  const { stdout } = await execFileAsync('pgbench', [...args, databaseUrl(PGBENCH_DATABASE)], { maxBuffer: 16 * 1024 * 1024 });
  return stdout;
}

/** pgbench with `clients` clients for the payment runs' duration; its transactions per second. */
async function pgbenchTps(extraArgs: string[], clients: number): Promise<number> {
  const threads = String(Math.min(availableParallelism(), clients));
  const output = await pgbench([...extraArgs, '-c', String(clients), '-j', threads, '-T', String(seconds)]);
  const match = /tps = ([\d.]+)/.exec(output);
  if (!match) throw new Error(`pgbench printed no tps:\n${output}`);
  return Number(match[1]);
}

const workDir = mkdtempSync(join(tmpdir(), 'av-bench-payments-'));
let service: ChildProcess | null = null;
let serviceDb: pg.Pool | null = null;

async function cleanUp(): Promise<void> {
  if (service) await stopProcess(service, { killAfterMs: SERVICE_STOP_TIMEOUT_MS });
  await serviceDb?.end().catch(() => {});
  await dropDatabase(SERVICE_DATABASE).catch(() => {});
  await dropDatabase(PGBENCH_DATABASE).catch(() => {});
  await admin.end().catch(() => {});
  rmSync(workDir, { recursive: true, force: true });
}

process.once('SIGINT', () => {
  void cleanUp().finally(() => process.exit(130));
});

const benchStartMs = Date.now();
const log = (message: string) => process.stderr.write(`[${((Date.now() - benchStartMs) / 1000).toFixed(0).padStart(3)} s] ${message}\n`);

let serviceOutput: { tail: string[]; warnings: string[] } | null = null;
try {
  await recreateDatabase(PGBENCH_DATABASE);
  log(`pgbench -i -s ${pgbenchScale}`);
  await pgbench(['-i', '-q', '-s', String(pgbenchScale)]);
  const singleRowScript = join(workDir, 'single-row-update.sql');
  writeFileSync(singleRowScript, 'UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = 1;\n');

  // -------------------------------------------------------------------------------------------
  // The service, an organisation, its vaults

  await recreateDatabase(SERVICE_DATABASE);
  const port = await freePort();
  const baseUrl = `http://127.0.0.1:${port}`;
  // Outside the work directory, which is removed: node writes the profile as the service exits.
  const profileDir = cpuProfile ? mkdtempSync(join(tmpdir(), 'av-bench-profile-')) : '';
  service = startService(port, profileDir);
  const serviceLog = captureLog(service);
  serviceOutput = serviceLog;
  await waitForHealth(baseUrl, service, { timeoutMs: SERVICE_START_TIMEOUT_MS, output: () => serviceLog.tail.join('\n') });
  log(`service listening on ${baseUrl} (pid ${service.pid}, LOG_LEVEL=${logLevel}, slot ${slotMs} ms)`);
  serviceDb = new pg.Pool({ connectionString: databaseUrl(SERVICE_DATABASE), max: 2 });
  serviceDb.on('error', () => {});
  const meter = cpuMeter(service.pid!, serviceDb);

  const api = apiClient(baseUrl);
  const policy = await api('POST', '/v1/policies', {
    name: 'Benchmark', maxPerTx: '1000', maxPerDay: '10000000', maxPerMonth: '100000000', velocityCap: 1_000_000,
  });
  const policyId = policy.policy_id as string;
  const recipients = await Promise.all(Array.from({ length: RECIPIENT_COUNT }, async () => (await generateKeyPairSigner()).address));
  const totalVaults = vaultCount + 2;
  await api('POST', '/v1/test_helpers/deposits', { amount: String(totalVaults * Number(VAULT_FUNDING)) });
  log(`creating and funding ${totalVaults} vaults`);
  const walletIds: string[] = [];
  for (let start = 0; start < totalVaults; start += CREATE_CONCURRENCY_MAX) {
    const created = await Promise.all(Array.from({ length: Math.min(CREATE_CONCURRENCY_MAX, totalVaults - start) }, (_, k) =>
      api('POST', '/v1/wallets', { agentId: `bench-${start + k}`, label: `Bench ${start + k}`, policyId })));
    walletIds.push(...created.map((wallet) => wallet.wallet_id as string));
  }
  const batches: string[][] = [];
  for (let start = 0; start < walletIds.length; start += FUND_BATCH_MAX) batches.push(walletIds.slice(start, start + FUND_BATCH_MAX));
  await Promise.all(batches.map((batch) => api('POST', '/v1/wallets/fund-batch', {
    allocations: batch.map((walletId) => ({ walletId, amount: VAULT_FUNDING })),
  })));
  const manyVaults = walletIds.slice(0, vaultCount);
  const freshVault = walletIds[vaultCount]!;
  const busyVault = walletIds[vaultCount + 1]!;

  // Every recipient's token account exists before anything is timed.
  await Promise.all(recipients.map((to, i) =>
    api('POST', '/v1/payments', { walletId: manyVaults[i % vaultCount], to, amount: PAYMENT_AMOUNT, currency: 'USDC', memo: 'warm-up' })));
  log(`filling the busy vault's 24 h window with ${busyPayments} confirmed payments`);
  const fillMs = await fillSpendWindow(serviceDb, busyVault, policyId, recipients, busyPayments);
  log(`filled in ${(fillMs / 1000).toFixed(1)} s`);
  // pgbench vacuums its tables before each run; the service's database gets the same after the
  // bulk fill, so that autovacuum's first pass over the fill's rows does not land in a timed run.
  const vacuumStartedMs = performance.now();
  await serviceDb.query('VACUUM ANALYZE');
  await serviceDb.query('CHECKPOINT');
  log(`vacuum analyze and checkpoint: ${((performance.now() - vacuumStartedMs) / 1000).toFixed(1)} s`);

  const bodiesFor = (wallets: string[], memo: string, wait: boolean) => {
    const bodies: string[] = [];
    for (let i = 0; i < Math.max(wallets.length, RECIPIENT_COUNT); i += 1) {
      bodies.push(JSON.stringify({
        walletId: wallets[i % wallets.length], to: recipients[i % RECIPIENT_COUNT], amount: PAYMENT_AMOUNT, currency: 'USDC',
        memo, waitForConfirmation: wait,
      }));
    }
    return bodies;
  };

  // JIT, pools and caches warm; not timed.
  log('warm-up: 2 s');
  await closedLoop(baseUrl, bodiesFor(manyVaults, 'warm-up', false), connectionCounts[0]!, 2);
  await sleep(settleSeconds * 1000);

  // The connection count at which the service accepts the most payments (the trials are not timed
  // into any figure; each trial's payments settle before the next starts).
  const trials: Array<{ count: number; perSecond: number }> = [];
  for (const count of connectionCounts) {
    const trial = await closedLoop(baseUrl, bodiesFor(manyVaults, 'trial', false), count, TRIAL_SECONDS);
    trials.push({ count, perSecond: trial.ok / trial.durationS });
    log(`trial: ${count} connections, ${TRIAL_SECONDS} s: ${(trial.ok / trial.durationS).toFixed(0)} payments/s`);
    await sleep(settleSeconds * 1000);
  }
  const connections = trials.reduce((best, trial) => (trial.perSecond > best.perSecond ? trial : best)).count;

  // -------------------------------------------------------------------------------------------
  // Scenarios

  const runScenario = async (scenario: Scenario, durationS = seconds, settleAfterS = settleSeconds): Promise<Piece> => {
    log(`${scenario.name}: ${scenario.rate ? `paced at ${scenario.rate} payments/s` : `${scenario.connections} connections`}, ${durationS} s`);
    const bodies = bodiesFor(scenario.wallets, scenario.name, scenario.wait);
    const piece = await runPiece(serviceDb!, meter, baseUrl, scenario, bodies, durationS, settleAfterS);
    const { p50Ms, p99Ms } = summarise([piece]);
    log(`  ${(piece.load.ok / piece.load.durationS).toFixed(0)} payments/s, p50 ${fmt(p50Ms)} ms, p99 ${fmt(p99Ms)} ms, non-2xx ${piece.load.non2xx}, `
      + `pending ${piece.pendingEnd} → ${piece.pendingLater}, ${describeCpu(piece.cpu, piece.load.ok)}`);
    return piece;
  };
  const pgbenchRuns: string[] = [];
  /** pgbench at each client count tried; its best figure. */
  const pgbenchRun = async (label: string, args: string[]): Promise<{ tps: number; clients: number }> => {
    let best = { tps: 0, clients: 0 };
    for (const clients of pgbenchClientCounts) {
      log(`pgbench ${label}: ${clients} clients, ${seconds} s`);
      const machineBefore = machineBusyS();
      const startedMs = performance.now();
      const { result: tps, cpuS: postgresS } = await withPostgresCpu(serviceDb!, PGBENCH_DATABASE, pgbenchTps(args, clients));
      const wallS = (performance.now() - startedMs) / 1000;
      const summary = `pgbench ${label}, ${clients} clients: ${tps.toFixed(0)} tps; postgres backends ${(postgresS / wallS).toFixed(2)} cores, `
        + `${((postgresS * 1000) / (tps * seconds)).toFixed(2)} CPU ms per transaction; `
        + `rest of the machine ${(Math.max(0, machineBusyS() - machineBefore - postgresS) / wallS).toFixed(2)} cores`;
      pgbenchRuns.push(summary);
      log(`  ${summary}`);
      if (tps > best.tps) best = { tps, clients };
    }
    return best;
  };
  const tpcb = await pgbenchRun('TPC-B', []);
  const tpcbTps = tpcb.tps;
  const many = summarise([await runScenario({ name: 'many vaults', wallets: manyVaults, wait: false, connections })]);
  const manyWait = summarise([await runScenario({ name: 'many vaults, wait', wallets: manyVaults, wait: true, connections: waitConnections })]);
  const halfRate = Math.max(1, Math.round(many.paymentsPerSecond / 2));
  const half = summarise([await runScenario({ name: 'half rate', wallets: manyVaults, wait: false, connections, rate: halfRate })]);
  const halfWait = summarise([await runScenario({ name: 'half rate, wait', wallets: manyVaults, wait: true, connections, rate: halfRate })]);
  const singleRow = await pgbenchRun('single-row update', ['-n', '-f', singleRowScript]);
  const singleRowTps = singleRow.tps;
  const freshPieces: Piece[] = [];
  const busyPieces: Piece[] = [];
  // Short turns, so that a neighbour's burst of load on a shared machine falls on both vaults alike.
  const pieceSeconds = Math.max(1, Math.round(seconds / ALTERNATION_ROUNDS));
  for (let round = 0; round < ALTERNATION_ROUNDS; round += 1) {
    const settleAfterS = round === ALTERNATION_ROUNDS - 1 ? settleSeconds : 1;
    freshPieces.push(await runScenario({ name: 'one hot vault', wallets: [freshVault], wait: false, connections }, pieceSeconds, settleAfterS));
    busyPieces.push(await runScenario({ name: 'busy vault', wallets: [busyVault], wait: false, connections }, pieceSeconds, settleAfterS));
  }
  const fresh = summarise(freshPieces);
  const busy = summarise(busyPieces);

  // The many-vault run with webhooks subscribed to every event, received here. The target's
  // webhooks (--webhooks) are switched on and off between turns of the same run, ABBA, so that
  // the drop compares neighbours in time; then, for reference, three times as many in one turn.
  // A webhook's backlog is drained before it is switched off (off, it would skip what it has
  // not sent yet).
  const receiver = new RawReceiver();
  const hookUrl = await receiver.listen();
  const webhookIds: string[] = [];
  const switchWebhooks = async (active: number): Promise<void> => {
    while (webhookIds.length < Math.max(active, WEBHOOKS)) {
      webhookIds.push((await api('POST', '/v1/webhooks', { url: hookUrl, events: '*' })).webhook_id as string);
    }
    await Promise.all(webhookIds.map((id, i) => api('PATCH', `/v1/webhooks/${id}`, { status: i < active ? 'active' : 'disabled' })));
  };
  const plainName = 'many vaults, webhooks off';
  const hookedName = (count: number) => `many vaults, ${count} webhook${count === 1 ? '' : 's'}`;
  const hookedTurn = async (count: number): Promise<{ piece: Piece; window: Window }> => {
    await switchWebhooks(count);
    const from = new Date();
    const piece = await runScenario({ name: hookedName(count), wallets: manyVaults, wait: false, connections });
    const drainedBy = Date.now() + WEBHOOK_DRAIN_MS;
    while ((await webhookLag(serviceDb!, [[from, new Date()]], count)).waiting > 0 && Date.now() < drainedBy) await sleep(100);
    const window: Window = [from, new Date()];
    await switchWebhooks(0);
    return { piece, window };
  };
  // As the warm-up before the scenarios: the dispatcher's code paths and its sending thread
  // (started with the first delivery) get going before anything is timed.
  await switchWebhooks(WEBHOOKS);
  log('webhook warm-up: 2 s');
  await closedLoop(baseUrl, bodiesFor(manyVaults, 'webhook warm-up', false), connections, 2);
  await sleep(settleSeconds * 1000);
  await switchWebhooks(0);
  const plainPieces: Piece[] = [];
  const hookedPieces: Piece[] = [];
  const hookedWindows: Window[] = [];
  for (let round = 0; round < WEBHOOK_ROUNDS; round += 1) {
    for (const webhooksOn of round % 2 === 0 ? [false, true] : [true, false]) {
      if (!webhooksOn) {
        plainPieces.push(await runScenario({ name: plainName, wallets: manyVaults, wait: false, connections }));
        continue;
      }
      const turn = await hookedTurn(WEBHOOKS);
      hookedPieces.push(turn.piece);
      hookedWindows.push(turn.window);
    }
  }
  const plain = summarise(plainPieces);
  const hooked = { row: summarise(hookedPieces), lag: await webhookLag(serviceDb, hookedWindows, WEBHOOKS) };
  const moreTurn = await hookedTurn(3 * WEBHOOKS);
  const moreHooked = { row: summarise([moreTurn.piece]), lag: await webhookLag(serviceDb, [moreTurn.window], 3 * WEBHOOKS) };
  receiver.close();
  const statuses = await paymentStatuses(serviceDb);

  const serviceWarnings = serviceLog.warnings;
  await stopProcess(service, { killAfterMs: SERVICE_STOP_TIMEOUT_MS });
  const profiles = cpuProfile ? readdirSync(profileDir).filter((file) => file.endsWith('.cpuprofile')) : [];

  // -------------------------------------------------------------------------------------------
  // Report

  const table: string[][] = [[
    'scenario', 'load', 'payments/s', 'p50 ms', 'p99 ms', 'ratio', `pending end → +${settleSeconds} s`, 'target', 'met',
  ]];
  const line = (row: Row, ratio: string, target: string, met: boolean | null) => table.push([
    row.name, row.rate ? `paced ${row.rate}/s` : `${row.connections} conns`, row.paymentsPerSecond.toFixed(0),
    fmt(row.p50Ms), fmt(row.p99Ms), ratio, `${row.pendingEnd} → ${row.pendingLater}`, target,
    met === null ? '-' : met && row.pendingLater === 0 ? 'yes' : 'NO',
  ]);
  const tpcbRatio = (row: Row) => `${(row.paymentsPerSecond / tpcbTps).toFixed(2)}× TPC-B`;
  const atRate = (row: Row) => row.paymentsPerSecond >= 0.95 * halfRate;
  line(many, tpcbRatio(many), `≥ ${TARGET.manyVsTpcb}× TPC-B`, many.paymentsPerSecond >= TARGET.manyVsTpcb * tpcbTps);
  line(manyWait, tpcbRatio(manyWait), '(confirmed; reference)', null);
  line(half, tpcbRatio(half), `p99 ≤ ${TARGET.p99NoWaitMs} ms`, half.p99Ms <= TARGET.p99NoWaitMs && atRate(half));
  line(halfWait, tpcbRatio(halfWait), `p99 ≤ ${slotMs + TARGET.p99WaitExtraMs} ms`,
    halfWait.p99Ms <= slotMs + TARGET.p99WaitExtraMs && atRate(halfWait));
  line(fresh, `${(fresh.paymentsPerSecond / singleRowTps).toFixed(2)}× 1-row`, `≥ ${TARGET.hotVsSingleRow}× 1-row update`,
    fresh.paymentsPerSecond >= TARGET.hotVsSingleRow * singleRowTps);
  line(busy, `${(busy.paymentsPerSecond / fresh.paymentsPerSecond).toFixed(2)}× fresh`, `≥ ${TARGET.busyVsFresh}× fresh vault`,
    busy.paymentsPerSecond >= TARGET.busyVsFresh * fresh.paymentsPerSecond);
  line(plain, `${(plain.paymentsPerSecond / many.paymentsPerSecond).toFixed(2)}× many vaults`, '(baseline of the webhook runs)', null);
  const dropOf = (run: { row: Row }) => 1 - run.row.paymentsPerSecond / plain.paymentsPerSecond;
  const lagMet = (lag: WebhookLag) => lag.p99 !== null && lag.p99 <= TARGET.webhookLagP99Ms && lag.waiting === 0;
  line(hooked.row, `${(dropOf(hooked) * 100).toFixed(0)}% drop`, `≤ ${TARGET.webhookDropPct}% drop, lag p99 ≤ ${TARGET.webhookLagP99Ms} ms`,
    dropOf(hooked) * 100 <= TARGET.webhookDropPct && lagMet(hooked.lag));
  line(moreHooked.row, `${(dropOf(moreHooked) * 100).toFixed(0)}% drop`, '(reference)', null);
  console.log();
  console.log(`pgbench on the same PostgreSQL, ${seconds} s, best of ${pgbenchClientCounts.join(', ')} clients: TPC-B (scale ${pgbenchScale}) `
    + `${tpcbTps.toFixed(0)} tps (${tpcb.clients} clients); single-row update ${singleRowTps.toFixed(0)} tps (${singleRow.clients} clients)`);
  console.log(`closed-loop trials of ${TRIAL_SECONDS} s on many vaults: `
    + `${trials.map((trial) => `${trial.count} connections ${trial.perSecond.toFixed(0)}/s`).join(', ')}; the runs use ${connections}`);
  console.log(`payments: ${seconds} s per scenario, ${vaultCount} vaults, slot ${slotMs} ms, service LOG_LEVEL=${logLevel}; `
    + `busy vault: ${busyPayments} payments in its 24 h window; half rate = ${halfRate}/s`);
  console.log();
  console.log(renderTable(table));
  console.log();
  for (const [count, run] of [[WEBHOOKS, hooked], [3 * WEBHOOKS, moreHooked]] as const) {
    console.log(`webhooks (${count} subscribed to *): ${run.lag.delivered} deliveries, ${run.lag.waiting} not yet delivered `
      + `${WEBHOOK_DRAIN_MS / 1000} s after its turns; lag (event written → receiver answered) p50 ${fmt(Number(run.lag.p50))} ms, `
      + `p99 ${fmt(Number(run.lag.p99))} ms`);
  }
  console.log(`the webhook receiver answered ${receiver.requests} requests on ${receiver.connections} connections`);
  console.log();
  console.log(`"met" also requires the settlement backlog to be gone ${settleSeconds} s after the run (pending → 0). `
    + `The fresh (one hot vault) and busy vaults took ${ALTERNATION_ROUNDS} turns each of ${pieceSeconds} s; `
    + `the many-vault run took ${WEBHOOK_ROUNDS} turns of ${seconds} s with ${WEBHOOKS} webhook${WEBHOOKS === 1 ? '' : 's'} on `
    + `and as many with them off, alternately (ABBA), and the drop compares the two.`);
  console.log();
  console.log(`CPU during each run, in cores of ${availableParallelism()} (service | postgres backends | load generator | rest of the machine), `
    + 'and CPU ms per accepted payment (per transaction for pgbench, whose client counts in the rest):');
  for (const summary of pgbenchRuns) console.log(`  ${summary}`);
  for (const row of [many, manyWait, half, halfWait, fresh, busy, plain, hooked.row, moreHooked.row]) {
    console.log(`  ${row.name.padEnd(24)} ${describeCpu(row.cpu, row.ok)}; non-2xx ${row.non2xx}, errors ${row.errors}, `
      + `peak pending ${row.pendingPeak}`);
  }
  console.log(`payments by status at the end: ${JSON.stringify(statuses)}`);
  if (serviceWarnings.length) {
    console.log(`service warnings and errors: ${serviceWarnings.length}; first: ${serviceWarnings.slice(0, 3).join(' | ')}`);
  }
  for (const file of profiles) console.log(`CPU profile of the service: ${join(profileDir, file)}`);
} catch (error) {
  if (serviceOutput) process.stderr.write(`the service's last output:\n${serviceOutput.tail.join('\n')}\n`);
  throw error;
} finally {
  await cleanUp();
}

// ---------------------------------------------------------------------------------------------
// The service process

function startService(port: number, profileDir: string): ChildProcess {
  const env: Record<string, string | undefined> = {};
  // Nothing of the caller's own agent-vault configuration leaks into the run.
  for (const [name, value] of Object.entries(process.env)) {
    if (!name.startsWith('AGENT_VAULT_') && !['DATABASE_URL', 'PORT', 'HOST', 'LOG_LEVEL'].includes(name)) env[name] = value;
  }
  Object.assign(env, {
    DATABASE_URL: databaseUrl(SERVICE_DATABASE),
    AGENT_VAULT_DATA_DIR: join(workDir, 'data'),
    AGENT_VAULT_SLOT_MS: String(slotMs),
    AGENT_VAULT_BOOTSTRAP_KEY: ADMIN_KEY,
    // The default (1200 a minute per key) would refuse most of the load with 429.
    AGENT_VAULT_RATE_LIMIT_PER_MINUTE: '1000000',
    AGENT_VAULT_TEST_HELPERS: 'true',
    // The webhook receiver of the webhooks run listens on 127.0.0.1.
    AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'true',
    PORT: String(port),
    HOST: '127.0.0.1',
    LOG_LEVEL: logLevel,
  });
  const nodeArgs = cpuProfile ? ['--cpu-prof', `--cpu-prof-dir=${profileDir}`] : [];
  return spawn(process.execPath, [...nodeArgs, join(ROOT, 'bin', 'agent-vault.js'), 'serve'], {
    cwd: ROOT, env, stdio: ['ignore', 'pipe', 'pipe'],
  });
}

/** The last lines of the service's output (shown when it fails to start) and its warnings and errors. */
function captureLog(child: ChildProcess): { tail: string[]; warnings: string[] } {
  const captured = { tail: [] as string[], warnings: [] as string[] };
  const onData = (chunk: Buffer) => {
    for (const text of chunk.toString('utf8').split('\n')) {
      if (!text) continue;
      captured.tail.push(text);
      if (captured.tail.length > 40) captured.tail.shift();
      const level = /"level":(\d+)/.exec(text);
      if (level && Number(level[1]) >= 40 && captured.warnings.length < 1000) captured.warnings.push(warningOf(text));
    }
  };
  child.stdout!.on('data', onData);
  child.stderr!.on('data', onData);
  return captured;
}

/** A pino line as "message (error message)". */
function warningOf(line: string): string {
  try {
    const entry = JSON.parse(line) as { msg?: string; err?: { message?: string } };
    return `${entry.msg ?? ''}${entry.err?.message ? ` (${entry.err.message.slice(0, 200)})` : ''}`;
  } catch {
    return line.slice(0, 200);
  }
}

/** Setup calls with the admin key; a 503 is retried as the API asks ("retry the same request"). */
function apiClient(baseUrl: string) {
  return async (method: string, path: string, body?: unknown): Promise<Record<string, unknown>> => {
    for (let attempt = 1; ; attempt += 1) {
      const response = await fetch(`${baseUrl}${path}`, {
        method,
        headers: { authorization: `Bearer ${ADMIN_KEY}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
      });
      const text = await response.text();
      if (response.ok) return JSON.parse(text) as Record<string, unknown>;
      if (response.status !== 503 || attempt >= SETUP_ATTEMPTS_MAX) throw new Error(`${method} ${path}: ${response.status} ${text}`);
      await sleep(1_000);
    }
  };
}

// ---------------------------------------------------------------------------------------------
// The busy vault

/**
 * Writes `count` confirmed payments spread evenly over the vault's last 24 hours straight into
 * the database, and the vault's spend windows as src/payments/spend-state.ts keeps them (sum and
 * count of the day and the hour, each with the instant through which spends have left, and the
 * calendar month), so the service finds a full window and keeps sliding it as time goes on:
 * about 1.2 spends a second leave the day window, as they would for a vault this busy.
 */
async function fillSpendWindow(db: pg.Pool, walletId: string, policyId: string, recipients: string[], count: number): Promise<number> {
  const startedMs = Date.now();
  const client = await db.connect();
  try {
    await client.query('BEGIN');
    const { org_id: orgId } = (await client.query('SELECT org_id FROM wallets WHERE id = $1 FOR UPDATE', [walletId])).rows[0];
    const offsetMs = Number((await client.query('SELECT offset_ms FROM service_clock WHERE id')).rows[0]?.offset_ms ?? 0);
    const nowMs = Date.now() + offsetMs;
    const firstMs = nowMs - DAY_MS + 60_000;
    const stepMs = (DAY_MS - 70_000) / count;
    await client.query(
      `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, recipient_address, policy_id,
         attestation_hash, tx_signature, on_chain_slot, spend_at_ms, created_at, updated_at, settled_at)
       SELECT 'tx_bench' || lpad(g::text, 18, '0'), $1, $2, 'payment', 'confirmed', $3, r.address, r.address, $4,
         'sha256:' || md5(g::text) || md5(g::text), 'bench-history-' || g, g, t.ms, to_timestamp(t.ms / 1000.0),
         to_timestamp(t.ms / 1000.0), to_timestamp(t.ms / 1000.0)
       FROM generate_series(1, $5::int) AS g,
         LATERAL (SELECT ($6::bigint + floor((g - 1) * $7::float8))::bigint AS ms) AS t,
         LATERAL (SELECT ($8::text[])[1 + g % $9::int] AS address) AS r`,
      [orgId, walletId, PAYMENT_MICRO, policyId, count, firstMs, stepMs, recipients, recipients.length]);
    const monthStartMs = Date.UTC(new Date(nowMs).getUTCFullYear(), new Date(nowMs).getUTCMonth(), 1);
    await client.query(
      `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count,
         hour_removed_through_ms, month_key, month_sum)
       SELECT $1,
         COALESCE(SUM(amount) FILTER (WHERE spend_at_ms > $2), 0), COUNT(*) FILTER (WHERE spend_at_ms > $2), $2,
         COALESCE(SUM(amount) FILTER (WHERE spend_at_ms > $3), 0), COUNT(*) FILTER (WHERE spend_at_ms > $3), $3,
         $4, COALESCE(SUM(amount) FILTER (WHERE spend_at_ms >= $5), 0)
       FROM transactions WHERE wallet_id = $1 AND spend_at_ms IS NOT NULL AND spend_at_ms <= $6
       ON CONFLICT (wallet_id) DO UPDATE SET day_sum = EXCLUDED.day_sum, day_count = EXCLUDED.day_count,
         day_removed_through_ms = EXCLUDED.day_removed_through_ms, hour_sum = EXCLUDED.hour_sum,
         hour_count = EXCLUDED.hour_count, hour_removed_through_ms = EXCLUDED.hour_removed_through_ms,
         month_key = EXCLUDED.month_key, month_sum = EXCLUDED.month_sum`,
      [walletId, nowMs - DAY_MS, nowMs - HOUR_MS, monthKey(nowMs), monthStartMs, nowMs]);
    await client.query('COMMIT');
  } catch (error) {
    await client.query('ROLLBACK').catch(() => {});
    throw error;
  } finally {
    client.release();
  }
  // As autovacuum would have long before a vault made 100k payments.
  await db.query('ANALYZE transactions');
  return Date.now() - startedMs;
}

// ---------------------------------------------------------------------------------------------
// Load

interface Scenario {
  name: string;
  wallets: string[];
  wait: boolean;
  connections: number;
  /** paced (open loop) at this many payments a second; none = closed loop, as fast as answered */
  rate?: number;
}

interface LoadResult {
  ok: number;
  non2xx: number;
  errors: number;
  durationS: number;
  /** closed loop: autocannon's mergeable result; paced: every latency */
  autocannon: RawAutocannonResult | null;
  latenciesMs: number[];
}

interface Piece {
  scenario: Scenario;
  load: LoadResult;
  cpu: CpuUse;
  pendingPeak: number;
  pendingEnd: number;
  pendingLater: number;
}

interface WebhookLag { delivered: number; waiting: number; p50: number | null; p99: number | null }
/** When webhooks were on: every event written in it is due to each of them. */
type Window = [from: Date, to: Date];

/**
 * Deliveries of the events written in `windows` (each due to `webhooks` webhooks subscribed to
 * '*'): how many arrived, how many have not, and the lag from the event's time to the receiver's
 * answer.
 */
async function webhookLag(db: pg.Pool, windows: Window[], webhooks: number): Promise<WebhookLag> {
  const [lag] = (await db.query<WebhookLag>(
    `WITH w AS (SELECT * FROM unnest($1::timestamptz[], $2::timestamptz[]) AS w(from_at, to_at))
     SELECT count(*)::int AS delivered,
            (SELECT count(*) FROM events e, w WHERE e.created_at >= w.from_at AND e.created_at < w.to_at)::int * $3
              - count(*)::int AS waiting,
            percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM d.delivered_at - d.event_created_at) * 1000) AS p50,
            percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM d.delivered_at - d.event_created_at) * 1000) AS p99
     FROM webhook_deliveries d, w
     WHERE d.event_created_at >= w.from_at AND d.event_created_at < w.to_at AND d.event_type <> 'ping' AND d.status = 'delivered'`,
    [windows.map(([from]) => from), windows.map(([, to]) => to), webhooks])).rows;
  return lag!;
}

interface Row {
  name: string;
  connections: number;
  rate: number | null;
  ok: number;
  paymentsPerSecond: number;
  p50Ms: number;
  p99Ms: number;
  non2xx: number;
  errors: number;
  cpu: CpuUse;
  pendingPeak: number;
  pendingEnd: number;
  pendingLater: number;
}

async function runPiece(
  db: pg.Pool, meter: CpuMeter, baseUrl: string, scenario: Scenario, bodies: string[], durationS: number, settleAfterS: number,
): Promise<Piece> {
  let pendingPeak = 0;
  let sampling = true;
  const sampler = (async () => {
    while (sampling) {
      pendingPeak = Math.max(pendingPeak, await pendingPayments(db));
      await sleep(1_000);
    }
  })();
  const before = await meter.read();
  const load = scenario.rate
    ? await paced(baseUrl, bodies, scenario.rate, durationS)
    : await closedLoop(baseUrl, bodies, scenario.connections, durationS);
  const cpu = meter.since(before, await meter.read());
  sampling = false;
  await sampler;
  const pendingEnd = await pendingPayments(db);
  await sleep(settleAfterS * 1000);
  const pendingLater = await pendingPayments(db);
  return { scenario, load, cpu, pendingPeak: Math.max(pendingPeak, pendingEnd), pendingEnd, pendingLater };
}

/** One row of the table from the pieces of one scenario (several when it alternated with another). */
function summarise(pieces: Piece[]): Row {
  const first = pieces[0]!;
  const ok = pieces.reduce((sum, piece) => sum + piece.load.ok, 0);
  const durationS = pieces.reduce((sum, piece) => sum + piece.load.durationS, 0);
  let p50Ms: number;
  let p99Ms: number;
  if (first.load.autocannon) {
    const merged = autocannon.aggregateResult(pieces.map((piece) => piece.load.autocannon!),
      { url: 'http://127.0.0.1', connections: first.scenario.connections });
    ({ p50: p50Ms, p99: p99Ms } = merged.latency);
  } else {
    const all = pieces.flatMap((piece) => piece.load.latenciesMs).sort((a, b) => a - b);
    const percentile = (p: number) => all[Math.min(all.length - 1, Math.floor(all.length * p))] ?? NaN;
    p50Ms = percentile(0.5);
    p99Ms = percentile(0.99);
  }
  return {
    name: first.scenario.name, connections: first.scenario.connections, rate: first.scenario.rate ?? null,
    ok, paymentsPerSecond: ok / durationS, p50Ms, p99Ms,
    non2xx: pieces.reduce((sum, piece) => sum + piece.load.non2xx, 0),
    errors: pieces.reduce((sum, piece) => sum + piece.load.errors, 0),
    cpu: pieces.map((piece) => piece.cpu).reduce(addCpu),
    pendingPeak: Math.max(...pieces.map((piece) => piece.pendingPeak)),
    pendingEnd: Math.max(...pieces.map((piece) => piece.pendingEnd)),
    // Only the last turn waited the full settle time.
    pendingLater: pieces[pieces.length - 1]!.pendingLater,
  };
}

async function pendingPayments(db: pg.Pool): Promise<number> {
  const { rows } = await db.query(`SELECT count(*)::int AS n FROM transactions WHERE status = 'pending' AND type = 'payment'`);
  return rows[0].n as number;
}

async function paymentStatuses(db: pg.Pool): Promise<Record<string, number>> {
  const { rows } = await db.query(
    `SELECT status, count(*)::int AS n FROM transactions WHERE type = 'payment' AND id NOT LIKE 'tx_bench%' GROUP BY status ORDER BY status`);
  return Object.fromEntries(rows.map((row) => [row.status as string, row.n as number]));
}

/** As fast as the service answers: each connection sends its next payment when the last is answered. */
async function closedLoop(baseUrl: string, bodies: string[], connectionCount: number, durationS: number): Promise<LoadResult> {
  let next = 0;
  const result = await autocannon({
    url: baseUrl, connections: connectionCount, duration: durationS, timeout: REQUEST_TIMEOUT_MS / 1000,
    headers: { authorization: `Bearer ${ADMIN_KEY}`, 'content-type': 'application/json' },
    skipAggregateResult: true,
    requests: [{
      method: 'POST', path: '/v1/payments',
      setupRequest: (request) => ({ ...request, body: bodies[(next += 1) % bodies.length] }),
    }],
  });
  return {
    ok: result.statusCodeStats['200']?.count ?? 0, non2xx: result.non2xx, errors: result.errors,
    durationS: result.duration, autocannon: result, latenciesMs: [],
  };
}

/**
 * Open loop at a fixed rate: payment k is sent at start + k/rate whether or not earlier ones
 * were answered, and its latency runs from that scheduled instant, so a stalled service cannot
 * hide the stall by slowing the sender down. autocannon's -R/overallRate is not used for this:
 * each connection sends its quota for the second back to back and then idles until the next
 * second (lib/httpClient.js, reqsMadeThisSecond), i.e. full-speed bursts rather than the rate.
 */
async function paced(baseUrl: string, bodies: string[], rate: number, durationS: number): Promise<LoadResult> {
  const client = new RawPostClient(new URL('/v1/payments', baseUrl),
    { authorization: `Bearer ${ADMIN_KEY}`, 'content-type': 'application/json' }, { maxSockets: 2_048, timeoutMs: REQUEST_TIMEOUT_MS });
  const total = Math.round(rate * durationS);
  const latenciesMs: number[] = [];
  let ok = 0;
  let non2xx = 0;
  let errors = 0;
  const inFlight = new Set<Promise<void>>();
  const send = (k: number, scheduledAt: number) => {
    const done = client.post(bodies[k % bodies.length]!).then((status) => {
      latenciesMs.push(performance.now() - scheduledAt);
      if (status === 200) ok += 1;
      else non2xx += 1;
    }, () => {
      errors += 1;
    });
    inFlight.add(done);
    void done.then(() => inFlight.delete(done));
  };
  const startMs = performance.now();
  let sent = 0;
  while (sent < total) {
    const due = Math.min(total, Math.floor(((performance.now() - startMs) * rate) / 1000) + 1);
    for (; sent < due; sent += 1) send(sent, startMs + (sent * 1000) / rate);
    await sleep(1);
  }
  await Promise.all(inFlight);
  client.close();
  return { ok, non2xx, errors, durationS, autocannon: null, latenciesMs };
}

// ---------------------------------------------------------------------------------------------
// Where the CPU went (Linux /proc; elsewhere every figure is NaN)

interface CpuUse {
  wallS: number;
  /** CPU seconds */
  serviceS: number;
  postgresS: number;
  loadGeneratorS: number;
  machineBusyS: number;
}

interface CpuReading {
  atMs: number;
  service: number;
  postgres: Map<number, number>;
  loadGenerator: number;
  machineBusy: number;
}

interface CpuMeter {
  read(): Promise<CpuReading>;
  since(before: CpuReading, after: CpuReading): CpuUse;
}

function cpuMeter(servicePid: number, db: pg.Pool): CpuMeter {
  return {
    async read() {
      const { rows } = await db.query(
        `SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'`, [SERVICE_DATABASE]);
      const usage = process.cpuUsage();
      return {
        atMs: performance.now(),
        service: processCpuS(servicePid),
        postgres: new Map(rows.map((row) => [row.pid as number, processCpuS(row.pid as number)])),
        loadGenerator: (usage.user + usage.system) / 1e6,
        machineBusy: machineBusyS(),
      };
    },
    since(before, after) {
      let postgresS = 0;
      // A backend that ended during the run is missing (the pool keeps its connections, so rarely).
      for (const [pid, cpuS] of after.postgres) if (Number.isFinite(cpuS)) postgresS += cpuS - (before.postgres.get(pid) ?? 0);
      return {
        wallS: (after.atMs - before.atMs) / 1000,
        serviceS: after.service - before.service,
        postgresS,
        loadGeneratorS: after.loadGenerator - before.loadGenerator,
        machineBusyS: after.machineBusy - before.machineBusy,
      };
    },
  };
}

/**
 * CPU seconds spent by the backends connected to `database` while `work` runs. They come and go
 * with the work (pgbench's clients), so they are sampled as it runs; the last 250 ms of each
 * may be missed.
 */
async function withPostgresCpu<T>(db: pg.Pool, database: string, work: Promise<T>): Promise<{ result: T; cpuS: number }> {
  const lastSeen = new Map<number, number>();
  let done = false;
  const sampler = (async () => {
    while (!done) {
      const { rows } = await db.query(
        `SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'`, [database]);
      for (const row of rows) {
        const cpuS = processCpuS(row.pid as number);
        if (Number.isFinite(cpuS)) lastSeen.set(row.pid as number, cpuS);
      }
      await sleep(250);
    }
  })();
  try {
    return { result: await work, cpuS: [...lastSeen.values()].reduce((sum, cpuS) => sum + cpuS, 0) };
  } finally {
    done = true;
    await sampler;
  }
}

/** utime + stime of a process, in seconds. */
function processCpuS(pid: number): number {
  const path = `/proc/${pid}/stat`;
  if (!existsSync(path)) return NaN;
  // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
  const fields = readFileSync(path, 'utf8').split(')').pop()!.trim().split(/\s+/);
  return (Number(fields[11]) + Number(fields[12])) / CLOCK_TICKS_PER_SECOND;
}

/** CPU seconds the whole machine spent busy (all cores), from /proc/stat. */
function machineBusyS(): number {
  if (!existsSync('/proc/stat')) return NaN;
  // user nice system idle iowait irq softirq steal
  const [user, nice, system, , , irq, softirq, steal] = readFileSync('/proc/stat', 'utf8').split('\n')[0]!
    .trim().split(/\s+/).slice(1).map(Number);
  return (user! + nice! + system! + irq! + softirq! + steal!) / CLOCK_TICKS_PER_SECOND;
}

function addCpu(a: CpuUse, b: CpuUse): CpuUse {
  return {
    wallS: a.wallS + b.wallS, serviceS: a.serviceS + b.serviceS, postgresS: a.postgresS + b.postgresS,
    loadGeneratorS: a.loadGeneratorS + b.loadGeneratorS, machineBusyS: a.machineBusyS + b.machineBusyS,
  };
}

function describeCpu(cpu: CpuUse, payments: number): string {
  const cores = (cpuS: number) => (cpuS / cpu.wallS).toFixed(2);
  const perPayment = (cpuS: number) => ((cpuS * 1000) / Math.max(1, payments)).toFixed(1);
  // /proc counts in 10 ms ticks, per process and for the machine apart: a quiet machine can come out a hair below 0.
  const rest = Math.max(0, cpu.machineBusyS - cpu.serviceS - cpu.postgresS - cpu.loadGeneratorS);
  return `cores ${cores(cpu.serviceS)} | ${cores(cpu.postgresS)} | ${cores(cpu.loadGeneratorS)} | ${cores(rest)}; `
    + `CPU ms per payment ${perPayment(cpu.serviceS)} | ${perPayment(cpu.postgresS)} | ${perPayment(cpu.loadGeneratorS)}`;
}

// ---------------------------------------------------------------------------------------------

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function fmt(value: number): string {
  return Number.isFinite(value) ? String(Math.round(value)) : '-';
}

function renderTable(cells: string[][]): string {
  const widths = cells[0]!.map((_, column) => Math.max(...cells.map((row) => [...row[column]!].length)));
  const render = (row: string[]) => `| ${row.map((cell, column) => cell + ' '.repeat(widths[column]! - [...cell].length)).join(' | ')} |`;
  return [render(cells[0]!), `|${widths.map((width) => '-'.repeat(width + 2)).join('|')}|`, ...cells.slice(1).map(render)].join('\n');
}
