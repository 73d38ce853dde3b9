/**
 * The outbound guard against real sockets: a local HTTP server on 127.0.0.1 plays the target,
 * so "refused" means the server never saw a request, not that a function returned false.
 */
import assert from 'node:assert/strict';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { createServer as createTlsServer } from 'node:tls';
import { after, before, describe, test } from 'node:test';
import { ServiceError } from '../errors/errors.ts';
import { OutboundError, assertPublicUrl, fetchGuarded, isPublicAddress, requestGuarded, type GuardedTarget, type OutboundFailure } from './outbound.ts';

describe('address classes', () => {
  // Every class the guard refuses, in IPv4, IPv6 and IPv6 forms that carry an IPv4 address.
  const nonPublic: Array<[string, string]> = [
    ['0.0.0.0', 'unspecified'], ['0.1.2.3', 'this network'],
    ['127.0.0.1', 'loopback'], ['127.255.255.254', 'loopback'],
    ['10.0.0.1', 'private'], ['172.16.0.1', 'private'], ['172.31.255.255', 'private'], ['192.168.1.1', 'private'],
    ['100.64.0.1', 'CGNAT'], ['100.127.255.255', 'CGNAT'],
    ['169.254.169.254', 'link-local (cloud metadata)'],
    ['192.0.0.8', 'IETF assignments'], ['192.0.2.1', 'TEST-NET-1'], ['198.51.100.7', 'TEST-NET-2'], ['203.0.113.9', 'TEST-NET-3'],
    ['198.18.0.1', 'benchmarking'], ['198.19.255.255', 'benchmarking'], ['192.88.99.1', '6to4 relay'],
    ['224.0.0.1', 'multicast'], ['239.255.255.250', 'multicast'], ['240.0.0.1', 'reserved'], ['255.255.255.255', 'broadcast'],
    ['::', 'unspecified'], ['::1', 'loopback'], ['::127.0.0.1', 'IPv4-compatible'],
    ['fe80::1', 'link-local'], ['fe80::1%eth0', 'link-local with zone'], ['febf::1', 'link-local'],
    ['fc00::1', 'unique local'], ['fd12:3456::1', 'unique local'], ['fec0::1', 'site-local'],
    ['ff02::1', 'multicast'], ['2001:db8::1', 'documentation'], ['3fff::1', 'documentation'],
    ['100::1', 'discard-only'], ['2001::1', 'Teredo'], ['2001:20::1', 'ORCHIDv2'], ['64:ff9b:1::1', 'local NAT64'],
    ['::ffff:127.0.0.1', 'mapped loopback'], ['::ffff:7f00:1', 'mapped loopback, hex'], ['::ffff:10.1.2.3', 'mapped private'],
    ['::ffff:169.254.169.254', 'mapped link-local'], ['::ffff:100.64.0.1', 'mapped CGNAT'], ['::ffff:0.0.0.0', 'mapped unspecified'],
    ['0:0:0:0:0:ffff:c0a8:0101', 'mapped private, long form'], ['::ffff:0:7f00:1', 'IPv4-translated'],
    ['64:ff9b::127.0.0.1', 'NAT64 of loopback'], ['64:ff9b::a00:1', 'NAT64 of private'],
    ['2002:7f00:1::1', '6to4 of loopback'], ['2002:c0a8:101::', '6to4 of private'],
    ['example.com', 'not an address'], ['', 'empty'], ['1.2.3', 'not an address'],
  ];
  const isPublic = [
    '1.1.1.1', '8.8.8.8', '93.184.216.34', '100.63.255.255', '100.128.0.0', '172.15.255.255', '172.32.0.0', '169.253.0.1',
    '192.0.1.1', '198.17.255.255', '198.20.0.0', '223.255.255.255',
    '2606:4700:4700::1111', '2a00:1450:4001::200e', '2001:4860:4860::8888',
    '::ffff:8.8.8.8', '::ffff:808:808', '64:ff9b::808:808', '2002:808:808::1',
  ];

  for (const [address, kind] of nonPublic) {
    test(`${address || '(empty)'} is not public (${kind})`, () => assert.equal(isPublicAddress(address), false));
  }
  test('public IPv4 and IPv6 addresses, also mapped, NAT64 and 6to4 forms of public IPv4', () => {
    for (const address of isPublic) assert.equal(isPublicAddress(address), true, address);
  });
});

