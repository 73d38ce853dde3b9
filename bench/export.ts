/**
 * A transaction export of 1,000,000 transactions through the real service on PostgreSQL, with
 * payments flowing over HTTP. Prints, for each phase (payments alone, the export alone, the
 * export while payments flow, the download), its time and the service's memory, and payment
 * throughput with and without the export; asserts nothing. docs/exports.md has figures.
 *
 *   npm run bench:export -- [--rows 1000000] [--format csv|json|jsonl] [--seconds 10] [--connections 8]
 *                           [--slot-ms 400] [--log-level warn] [--node-flags "<flags for the service's node>"]
 *                           [--database-url postgres://postgres@127.0.0.1:5432/postgres]
 *
 * The service runs as a child process, `node bin/agent-vault.js serve`, as deployed, on a
 * database created for the run and dropped at the end. The transactions are written straight
 * into it with one `INSERT … SELECT generate_series` (the API would take hours to make a
 * million); the payments go through the API. Memory is the service process's resident set:
 * VmRSS sampled every 50 ms and VmHWM (reset through /proc/<pid>/clear_refs before each phase);
 * growth = peak during the phase − resident set just before it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { generateKeyPairSigner } from '@solana/kit';
import pg from 'pg';
import { freePort, stopProcess, waitForHealth } from '../test/processes.ts';
import { positiveInteger } from './args.ts';

const { values } = parseArgs({
  options: {
    rows: { type: 'string', default: '1000000' },
    format: { type: 'string', default: 'csv' },
    seconds: { type: 'string', default: '10' },
    connections: { type: 'string', default: '8' },
    'slot-ms': { type: 'string', default: '400' },
    'log-level': { type: 'string', default: 'warn' },
    'database-url': { type: 'string', default: 'postgres://postgres@127.0.0.1:5432/postgres' },
    'node-flags': { type: 'string', default: '' },
  },
  strict: true,
});

const rowCount = positiveInteger('rows', values.rows);
const seconds = positiveInteger('seconds', values.seconds);
const connections = positiveInteger('connections', values.connections);
const slotMs = positiveInteger('slot-ms', values['slot-ms']);
const format = values.format!;
if (format !== 'csv' && format !== 'json' && format !== 'jsonl') throw new Error('--format must be csv, json or jsonl');

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const DATABASE = 'agent_vault_bench_export';
const ADMIN_KEY = 'av_admin_benchexportbenchexportbench01';
const VAULTS = 8;
const VAULT_FUNDING = '10000';
const PAYMENT_AMOUNT = '0.01';
const RECIPIENTS = 8;
const REQUEST_TIMEOUT_MS = 30_000;
const SERVICE_START_TIMEOUT_MS = 120_000;
const EXPORT_TIMEOUT_MS = 10 * 60_000;
const MEMORY_SAMPLE_MS = 50;
/** The issue's target for the service's memory growth during an export. */
const MEMORY_GROWTH_TARGET_BYTES = 100 * 1024 * 1024;

function databaseUrl(name: string): string {
  const url = new URL(values['database-url']!);
  url.pathname = `/${name}`;
  return url.toString();
}

const admin = new pg.Client({ connectionString: values['database-url'] });
admin.on('error', () => {});
await admin.connect();
const workDir = mkdtempSync(join(tmpdir(), 'av-bench-export-'));
let service: ChildProcess | null = null;
let serviceDb: pg.Pool | null = null;
const output: string[] = [];
/** The service's last lines of output, shown when the run fails. */
const serviceTail: string[] = [];

async function cleanUp(): Promise<void> {
  if (service) await stopProcess(service);
  await serviceDb?.end().catch(() => {});
  await admin.query(`DROP DATABASE IF EXISTS ${DATABASE} WITH (FORCE)`).catch(() => {});
  await admin.end().catch(() => {});
  rmSync(workDir, { recursive: true, force: true });
}
process.once('SIGINT', () => { void cleanUp().finally(() => process.exit(130)); });

const benchStartMs = Date.now();
const log = (message: string) => process.stderr.write(`[${((Date.now() - benchStartMs) / 1000).toFixed(0).padStart(3)} s] ${message}\n`);

