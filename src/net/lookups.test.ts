/**
 * Name lookups of outbound calls take one of libuv's shared threads each and cannot be cancelled,
 * so they are limited to one in flight per thread: a name whose DNS never answers delays other
 * outbound calls (each within its own deadline) and never the process's other work. node:dns
 * `lookup` is wrapped to hold back the answer for one name; every other name resolves as usual.
 */
import assert from 'node:assert/strict';
import dns from 'node:dns';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { syncBuiltinESMExports } from 'node:module';
import { after, before, describe, mock, test } from 'node:test';
import { OutboundError, fetchGuarded } from './outbound.ts';

describe('outbound name lookups', () => {
  let server: Server;
  let port: number;
  const held: Array<() => void> = [];
  before(async () => {
    server = createServer((_request, response) => response.end('ok'));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    port = (server.address() as AddressInfo).port;
    const lookup = dns.lookup;
    mock.method(dns, 'lookup', (...args: Parameters<typeof dns.lookup>) => {
      if (args[0] !== 'never-answers.example') return (lookup as (...a: unknown[]) => void)(...args);
      const callback = args.at(-1) as unknown as (error: NodeJS.ErrnoException | null, addresses: dns.LookupAddress[]) => void;
      held.push(() => callback(Object.assign(new Error('getaddrinfo EAI_AGAIN'), { code: 'EAI_AGAIN' }), []));
    });
    // The guard imports `lookup` by name: its binding follows the module's property only once synced.
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

  test('a lookup that never answers holds its slot past its deadline; others wait their turn, within their own', async () => {
    assert.equal((await call('localhost', 2_000)).status, 200, 'a name resolves as usual');
    const stuck = await failure(call('never-answers.example', 100));
    assert.equal(stuck.reason, 'timeout');
    assert.equal(held.length, 1, 'getaddrinfo is still running');
    const queued = await failure(call('localhost', 150));
    assert.equal(queued.reason, 'timeout');
    assert.match(queued.message, /waited for other lookups/);
    const waiting = call('localhost', 2_000);
    held.shift()!(); // the system resolver gives up at last: the slot comes back
    assert.equal((await waiting).status, 200, 'the next lookup runs once the slot is free');
    assert.equal((await call('127.0.0.1', 2_000)).status, 200, 'an address literal needs no lookup');
  });
});