describe('assertPublicUrl', () => {
  const refusal = (url: string, allowPrivate = false): ServiceError => {
    try {
      assertPublicUrl(url, { allowPrivate, param: 'url' });
    } catch (error) {
      if (error instanceof ServiceError) return error;
      throw error;
    }
    assert.fail(`${url} was accepted`);
  };

  test('public http(s) URLs are accepted, any port, and parsed', () => {
    for (const url of ['https://example.com/hook', 'http://example.com:8080/a?b=c', 'https://93.184.216.34/x',
      'https://[2606:4700:4700::1111]:8443/', 'https://sub.example.co.uk./path']) {
      assert.equal(assertPublicUrl(url, { allowPrivate: false, param: 'url' }).href, new URL(url).href, url);
    }
  });

  test('every refusal is invalid_request naming the caller\'s param', () => {
    try {
      assertPublicUrl('ftp://example.com/', { allowPrivate: false, param: 'webhook_url' });
      assert.fail('accepted');
    } catch (error) {
      assert.ok(error instanceof ServiceError, 'a ServiceError');
      assert.equal(error.code, 'invalid_request');
      assert.deepEqual(error.details, { param: 'webhook_url' });
    }
  });

  test('wrong scheme, credentials, relative or overlong URLs are refused even with private targets allowed', () => {
    for (const url of ['ftp://example.com/', 'file:///etc/passwd', 'javascript:alert(1)', 'gopher://example.com/',
      'https://user:pass@example.com/', 'https://user@example.com/', '/relative/path', 'example.com', '',
      `https://example.com/${'a'.repeat(2048)}`,
      // 420 characters as sent, over 2,400 as stored once percent-encoded (the column holds 2,048).
      `https://example.com/${'é'.repeat(400)}`]) {
      for (const allowPrivate of [false, true]) {
        assert.equal(refusal(url, allowPrivate).details.param, 'url', url);
      }
    }
  });

  test('localhost and literal non-public addresses, in every spelling the URL standard accepts, are refused', () => {
    for (const url of ['http://localhost/', 'http://LOCALHOST./', 'http://localhost../', 'http://api.localhost..:3000/', 'http://api.localhost:3000/', 'http://127.0.0.1/',
      'http://127.1/', 'http://0x7f.0.0.1/', 'http://2130706433/', 'http://017700000001/', 'http://0/', 'http://0.0.0.0:8080/',
      'http://10.1.2.3/', 'http://192.168.0.10/', 'http://172.20.1.1/', 'http://100.100.100.100/', 'http://169.254.169.254/latest/meta-data',
      'http://[::1]/', 'http://[::]/', 'http://[::ffff:127.0.0.1]/', 'http://[::ffff:a9fe:a9fe]/', 'http://[fe80::1]/',
      'http://[fd00::1]/', 'http://[ff02::1]/', 'http://[64:ff9b::7f00:1]/', 'https://224.0.0.1/', 'http://255.255.255.255/']) {
      assert.equal(refusal(url).code, 'invalid_request', url);
      assert.match(refusal(url).message, /AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS=on/, 'says how a local development service allows them');
    }
  });

  test('with private targets allowed, those same URLs are accepted', () => {
    for (const url of ['http://localhost:3000/hook', 'http://127.0.0.1:8080/', 'http://[::1]/', 'http://10.0.0.5/']) {
      assert.equal(assertPublicUrl(url, { allowPrivate: true, param: 'url' }).protocol, 'http:', url);
    }
  });
});

