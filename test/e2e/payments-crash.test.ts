/**
 * Crash recovery of payments, on real processes: `agent-vault serve` is killed (SIGKILL) while
 * payments are recorded `pending` (recorded and debited, sent or about to be, not yet settled),
 * then restarted on the same data dir. Afterwards every payment is `confirmed` or `failed`,
 * none is paid twice, every acknowledged payment is still there, and the balances the service
 * shows are the chain's.
 *
 * A. The embedded validator dies with the service: what it had queued or executed but not yet
 *    persisted is gone with it. The reconciler sends those payments again from their recorded
 *    bytes (their blockhashes still valid: long slots), so every payment ends confirmed, none
 *    twice; what the validator persisted is confirmed as it is.
 * B. An external validator keeps running: every payment the service acknowledged was submitted
 *    and lands, so it ends confirmed; one recorded but not yet sent at the kill is sent again by
 *    the reconciler if its blockhash is still valid, and fails on expiry if not (short slots).
 *
 * PGlite under the data dir by default; a fresh PostgreSQL database when DATABASE_URL is set.
 *
 * Recovery is the `transactions.reconcile` job (every 2 s, rows older than 10 s): a payment the
 * chain ran is settled then; one it never ran is sent again while its blockhash is valid, and
 * failed once it expired (150 slots).
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test, type TestContext } from 'node:test';
import { address, createSolanaRpc, generateKeyPairSigner, type Address, type Signature } from '@solana/kit';
import pg from 'pg';
import { findAssociatedTokenAddress } from '../../src/chain/program.ts';
import { freePort, stopProcess } from '../processes.ts';

const ROOT = join(import.meta.dirname, '..', '..');
const START_TIMEOUT_MS = 60_000;
const ADMIN_KEY = 'av_admin_crashcrashcrashcrashcrash0001';
const WALLETS = 3;
const RECIPIENTS = 4;
const FUNDED_PER_WALLET = 100_000_000n; // 100 USDC
const WORKERS = 6;
/** The kill waits for at least this many acknowledged payments, and a pending one. */
const ACKNOWLEDGED_BEFORE_KILL = 15;
const RECOVERY_TIMEOUT_MS = 45_000;
/** Longer than a payment that waits for the chain (PAYMENT_WAIT_MS). */
const REQUEST_TIMEOUT_MS = 30_000;

// ---------------------------------------------------------------------------------------------
// Processes

interface Running {
  child: ChildProcess;
  output: () => string;
  /** the first match of the readiness pattern */
  ready: RegExpExecArray;
}

function spawnUntil(args: string[], env: Record<string, string>, ready: RegExp): Promise<Running> {
  const child = spawn(process.execPath, [join(ROOT, 'bin', 'agent-vault.js'), ...args], { env, cwd: ROOT });
  let output = '';
  child.stdout!.on('data', (chunk) => { output += chunk; });
  child.stderr!.on('data', (chunk) => { output += chunk; });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`${args[0]} did not start:\n${output}`)); }, START_TIMEOUT_MS);
    const check = () => {
      const match = ready.exec(output);
      if (match) {
        clearTimeout(timer);
        child.stdout!.off('data', check);
        child.removeListener('exit', onExit);
        resolve({ child, output: () => output, ready: match });
      }
    };
    const onExit = (code: number | null) => { clearTimeout(timer); reject(new Error(`${args[0]} exited with ${code}:\n${output}`)); };
    child.stdout!.on('data', check);
    child.on('exit', onExit);
  });
}

function baseEnv(dataDir: string, databaseUrl: string | null): Record<string, string> {
  const env: Record<string, string> = {
    ...process.env as Record<string, string>,
    AGENT_VAULT_DATA_DIR: dataDir, PORT: '0', LOG_LEVEL: 'info',
    AGENT_VAULT_BOOTSTRAP_KEY: ADMIN_KEY, AGENT_VAULT_RATE_LIMIT_PER_MINUTE: '1000000', AGENT_VAULT_TEST_HELPERS: 'on',
    // What is tested is what a crash leaves, not how a busy process sheds load.
    AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS: '0',
  };
  delete env.DATABASE_URL;
  delete env.AGENT_VAULT_RPC_URL;
  if (databaseUrl) env.DATABASE_URL = databaseUrl;
  return env;
}

