/**
 * The HTTP foundation through the real stack: request ids, the error shape, auth, docs.
 */
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Writable } from 'node:stream';
import { gunzipSync } from 'node:zlib';
import { after, before, describe, test } from 'node:test';
import { generateKeyPairSigner, lamports } from '@solana/kit';
import pino from 'pino';
import { beforeDeadline } from '../../test/deadline.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { holdLocks, queuedRequest, withSecondConnection } from '../../test/locks.ts';
import { OffsetClock } from '../clock/clock.ts';
import { startRpcServer } from '../validator/http.ts';
import { SNAPSHOT_FILES } from '../validator/state-file.ts';
import { DEFAULT_PROGRAM_SO_PATH, LocalValidator } from '../validator/validator.ts';

describe('HTTP foundation', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('healthz answers ok once the database and chain answer, without auth', async () => {
    const response = await t.request('GET', '/healthz', { key: null });
    assert.equal(response.status, 200);
    assert.deepEqual(response.body, { status: 'ok' });
    assert.match(String(response.headers['request-id']), /^req_/);
  });

  test('every error has the documented shape and its request id equals the Request-Id header', async () => {
    const response = await t.request('GET', '/v1/organization', { key: null });
    assert.equal(response.status, 401);
    assert.equal(response.body.error.code, 'authentication_failed');
    assert.equal(response.body.error.docs, 'https://docs.agent-vault.test/errors#authentication_failed');
    assert.equal(response.body.error.request_id, response.headers['request-id']);
    assert.equal(typeof response.body.error.message, 'string');
  });

  test('unknown routes answer 404 not_found in the same shape', async () => {
    const response = await t.request('GET', '/v1/nothing-here');
    assert.equal(response.status, 404);
    assert.equal(response.body.error.code, 'not_found');
  });

  test('a path whose id is empty (a trailing or doubled slash) is no route, not a missing resource', async () => {
    for (const [method, path, param] of [['GET', '/v1/wallets/', 'wallet_id'], ['POST', '/v1/wallets//fund', 'wallet_id'],
      ['GET', '/v1/policies/', 'policy_id'], ['DELETE', '/v1/webhooks/', 'webhook_id']] as const) {
      const response = await t.request(method, path, method === 'POST' ? { body: { amount: '1' } } : {});
      assert.equal(response.status, 404, `${method} ${path}: ${JSON.stringify(response.body)}`);
      assert.equal(response.body.error.code, 'not_found', path);
      assert.equal(response.body.error.param, param, path);
      assert.match(response.body.error.message, new RegExp(`^No route ${method} ${path}: its ${param} is empty`), path);
    }
  });

  test('a URL the router refuses (bad percent-encoding, an overlong id) is 400 in the same shape', async () => {
    for (const path of ['/v1/payments/%zz', `/v1/payments/tx_${'x'.repeat(120)}`]) {
      const response = await t.request('GET', path);
      assert.equal(response.status, 400, `${path}: ${JSON.stringify(response.body)}`);
      assert.equal(response.body.error.code, 'invalid_request');
      assert.equal(response.body.error.param, 'path');
      assert.equal(response.body.error.request_id, response.headers['request-id']);
    }
  });

  test('a NUL character anywhere in a request is 400 naming where, before anything is read or written', async () => {
    const cases: Array<[string, string, Record<string, unknown> | undefined, string]> = [
      ['GET', '/v1/wallets/wal%00', undefined, 'wallet_id'],
      ['GET', '/v1/transactions?recipient=a%00', undefined, 'recipient'],
      ['POST', '/v1/recipients', { domain: 'nul.example', address: 'x', label: 'a\u0000' }, 'label'],
      ['POST', '/v1/wallets/fund-batch', { allocations: [{ walletId: 'wal\u0000', amount: '1' }] }, 'allocations.0.wallet_id'],
    ];
    for (const [method, path, body, param] of cases) {
      const response = await t.request(method, path, body ? { body } : {});
      assert.equal(response.status, 400, `${path}: ${JSON.stringify(response.body)}`);
      assert.equal(response.body.error.code, 'invalid_request');
      assert.equal(response.body.error.param, param, path);
    }
    // Deep in arrays nested 1,000 deep: the path named is cut in its middle, not 2 KB long twice.
    let deep: unknown = 'a\u0000';
    for (let i = 0; i < 1_000; i += 1) deep = [deep];
    const nested = await t.request('POST', '/v1/recipients', { body: { domain: 'deep.example', address: 'x', label: deep } });
    assert.equal(nested.status, 400, JSON.stringify(nested.body).slice(0, 500));
    assert.match(nested.body.error.param, /^label\.0\.0\.0.*….*\.0\.0$/);
    assert.ok(nested.body.error.param.length <= 120 && JSON.stringify(nested.body).length < 1_000, JSON.stringify(nested.body).length.toString());
  });

  test('an unpaired UTF-16 surrogate (which jsonb refuses) is 400 naming where; a pair (an emoji) is stored', async () => {
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ domain: 'lone-high.example', address: 'x', label: 'a \ud800 b' }, 'label'],
      [{ domain: 'lone-low.example', address: 'x', label: '\udc00' }, 'label'],
      [{ domain: 'lone-key.example', address: 'x', label: 'ok', ['\ud83d']: 1 }, 'body'],
    ];
    for (const [body, param] of cases) {
      const response = await t.request('POST', '/v1/recipients', { body });
      assert.equal(response.status, 400, JSON.stringify(response.body));
      assert.equal(response.body.error.code, 'invalid_request');
      assert.equal(response.body.error.param, param);
      assert.match(response.body.error.message, /unpaired UTF-16 surrogate/);
    }
    // A policy's audit trail is JSON: a lone surrogate in its name would have failed there (500).
    const policy = await t.request('POST', '/v1/policies', { body: { name: `lone-\ud800-${process.pid}`, maxPerTx: '1' } });
    assert.equal(policy.status, 400, JSON.stringify(policy.body));
    assert.equal(policy.body.error.param, 'name');
    const emoji = await t.request('POST', '/v1/policies', { body: { name: `pair-\ud83d\ude00-${process.pid}`, maxPerTx: '1' } });
    assert.equal(emoji.status, 200, JSON.stringify(emoji.body));
    assert.equal(emoji.body.name, `pair-\u{1f600}-${process.pid}`);
  });

  test('a body nested thousands deep is 400, not a walk of it that runs out of stack', async () => {
    for (const [open, close] of [['[', ']'], ['[{"":', '}]']] as const) {
      const deep = `{"domain":"deep.example","address":"x","label":${open.repeat(5_000)}1${close.repeat(5_000)}}`;
      const response = await t.request('POST', '/v1/recipients', { body: deep, headers: { 'content-type': 'application/json' } });
      assert.equal(response.status, 400, JSON.stringify(response.body));
      assert.equal(response.body.error.code, 'invalid_request');
    }
  });

  test('a policy expiry past the year 9999 once its offset is applied is 400, not a date the database refuses', async () => {
    const response = await t.request('POST', '/v1/policies', { body: { name: `far-${process.pid}`, maxPerTx: '1', expiry: '9999-12-31T23:59:59-01:00' } });
    assert.equal(response.status, 400, JSON.stringify(response.body));
    assert.equal(response.body.error.param, 'expiry');
  });

  // The guarantee: a probe is answered in seconds even when the chain's node takes the request
  // and never answers, as a hung node or a black-holed network does.
  test('/healthz is 503 naming the chain when the chain does not answer, without waiting for it', async () => {
    const { chain } = t.service.ctx;
    const getHealth = chain.getHealth;
    chain.getHealth = () => new Promise(() => {}); // a node that never answers
    try {
      const response = await beforeDeadline(t.request('GET', '/healthz', { key: null }), 10_000);
      assert.ok(response, 'answered');
      assert.equal(response.status, 503);
      assert.deepEqual(response.body, { status: 'unavailable', unavailable: ['chain'] });
    } finally {
      chain.getHealth = getHealth;
    }
    assert.equal((await t.request('GET', '/healthz', { key: null })).status, 200);
  });

  test('/healthz is 503 while the embedded validator cannot write its state, and 200 again once it can', async () => {
    const halting = await startTestService();
    const healthy = async (want: number) => {
      const deadline = Date.now() + 10_000;
      while ((await halting.request('GET', '/healthz', { key: null })).status !== want) {
        assert.ok(Date.now() < deadline, `/healthz never answered ${want}`);
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    };
    const files = SNAPSHOT_FILES.map((file) => join(halting.config.dataDir, 'validator', file));
    try {
      await healthy(200);
      // Each snapshot file turned into a directory: its writes fail, as on a failing disk.
      for (const file of files) {
        rmSync(file, { force: true });
        mkdirSync(file);
      }
      await halting.service.ctx.chain.rpc.requestAirdrop((await generateKeyPairSigner()).address, lamports(1_000n)).send();
      await healthy(503);
      assert.deepEqual((await halting.request('GET', '/healthz', { key: null })).body, { status: 'unavailable', unavailable: ['chain'] },
        'says which');
      for (const file of files) rmSync(file, { recursive: true });
      await healthy(200);
    } finally {
      for (const file of files) if (statSync(file, { throwIfNoEntry: false })?.isDirectory()) rmSync(file, { recursive: true });
      await halting.close();
    }
  });

  test('a request reaching a closing server is 503 service_unavailable in the same shape', async () => {
    const closing = await startTestService();
    const closed = closing.close();
    const response = await closing.request('GET', '/v1/organization');
    await closed;
    assert.equal(response.status, 503, JSON.stringify(response.body));
    assert.equal(response.body.error.code, 'service_unavailable');
    assert.equal(response.body.error.request_id, response.headers['request-id']);
    assert.equal(response.headers['retry-after'], '1', 'retry at once: a new connection reaches the next process');
    assert.equal(response.headers.connection, 'close');
  });

  test('a database connection lost under a request is 503 service_unavailable, and the next request is served', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const created = await t.request('POST', '/v1/wallets', { body: { agentId: `lost-${process.pid}`, label: 'Before', policyId: 'pol_moderate' } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      const walletId = created.body.wallet_id as string;
      // The rename waits for the vault's lock; its backend is then terminated, as a failover would.
      const held = await holdLocks(other, (tx) => tx.query('SELECT 1 FROM wallets WHERE id = $1 FOR UPDATE', [walletId]));
      const renamed = await queuedRequest(t.service.ctx.db, held, () => t.request('PATCH', `/v1/wallets/${walletId}`, { body: { label: 'After' } }),
        () => other.query('SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))', [held.pid]));
      assert.equal(renamed.status, 503, JSON.stringify(renamed.body));
      assert.equal(renamed.body.error.code, 'service_unavailable');
      const read = await t.request('GET', `/v1/wallets/${walletId}`);
      assert.equal(read.status, 200);
      assert.equal(read.body.label, 'Before', 'nothing of the failed request was written');
    });
  });

  test('a wrong or revoked key is 401; a syntactically odd one never reaches the database', async () => {
    const admin = await t.createKey('admin');
    const created = await t.request('POST', '/v1/api-keys', { key: admin, body: { name: 'to revoke', role: 'viewer' } });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    assert.equal((await t.request('DELETE', `/v1/api-keys/${created.body.api_key_id}`, { key: admin })).status, 200);
    const { db } = t.service.ctx;
    const query = db.query;
    let queries = 0;
    db.query = ((...args: Parameters<typeof query>) => { queries += 1; return query.apply(db, args); }) as typeof query;
    try {
      for (const [key, readsKeys] of [[created.body.key, true], ['av_admin_wrongwrongwrongwrongwrongwrong00', true], ['short', false], ['x'.repeat(300), false]] as const) {
        queries = 0;
        const response = await t.request('GET', '/v1/organization', { key });
        assert.equal(response.status, 401, key);
        assert.equal(response.body.error.code, 'authentication_failed');
        assert.equal(queries > 0, readsKeys, `${key.slice(0, 20)}: ${queries} statements`);
      }
    } finally {
      db.query = query;
    }
  });

  test('GET /v1/organization shows the reserve address and its balance', async () => {
    const response = await t.request('GET', '/v1/organization');
    assert.equal(response.status, 200);
    assert.equal(response.body.org_id, t.orgId);
    assert.equal(response.body.reserve.usdc_balance, '0.00');
    assert.match(response.body.reserve.chain_address, /^[1-9A-HJ-NP-Za-km-z]{32,44}$/);
  });

  test('the OpenAPI document, the reference and the error page are served', async () => {
    const openapi = await t.request('GET', '/openapi.json', { key: null });
    assert.equal(openapi.status, 200);
    assert.equal(openapi.body.openapi, '3.1.0');
    assert.ok(openapi.body.paths['/v1/organization']);
    // Every operation documents its errors; the headers a route reads beyond Authorization are parameters.
    const pay = openapi.body.paths['/v1/payments'].post;
    for (const range of ['4XX', '5XX']) {
      const schema = pay.responses[range]?.content?.['application/json']?.schema;
      assert.ok(schema, `POST /v1/payments documents ${range}`);
      assert.ok(JSON.stringify(schema).includes('wallet_insufficient_balance'), 'with the closed list of codes');
    }
    const headerNames = (operation: { parameters?: Array<{ in: string; name: string }> }) =>
      (operation.parameters ?? []).filter((p) => p.in === 'header').map((p) => p.name.toLowerCase()).sort();
    assert.deepEqual(headerNames(pay), ['idempotency-key', 'session-token']);
    assert.ok(pay.parameters.filter((p: { in: string }) => p.in === 'header').every((p: { required?: boolean }) => !p.required),
      'optional: an admin key pays without a session token, and any request without an idempotency key');
    assert.ok(openapi.body.paths['/v1/transactions/exports/{export_id}/download'].get.responses['200'], 'a route without a response schema keeps its 200');
    assert.deepEqual(headerNames(openapi.body.paths['/v1/organization'].get), []);
    // A POST whose fields are all optional is answered without a body, and documented so.
    for (const path of ['/v1/payments/{tx_id}/approve', '/v1/payments/{tx_id}/reject', '/v1/wallets/{wallet_id}/rotate-token',
      '/v1/webhooks/{webhook_id}/test', '/v1/webhooks/{webhook_id}/rotate-secret', '/v1/payments/a2a/{escrow_id}/decline']) {
      assert.equal(openapi.body.paths[path].post.requestBody.required, false, `${path}: its body is optional`);
    }
    assert.equal(pay.requestBody.required, true, 'a payment needs its fields');
    assert.equal(openapi.body.paths['/v1/policies/{policy_id}'].patch.requestBody.required, true, 'a PATCH needs one field');
    assert.ok(openapi.body.paths['/v1/organization'].get.responses['4XX'], 'every operation');
    // What a client generator names and types things by: a unique operationId on every operation,
    // a success described by its summary, errors in JSON alone (an export's file is CSV or JSON
    // Lines, its errors are not), `limit` with the values it takes.
    const operations = Object.entries(openapi.body.paths as Record<string, Record<string, {
      operationId?: string; summary?: string; responses: Record<string, { description: string; content?: Record<string, unknown> }>;
      parameters?: Array<{ in: string; name: string; schema: { pattern?: string } }>;
    }>>).flatMap(([path, item]) => Object.entries(item).map(([method, operation]) => ({ at: `${method} ${path}`, ...operation })));
    assert.ok(operations.length >= 60, String(operations.length));
    assert.deepEqual(operations.filter((o) => !o.operationId).map((o) => o.at), [], 'every operation has an operationId');
    const ids = operations.map((o) => o.operationId);
    assert.equal(new Set(ids).size, ids.length, 'each its own');
    assert.equal(pay.operationId, 'createPayment');
    assert.deepEqual(operations.filter((o) => o.responses['200']?.description === 'Default Response').map((o) => o.at), []);
    assert.equal(openapi.body.paths['/v1/wallets/{wallet_id}'].get.responses['200'].description, 'A wallet, with its balance and policy');
    const download = openapi.body.paths['/v1/transactions/exports/{export_id}/download'].get.responses;
    assert.deepEqual(Object.keys(download['4XX'].content), ['application/json']);
    assert.equal(Object.keys(download['200'].content).length, 3, 'the file in its three formats');
    const limit = openapi.body.paths['/v1/wallets'].get.parameters.find((p: { name: string }) => p.name === 'limit');
    assert.ok(limit.schema.pattern, 'limit says what it takes');
    const tooMany = await t.request('GET', '/v1/wallets?limit=101');
    assert.deepEqual([tooMany.status, tooMany.body.error.param, tooMany.body.error.message],
      [400, 'limit', 'Invalid value for "limit": must be an integer from 1 to 100.']);
    // Made once and kept: the same bytes each time, gzipped for a client that takes it, and a
    // client holding them is told so by their ETag (one per coding).
    const etag = String(openapi.headers.etag);
    assert.match(etag, /^"[\w-]{27}"$/);
    const get = (url: string, headers: Record<string, string>) => t.service.app.inject({ method: 'GET', url, headers });
    const zipped = await get('/openapi.json', { 'accept-encoding': 'br, gzip' });
    assert.equal(zipped.headers['content-encoding'], 'gzip');
    assert.equal(zipped.headers.etag, etag.replace(/"$/, '-gz"'));
    assert.deepEqual(JSON.parse(gunzipSync(zipped.rawPayload).toString('utf8')), openapi.body);
    assert.ok(zipped.rawPayload.length * 4 < Buffer.byteLength(JSON.stringify(openapi.body)), 'a quarter of the size or less');
    assert.equal((await get('/openapi.json', { 'accept-encoding': 'gzip;q=0, identity' })).headers['content-encoding'], undefined, 'q=0 refuses gzip');
    for (const held of [etag, `W/${etag}`, `"other", ${etag}`, '*']) {
      const unchanged = await get('/openapi.json', { 'if-none-match': held });
      assert.deepEqual([unchanged.statusCode, unchanged.body], [304, ''], held);
    }
    assert.equal((await get('/openapi.json', { 'if-none-match': '"other"' })).statusCode, 200);
    // The reference's own copies (JSON and YAML) are kept too, from their first request on.
    for (const url of ['/docs/json', '/docs/yaml']) {
      const [first, second] = [await get(url, {}), await get(url, {})];
      assert.deepEqual([first.statusCode, second.statusCode], [200, 200], url);
      assert.equal(second.body, first.body, url);
      assert.match(String(second.headers.etag), /^"[\w-]{27}"$/, `${url} is answered from the copy`);
    }
    assert.deepEqual(JSON.parse((await get('/docs/json', {})).body), openapi.body);
    const docs = await t.request('GET', '/docs/', { key: null });
    assert.equal(docs.status, 200);
    const errors = await t.request('GET', '/docs/errors', { key: null });
    assert.equal(errors.status, 200);
    for (const code of ['invalid_request', 'policy_violation', 'rate_limited', 'internal_error']) {
      assert.ok(String(errors.body).includes(`id="${code}"`), code);
    }
    // The descriptions are written with Markdown's `code`: a reader sees code, not backticks.
    const page = String(errors.body);
    assert.ok(page.includes('(named in <code>param</code>).'), 'invalid_request names its field as code');
    assert.ok(page.includes('<code>POST /v1/wallets/{wallet_id}/rotate-token</code>'), 'session_token_expired');
    assert.ok(page.includes('<code>Retry-After</code>'), 'rate_limited');
    assert.ok(!page.includes('`'), 'no backtick is left');
    assert.ok(!page.includes('&lt;code'), 'the markup is not escaped as text');
  });
});