describe('fetchGuarded against a local server', () => {
  let server: Server;
  let base: string;
  let port: number;
  const seen: string[] = [];
  const routes: Record<string, (request: IncomingMessage, response: ServerResponse, body: Buffer) => void> = {
    '/echo': (request, response, body) => {
      response.writeHead(201, { 'content-type': 'application/json', 'x-answer': '42' });
      response.end(JSON.stringify({ method: request.method, host: request.headers.host, header: request.headers['x-test'], body: body.toString('utf8') }));
    },
    '/redirect': (_request, response) => {
      response.writeHead(302, { location: '/echo' });
      response.end('moved');
    },
    '/hang': () => { /* never answers: the client's deadline must end the call */ },
    '/slow-body': (_request, response) => {
      response.writeHead(200, { 'content-type': 'text/plain' });
      response.write('first part; the rest never comes');
    },
    '/big-declared': (_request, response) => {
      response.writeHead(200, { 'content-length': '5000' });
      response.end('x'.repeat(5000));
    },
    '/big-chunked': (_request, response) => {
      response.writeHead(200, { 'content-type': 'text/plain' });
      for (let i = 0; i < 10; i += 1) response.write('y'.repeat(500));
      response.end();
    },
    '/exact': (_request, response) => {
      response.writeHead(200);
      response.end('z'.repeat(1000));
    },
    '/reset': (request) => { request.socket.destroy(); },
  };
  let connections = 0;

  before(async () => {
    server = createServer((request, response) => {
      seen.push(request.url ?? '');
      const chunks: Buffer[] = [];
      request.on('data', (chunk: Buffer) => chunks.push(chunk));
      request.on('end', () => {
        const route = routes[(request.url ?? '').split('?')[0]!];
        if (route) route(request, response, Buffer.concat(chunks));
        else { response.writeHead(404); response.end(); }
      });
    });
    server.on('connection', () => { connections += 1; });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    port = (server.address() as AddressInfo).port;
    base = `http://127.0.0.1:${port}`;
  });
  after(async () => {
    server.closeAllConnections();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  });

  const allowed = { timeoutMs: 5000, maxBytes: 1000, allowPrivate: true };
  async function failure(promise: Promise<unknown>): Promise<OutboundFailure> {
    try {
      await promise;
    } catch (error) {
      assert.ok(error instanceof OutboundError, `an OutboundError, not ${String(error)}`);
      return error.reason;
    }
    assert.fail('the call succeeded');
  }

  test('status, headers and body come back; method, headers and body go out', async () => {
    const response = await fetchGuarded(`${base}/echo?x=1`, {
      ...allowed, method: 'POST', headers: { 'x-test': 'yes', 'content-type': 'text/plain' }, body: 'héllo',
    });
    assert.equal(response.status, 201);
    assert.equal(response.headers['x-answer'], '42');
    assert.deepEqual(JSON.parse(response.body.toString('utf8')), { method: 'POST', host: `127.0.0.1:${port}`, header: 'yes', body: 'héllo' });
    assert.ok(Number.isInteger(response.latencyMs) && response.latencyMs >= 0, 'latency is a whole number of milliseconds');
  });

  test('a connection is kept alive and reused by the next call to the same vetted address', async () => {
    await fetchGuarded(`${base}/echo`, allowed);
    const opened = connections;
    for (let i = 0; i < 3; i += 1) assert.equal((await fetchGuarded(`${base}/echo`, allowed)).status, 201);
    assert.equal(connections, opened, 'no new connection for three more calls');
  });

  test('a kept-alive connection the server closed meanwhile is replaced by a new one, not reported as a failure', async () => {
    // A server of its own (so a pool of its own) that answers only the first request of each
    // connection: a later request finds its connection closed under it.
    let opened = 0;
    const once = createServer((request, response) => {
      if ((request.socket as { served?: boolean }).served) {
        request.socket.destroy();
        return;
      }
      (request.socket as { served?: boolean }).served = true;
      request.resume();
      request.on('end', () => { response.writeHead(200); response.end('ok'); });
    });
    once.on('connection', () => { opened += 1; });
    await new Promise<void>((resolve) => once.listen(0, '127.0.0.1', resolve));
    const url = `http://127.0.0.1:${(once.address() as AddressInfo).port}/`;
    try {
      // A POST, as webhooks send: not one a client may resend on its own as idempotent.
      const post = { ...allowed, method: 'POST', body: '{}' };
      assert.equal((await fetchGuarded(url, post)).status, 200);
      assert.equal(opened, 1);
      await new Promise((resolve) => setTimeout(resolve, 20)); // the connection back in its pool, idle
      assert.equal((await fetchGuarded(url, post)).status, 200, 'answered on a new connection');
      assert.equal(opened, 2, 'the closed connection was replaced once');
    } finally {
      once.closeAllConnections();
      await new Promise<void>((resolve) => once.close(() => resolve()));
    }
  });

  test('a resolved target is reached at its vetted addresses only, whatever DNS would say of its name', async () => {
    // A name no resolver knows, vetted to this server's address: the connection must go there.
    const host = 'vetted-name.invalid';
    const url = new URL(`http://${host}:${port}/echo`);
    const target: GuardedTarget = {
      url, host, addresses: [{ address: '127.0.0.1', family: 4 }], key: `${url.origin} 127.0.0.1`, path: '/echo',
    };
    const response = await requestGuarded(target, { timeoutMs: 5000, maxBytes: 1000 });
    assert.equal(response.status, 201, 'answered by the vetted address');
    assert.equal(JSON.parse(response.body.toString('utf8')).host, `${host}:${port}`, 'the request names the host, not the address');
  });

  test('a request whose fresh connection breaks before any answer is not sent again', async () => {
    let requests = 0;
    const breaking = createServer((request) => {
      requests += 1;
      request.socket.destroy();
    });
    await new Promise<void>((resolve) => breaking.listen(0, '127.0.0.1', resolve));
    try {
      const url = `http://127.0.0.1:${(breaking.address() as AddressInfo).port}/`;
      assert.equal(await failure(fetchGuarded(url, { ...allowed, method: 'POST', body: '{}' })), 'network');
      assert.equal(requests, 1, 'the server saw the request once');
    } finally {
      breaking.closeAllConnections();
      await new Promise<void>((resolve) => breaking.close(() => resolve()));
    }
  });

  test('a private target is refused before any request when private targets are not allowed', async () => {
    const before = seen.length;
    assert.equal(await failure(fetchGuarded(`${base}/echo`, { ...allowed, allowPrivate: false })), 'refused_address');
    assert.equal(seen.length, before, 'the server saw no request');
  });

  test('a name resolving to loopback (localhost) is refused after resolution, and reached when allowed', async () => {
    const before = seen.length;
    assert.equal(await failure(fetchGuarded(`http://localhost:${port}/echo`, { ...allowed, allowPrivate: false })), 'refused_address');
    assert.equal(seen.length, before, 'the server saw no request');
    // localhost may resolve to ::1 first, where nothing listens; the vetted IPv4 address is then tried.
    const response = await fetchGuarded(`http://localhost:${port}/echo`, allowed);
    assert.equal(response.status, 201);
    assert.equal(JSON.parse(response.body.toString('utf8')).host, `localhost:${port}`);
  });

  // The developer who meets a refusal of a local target is often the one running the service:
  // told at call time, as at creation, how a local development service allows it. Only for a
  // target private by its text: a name DNS answers for never gets it (src/net/lookups.test.ts).
  test('refused at call time, a literal address or a localhost name says how a local development service allows it', async () => {
    for (const url of [`${base}/echo`, `http://localhost:${port}/echo`, `http://api.localhost:${port}/echo`, `http://[::1]:${port}/echo`]) {
      const error = await fetchGuarded(url, { ...allowed, allowPrivate: false }).then(() => null, (e: unknown) => e);
      assert.ok(error instanceof OutboundError && error.reason === 'refused_address', `${url}: ${String(error)}`);
      assert.match(error.message, /\(a service run for local development can allow them: AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS=on\)$/, url);
    }
  });

  test('a redirect is returned as is, never followed', async () => {
    const before = seen.length;
    const response = await fetchGuarded(`${base}/redirect`, allowed);
    assert.equal(response.status, 302);
    assert.equal(response.headers.location, '/echo');
    assert.equal(response.body.toString('utf8'), 'moved');
    assert.deepEqual(seen.slice(before), ['/redirect']);
  });

  test('a target that never answers, or stops halfway through the body, ends in timeout', async () => {
    assert.equal(await failure(fetchGuarded(`${base}/hang`, { ...allowed, timeoutMs: 200 })), 'timeout');
    assert.equal(await failure(fetchGuarded(`${base}/slow-body`, { ...allowed, timeoutMs: 200 })), 'timeout');
  });

  test('a body over maxBytes is too_large, declared or streamed; exactly maxBytes is fine', async () => {
    assert.equal(await failure(fetchGuarded(`${base}/big-declared`, allowed)), 'too_large');
    assert.equal(await failure(fetchGuarded(`${base}/big-chunked`, allowed)), 'too_large');
    // The answer came: its status is told with the failure (a webhook's delivery log shows it).
    for (const path of ['/big-declared', '/big-chunked']) {
      await assert.rejects(fetchGuarded(`${base}${path}`, allowed), (error: OutboundError) => error.statusCode === 200);
    }
    await assert.rejects(fetchGuarded(`${base}/hang`, { ...allowed, timeoutMs: 100 }), (error: OutboundError) => error.statusCode === null);
    assert.equal((await fetchGuarded(`${base}/exact`, allowed)).body.length, 1000);
  });

  test('connection failures are network errors, bad URLs bad_url; nothing else escapes', async () => {
    const closed = createServer();
    await new Promise<void>((resolve) => closed.listen(0, '127.0.0.1', resolve));
    const closedPort = (closed.address() as AddressInfo).port;
    await new Promise<void>((resolve) => closed.close(() => resolve()));
    assert.equal(await failure(fetchGuarded(`http://127.0.0.1:${closedPort}/`, allowed)), 'network');
    assert.equal(await failure(fetchGuarded(`${base}/reset`, allowed)), 'network');
    // A generous deadline so that a slow resolver still answers "no such name" rather than timing out.
    assert.equal(await failure(fetchGuarded('http://name-that-does-not-exist.invalid/', { ...allowed, timeoutMs: 20_000 })), 'network');
    for (const url of ['not a url', 'ftp://127.0.0.1/', 'http://user:pw@127.0.0.1/', 'file:///etc/passwd']) {
      assert.equal(await failure(fetchGuarded(url, allowed)), 'bad_url', url);
    }
  });

  test('https presents the host name (SNI) to the address it connects to, never an IP; a failed handshake is a network error', async () => {
    // A TLS server without a certificate: it records the name the client asks for, then refuses.
    const names: string[] = [];
    const tls = createTlsServer({ SNICallback: (name, callback) => { names.push(name); callback(new Error('no certificate'), undefined); } });
    tls.on('tlsClientError', () => {});
    await new Promise<void>((resolve) => tls.listen(0, '127.0.0.1', resolve));
    const tlsPort = (tls.address() as AddressInfo).port;
    try {
      assert.equal(await failure(fetchGuarded(`https://localhost:${tlsPort}/`, allowed)), 'network');
      assert.equal(await failure(fetchGuarded(`https://127.0.0.1:${tlsPort}/`, allowed)), 'network');
      assert.deepEqual(names, ['localhost']);
    } finally {
      await new Promise<void>((resolve) => tls.close(() => resolve()));
    }
  });
});