async function startServe(dataDir: string, databaseUrl: string | null, extra: Record<string, string>): Promise<Running & { baseUrl: string }> {
  const running = await spawnUntil(['serve'], { ...baseEnv(dataDir, databaseUrl), ...extra },
    /Server listening at (http:\/\/127\.0\.0\.1:\d+)/);
  return { ...running, baseUrl: running.ready[1]! };
}

async function startValidator(dataDir: string, slotMs: number): Promise<Running & { url: string }> {
  const port = await freePort();
  const running = await spawnUntil(['validator', '--port', String(port)],
    { ...baseEnv(dataDir, null), AGENT_VAULT_SLOT_MS: String(slotMs) }, /"msg":"local validator ready","url":"([^"]+)"/);
  return { ...running, url: running.ready[1]! };
}

/** A fresh PostgreSQL database for one scenario when DATABASE_URL is set; null = PGlite. */
async function freshDatabase(): Promise<{ url: string | null; drop(): Promise<void> }> {
  const base = process.env.DATABASE_URL;
  if (!base) return { url: null, async drop() {} };
  const name = `av_crash_${randomBytes(6).toString('hex')}`;
  const admin = new pg.Client({ connectionString: base });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${name}`);
  } finally {
    await admin.end();
  }
  const url = new URL(base);
  url.pathname = `/${name}`;
  return {
    url: url.toString(),
    async drop() {
      const client = new pg.Client({ connectionString: base });
      await client.connect();
      try {
        await client.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      } finally {
        await client.end();
      }
    },
  };
}

// ---------------------------------------------------------------------------------------------
// The API

interface Response<T = any> { status: number; body: T }

async function call<T = any>(baseUrl: string, method: string, path: string, body?: unknown): Promise<Response<T>> {
  const response = await fetch(`${baseUrl}${path}`, {
    method,
    signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
    headers: { authorization: `Bearer ${ADMIN_KEY}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) as T : undefined as T };
}

async function ok<T = any>(baseUrl: string, method: string, path: string, body?: unknown): Promise<T> {
  const response = await call<T>(baseUrl, method, path, body);
  assert.equal(response.status, 200, `${method} ${path}: ${JSON.stringify(response.body)}`);
  return response.body;
}

interface TransactionView {
  tx_id: string;
  type: string;
  status: string;
  amount: string;
  recipient: string | null;
  wallet_id: string | null;
  tx_signature: string | null;
  settled_at: string | null;
}

/** Every transaction matching the query, through the pages. */
async function listAll(baseUrl: string, query: string): Promise<TransactionView[]> {
  const rows: TransactionView[] = [];
  let cursor: string | null = null;
  do {
    const page: { data: TransactionView[]; next_cursor: string | null } = await ok(baseUrl, 'GET',
      `/v1/transactions?limit=100&${query}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`);
    rows.push(...page.data);
    cursor = page.next_cursor;
  } while (cursor);
  return rows;
}

const micro = (usdc: string): bigint => {
  const [whole, fraction = ''] = usdc.split('.');
  return BigInt(whole!) * 1_000_000n + BigInt(fraction.padEnd(6, '0'));
};
const usdc = (amount: bigint): string => `${amount / 1_000_000n}.${(amount % 1_000_000n).toString().padStart(6, '0')}`;

// ---------------------------------------------------------------------------------------------
// The scenario

interface Wallet { wallet_id: string; token_account: string }

