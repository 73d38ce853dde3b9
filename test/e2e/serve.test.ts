/**
 * `agent-vault serve` as users run it (`npm start`): a real process on its embedded defaults
 * (PGlite and the local validator under a data dir), its first-start admin key, health,
 * graceful shutdown, durability across a restart, and one process per data dir.
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { connect, createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, test } from 'node:test';
import pino from 'pino';
import { loadConfig } from '../../src/config/config.ts';
import { buildService } from '../../src/server.ts';

const ROOT = join(import.meta.dirname, '..', '..');
const START_TIMEOUT_MS = 60_000;

interface Running {
  child: ChildProcess;
  baseUrl: string;
  output: () => string;
}

function startServe(
  dataDir: string, args = ['serve'], ready = /Server listening at (http:\/\/127\.0\.0\.1:\d+)/, more: Record<string, string> = {},
): Promise<Running> {
  const env: Record<string, string> = { ...process.env as Record<string, string>, AGENT_VAULT_DATA_DIR: dataDir, PORT: '0', LOG_LEVEL: 'info', ...more };
  delete env.DATABASE_URL;
  delete env.AGENT_VAULT_BOOTSTRAP_KEY;
  const child = spawn(process.execPath, [join(ROOT, 'bin', 'agent-vault.js'), ...args], { env, cwd: ROOT });
  let output = '';
  child.stdout.on('data', (chunk) => { output += chunk; });
  child.stderr.on('data', (chunk) => { output += chunk; });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${args.join(' ')} did not start:\n${output}`)), START_TIMEOUT_MS);
    const check = () => {
      const match = ready.exec(output);
      if (match) {
        clearTimeout(timer);
        resolve({ child, baseUrl: match[1] ?? '', output: () => output });
      }
    };
    child.stdout.on('data', check);
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`${args.join(' ')} exited with ${code}:\n${output}`)); });
  });
}

/** SIGTERM, `times` times 50 ms apart (a second Ctrl-C, a supervisor's after a kill); its exit code. */
function stop(running: Running, times = 1): Promise<number | null> {
  return new Promise((resolve) => {
    running.child.removeAllListeners('exit');
    running.child.once('exit', (code) => resolve(code));
    for (let i = 0; i < times; i += 1) setTimeout(() => running.child.kill('SIGTERM'), i * 50);
  });
}

