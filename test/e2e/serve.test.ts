/**
 * `agent-vault serve` as users run it (`npm start`): a real process on its embedded defaults
 * (PGlite and the local validator under a data dir), its first-start admin key, health,
 * graceful shutdown, durability across a restart, and one process per data dir.
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, test } from 'node:test';

const ROOT = join(import.meta.dirname, '..', '..');
const START_TIMEOUT_MS = 60_000;

interface Running {
  child: ChildProcess;
  baseUrl: string;
  output: () => string;
}

function startServe(dataDir: string): Promise<Running> {
  const env: Record<string, string> = { ...process.env as Record<string, string>, AGENT_VAULT_DATA_DIR: dataDir, PORT: '0', LOG_LEVEL: 'info' };
  delete env.DATABASE_URL;
  delete env.AGENT_VAULT_BOOTSTRAP_KEY;
  const child = spawn(process.execPath, [join(ROOT, 'bin', 'agent-vault.js'), 'serve'], { env, cwd: ROOT });
  let output = '';
  child.stdout.on('data', (chunk) => { output += chunk; });
  child.stderr.on('data', (chunk) => { output += chunk; });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`serve did not start:\n${output}`)), START_TIMEOUT_MS);
    const check = () => {
      const match = /Server listening at (http:\/\/127\.0\.0\.1:\d+)/.exec(output);
      if (match) {
        clearTimeout(timer);
        resolve({ child, baseUrl: match[1]!, output: () => output });
      }
    };
    child.stdout.on('data', check);
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`serve exited with ${code}:\n${output}`)); });
  });
}

function stop(running: Running): Promise<number | null> {
  return new Promise((resolve) => {
    running.child.removeAllListeners('exit');
    running.child.once('exit', (code) => resolve(code));
    running.child.kill('SIGTERM');
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
    const deposit = await fetch(`${first.baseUrl}/v1/test_helpers/deposits`, {
      method: 'POST', headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' }, body: '{"amount":"42"}',
    });
    assert.equal(deposit.status, 200);

    // One process per data dir: a second one refuses, saying why.
    const second = await startServe(dataDir).then(
      async (running) => { await stop(running); return 'started'; },
      (error: Error) => error.message);
    assert.match(second, /in use by pid/);

    assert.equal(await stop(first), 0, 'SIGTERM stops it gracefully');

    const restarted = await startServe(dataDir);
    try {
      assert.doesNotMatch(restarted.output(), /Admin API key/, 'the key is shown only on the first start');
      const org = await fetch(`${restarted.baseUrl}/v1/organization`, { headers: { authorization: `Bearer ${key}` } });
      assert.equal(org.status, 200);
      const body = await org.json() as { reserve: { usdc_balance: string } };
      assert.equal(body.reserve.usdc_balance, '42.00', 'the deposit survived the restart');
    } finally {
      assert.equal(await stop(restarted), 0);
    }
  });
});