/** Deposits, wallets under the permissive preset, each funded. */
async function setUp(baseUrl: string): Promise<Wallet[]> {
  await ok(baseUrl, 'POST', '/v1/test_helpers/deposits', { amount: usdc(FUNDED_PER_WALLET * BigInt(WALLETS)) });
  const wallets = await Promise.all(Array.from({ length: WALLETS }, (_, i) => ok<Wallet>(baseUrl, 'POST', '/v1/wallets',
    { agentId: `crash-agent-${i}-${randomBytes(3).toString('hex')}`, label: `Crash ${i}`, policyId: 'pol_permissive' })));
  await Promise.all(wallets.map((wallet) =>
    ok(baseUrl, 'POST', `/v1/wallets/${wallet.wallet_id}/fund`, { amount: usdc(FUNDED_PER_WALLET) })));
  return wallets;
}

interface Load {
  acknowledged: Map<string, string>;
  /** resolves when every worker has stopped (the process died under them) */
  done: Promise<void>;
  stop(): void;
}

/**
 * Payments from every wallet to a few recipients, as fast as the service takes them. One worker
 * waits for the chain on each payment (in flight when the kill comes); the others never wait, so
 * between two slots there are always payments recorded and not yet settled. (When every worker
 * could end up waiting, all of them sometimes sat in confirmation at once, the slot settled the
 * whole pending set just before the kill, and nothing was left for the restart to recover.)
 */
function startLoad(baseUrl: string, wallets: Wallet[], recipients: string[]): Load {
  const acknowledged = new Map<string, string>();
  let stopped = false;
  let sequence = 0;
  const worker = async (waits: boolean) => {
    while (!stopped) {
      const n = (sequence += 1);
      const wallet = wallets[n % wallets.length]!;
      const to = recipients[n % recipients.length]!;
      const amount = `0.${String(1 + (n % 97)).padStart(2, '0')}`;
      let response: Response<TransactionView>;
      try {
        response = await call(baseUrl, 'POST', '/v1/payments',
          { walletId: wallet.wallet_id, to, amount, currency: 'USDC', waitForConfirmation: waits });
      } catch {
        return; // the process is gone
      }
      if (response.status === 200) acknowledged.set(response.body.tx_id, response.body.status);
      else if (!stopped) throw new Error(`payment refused: ${response.status} ${JSON.stringify(response.body)}`);
    }
  };
  const workers = Array.from({ length: WORKERS }, (_, i) => worker(i === 0));
  return { acknowledged, done: Promise.all(workers).then(() => {}), stop() { stopped = true; } };
}

/**
 * SIGKILLs serve once enough payments were acknowledged, some already confirmed, and the API
 * shows pending ones. Returns the pending ones it saw.
 */