describe('test helpers', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('a test deposit mints USDC to the reserve on chain and indexes it once', async () => {
    const response = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '250.5' } });
    assert.equal(response.status, 200);
    assert.equal(response.body.amount, '250.50');
    assert.equal(response.body.status, 'confirmed');
    assert.equal(response.body.org_balance, '250.50');
    const org = await t.request('GET', '/v1/organization');
    assert.equal(org.body.reserve.usdc_balance, '250.50');
    const onChain = await t.service.ctx.chain.getTokenBalance(org.body.reserve.token_account);
    assert.equal(onChain, 250_500_000n, 'the index equals the chain');
    const [first, second] = await Promise.all([1, 2].map(() =>
      t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '1' } })));
    assert.notEqual(first!.body.tx_signature, second!.body.tx_signature, 'two identical deposits are two transactions');
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, '252.50');
    for (const amount of ['-1', 250, '']) {
      const bad = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount } });
      assert.equal(bad.status, 400, JSON.stringify(amount));
      assert.equal(bad.body.error.code, 'invalid_amount', `${JSON.stringify(amount)}: as any money move's amount`);
    }
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, '252.50');
  });

  // That the chain's clock follows it is src/validator/thread.test.ts's (a transaction's block time).
  test('the test clock moves business time forward; an advance of nothing is refused', async () => {
    const before = await t.request('GET', '/v1/test_helpers/clock');
    const advanced = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 7200 } });
    assert.equal(advanced.status, 200);
    assert.ok(Date.parse(advanced.body.now) - Date.parse(before.body.now) >= 7_200_000);
    assert.equal(advanced.body.offset_seconds, before.body.offset_seconds + 7200);
    const bad = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 0 } });
    assert.equal(bad.body.error.code, 'invalid_request');
    assert.equal(bad.body.error.param, 'seconds');
  });

  test('a viewer key may read the clock but not move it', async () => {
    const viewer = await t.createKey('viewer');
    assert.equal((await t.request('GET', '/v1/test_helpers/clock', { key: viewer })).status, 200);
    const moved = await t.request('POST', '/v1/test_helpers/clock/advance', { key: viewer, body: { seconds: 1 } });
    assert.equal(moved.status, 403);
    assert.equal(moved.body.error.code, 'insufficient_permissions');
  });

  test('only the default organisation moves the clock, which is every organisation\'s', async () => {
    const other = await t.createOrganization('Tenant');
    const before = (await t.request('GET', '/v1/test_helpers/clock', { key: other.adminKey })).body.offset_seconds;
    const moved = await t.request('POST', '/v1/test_helpers/clock/advance', { key: other.adminKey, body: { seconds: 3600 } });
    assert.equal(moved.status, 403, JSON.stringify(moved.body));
    assert.equal(moved.body.error.code, 'insufficient_permissions');
    assert.match(moved.body.error.message, /default organisation/);
    assert.equal((await t.request('GET', '/v1/test_helpers/clock')).body.offset_seconds, before, 'the clock did not move');
    // Refused whatever the body: a key that may not move it learns nothing of its request's validity.
    for (const body of [{}, { seconds: 0 }, { seconds: 'soon' }]) {
      const malformed = await t.request('POST', '/v1/test_helpers/clock/advance', { key: other.adminKey, body });
      assert.deepEqual([malformed.status, malformed.body.error?.code], [403, 'insufficient_permissions'], JSON.stringify(body));
    }
    const deposit = await t.request('POST', '/v1/test_helpers/deposits', { key: other.adminKey, body: { amount: '1' } });
    assert.equal(deposit.status, 200, 'deposits into its own reserve stay open to every organisation');
  });

  // Last in this suite: it leaves the clock a century ahead.
  test('the clock moves a year at most at a time, and a century ahead in all: never to where the database has no time', async () => {
    const YEAR_S = 366 * 24 * 3600;
    const tooFar = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: YEAR_S + 1 } });
    assert.deepEqual([tooFar.status, tooFar.body.error.code, tooFar.body.error.param], [400, 'invalid_request', 'seconds']);
    let last = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: YEAR_S } });
    for (let n = 0; last.status === 200 && n < 200; n += 1) {
      last = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: YEAR_S } });
    }
    assert.deepEqual([last.status, last.body.error?.code, last.body.error?.param], [400, 'invalid_request', 'seconds'], JSON.stringify(last.body));
    assert.match(last.body.error.message, /^The service clock runs at most 100 years ahead of the wall clock, and is \d+ s ahead already/);
    const clock = (await t.request('GET', '/v1/test_helpers/clock')).body;
    assert.ok(clock.offset_seconds <= 100 * YEAR_S && clock.offset_seconds > 99 * YEAR_S, JSON.stringify(clock));
    // The service still works there: a deposit is written and indexed with the clock's time.
    const deposit = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '1' } });
    assert.equal(deposit.status, 200, JSON.stringify(deposit.body));
    assert.equal(Date.parse(deposit.body.created_at) >= Date.parse(clock.now), true);
  });
});