try {
  await admin.query(`DROP DATABASE IF EXISTS ${DATABASE} WITH (FORCE)`);
  await admin.query(`CREATE DATABASE ${DATABASE}`);
  const port = await freePort();
  const baseUrl = `http://127.0.0.1:${port}`;
  service = startService(port);
  await waitForHealth(baseUrl, service, { timeoutMs: SERVICE_START_TIMEOUT_MS });
  const pid = service.pid!;
  log(`service listening on ${baseUrl} (pid ${pid}, slot ${slotMs} ms)`);
  serviceDb = new pg.Pool({ connectionString: databaseUrl(DATABASE), max: 2 });
  serviceDb.on('error', () => {});
  const api = apiClient(baseUrl);

  // -------------------------------------------------------------------------------------------
  // Vaults that pay during the run, and a million transactions already in the index

  const policy = await api('POST', '/v1/policies', {
    name: 'Benchmark', maxPerTx: '1000', maxPerDay: '100000000', maxPerMonth: '1000000000', velocityCap: 1_000_000,
  });
  await api('POST', '/v1/test_helpers/deposits', { amount: String(VAULTS * Number(VAULT_FUNDING)) });
  const walletIds: string[] = [];
  for (let i = 0; i < VAULTS; i += 1) {
    const wallet = await api('POST', '/v1/wallets', { agentId: `bench-export-${i}`, label: `Bench ${i}`, policyId: policy.policy_id });
    walletIds.push(wallet.wallet_id as string);
  }
  await api('POST', '/v1/wallets/fund-batch', { allocations: walletIds.map((walletId) => ({ walletId, amount: VAULT_FUNDING })) });
  const recipients = await Promise.all(Array.from({ length: RECIPIENTS }, async () => (await generateKeyPairSigner()).address));
  await Promise.all(recipients.map((to, i) =>
    api('POST', '/v1/payments', { walletId: walletIds[i % VAULTS], to, amount: PAYMENT_AMOUNT, currency: 'USDC', memo: 'warm-up' })));

  log(`seeding ${rowCount} transactions`);
  const seedStartedMs = performance.now();
  const orgId = (await api('GET', '/v1/organization')).org_id as string;
  await seedTransactions(serviceDb, orgId, walletIds, recipients, policy.policy_id as string, rowCount);
  const seedS = (performance.now() - seedStartedMs) / 1000;
  log(`seeded in ${seedS.toFixed(1)} s`);

  const paymentBodies = Array.from({ length: VAULTS * RECIPIENTS }, (_, i) => JSON.stringify({
    walletId: walletIds[i % VAULTS], to: recipients[Math.floor(i / VAULTS) % RECIPIENTS], amount: PAYMENT_AMOUNT, currency: 'USDC',
    memo: 'bench', waitForConfirmation: false,
  }));
  log('warm-up payments: 2 s');
  await payFor(baseUrl, paymentBodies, connections, () => sleep(2_000));

  // -------------------------------------------------------------------------------------------
  // Payments alone, the export alone, the export while payments flow, the download

  log(`payments alone: ${connections} connections, ${seconds} s`);
  const alone = await withMemory(pid, () => payFor(baseUrl, paymentBodies, connections, () => sleep(seconds * 1000)));
  await sleep(2_000);
  log(`export (${format}), alone`);
  const quiet = await withMemory(pid, () => runExport(api));
  log(`  ready: ${quiet.result.ready.row_count} rows, ${quiet.result.ready.size_bytes} bytes in ${quiet.result.wallS.toFixed(1)} s`);
  await sleep(2_000);
  log(`export (${format}), payments flowing`);
  let busy: ExportRun | null = null;
  const during = await withMemory(pid, () => payFor(baseUrl, paymentBodies, connections, async () => { busy = await runExport(api); }));
  const { created, ready, wallS } = busy! as ExportRun;
  log(`  ready: ${ready.row_count} rows, ${ready.size_bytes} bytes in ${wallS.toFixed(1)} s`);
  // The download, measured apart: it streams from the database to the client.
  const fetched = await withMemory(pid, async () => {
    const startedMs = performance.now();
    const bytes = await downloadBytes(`${baseUrl}${ready.download_url}`);
    return { bytes, seconds: (performance.now() - startedMs) / 1000 };
  });
  log(`  downloaded ${fetched.result.bytes} bytes in ${fetched.result.seconds.toFixed(1)} s`);

  // -------------------------------------------------------------------------------------------
  // Report

  /** What an export must hold: every transaction recorded up to its request (docs/exports.md). */
  const expectedRows = async (run: ExportRun) => Number((await serviceDb!.query(
    'SELECT count(*)::bigint AS n FROM transactions WHERE org_id = $1 AND created_at <= $2', [orgId, run.created.created_at])).rows[0].n);
  const rowsMatch = Number(quiet.result.ready.row_count) === await expectedRows(quiet.result)
    && Number(ready.row_count) === await expectedRows(busy!);

  const mb = (bytes: number) => `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
  const growth = (m: Measured<unknown>) => m.peakBytes - m.beforeBytes;
  const target = (m: Measured<unknown>) => `target ≤ ${mb(MEMORY_GROWTH_TARGET_BYTES)}: ${growth(m) <= MEMORY_GROWTH_TARGET_BYTES ? 'met' : 'NOT met'}`;
  const serviceS = (run: ExportRun) => (Date.parse(run.ready.ready_at as string) - Date.parse(run.created.created_at as string)) / 1000;
  const estimatedS = (Date.parse(created.estimated_ready_at as string) - Date.parse(created.created_at as string)) / 1000;
  const drop = alone.result.perSecond > 0 ? 1 - during.result.perSecond / alone.result.perSecond : 0;
  output.push(
    '',
    `export of ${ready.row_count} transactions as ${format}: ${ready.size_bytes} bytes (${mb(Number(ready.size_bytes))}); `
      + `every row of the index up to the request exported: ${rowsMatch ? 'yes' : 'NO'}`,
    '',
    'phase                      time      rows/s   service RSS before → peak (growth)',
    `payments alone            ${`${seconds.toFixed(1)} s`.padStart(7)}   ${'-'.padStart(7)}   ${mb(alone.beforeBytes)} → ${mb(alone.peakBytes)} (${mb(growth(alone))})`,
    `export alone              ${`${quiet.result.wallS.toFixed(1)} s`.padStart(7)}   ${String(Math.round(Number(quiet.result.ready.row_count) / serviceS(quiet.result))).padStart(7)}   `
      + `${mb(quiet.beforeBytes)} → ${mb(quiet.peakBytes)} (${mb(growth(quiet))}; ${target(quiet)})`,
    `export + payments         ${`${wallS.toFixed(1)} s`.padStart(7)}   ${String(Math.round(Number(ready.row_count) / serviceS(busy!))).padStart(7)}   `
      + `${mb(during.beforeBytes)} → ${mb(during.peakBytes)} (${mb(growth(during))}; ${target(during)})`,
    `download                  ${`${fetched.result.seconds.toFixed(1)} s`.padStart(7)}   ${'-'.padStart(7)}   `
      + `${mb(fetched.beforeBytes)} → ${mb(fetched.peakBytes)} (${mb(growth(fetched))}); `
      + `${fetched.result.bytes === Number(ready.size_bytes) ? 'complete' : `INCOMPLETE (${fetched.result.bytes} bytes)`}, ${mb(fetched.result.bytes / fetched.result.seconds)}/s`,
    '',
    `estimated_ready_at said ${estimatedS.toFixed(1)} s; time is request → ready as the client polled (every 200 ms).`,
    `payments over HTTP, ${connections} connections, slot ${slotMs} ms: alone ${alone.result.perSecond.toFixed(0)}/s `
      + `(p99 ${alone.result.p99Ms.toFixed(0)} ms, errors ${alone.result.errors}); during the export ${during.result.perSecond.toFixed(0)}/s `
      + `(p99 ${during.result.p99Ms.toFixed(0)} ms, errors ${during.result.errors}): throughput drop ${(drop * 100).toFixed(0)}%`,
    `seeding ${rowCount} rows with INSERT … SELECT generate_series: ${seedS.toFixed(1)} s`
      + (values['node-flags'] ? `; service node flags: ${values['node-flags']}` : ''),
  );
  console.log(output.join('\n'));
} catch (error) {
  process.stderr.write(`the service's last output:\n${serviceTail.join('\n')}\n`);
  throw error;
} finally {
  await cleanUp();
}

