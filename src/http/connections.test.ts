/**
 * What the HTTP listener allows a client, through a real socket: the whole request within the
 * request timeout (AGENT_VAULT_REQUEST_TIMEOUT_SECONDS), headers within 16 KiB, a refusal before
 * the body closes the connection, and no more than AGENT_VAULT_MAX_CONNECTIONS at once. Each
 * refusal Node's parser makes is answered in the API's error shape.
 */
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { connect, type AddressInfo, type Socket } from 'node:net';
import { Writable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { beforeDeadline } from '../../test/deadline.ts';
import { ADMIN_KEY, startTestService, type TestService } from '../../test/harness.ts';
import { holdLocks, queuedBehind, withSecondConnection } from '../../test/locks.ts';
import { hashApiKey } from '../auth/api-keys.ts';
import { startReceiver } from '../webhooks/testing.ts';

interface RawAnswer { status: number; headers: Record<string, string>; body: any; closed: boolean }

/** Sends `text` on a new connection and reads until the server closes it. */
function exchange(port: number, text: string): Promise<RawAnswer> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, '127.0.0.1', () => socket.write(text));
    let received = '';
    socket.setEncoding('utf8');
    socket.on('data', (chunk: string) => { received += chunk; });
    socket.on('error', reject);
    socket.on('close', () => {
      const [head = '', body = ''] = received.split('\r\n\r\n');
      const [statusLine = '', ...lines] = head.split('\r\n');
      const headers = Object.fromEntries(lines.map((line) => {
        const at = line.indexOf(':');
        return [line.slice(0, at).toLowerCase(), line.slice(at + 1).trim()];
      }));
      resolve({ status: Number(statusLine.split(' ')[1]), headers, body: body ? JSON.parse(body) : null, closed: true });
    });
  });
}

const partialPost = (authorization: string): string => 'POST /v1/payments HTTP/1.1\r\nHost: localhost\r\n'
  + `${authorization}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"walletId":`;

