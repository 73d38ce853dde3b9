/**
 * Outbound name resolution goes through c-ares (`dns.promises.Resolver`), never `dns.lookup`:
 * getaddrinfo would take one of libuv's 4 shared threads per lookup and could not be cancelled,
 * so a name whose DNS never answers could hold them past any deadline. The resolver's queries
 * are wrapped to answer for test names (no network here): one name never answers, another
 * answers 127.0.0.1; `dns.lookup` is wrapped to count its calls.
 */
import assert from 'node:assert/strict';
import dns from 'node:dns';
import { Resolver } from 'node:dns/promises';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { syncBuiltinESMExports } from 'node:module';
import { after, before, describe, mock, test } from 'node:test';
import { OutboundError, fetchGuarded } from './outbound.ts';

describe('outbound name resolution', () => {
  let server: Server;
  let port: number;
  let lookups = 0;
  before(async () => {
    server = createServer((_request, response) => response.end('ok'));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    port = (server.address() as AddressInfo).port;
    const answer = (family: 4 | 6) => async (name: string): Promise<string[]> => {
      if (name === 'never-answers.example') return new Promise<string[]>(() => {});
      // A DNS server that answers A at once and drops AAAA queries.
      if (name === 'drops-aaaa.example') return family === 4 ? ['127.0.0.1'] : new Promise<string[]>(() => {});
      if (name === 'hooks.example') {
        if (family === 4) return ['127.0.0.1'];
        throw Object.assign(new Error('queryAaaa ENODATA'), { code: 'ENODATA' });
      }
      throw Object.assign(new Error('queryA ENOTFOUND'), { code: 'ENOTFOUND' });
    };
    mock.method(Resolver.prototype, 'resolve4', answer(4));
    mock.method(Resolver.prototype, 'resolve6', answer(6));
    const lookup = dns.lookup;
    mock.method(dns, 'lookup', (...args: Parameters<typeof dns.lookup>) => {
      lookups += 1;
      return (lookup as (...a: unknown[]) => void)(...args);
    });
    syncBuiltinESMExports();
  });
  after(async () => {
    mock.restoreAll();
    syncBuiltinESMExports();
    server.close();
  });

  const call = (host: string, timeoutMs: number) =>
    fetchGuarded(`http://${host}:${port}/`, { method: 'GET', timeoutMs, maxBytes: 1024, allowPrivate: true });
  const failure = async (promise: Promise<unknown>) => {
    const error = await promise.then(() => null, (e: unknown) => e);
    assert.ok(error instanceof OutboundError, `an OutboundError, not ${String(error)}`);
    return error;
  };

  test('a name whose DNS never answers fails at the call\'s deadline and holds up no other call', async () => {
    let stuckSettled = 0;
    const stuck = [call('never-answers.example', 1_000), call('never-answers.example', 1_000), call('never-answers.example', 1_000)]
      .map((promise) => promise.finally(() => { stuckSettled += 1; }));
    const meanwhile = await call('hooks.example', 5_000);
    assert.equal(meanwhile.status, 200, 'another name resolves while those wait');
    assert.equal(stuckSettled, 0, 'answered while the stuck ones were still waiting, not after them');
    for (const error of await Promise.all(stuck.map(failure))) {
      assert.equal(error.reason, 'timeout');
      assert.match(error.message, /deadline/);
    }
    const unknown = await failure(call('unknown.example', 2_000));
    assert.equal(unknown.reason, 'network');
    assert.match(unknown.message, /did not resolve \(ENOTFOUND\)/);
    assert.equal((await call('localhost', 2_000)).status, 200, 'localhost is loopback without asking DNS');
    assert.equal((await call('127.0.0.1', 2_000)).status, 200, 'an address literal needs no resolution');
    assert.equal(lookups, 0, 'getaddrinfo (dns.lookup) is never used');
  });

  test('guarded, a name that does not resolve and one that resolves to a private address fail alike', async () => {
    const guarded = (host: string) => failure(fetchGuarded(`http://${host}:${port}/`, { method: 'GET', timeoutMs: 2_000, maxBytes: 1024, allowPrivate: false }));
    const [unknown, internal] = await Promise.all([guarded('unknown.example'), guarded('hooks.example')]);
    assert.deepEqual([unknown.reason, unknown.message.replace('unknown.example', 'NAME')], [internal.reason, internal.message.replace('hooks.example', 'NAME')],
      'which internal names exist cannot be told from the failure');
    assert.match(internal.message, /^hooks\.example does not resolve to a public address/);
    // The hint a localhost name or a literal address gets would set a name that resolves apart.
    assert.doesNotMatch(internal.message, /AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS/);
  });

  test('an IPv4 answer does not wait for an IPv6 query that never comes back', async () => {
    // Waiting for both families, the call would fail at its deadline ('timeout').
    assert.equal((await call('drops-aaaa.example', 3_000)).status, 200);
  });
});