// ---------------------------------------------------------------------------------------------
// Seeding

/**
 * `count` transactions spread over the 30 days before now: mostly confirmed payments, with
 * fundings, withdrawals, blocked payments with a violation, failed ones, and memos that need
 * quoting or neutralising, so the writer does all its kinds of work.
 */
async function seedTransactions(
  db: pg.Pool, orgId: string, wallets: string[], recipients: string[], policyId: string, count: number,
): Promise<void> {
  const nowMs = Date.now() + Number((await db.query('SELECT offset_ms FROM service_clock WHERE id')).rows[0]?.offset_ms ?? 0);
  const client = await db.connect();
  try {
    // The rows name the organisation and vaults made above: checking a million foreign keys would
    // only slow the seeding down (a superuser may skip them; anyone else just waits longer).
    await client.query(`SET session_replication_role = replica`).catch(() => {});
    await client.query(
      `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, policy_id, policy_triggered, violation,
         memo, attestation_hash, tx_signature, on_chain_slot, failure_reason, created_at, updated_at, settled_at)
       SELECT 'tx_seed' || lpad(g::text, 19, '0'), $1, ($2::text[])[1 + g % $3::int],
         CASE WHEN g % 10 = 0 THEN 'funding' WHEN g % 97 = 0 THEN 'withdrawal' ELSE 'payment' END,
         CASE WHEN g % 13 = 0 THEN 'blocked' WHEN g % 101 = 0 THEN 'failed' ELSE 'confirmed' END,
         1 + (g::bigint * 7919) % 50000000, ($4::text[])[1 + g % $5::int], $6, g % 13 = 0,
         CASE WHEN g % 13 = 0 THEN '{"rule":"max_per_tx","limit":"100.00","attempted":"150.00"}'::jsonb END,
         CASE WHEN g % 5 = 0 THEN 'invoice ' || g WHEN g % 7 = 0 THEN 'cloud, "GPU" hours' WHEN g % 11 = 0 THEN '=SUM(A' || g || ')' END,
         'sha256:' || md5(g::text) || md5((g + 1)::text),
         CASE WHEN g % 13 <> 0 THEN 'seed' || md5(g::text) || md5((g + 2)::text) END,
         CASE WHEN g % 13 <> 0 THEN 1000000 + g END,
         CASE WHEN g % 101 = 0 AND g % 13 <> 0 THEN 'insufficient funds' END,
         t.at, t.at, t.at
       FROM generate_series(1, $7::int) AS g,
         LATERAL (SELECT to_timestamp(($8::bigint - 60000 - ((g::bigint * 2592000000) / $7::int)) / 1000.0) AS at) AS t`,
      [orgId, wallets, wallets.length, recipients, recipients.length, policyId, count, nowMs]);
  } finally {
    client.release(true);
  }
  await db.query('ANALYZE transactions');
}

