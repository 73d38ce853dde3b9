/**
 * Connecting to a cluster at AGENT_VAULT_RPC_URL: what the service logs of it.
 */
import assert from 'node:assert/strict';
import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer as createHttpServer } from 'node:http';
import { createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { createKeyPairSignerFromBytes, getAddressDecoder } from '@solana/kit';
import { OffsetClock } from '../clock/clock.ts';
import { loadConfig } from '../config/config.ts';
import { beforeDeadline } from '../../test/deadline.ts';
import { MAX_CONNECTIONS, startRpcServer } from '../validator/http.ts';
import { DEFAULT_PROGRAM_SO_PATH, LocalValidator } from '../validator/validator.ts';
import { connectChain, createHttpRpc, type ChainLogger } from './connect.ts';
import { encodeSecretKeyBase58 } from './operator-key.ts';

test('the RPC URL is logged as its origin only: a provider\'s API key in its path or query stays out of the logs', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'av-connect-'));
  const validator = await LocalValidator.open({ dataDir: join(dir, 'validator'), slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
  const rpc = await startRpcServer(validator, { port: 0 });
  const logged: unknown[] = [];
  const record = (...args: unknown[]) => {
    logged.push(args);
  };
  const logger = { debug: record, info: record, warn: record, error: record } as unknown as ChainLogger;
  try {
    const rpcUrl = `${rpc.url.replace(/\/$/, '')}/?api-key=s3cret-provider-key`;
    const config = loadConfig({ AGENT_VAULT_DATA_DIR: join(dir, 'service'), AGENT_VAULT_RPC_URL: rpcUrl, LOG_LEVEL: 'silent' });
    const connection = await connectChain(config, new OffsetClock(), logger);
    await connection.close();
    const text = JSON.stringify(logged);
    assert.ok(text.includes(new URL(rpc.url).origin), `the cluster is named: ${text}`);
    assert.ok(!text.includes('s3cret'), `no key in the logs: ${text}`);
  } finally {
    await rpc.close();
    await validator.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test('an RPC URL nothing answers at is said so at start, not taken for a real cluster', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'av-connect-'));
  // A port just freed: nothing listens there.
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  await new Promise((resolve) => server.close(resolve));
  try {
    const config = loadConfig({ AGENT_VAULT_DATA_DIR: join(dir, 'service'), AGENT_VAULT_RPC_URL: `http://127.0.0.1:${port}/?api-key=s3cret`, LOG_LEVEL: 'silent' });
    await assert.rejects(connectChain(config, new OffsetClock(), { debug() {}, info() {}, warn() {}, error() {} } as unknown as ChainLogger),
      (error: Error) => error.message.includes(`the chain at http://127.0.0.1:${port} (AGENT_VAULT_RPC_URL) did not answer`)
        && /ECONNREFUSED/.test(error.message) && !error.message.includes('s3cret'));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('an RPC URL that takes the connection and never answers stops the start within the call timeout, saying so', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'av-connect-'));
  const silent = createHttpServer(() => {}); // a hung node: every request taken, none answered
  await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
  const { port } = silent.address() as AddressInfo;
  try {
    const config = loadConfig({ AGENT_VAULT_DATA_DIR: join(dir, 'service'), AGENT_VAULT_RPC_URL: `http://127.0.0.1:${port}`, LOG_LEVEL: 'silent' });
    const connecting = connectChain(config, new OffsetClock(), { debug() {}, info() {}, warn() {}, error() {} } as unknown as ChainLogger,
      { callTimeoutMs: 300 }).then(() => null, (error: Error) => error);
    const error = await beforeDeadline(connecting, 10_000);
    assert.ok(error, 'the start fails');
    assert.equal(error.message, `the chain at http://127.0.0.1:${port} (AGENT_VAULT_RPC_URL) did not answer: nothing within 300 ms`);
  } finally {
    silent.closeAllConnections();
    await new Promise((resolve) => silent.close(resolve));
    rmSync(dir, { recursive: true, force: true });
  }
});

// The guarantee: under load the service's calls queue for a socket rather than open one each,
// past what the node accepts (this project's validator resets connections past 256).
test('calls over HTTP past the node\'s connection limit all answer: they wait for a socket', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'av-connect-'));
  const validator = await LocalValidator.open({ dataDir: join(dir, 'validator'), slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
  const server = await startRpcServer(validator, { port: 0 });
  try {
    const rpc = createHttpRpc(server.url);
    // Each call its own (kit coalesces identical calls made together into one request).
    const calls = Array.from({ length: MAX_CONNECTIONS * 2 }, () => rpc.getBalance(getAddressDecoder().decode(randomBytes(32))).send()
      .then(() => 'ok', (error: Error) => describe(error)));
    const outcomes = await Promise.all(calls);
    assert.deepEqual(outcomes.filter((outcome) => outcome !== 'ok'), [], 'none refused or reset');
  } finally {
    await server.close();
    await validator.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

/** An error and its causes, in one line. */
function describe(error: unknown): string {
  const parts: string[] = [];
  for (let cause = error; cause && parts.length < 3; cause = (cause as { cause?: unknown }).cause) parts.push(String((cause as Error).message ?? cause));
  return parts.join(': ');
}

test('AGENT_VAULT_ARBITER_KEY gives every process the same arbiter, whatever its data dir', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'av-connect-'));
  const validator = await LocalValidator.open({ dataDir: join(dir, 'validator'), slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
  const rpc = await startRpcServer(validator, { port: 0 });
  const quiet = { debug() {}, info() {}, warn() {}, error() {} } as unknown as ChainLogger;
  const arbiterOf = async (dataDir: string, env: Record<string, string> = {}) => {
    const connection = await connectChain(loadConfig({ AGENT_VAULT_DATA_DIR: join(dir, dataDir), AGENT_VAULT_RPC_URL: rpc.url, LOG_LEVEL: 'silent', ...env }),
      new OffsetClock(), quiet);
    try {
      return connection.chain.arbiter.address;
    } finally {
      await connection.close();
    }
  };
  try {
    // Each escrow names its arbiter on chain: a process with another one could not decide its dispute.
    assert.notEqual(await arbiterOf('a'), await arbiterOf('b'), 'without it, each data dir makes its own');
    const { privateKey, publicKey } = generateKeyPairSync('ed25519');
    const secret = Buffer.concat([privateKey.export({ format: 'der', type: 'pkcs8' }).subarray(-32), publicKey.export({ format: 'der', type: 'spki' }).subarray(-32)]);
    const env = { AGENT_VAULT_ARBITER_KEY: encodeSecretKeyBase58(secret) };
    const expected = (await createKeyPairSignerFromBytes(secret)).address;
    assert.deepEqual([await arbiterOf('c', env), await arbiterOf('d', env)], [expected, expected]);
    await assert.rejects(arbiterOf('e', { AGENT_VAULT_ARBITER_KEY: 'not a key' }), /AGENT_VAULT_ARBITER_KEY: not a valid secret key/, 'refused with the configuration, before anything is opened');
  } finally {
    await rpc.close();
    await validator.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