describe('HTTP connections', () => {
  let t: TestService;
  let port: number;
  before(async () => {
    t = await startTestService({ workers: false, env: { AGENT_VAULT_REQUEST_TIMEOUT_SECONDS: '1', AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'on' } });
    await t.service.app.listen({ port: 0, host: '127.0.0.1' });
    port = (t.service.app.server.address() as AddressInfo).port;
  });
  after(async () => { await t.close(); });

  test('a body that stops coming is answered 408 in the API\'s shape, and the connection closed', async () => {
    const answer = await exchange(port, partialPost(`Authorization: Bearer ${ADMIN_KEY}\r\n`));
    assert.equal(answer.status, 408, JSON.stringify(answer));
    assert.equal(answer.body.error.code, 'invalid_request');
    assert.equal(answer.body.error.param, 'request');
    assert.equal(answer.body.error.message, 'The request was not received in full in time (its headers within 1 s, all of it within 1 s).');
    assert.equal(answer.headers['request-id'], answer.body.error.request_id);
    assert.equal(answer.headers.connection, 'close');
  });

  test('a request refused before its body (no key) is answered and its connection closed, the body never awaited', async () => {
    const answer = await exchange(port, partialPost(''));
    assert.equal(answer.status, 401, JSON.stringify(answer));
    assert.equal(answer.body.error.code, 'authentication_failed');
    assert.equal(answer.headers.connection, 'close', 'the server does not keep the connection to read the rest');
  });

  test('a connection that never sends a byte is closed without an answer', async () => {
    const answer = await exchange(port, '');
    assert.deepEqual([answer.closed, Number.isNaN(answer.status), answer.body], [true, true, null], JSON.stringify(answer));
  });

  test('a pipelined request that times out while the one before is still being answered: that answer comes, then the close', async () => {
    // The first request (a webhook's test ping, to a receiver answering in 2.5 s) runs longer
    // than the timeout; the second, sent right behind it, stops in its body.
    const receiver = await startReceiver();
    receiver.reply = () => ({ status: 200, body: 'ok', delayMs: 2_500 });
    try {
      const hook = await t.request('POST', '/v1/webhooks', { body: { url: receiver.url(), events: '*' } });
      assert.equal(hook.status, 200, JSON.stringify(hook.body));
      const ping = `POST /v1/webhooks/${hook.body.webhook_id}/test HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ${ADMIN_KEY}\r\n`
        + 'Content-Length: 0\r\n\r\n';
      const answer = await exchange(port, ping + partialPost(`Authorization: Bearer ${ADMIN_KEY}\r\n`));
      assert.equal(answer.status, 200, JSON.stringify(answer));
      assert.equal(answer.body.success, true, 'the ping\'s own answer, not a 408 in its place');
      assert.equal(answer.headers.connection, 'close');
      assert.equal((await t.request('DELETE', `/v1/webhooks/${hook.body.webhook_id}`)).status, 200);
    } finally {
      await receiver.close();
    }
  });

  test('an HTTP/1.1 request without a Host header, or with two Host or Authorization headers, is answered 400 in the API\'s shape', async () => {
    const answer = await exchange(port, `GET /v1/organization HTTP/1.1\r\nAuthorization: Bearer ${ADMIN_KEY}\r\nConnection: close\r\n\r\n`);
    assert.equal(answer.status, 400, JSON.stringify(answer));
    assert.deepEqual([answer.body.error.code, answer.body.error.param], ['invalid_request', 'host']);
    assert.equal(answer.body.error.message, 'The request has no Host header, which HTTP/1.1 requires.');
    assert.equal(answer.headers['request-id'], answer.body.error.request_id);
    const old = await exchange(port, `GET /v1/organization HTTP/1.0\r\nAuthorization: Bearer ${ADMIN_KEY}\r\n\r\n`);
    assert.equal(old.status, 200, 'HTTP/1.0 has no Host header to require');
    const twice = await exchange(port,
      `GET /v1/organization HTTP/1.1\r\nHost: localhost\r\nHOST: elsewhere.example\r\nAuthorization: Bearer ${ADMIN_KEY}\r\nConnection: close\r\n\r\n`);
    assert.equal(twice.status, 400, JSON.stringify(twice));
    assert.deepEqual([twice.body.error.param, twice.body.error.message], ['host', 'The request has more than one Host header.']);
    // Two keys: refused, whichever a proxy in front would have read.
    const twoKeys = await exchange(port,
      `GET /v1/organization HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ${ADMIN_KEY}\r\nauthorization: Bearer av_other\r\nConnection: close\r\n\r\n`);
    assert.equal(twoKeys.status, 400, JSON.stringify(twoKeys));
    assert.deepEqual([twoKeys.body.error.param, twoKeys.body.error.message], ['authorization', 'The request has more than one Authorization header.']);
  });

  test('headers over 16 KiB are answered 431 in the API\'s shape', async () => {
    const answer = await exchange(port, `GET /v1/wallets HTTP/1.1\r\nHost: localhost\r\nX-Big: ${'a'.repeat(17 * 1024)}\r\n\r\n`);
    assert.equal(answer.status, 431, JSON.stringify(answer));
    assert.deepEqual([answer.body.error.code, answer.body.error.param], ['invalid_request', 'headers']);
    assert.equal(answer.headers['request-id'], answer.body.error.request_id);
  });

  test('an Expect other than 100-continue and a CONNECT are answered in the API\'s shape, nothing done', async () => {
    const before = (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance;
    const expect = await exchange(port, 'POST /v1/test_helpers/deposits HTTP/1.1\r\nHost: localhost\r\n'
      + `Authorization: Bearer ${ADMIN_KEY}\r\nExpect: foo\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{"amount":"1"}`);
    assert.equal(expect.status, 417, JSON.stringify(expect));
    assert.deepEqual([expect.body.error.code, expect.body.error.param], ['invalid_request', 'expect']);
    assert.equal(expect.headers['request-id'], expect.body.error.request_id);
    assert.equal(expect.headers['content-type'], 'application/json; charset=utf-8');
    const tunnel = await exchange(port, `CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nAuthorization: Bearer ${ADMIN_KEY}\r\n\r\n`);
    assert.equal(tunnel.status, 400, JSON.stringify(tunnel));
    assert.deepEqual([tunnel.body.error.code, tunnel.body.error.param], ['invalid_request', 'method']);
    assert.equal(tunnel.headers['request-id'], tunnel.body.error.request_id);
    assert.equal((await t.request('GET', '/v1/organization')).body.reserve.usdc_balance, before, 'no deposit was made');

    // A CONNECT socket is the process's own to guard: a client resetting it does not end the
    // process, and one that keeps its side open is closed all the same.
    const reset = connect(port, '127.0.0.1', () => reset.write('CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n'));
    reset.on('error', () => {});
    await once(reset, 'data');
    reset.resetAndDestroy();
    const held = connect({ port, host: '127.0.0.1', allowHalfOpen: true }, () => held.write('CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n\r\n'));
    held.on('error', () => {});
    held.resume();
    await once(held, 'end'); // the server's side closed, though this one stays open
    held.destroy();

    // Pipelined behind two requests, the second of them slow (the database held): answered
    // after both, in order.
    const slow = t.service.ctx.db.transaction(async (tx) => {
      await tx.query('SELECT 1');
      await new Promise((resolve) => setTimeout(resolve, 1_500));
    });
    const pipelined = connect(port, '127.0.0.1', () => pipelined.write('GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n'
      + `POST /v1/test_helpers/deposits HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ${ADMIN_KEY}\r\n`
      + 'Content-Type: application/json\r\nContent-Length: 14\r\n\r\n{"amount":"1"}'
      + 'CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n\r\n'));
    let received = '';
    pipelined.setEncoding('utf8');
    pipelined.on('data', (chunk: string) => { received += chunk; });
    pipelined.on('error', () => {});
    await once(pipelined, 'close');
    await slow;
    assert.deepEqual([...received.matchAll(/HTTP\/1\.1 (\d{3})/g)].map((m) => m[1]), ['200', '200', '400'], received);
    assert.equal((await t.request('GET', '/healthz')).status, 200, 'still serving');
  });
});

describe('HTTP connections at the most allowed', () => {
  const MAX = 3;
  let t: TestService;
  let port: number;
  before(async () => {
    t = await startTestService({ workers: false, env: { AGENT_VAULT_MAX_CONNECTIONS: String(MAX) } });
    await t.service.app.listen({ port: 0, host: '127.0.0.1' });
    port = (t.service.app.server.address() as AddressInfo).port;
  });
  after(async () => { await t.close(); });

  const open = (): Promise<Socket> => new Promise((resolve, reject) => {
    const socket = connect(port, '127.0.0.1', () => resolve(socket));
    socket.on('error', reject);
  });

  test('a connection past the most is closed as it arrives; the open ones still work, and room made is taken', async () => {
    const held = [await open(), await open(), await open()];
    // Accepted by the kernel, then closed by the server without a byte.
    const refused = await exchange(port, 'GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n');
    assert.deepEqual([refused.closed, Number.isNaN(refused.status)], [true, true], JSON.stringify(refused));

    held[0]!.destroy();
    const server = t.service.app.server;
    const count = (): Promise<number> => new Promise((resolve, reject) => server.getConnections((error, n) => (error ? reject(error) : resolve(n))));
    while (await count() >= MAX) await new Promise((resolve) => setImmediate(resolve));
    const answer = await exchange(port, `GET /v1/organization HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ${ADMIN_KEY}\r\nConnection: close\r\n\r\n`);
    assert.equal(answer.status, 200, JSON.stringify(answer));
    for (const socket of held) socket.destroy();
  });
});

describe('HTTP connections closed by the client', () => {
  const lines: Array<{ level: number; msg: string }> = [];
  let t: TestService;
  let port: number;
  before(async () => {
    const sink = new Writable({ write(chunk, _encoding, done) { lines.push(JSON.parse(String(chunk))); done(); } });
    t = await startTestService({ workers: false, logger: pino({ level: 'info' }, sink) });
    await t.service.app.listen({ port: 0, host: '127.0.0.1' });
    port = (t.service.app.server.address() as AddressInfo).port;
  });
  after(async () => { await t.close(); });

  test('a client that hangs up in the middle of its body is not logged as the database or the chain being down', async () => {
    const socket = connect(port, '127.0.0.1');
    await once(socket, 'connect');
    socket.write(partialPost(`Authorization: Bearer ${ADMIN_KEY}\r\n`));
    // Once the service is reading the body (its request logged), the client goes.
    while (!lines.some((line) => line.msg === 'incoming request')) await new Promise((resolve) => setTimeout(resolve, 5));
    socket.destroy();
    const gone = 'the client closed its connection before its body arrived';
    while (!lines.some((line) => line.msg === gone || line.level >= 40)) await new Promise((resolve) => setTimeout(resolve, 5));
    assert.deepEqual(lines.filter((line) => line.level >= 40).map((line) => line.msg), [], 'no warning, no error');
    assert.equal((await t.request('GET', '/v1/organization')).status, 200, 'the service goes on serving');
  });

  // The guarantee: a request whose client hung up while its key was being checked ends, rather
  // than waiting for a body whose end came before anyone listened (held in memory for good).
  test('a client that hangs up while its key is checked: the request ends, logged as such', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const gone = 'the client closed its connection before its body arrived';
      const toldBefore = lines.filter((line) => line.msg === gone).length;
      const key = await t.createKey('operator'); // never used: its first request writes last_used_at
      const held = await holdLocks(other, (tx) => tx.query('SELECT 1 FROM api_keys WHERE key_hash = $1 FOR UPDATE', [hashApiKey(key)]));
      const socket = connect(port, '127.0.0.1');
      try {
        await once(socket, 'connect');
        socket.write(partialPost(`Authorization: Bearer ${key}\r\n`));
        await queuedBehind(other, held.pid, 1); // the key check waits for the key's row
        const closed = once(socket, 'close');
        socket.destroy();
        await closed;
        while ((await new Promise<number>((resolve, reject) => t.service.app.server.getConnections((error, n) => (error ? reject(error) : resolve(n))))) > 0) {
          await new Promise((resolve) => setTimeout(resolve, 5));
        }
      } finally {
        held.release();
        await held.done;
      }
      const told = await beforeDeadline((async () => {
        while (lines.filter((line) => line.msg === gone).length <= toldBefore) await new Promise((resolve) => setTimeout(resolve, 5));
        return true;
      })(), 10_000);
      assert.ok(told, 'the request ended and said why');
    });
  });
});