async function killWhilePending(serve: Running & { baseUrl: string }, load: Load): Promise<string[]> {
  const deadline = Date.now() + 30_000;
  const list = (status: string) =>
    call<{ data: TransactionView[] }>(serve.baseUrl, 'GET', `/v1/transactions?status=${status}&type=payment&limit=100`);
  let someConfirmed = false;
  while (Date.now() < deadline) {
    if (load.acknowledged.size >= ACKNOWLEDGED_BEFORE_KILL) {
      someConfirmed ||= (await list('confirmed')).body.data.length > 0;
      const pending = await list('pending');
      if (someConfirmed && pending.status === 200 && pending.body.data.length > 0) {
        await stopProcess(serve.child, { signal: 'SIGKILL' });
        load.stop();
        return pending.body.data.map((row) => row.tx_id);
      }
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  throw new Error(`no pending payment to kill on (${load.acknowledged.size} acknowledged):\n${serve.output()}`);
}

/** Waits until no transaction of any type is pending; returns how long that took. */
async function awaitReconciled(baseUrl: string): Promise<number> {
  const startedMs = Date.now();
  for (;;) {
    const pending = await ok<{ data: TransactionView[] }>(baseUrl, 'GET', '/v1/transactions?status=pending&limit=1');
    if (pending.data.length === 0) return Date.now() - startedMs;
    if (Date.now() - startedMs > RECOVERY_TIMEOUT_MS) {
      throw new Error(`still pending ${RECOVERY_TIMEOUT_MS} ms after the restart: ${JSON.stringify(pending.data)}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

interface Observed {
  payments: TransactionView[];
  wallets: Array<Wallet & { usdc_balance: string }>;
}

/**
 * What the service shows must be what the chain holds: each wallet's balance is its vault's,
 * funded = balance + confirmed payments (failed ones gave their amount back), each confirmed
 * payment executed successfully on chain exactly once, each failed one moved nothing.
 */
async function assertMatchesChain(rpcUrl: string, observed: Observed, recipients: string[]): Promise<void> {
  const rpc = createSolanaRpc(rpcUrl);
  const { usdcMint } = await (rpc as unknown as { agentVault_getInfo(): { send(): Promise<{ usdcMint: Address }> } })
    .agentVault_getInfo().send();
  const tokenBalance = async (account: Address): Promise<bigint> => {
    try {
      return BigInt((await rpc.getTokenAccountBalance(account).send()).value.amount);
    } catch {
      return 0n; // no token account: nothing ever arrived
    }
  };

  for (const wallet of observed.wallets) {
    const mine = observed.payments.filter((p) => p.wallet_id === wallet.wallet_id);
    const confirmed = mine.filter((p) => p.status === 'confirmed').reduce((sum, p) => sum + micro(p.amount), 0n);
    assert.equal(micro(wallet.usdc_balance) + confirmed, FUNDED_PER_WALLET,
      `wallet ${wallet.wallet_id}: balance + confirmed payments = funded`);
    assert.equal(await tokenBalance(address(wallet.token_account)), micro(wallet.usdc_balance),
      `wallet ${wallet.wallet_id}: usdc_balance = the vault's token balance on chain`);
  }

  for (const recipient of recipients) {
    const toRecipient = observed.payments.filter((p) => p.recipient === recipient && p.status === 'confirmed');
    const ata = await findAssociatedTokenAddress(address(recipient), usdcMint);
    assert.equal(await tokenBalance(ata), toRecipient.reduce((sum, p) => sum + micro(p.amount), 0n),
      `recipient ${recipient} holds exactly the sum of the confirmed payments to it`);
    const history = (await rpc.getSignaturesForAddress(ata, { limit: 1000 }).send()).filter((entry) => entry.err === null);
    assert.deepEqual(history.map((entry) => entry.signature).sort(), toRecipient.map((p) => p.tx_signature).sort(),
      `recipient ${recipient}: the chain ran each confirmed payment once, and nothing else paid it`);
  }

  const signatures = observed.payments.map((p) => p.tx_signature as Signature);
  for (let start = 0; start < signatures.length; start += 256) {
    const batch = signatures.slice(start, start + 256);
    const { value } = await rpc.getSignatureStatuses(batch, { searchTransactionHistory: true }).send();
    batch.forEach((signature, i) => {
      const payment = observed.payments[start + i]!;
      const status = value[i];
      if (payment.status === 'confirmed') assert.ok(status && status.err === null, `${payment.tx_id} confirmed: executed on chain (${signature})`);
      else assert.ok(!status || status.err !== null, `${payment.tx_id} failed: did not execute on chain (${signature})`);
    });
  }
}

async function observe(baseUrl: string, wallets: Wallet[]): Promise<Observed> {
  return {
    payments: await listAll(baseUrl, 'type=payment'),
    wallets: await Promise.all(wallets.map((w) => ok<Wallet & { usdc_balance: string }>(baseUrl, 'GET', `/v1/wallets/${w.wallet_id}`))),
  };
}

/** Payment outcomes after recovery: all settled, the acknowledged ones all present. */
function assertSettled(observed: Observed, acknowledged: Map<string, string>, restartedAtMs: number, pendingAtKill: string[]): void {
  const byId = new Map(observed.payments.map((p) => [p.tx_id, p]));
  const statuses = observed.payments.map((p) => p.status);
  assert.deepEqual([...new Set(statuses)].filter((s) => s !== 'confirmed' && s !== 'failed'), [],
    'every payment ended confirmed or failed');
  for (const txId of acknowledged.keys()) assert.ok(byId.has(txId), `acknowledged payment ${txId} survived the crash`);
  for (const txId of pendingAtKill) assert.ok(byId.has(txId), `payment ${txId}, pending at the kill, survived it`);
  const settledAfterRestart = observed.payments.filter((p) => Date.parse(p.settled_at!) >= restartedAtMs);
  assert.ok(settledAfterRestart.length > 0, 'the kill left pending payments, and the restarted service settled them');
}

async function runScenario(t: TestContext, external: boolean): Promise<void> {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-crash-'));
  const validatorDir = mkdtempSync(join(tmpdir(), 'av-crash-chain-'));
  const database = await freshDatabase();
  const processes: ChildProcess[] = [];
  try {
    // B: a chain of its own, with short slots so a payment recorded but never sent expires soon.
    const validator = external ? await startValidator(validatorDir, 100) : null;
    if (validator) processes.push(validator.child);
    const chainEnv: Record<string, string> = validator
      ? { AGENT_VAULT_RPC_URL: validator.url, AGENT_VAULT_SLOT_MS: '100' }
      : { AGENT_VAULT_SLOT_MS: '1500' }; // A: long slots, so payments stay pending a while

    const first = await startServe(dataDir, database.url, chainEnv);
    processes.push(first.child);
    const wallets = await setUp(first.baseUrl);
    const recipients = await Promise.all(Array.from({ length: RECIPIENTS }, async () => (await generateKeyPairSigner()).address));

    const load = startLoad(first.baseUrl, wallets, recipients);
    const pendingAtKill = await killWhilePending(first, load);
    await load.done;
    t.diagnostic(`killed with ${load.acknowledged.size} payments acknowledged, ${pendingAtKill.length}+ pending`);

    // A: the restarted embedded validator keeps the chain and its slots, so what it lost with the
    // process can still land when the reconciler sends it again.
    const restartedAtMs = Date.now();
    const second = await startServe(dataDir, database.url, chainEnv);
    processes.push(second.child);
    const recoveryMs = await awaitReconciled(second.baseUrl);
    t.diagnostic(`all pending settled ${recoveryMs} ms after the restart was listening (${Date.now() - restartedAtMs} ms after spawn)`);

    const observed = await observe(second.baseUrl, wallets);
    assertSettled(observed, load.acknowledged, restartedAtMs, pendingAtKill);
    const count = (status: string) => observed.payments.filter((p) => p.status === status).length;
    t.diagnostic(`${observed.payments.length} payments: ${count('confirmed')} confirmed, ${count('failed')} failed`);
    for (const txId of load.acknowledged.keys()) {
      assert.equal(observed.payments.find((p) => p.tx_id === txId)!.status, 'confirmed', external
        ? `acknowledged payment ${txId} was submitted before the kill, and the running chain landed it`
        : `acknowledged payment ${txId}, lost with the embedded validator or not, was landed by the reconciler`);
    }
    if (!external) {
      assert.deepEqual(observed.payments.filter((p) => p.status !== 'confirmed').map((p) => p.tx_id), [],
        'every recorded payment landed: the reconciler sent again what the chain lost or never got');
    }

    if (validator) {
      await assertMatchesChain(validator.url, observed, recipients);
    } else {
      // The embedded chain is read through its own JSON-RPC: the service stops, a validator opens its state.
      assert.equal(await stopProcess(second.child), 0, 'serve stops gracefully');
      const reader = await startValidator(dataDir, 400);
      processes.push(reader.child);
      await assertMatchesChain(reader.url, observed, recipients);
    }
  } finally {
    for (const child of processes.reverse()) await stopProcess(child);
    await database.drop();
    rmSync(dataDir, { recursive: true, force: true });
    rmSync(validatorDir, { recursive: true, force: true });
  }
}

describe('payments survive a SIGKILL between recording and confirmation', () => {
  test('A: serve with the embedded validator, killed and restarted', (t) => runScenario(t, false));
  test('B: serve on an external validator that keeps running, killed and restarted', (t) => runScenario(t, true));
});