// ---------------------------------------------------------------------------------------------
// Payments

interface PaymentRun { ok: number; errors: number; perSecond: number; p99Ms: number }

/** Pays in a closed loop over `connections` connections until `until` resolves. */
async function payFor(baseUrl: string, bodies: string[], connections: number, until: () => Promise<void>): Promise<PaymentRun> {
  let running = true;
  let ok = 0;
  let errors = 0;
  let next = 0;
  const latencies: number[] = [];
  const startedMs = performance.now();
  const loops = Array.from({ length: connections }, async () => {
    while (running) {
      const body = bodies[(next += 1) % bodies.length]!;
      const sentMs = performance.now();
      try {
        const response = await fetch(`${baseUrl}/v1/payments`, {
          method: 'POST', body,
          headers: { authorization: `Bearer ${ADMIN_KEY}`, 'content-type': 'application/json' },
          signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
        });
        await response.arrayBuffer();
        if (response.ok) {
          ok += 1;
          latencies.push(performance.now() - sentMs);
        } else {
          errors += 1;
        }
      } catch {
        errors += 1;
      }
    }
  });
  try {
    await until();
  } finally {
    running = false;
    await Promise.all(loops);
  }
  const durationS = (performance.now() - startedMs) / 1000;
  latencies.sort((a, b) => a - b);
  return { ok, errors, perSecond: ok / durationS, p99Ms: latencies[Math.floor(latencies.length * 0.99)] ?? NaN };
}

// ---------------------------------------------------------------------------------------------
// Memory of the service process

/** The process's resident set and its peak; zeros once it has exited (the run then fails on its own). */
function readMemory(pid: number): { rss: number; hwm: number } {
  let status = '';
  try {
    status = readFileSync(`/proc/${pid}/status`, 'utf8');
  } catch {
    return { rss: 0, hwm: 0 };
  }
  const kib = (name: string) => Number(new RegExp(`^${name}:\\s+(\\d+) kB`, 'm').exec(status)?.[1] ?? 0) * 1024;
  return { rss: kib('VmRSS'), hwm: kib('VmHWM') };
}