describe('test helpers where the chain is not the embedded validator', () => {
  /** A service whose chain is a standalone validator (as `agent-vault validator`), in this process. */
  async function withStandaloneValidator(work: (t: TestService, validator: LocalValidator) => Promise<void>): Promise<void> {
    const dir = mkdtempSync(join(tmpdir(), 'av-standalone-'));
    const validator = await LocalValidator.open({ dataDir: dir, slotMs: 0, clock: new OffsetClock(), programSoPath: DEFAULT_PROGRAM_SO_PATH });
    const rpc = await startRpcServer(validator, { port: 0 });
    try {
      const t = await startTestService({ env: { AGENT_VAULT_RPC_URL: rpc.url } });
      try {
        await work(t, validator);
      } finally {
        await t.close();
      }
    } finally {
      await rpc.close();
      await validator.close();
      rmSync(dir, { recursive: true, force: true });
    }
  }

  test('are on by default against `agent-vault validator` at AGENT_VAULT_RPC_URL', () => withStandaloneValidator(async (t) => {
    const deposit = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '2.5' } });
    assert.equal(deposit.status, 200, JSON.stringify(deposit.body));
    const org = await t.request('GET', '/v1/organization');
    assert.equal(org.body.reserve.usdc_balance, '2.50');
  }));

  test('a standalone validator\'s clock behind the service\'s (set back by a restart) is brought up to it each second',
    () => withStandaloneValidator(async (t, validator) => {
      // The service's clock 3 minutes on; the validator not told, as after a restart that lost its downtime.
      await (t.service.ctx.clock as unknown as { advanceBy(seconds: number): Promise<number> }).advanceBy(180);
      assert.ok(validator.clockUnixTimestamp * 1000 < t.service.ctx.clock.nowMs() - 100_000, 'behind');
      await t.service.jobs.runOnce();
      assert.ok(validator.clockUnixTimestamp * 1000 >= t.service.ctx.clock.nowMs() - 5_000, 'caught up with the service');
    }));

  test('are off when set off: 404 like any unknown route', async () => {
    const t = await startTestService({ env: { AGENT_VAULT_TEST_HELPERS: 'off' } });
    try {
      const response = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '1' } });
      assert.equal(response.status, 404);
      assert.equal(response.body.error.code, 'not_found');
      const anonymous = await t.request('POST', '/v1/test_helpers/clock/advance', { key: null, body: { bad: true } });
      assert.equal(anonymous.status, 404, 'not 401 or 400: the route does not exist');
    } finally {
      await t.close();
    }
  });
});