describe('agent-vault serve', () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-serve-'));
  after(() => rmSync(dataDir, { recursive: true, force: true }));

  test('starts on its defaults, prints the admin key once, survives a restart, stops cleanly', async () => {
    const first = await startServe(dataDir);
    const key = /Admin API key \(shown once, store it now\):\s+(\S+)/.exec(first.output())?.[1];
    assert.ok(key, `the first start prints the admin key:\n${first.output()}`);
    const health = await fetch(`${first.baseUrl}/healthz`);
    assert.equal(health.status, 200);
    // PORT=0: an error's docs link names the port the system chose, not 0.
    const refused = await (await fetch(`${first.baseUrl}/v1/wallets`)).json() as { error: { docs: string } };
    assert.equal(refused.error.docs, `${first.baseUrl}/docs/errors#authentication_failed`);
    const deposit = await fetch(`${first.baseUrl}/v1/test_helpers/deposits`, {
      method: 'POST', headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' }, body: '{"amount":"42"}',
    });
    assert.equal(deposit.status, 200);

    // One process per data dir: a second one refuses, saying why.
    const second = await startServe(dataDir).then(
      async (running) => { await stop(running); return 'started'; },
      (error: Error) => error.message);
    assert.match(second, /in use by pid/);

    assert.equal(await stop(first, 2), 0, 'SIGTERM stops it gracefully, a second one too');
    assert.match(first.output(), /"msg":"stopped"/, 'the graceful path ran to its end');

    // Restarted with docs of its own: PORT=0 leaves an operator's AGENT_VAULT_DOCS_URL as it is.
    const restarted = await startServe(dataDir, undefined, undefined, { AGENT_VAULT_DOCS_URL: 'https://docs.example.com' });
    try {
      assert.doesNotMatch(restarted.output(), /Admin API key/, 'the key is shown only on the first start');
      const told = await (await fetch(`${restarted.baseUrl}/v1/wallets`)).json() as { error: { docs: string } };
      assert.equal(told.error.docs, 'https://docs.example.com/errors#authentication_failed');
      const org = await fetch(`${restarted.baseUrl}/v1/organization`, { headers: { authorization: `Bearer ${key}` } });
      assert.equal(org.status, 200);
      const body = await org.json() as { reserve: { usdc_balance: string } };
      assert.equal(body.reserve.usdc_balance, '42.00', 'the deposit survived the restart');
    } finally {
      assert.equal(await stop(restarted), 0);
    }
  });

  test('a stalled request holds the shutdown no longer than its wait, then its connection is cut', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'av-stall-'));
    const service = await buildService(loadConfig({ AGENT_VAULT_DATA_DIR: dir, AGENT_VAULT_SLOT_MS: '0', LOG_LEVEL: 'silent' }),
      { workers: false, scheduleJobs: false, inMemoryDatabase: true, httpCloseWaitMs: 300, logger: pino({ level: 'silent' }) });
    try {
      await service.app.listen({ port: 0, host: '127.0.0.1' });
      const { port } = service.app.server.address() as AddressInfo;
      // A client that sends its headers and part of its body, then nothing.
      const client = connect(port, '127.0.0.1');
      await new Promise((resolve) => client.once('connect', resolve));
      const cut = new Promise((resolve) => client.once('close', resolve));
      client.resume(); // what it is answered is read, so that its end is seen
      const received = new Promise((resolve) => service.app.server.once('request', resolve));
      client.write('POST /v1/payments HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"to":');
      await received; // its headers read: a request in flight, waiting for the rest of its body
      // Without the wait's end the close never ends: the client never sends the rest.
      const closed = await Promise.race([service.close().then(() => 'closed'), new Promise((resolve) => setTimeout(() => resolve('hung'), 10_000))]);
      assert.equal(closed, 'closed', 'the shutdown ended, the stalled client notwithstanding');
      await cut;
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('a port already taken ends the process with an error and leaves nothing running or locked', async () => {
    const taken = createServer();
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
    const dir = mkdtempSync(join(tmpdir(), 'av-port-'));
    try {
      const env: Record<string, string> = {
        ...process.env as Record<string, string>, AGENT_VAULT_DATA_DIR: dir, HOST: '127.0.0.1', PORT: String((taken.address() as AddressInfo).port),
      };
      delete env.DATABASE_URL;
      const child = spawn(process.execPath, [join(ROOT, 'bin', 'agent-vault.js'), 'serve'], { env, cwd: ROOT });
      let output = '';
      child.stdout.on('data', (chunk) => { output += chunk; });
      child.stderr.on('data', (chunk) => { output += chunk; });
      const code = await new Promise<number | null>((resolve, reject) => {
        const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`serve kept running after its listen failed:\n${output}`)); }, START_TIMEOUT_MS);
        // 'close', not 'exit': its output may still be arriving when it has exited.
        child.once('close', (exitCode) => { clearTimeout(timer); resolve(exitCode); });
      });
      assert.equal(code, 1, output);
      assert.match(output, /cannot listen on HOST=127\.0\.0\.1 PORT=\d+: .*EADDRINUSE/);
      // Said before anything was set up: no organisation made, no key printed, no database.
      assert.doesNotMatch(output, /Admin API key/);
      assert.deepEqual(readdirSync(dir), []);
      // Its locks were released: the same data dir starts at once on a free port.
      const next = await startServe(dir);
      assert.equal(await stop(next), 0);
    } finally {
      await new Promise((resolve) => taken.close(resolve));
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('worker runs the background jobs with no HTTP listener, beside an API started with --no-workers', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'av-worker-'));
    try {
      // The API alone: a policy that expires in a few seconds and a vault on it. Nothing here
      // runs the expiry job.
      const api = await startServe(dir, ['serve', '--no-workers']);
      const key = /Admin API key \(shown once, store it now\):\s+(\S+)/.exec(api.output())![1]!;
      let baseUrl = api.baseUrl;
      const call = async (method: string, path: string, body?: unknown) => {
        const response = await fetch(`${baseUrl}${path}`, {
          method, headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
          body: body === undefined ? undefined : JSON.stringify(body),
        });
        return { status: response.status, body: await response.json() as Record<string, any> };
      };
      // An hour ahead, then the service clock (stored with the data, every process's) two hours on.
      const expiry = new Date(Date.now() + 3_600_000).toISOString();
      const policy = await call('POST', '/v1/policies', { name: 'Soon over', expiry });
      assert.equal(policy.status, 200, JSON.stringify(policy.body));
      const wallet = await call('POST', '/v1/wallets', { agentId: 'worker-test', label: 'W', policyId: policy.body.policy_id });
      assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
      assert.equal((await call('POST', '/v1/test_helpers/clock/advance', { seconds: 7_200 })).status, 200);
      assert.equal((await call('GET', `/v1/wallets/${wallet.body.wallet_id}`)).body.status, 'active',
        'past the expiry, the API alone expires nothing');
      assert.equal(await stop(api), 0);

      // The workers alone (one process owns a PGlite data dir; on PostgreSQL both run at once),
      // then the API to look: a few turns at most, a slow machine's worker may need more than one.
      let status = 'active';
      for (let turn = 0; turn < 5 && status !== 'frozen'; turn += 1) {
        const worker = await startServe(dir, ['worker'], /workers running \(no HTTP listener\)/);
        assert.doesNotMatch(worker.output(), /Server listening/);
        await new Promise((resolve) => setTimeout(resolve, 2_000));
        assert.equal(await stop(worker), 0, 'SIGTERM stops the worker');
        const after = await startServe(dir, ['serve', '--no-workers']);
        baseUrl = after.baseUrl;
        try {
          status = (await call('GET', `/v1/wallets/${wallet.body.wallet_id}`)).body.status;
        } finally {
          assert.equal(await stop(after), 0);
        }
      }
      assert.equal(status, 'frozen', 'the worker ran the expiry job');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