/** Resets the kernel's peak-RSS mark (VmHWM) of the process; sampling alone remains when not allowed. */
function resetPeak(pid: number): void {
  try {
    writeFileSync(`/proc/${pid}/clear_refs`, '5');
  } catch {
    // not permitted here: the 50 ms samples are the peak
  }
}

function memorySampler(pid: number): { stop(): number } {
  let peak = readMemory(pid).rss;
  const timer = setInterval(() => { peak = Math.max(peak, readMemory(pid).rss); }, MEMORY_SAMPLE_MS);
  return { stop() { clearInterval(timer); return Math.max(peak, readMemory(pid).rss); } };
}

interface Measured<T> { result: T; beforeBytes: number; peakBytes: number }

/** The service's resident set just before `work` and its peak while `work` runs. */
async function withMemory<T>(pid: number, work: () => Promise<T>): Promise<Measured<T>> {
  const beforeBytes = readMemory(pid).rss;
  resetPeak(pid);
  const sampler = memorySampler(pid);
  try {
    const result = await work();
    return { result, beforeBytes, peakBytes: Math.max(sampler.stop(), readMemory(pid).hwm) };
  } finally {
    sampler.stop();
  }
}

interface ExportRun { created: Record<string, unknown>; ready: Record<string, unknown>; wallS: number }

/** Requests an export and polls it until it is ready. */
async function runExport(api: ReturnType<typeof apiClient>): Promise<ExportRun> {
  const startedMs = performance.now();
  const created = await api('POST', '/v1/transactions/export', { format });
  for (;;) {
    const ready = await api('GET', `/v1/transactions/exports/${created.export_id}`);
    if (ready.status === 'ready') return { created, ready, wallS: (performance.now() - startedMs) / 1000 };
    if (ready.status !== 'processing') throw new Error(`the export ended ${ready.status}: ${ready.failure_reason}`);
    if (performance.now() - startedMs > EXPORT_TIMEOUT_MS) throw new Error('the export did not finish in time');
    await sleep(200);
  }
}

async function downloadBytes(url: string): Promise<number> {
  const response = await fetch(url, { headers: { authorization: `Bearer ${ADMIN_KEY}` } });
  if (!response.ok || !response.body) throw new Error(`download: ${response.status}`);
  let bytes = 0;
  for await (const chunk of response.body) bytes += (chunk as Uint8Array).length;
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// The service process


function startService(port: number): ChildProcess {
  const env: Record<string, string | undefined> = {};
  for (const [name, value] of Object.entries(process.env)) {
    if (!name.startsWith('AGENT_VAULT_') && !['DATABASE_URL', 'PORT', 'HOST', 'LOG_LEVEL'].includes(name)) env[name] = value;
  }
  Object.assign(env, {
    DATABASE_URL: databaseUrl(DATABASE),
    AGENT_VAULT_DATA_DIR: join(workDir, 'data'),
    AGENT_VAULT_SLOT_MS: String(slotMs),
    AGENT_VAULT_BOOTSTRAP_KEY: ADMIN_KEY,
    AGENT_VAULT_RATE_LIMIT_PER_MINUTE: '1000000',
    AGENT_VAULT_TEST_HELPERS: 'true',
    PORT: String(port),
    HOST: '127.0.0.1',
    LOG_LEVEL: values['log-level'],
  });
  const nodeFlags = values['node-flags']!.split(' ').filter(Boolean);
  const child = spawn(process.execPath, [...nodeFlags, join(ROOT, 'bin', 'agent-vault.js'), 'serve'], { cwd: ROOT, env, stdio: ['ignore', 'pipe', 'pipe'] });
  const keep = (chunk: Buffer) => {
    for (const line of chunk.toString('utf8').split('\n')) {
      if (!line) continue;
      serviceTail.push(line);
      if (serviceTail.length > 40) serviceTail.shift();
    }
  };
  child.stdout!.on('data', keep);
  child.stderr!.on('data', keep);
  return child;
}

function apiClient(baseUrl: string) {
  return async (method: string, path: string, body?: unknown): Promise<Record<string, unknown>> => {
    const response = await fetch(`${baseUrl}${path}`, {
      method,
      headers: { authorization: `Bearer ${ADMIN_KEY}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
    });
    const text = await response.text();
    if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${text}`);
    return JSON.parse(text) as Record<string, unknown>;
  };
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
