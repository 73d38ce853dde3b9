import assert from 'node:assert/strict';
import { test } from 'node:test';
import { ConfigError, loadConfig } from './config.ts';

test('defaults: embedded PGlite under ./data and the local validator with 400 ms slots', () => {
  const config = loadConfig({});
  assert.equal(config.port, 8080);
  assert.equal(config.host, '127.0.0.1');
  assert.equal(config.databaseUrl, null);
  assert.equal(config.rpcUrl, null);
  assert.equal(config.slotMs, 400);
  assert.equal(config.testHelpers, null, 'test helpers unset: on with a local validator (src/http/foundation.test.ts)');
  assert.match(config.dataDir, /\/data$/);
});

test('test helpers: on and off as set, unset decided by the chain found', () => {
  assert.equal(loadConfig({ AGENT_VAULT_RPC_URL: 'https://api.devnet.solana.com' }).testHelpers, null);
  assert.equal(loadConfig({ AGENT_VAULT_TEST_HELPERS: 'off' }).testHelpers, false);
  assert.equal(loadConfig({ AGENT_VAULT_RPC_URL: 'http://127.0.0.1:8899', AGENT_VAULT_TEST_HELPERS: 'on' }).testHelpers, true);
});

test('a bad value stops start-up with a message naming the variable', () => {
  const cases: Array<[Record<string, string>, RegExp]> = [
    [{ PORT: 'eighty' }, /^PORT: must be an integer/],
    [{ PORT: '70000' }, /^PORT: must be between/],
    [{ AGENT_VAULT_SLOT_MS: '-1' }, /^AGENT_VAULT_SLOT_MS/],
    [{ AGENT_VAULT_RPC_URL: 'ftp://x' }, /^AGENT_VAULT_RPC_URL: must use/],
    [{ DATABASE_URL: 'mysql://x' }, /^DATABASE_URL/],
    [{ AGENT_VAULT_TEST_HELPERS: 'maybe' }, /^AGENT_VAULT_TEST_HELPERS/],
    [{ LOG_LEVEL: 'loud' }, /^LOG_LEVEL/],
    [{ HOST: 'http://0.0.0.0' }, /^HOST: must be an IP address or a host name/],
    [{ HOST: 'my host' }, /^HOST: must be an IP address or a host name/],
    [{ HOST: '-bad.example' }, /^HOST: must be an IP address or a host name/],
    [{ AGENT_VAULT_PROGRAM_ID: 'not-an-address!' }, /^AGENT_VAULT_PROGRAM_ID/],
    [{ AGENT_VAULT_BOOTSTRAP_KEY: 'short' }, /^AGENT_VAULT_BOOTSTRAP_KEY/],
    [{ AGENT_VAULT_BOOTSTRAP_KEY: 'abcdefghij+klmnopqrstuvwxyz/0123=' }, /^AGENT_VAULT_BOOTSTRAP_KEY: must be at most 256/],
    [{ AGENT_VAULT_OPERATOR_KEY: 'garbage' }, /^AGENT_VAULT_OPERATOR_KEY: not a valid secret key: a secret key has 64 bytes/],
    [{ AGENT_VAULT_ARBITER_KEY: '[1,2,3' }, /^AGENT_VAULT_ARBITER_KEY: not a valid secret key: a key starting with "\[" must be a JSON array/],
    [{ AGENT_VAULT_OPERATOR_KEY: JSON.stringify(Array(64).fill(7)) },
      /^AGENT_VAULT_OPERATOR_KEY: not a valid secret key: its last 32 bytes are not the public key of its first 32/],
  ];
  for (const [env, message] of cases) {
    assert.throws(() => loadConfig(env), (error: unknown) => error instanceof ConfigError && message.test(error.message));
  }
});

test('HOST: a DNS name\'s bounds (253 characters, a trailing dot apart; labels of 63), underscores anywhere', () => {
  const label = (n: number) => 'a'.repeat(n);
  // 4 labels of 63 and their 3 dots make 255: three of 63 and one of 61 make 253.
  const longest = [label(63), label(63), label(63), label(61)].join('.');
  assert.equal(longest.length, 253);
  assert.equal(loadConfig({ HOST: longest }).host, longest);
  assert.equal(loadConfig({ HOST: `${longest}.` }).host, `${longest}.`, 'the trailing dot is not counted');
  assert.equal(loadConfig({ HOST: `_svc.${label(63)}` }).host, `_svc.${label(63)}`);
  for (const host of [`${longest}a`, `${label(64)}.example`, 'a..b', 'bad-.example']) {
    assert.throws(() => loadConfig({ HOST: host }), /^ConfigError: HOST: must be an IP address or a host name/, host);
  }
});

test('error docs links point at this process\'s own reference unless AGENT_VAULT_DOCS_URL says otherwise', () => {
  assert.equal(loadConfig({}).docsUrl, 'http://127.0.0.1:8080/docs');
  assert.equal(loadConfig({ PORT: '3917' }).docsUrl, 'http://127.0.0.1:3917/docs');
  assert.equal(loadConfig({ HOST: '0.0.0.0', PORT: '9000' }).docsUrl, 'http://127.0.0.1:9000/docs');
  assert.equal(loadConfig({ HOST: '::1', PORT: '9000' }).docsUrl, 'http://[::1]:9000/docs');
  assert.equal(loadConfig({ HOST: 'api.internal', PORT: '9000' }).docsUrl, 'http://api.internal:9000/docs');
  assert.equal(loadConfig({ HOST: 'agent_vault', PORT: '9000' }).host, 'agent_vault', 'a compose service name');
  assert.equal(loadConfig({ HOST: 'localhost.' }).host, 'localhost.');
  assert.equal(loadConfig({ HOST: '::', PORT: '9000' }).docsUrl, 'http://127.0.0.1:9000/docs', 'every IPv6 address: loopback');
  assert.equal(loadConfig({ AGENT_VAULT_DOCS_URL: 'https://docs.example.com/' }).docsUrl, 'https://docs.example.com');
});