describe('request conventions', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ env: { AGENT_VAULT_RATE_LIMIT_PER_MINUTE: '5' } }); });
  after(async () => { await t.close(); });

  test('each API key has its own rate limit; over it: 429 rate_limited with Retry-After', async () => {
    const viewer = await t.createKey('viewer');
    const statuses = [];
    for (let i = 0; i < 6; i += 1) statuses.push((await t.request('GET', '/v1/organization', { key: viewer })).status);
    assert.deepEqual(statuses, [200, 200, 200, 200, 200, 429]);
    const limited = await t.request('GET', '/v1/organization', { key: viewer });
    assert.equal(limited.body.error.code, 'rate_limited');
    assert.ok(Number(limited.headers['retry-after']) > 0, 'Retry-After names the seconds to wait');
    assert.equal(limited.body.error.request_id, limited.headers['request-id']);
    const other = await t.createKey('viewer');
    assert.equal((await t.request('GET', '/v1/organization', { key: other })).status, 200, 'another key is not limited');
    assert.equal((await t.request('GET', '/healthz', { key: null })).status, 200, 'health checks are never limited');
  });

  test('malformed JSON, a wrong content type and an oversized body are 400 invalid_request', async () => {
    const key = await t.createKey('admin');
    const malformed = await t.request('POST', '/v1/wallets', { key, body: '{"agentId": ', headers: { 'content-type': 'application/json' } });
    assert.equal(malformed.status, 400);
    assert.equal(malformed.body.error.code, 'invalid_request');
    assert.equal(malformed.body.error.param, 'body');
    const text = await t.request('POST', '/v1/wallets', { key, body: 'agentId=x', headers: { 'content-type': 'text/plain' } });
    assert.equal(text.status, 400);
    assert.equal(text.body.error.code, 'invalid_request');
    const big = await t.request('POST', '/v1/wallets', {
      key: await t.createKey('admin'), body: { agentId: 'a', label: 'x'.repeat(70_000), policyId: 'pol_moderate' },
    });
    assert.equal(big.status, 400);
    assert.match(big.body.error.message, /larger than/);
  });

  test('a body of another content type, even one that parses, is asked for as application/json', async () => {
    const key = await t.createKey('admin');
    for (const contentType of ['text/plain', 'text/plain; charset=utf-8']) {
      const text = await t.request('POST', '/v1/wallets', { key, body: '{}', headers: { 'content-type': contentType } });
      assert.equal(text.status, 400);
      assert.equal(text.body.error.code, 'invalid_request');
      assert.equal(text.body.error.message, 'Send the body as application/json.');
    }
  });

  test('a value a pattern refuses is told what the field takes, in words, never as the regular expression', async () => {
    const key = await t.createKey('admin');
    const cases: Array<[string, Record<string, unknown>, string, string]> = [
      ['/v1/api-keys', { name: ' \t ', role: 'read' }, 'name', 'must not be blank nor hold control characters'],
      ['/v1/wallets', { agentId: '-agent', label: 'x', policyId: 'pol_moderate' }, 'agent_id',
        'must be 1–128 characters of letters, digits, ".", "_", ":", "@" or "-", starting with a letter or digit'],
      ['/v1/policies', { name: '   ' }, 'name', 'must not be blank'],
      ['/v1/recipients', { domain: 'shop.example', address: '11111111111111111111111111111112', category: 'a b' }, 'category',
        'must be 1–64 characters of letters, digits, "_", "." or "-"'],
    ];
    for (const [path, body, param, text] of cases) {
      const refused = await t.request('POST', path, { key, body });
      assert.deepEqual([refused.status, refused.body.error?.param], [400, param], JSON.stringify(refused.body));
      assert.ok(refused.body.error.message.endsWith(`: ${text}.`), refused.body.error.message);
    }
  });

  test('a value outside a fixed list names the values taken; an amount sent as a JSON number says to send a string', async () => {
    const key = await t.createKey('admin');
    const status = await t.request('GET', '/v1/transactions?status=bogus', { key });
    assert.equal(status.status, 400);
    assert.equal(status.body.error.param, 'status');
    assert.match(status.body.error.message, /^Invalid value for "status": must be one of "confirmed", "pending", "blocked", "failed"\.$/);
    const format = await t.request('POST', '/v1/transactions/export', { key, body: { format: 'xml' } });
    assert.equal(format.status, 400);
    assert.match(format.body.error.message, /must be one of "csv", "json", "jsonl"/);

    const amount = await t.request('POST', '/v1/payments', { key, body: { walletId: 'wal_x', to: 'x', amount: 0.25, currency: 'USDC' } });
    assert.equal(amount.status, 400);
    assert.equal(amount.body.error.code, 'invalid_amount');
    assert.equal(amount.body.error.message, 'Invalid value for "amount": must be a string, such as "0.25" (amounts are decimal strings).');
    const limit = await t.request('POST', '/v1/policies', { key, body: { name: 'numbers', maxPerTx: 5 } });
    assert.equal(limit.status, 400);
    assert.equal(limit.body.error.code, 'invalid_request');
    assert.match(limit.body.error.message, /must be a string, such as "5" \(amounts are decimal strings\)/);
    // This suite's limit is 5 requests a minute per key.
    const another = await t.createKey('admin');
    const tiny = await t.request('POST', '/v1/payments', { key: another, body: { walletId: 'wal_x', to: 'x', amount: 1e-7, currency: 'USDC' } });
    assert.match(tiny.body.error.message, /such as "0\.25"/, 'a number no amount field takes is not offered back');
    const label = await t.request('POST', '/v1/wallets', { key: another, body: { agentId: 'a', label: 5, policyId: 'pol_moderate' } });
    assert.equal(label.body.error.message, 'Invalid value for "label": must be string.', 'not an amount: no amount advice');
  });

  test('a refusal says what to send instead: an empty change, a malformed tag, "ALL", no event or the test event', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    for (const path of ['/v1/wallets/wal_x', '/v1/policies/pol_x']) {
      const empty = await t.request('PATCH', path, { key, body: {} });
      assert.deepEqual([empty.status, empty.body.error.param, empty.body.error.message],
        [400, 'body', 'The body has no field: send at least one field to change.'], path);
    }
    const tag = await t.request('GET', '/v1/wallets?tags=team-a,-x', { key });
    assert.equal(tag.body.error.param, 'tags');
    assert.match(tag.body.error.message, /^"-x" is not a tag: .*starting with a letter or digit\.$/);
    const all = await t.request('POST', '/v1/wallets/wal_x/withdraw', { key, body: { amount: 'ALL' } });
    assert.equal(all.body.error.code, 'invalid_amount');
    assert.match(all.body.error.message, /or "all" \(lowercase\) for the whole balance/);

    const another = await t.createKey('admin');
    const none = await t.request('POST', '/v1/webhooks', { key: another, body: { url: 'https://hooks.example.com/a', events: [] } });
    assert.deepEqual([none.status, none.body.error.param, none.body.error.message],
      [400, 'events', 'events is "*" or a non-empty array of event names.']);
    const ping = await t.request('POST', '/v1/webhooks', { key: another, body: { url: 'https://hooks.example.com/a', events: ['ping'] } });
    assert.equal(ping.body.error.param, 'events');
    assert.match(ping.body.error.message, /^"ping" is the test event: POST \/v1\/webhooks\/\{id\}\/test sends it/);
  });

  test('a field inside a list is named by its path; a union says what it takes; a currency number gets no amount advice', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    const batch = (allocation: Record<string, unknown>) => t.request('POST', '/v1/wallets/fund-batch', {
      key, body: { allocations: [{ walletId: 'wal_a', amount: '1' }, allocation] },
    });
    const missing = await batch({ amount: '2' });
    assert.deepEqual([missing.status, missing.body.error.param, missing.body.error.message],
      [400, 'allocations.1.wallet_id', 'Missing required field "allocations.1.walletId".']);
    const unknown = await batch({ walletId: 'wal_b', amount: '2', currency: 'USDC' });
    assert.deepEqual([unknown.status, unknown.body.error.param], [400, 'allocations.1.currency'], 'not a top-level currency');
    const currency = await t.request('POST', '/v1/payments', { key, body: { walletId: 'wal_x', to: 'x', amount: '1', currency: 5 } });
    assert.deepEqual([currency.body.error.code, currency.body.error.message],
      ['invalid_currency', 'Invalid value for "currency": must be string.']);
    const events = await t.request('POST', '/v1/webhooks', { key, body: { url: 'https://hooks.example.com/a', events: 'all' } });
    assert.deepEqual([events.body.error.param, events.body.error.message], ['events',
      'Invalid value for "events": must be "*" (or ["*"]) for every event, or an array of event names (docs/events.md).']);
  });

  test('a field given in both spellings is refused by its snake_case name; a key named like an Object method is just unknown', async () => {
    const key = await t.createKey('admin');
    const twice = await t.request('POST', '/v1/payments', {
      key, body: { walletId: 'wal_x', wallet_id: 'wal_x', to: 'x', amount: '1', currency: 'USDC' },
    });
    assert.deepEqual([twice.status, twice.body.error.param, twice.body.error.message],
      [400, 'wallet_id', '"wallet_id" is given twice (camelCase and snake_case).']);
    const method = await t.request('POST', '/v1/payments', {
      key, body: { to_string: 1, walletId: 'wal_x', to: 'x', amount: '1', currency: 'USDC' },
    });
    assert.deepEqual([method.status, method.body.error.param, method.body.error.message], [400, 'to_string', 'Unknown field "toString".']);
  });

  test('a body with a key twice, or a __proto__ key, is refused by name; bad JSON is said to be bad JSON', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    const send = async (body: string) => {
      const response = await t.request('POST', '/v1/payments', { key, body });
      return [response.status, response.body.error?.code, response.body.error?.param, response.body.error?.message];
    };
    assert.deepEqual(await send('{"walletId":"wal_x","to":"x","amount":"1","amount":"1000","currency":"USDC"}'),
      [400, 'invalid_request', 'amount', '"amount" is given twice.']);
    assert.deepEqual(await send('{"a":[{"walletId":"w"},{"walletId":"w","\\u0077alletId":"v"}]}'),
      [400, 'invalid_request', 'a.1.wallet_id', '"a.1.wallet_id" is given twice.']);
    assert.deepEqual(await send('{"walletId":"wal_x","__proto__":{"admin":true}}'),
      [400, 'invalid_request', 'body', 'The body has a "__proto__" or "constructor.prototype" key, which is not allowed.']);
    assert.deepEqual(await send('{"walletId":'), [400, 'invalid_request', 'body', 'The body is not valid JSON.']);
  });

  test('a body that is not UTF-8, declared in another charset or compressed is refused, and nothing is made', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    const agentId = `encoding-${process.pid}`;
    const send = async (payload: Buffer, headers: Record<string, string> = {}) => {
      const response = await t.service.app.inject({
        method: 'POST', url: '/v1/wallets', payload,
        headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json', ...headers },
      });
      const { error } = JSON.parse(response.body);
      return [response.statusCode, error?.code, error?.param, error?.message];
    };
    const body = (label: Buffer) => Buffer.concat([Buffer.from(`{"agentId":"${agentId}","policyId":"pol_moderate","label":"`), label, Buffer.from('"}')]);
    assert.deepEqual(await send(body(Buffer.from([0x69, 0x6e, 0x76, 0xff, 0xfe]))),
      [400, 'invalid_request', 'body', 'The body is not valid UTF-8, which JSON must be.'], 'bytes that are not UTF-8');
    assert.deepEqual(await send(body(Buffer.from('caf\xe9', 'latin1')), { 'content-type': 'application/json; charset=latin1' }),
      [400, 'invalid_request', 'body', 'The body is declared as latin1 and is not ASCII: send JSON in UTF-8 (charset=utf-8, or no charset).']);
    assert.deepEqual(await send(body(Buffer.from('plain')), { 'content-encoding': 'gzip' }), [400, 'invalid_request', 'body',
      'The body is sent with Content-Encoding gzip, which this API does not decode: send it uncompressed.'], 'labelled gzip');
    const listed = await t.request('GET', '/v1/wallets?limit=100', { key });
    assert.deepEqual(listed.body.data.filter((w: { agent_id: string }) => w.agent_id === agentId), [], 'no wallet was made');
    assert.deepEqual(await send(body(Buffer.from('caf\u00e9 \u{1f600}')), { 'content-type': 'application/json; charset="UTF-8"', 'content-encoding': 'identity' }),
      [200, undefined, undefined, undefined], 'UTF-8, declared or not, uncompressed, is taken');

    // ASCII reads alike in every charset a client may declare; and the body is judged only after
    // the key and its permission (docs/api-keys.md, the order of checks).
    const ascii = await t.service.app.inject({
      method: 'POST', url: '/v1/wallets', payload: JSON.stringify({ agentId: `${agentId}-ascii`, policyId: 'pol_moderate', label: 'plain' }),
      headers: { authorization: `Bearer ${await t.createKey('admin')}`, 'content-type': 'application/json; charset=ISO-8859-1' },
    });
    assert.equal(ascii.statusCode, 200, ascii.body);
    const gzip = { 'content-type': 'application/json', 'content-encoding': 'gzip' };
    const viewer = await t.service.app.inject({ method: 'POST', url: '/v1/wallets', payload: '{}', headers: { authorization: `Bearer ${await t.createKey('viewer')}`, ...gzip } });
    assert.equal(viewer.statusCode, 403, viewer.body);
    const nobody = await t.service.app.inject({ method: 'POST', url: '/v1/wallets', payload: '{}', headers: gzip });
    assert.equal(nobody.statusCode, 401, nobody.body);
  });

  test('a DELETE takes no field: one sent is refused and nothing is deleted', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    const hook = await t.request('POST', '/v1/webhooks', { key, body: { url: 'https://hooks.example.com/delete-me', events: '*' } });
    assert.equal(hook.status, 200, JSON.stringify(hook.body));
    const path = `/v1/webhooks/${hook.body.webhook_id}`;
    const refused = await t.request('DELETE', path, { key, body: { force: true } });
    assert.deepEqual([refused.status, refused.body.error?.code, refused.body.error?.param], [400, 'invalid_request', 'force']);
    const list = await t.request('DELETE', path, { key, body: [] });
    assert.deepEqual([list.status, list.body.error?.param], [400, 'body']);
    assert.equal((await t.request('GET', path, { key })).status, 200, 'still there');
    assert.equal((await t.request('DELETE', path, { key: await t.createKey('admin') })).status, 200, 'without a body it is deleted');
    // The reference shows no request body for a DELETE (none is required, or taken).
    const openapi = (await t.request('GET', '/openapi.json', { key: null })).body as { paths: Record<string, Record<string, { requestBody?: unknown }>> };
    const deletes = Object.entries(openapi.paths).flatMap(([route, ops]) => (ops.delete ? [[route, ops.delete.requestBody]] : []));
    assert.ok(deletes.length >= 6, JSON.stringify(deletes));
    assert.deepEqual(deletes.filter(([, body]) => body !== undefined), [], 'no DELETE has a requestBody');
  });

  test('a query parameter a route does not take is refused, as lists refuse one, and nothing is done', async () => {
    // This suite's limit is 5 requests a minute per key.
    const key = await t.createKey('admin');
    const hook = await t.request('POST', '/v1/webhooks', { key, body: { url: 'https://hooks.example.com/dry-run', events: '*' } });
    assert.equal(hook.status, 200, JSON.stringify(hook.body));
    const path = `/v1/webhooks/${hook.body.webhook_id}`;
    const dryRun = await t.request('DELETE', `${path}?dry_run=true`, { key });
    assert.deepEqual([dryRun.status, dryRun.body.error?.code, dryRun.body.error?.param, dryRun.body.error?.message],
      [400, 'invalid_request', 'dry_run', 'Unknown field "dry_run": this request takes no query parameter.']);
    assert.equal((await t.request('GET', path, { key })).status, 200, 'not deleted');
    const read = await t.request('GET', `${path}?expand=deliveries`, { key });
    assert.deepEqual([read.status, read.body.error?.param], [400, 'expand'], 'a read as well: the option it asked for is not there');
    const list = await t.request('GET', '/v1/webhooks?dry_run=true', { key: await t.createKey('admin') });
    assert.deepEqual([list.status, list.body.error?.message], [400, 'Unknown field "dry_run".'], 'as a list says');
    assert.equal((await t.request('GET', '/healthz?probe=1', { key: null })).status, 200, 'an unauthenticated probe takes what it is given');
  });

  test('no body with a JSON content type (a client sending the header on every call) is no body, not malformed JSON', async () => {
    const key = await t.createKey('admin');
    const wallet = await t.request('POST', '/v1/wallets', { key, body: { agentId: `empty-body-${process.pid}`, label: 'x', policyId: 'pol_moderate' } });
    assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
    for (const headers of [{ 'content-type': 'application/json' }, { 'content-type': 'application/json', 'content-length': '0' }]) {
      const rotated = await t.service.app.inject({
        method: 'POST', url: `/v1/wallets/${wallet.body.wallet_id}/rotate-token`, headers: { authorization: `Bearer ${key}`, ...headers },
      });
      assert.equal(rotated.statusCode, 200, rotated.body);
      assert.ok(JSON.parse(rotated.body).session_token, 'a token was issued');
    }
    // A body that is sent must still be JSON, and a body a route requires is still required.
    const required = await t.service.app.inject({
      method: 'POST', url: '/v1/wallets', headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
    });
    assert.equal(required.statusCode, 400, required.body);
    assert.equal(JSON.parse(required.body).error.code, 'invalid_request');
  });

  test('both spellings of one field in one body are ambiguous and refused', async () => {
    const response = await t.request('POST', '/v1/wallets', {
      key: await t.createKey('admin'), body: { agentId: 'a1', agent_id: 'a2', label: 'x', policyId: 'pol_moderate' },
    });
    assert.equal(response.status, 400);
    assert.equal(response.body.error.code, 'invalid_request');
  });
});

describe('an outage in the log', () => {
  // The guarantee: requests answered 503 while the database or the chain is down do not flood the
  // log. The first is logged at warn with its error; later ones within a minute only counted, and
  // the next line a minute on says how many.
  test('requests answered 503 for a dependency down are logged once, then once a minute with the count', async () => {
    const lines: Array<{ level: number; msg: string; untold?: number; err?: { message: string } }> = [];
    const sink = new Writable({ write(chunk, _encoding, done) { lines.push(JSON.parse(String(chunk))); done(); } });
    let wallMs = 1_000_000;
    const t = await startTestService({ workers: false, logger: pino({ level: 'warn' }, sink), wallNowMs: () => wallMs });
    try {
      const wallet = await t.request('POST', '/v1/wallets', { body: { agentId: 'outage', label: 'Outage', policyId: 'pol_moderate' } });
      assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
      // The database refusing connections, as a stopped server does.
      const { db } = t.service.ctx;
      const refused = () => Promise.reject(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }));
      const [query, transaction] = [db.query, db.transaction];
      db.query = refused;
      db.transaction = refused;
      const read = async () => (await t.request('GET', `/v1/wallets/${wallet.body.wallet_id}`)).status;
      try {
        const statuses = [];
        for (let second = 0; second < 30; second += 1, wallMs += 1_000) statuses.push(await read(), await read());
        assert.deepEqual(new Set(statuses), new Set([503]));
        assert.deepEqual(lines.map((line) => [line.level, line.msg, line.err?.message]),
          [[40, 'dependency unavailable', 'connect ECONNREFUSED 127.0.0.1:5432']], 'the first of 60, with its error');
        wallMs += 30_000;
        assert.equal(await read(), 503);
        assert.deepEqual(lines.slice(1).map((line) => [line.level, line.msg, line.untold]),
          [[40, 'dependency unavailable; 59 more answered 503 since the last such line', 59]], 'a minute on, with the count');
      } finally {
        db.query = query;
        db.transaction = transaction;
      }
      assert.equal(await read(), 200, 'served again');
    } finally {
      await t.close();
    }
  });
});
