/**
 * Every outbound HTTP call of the service goes through here (DESIGN §8): only http(s), never to
 * loopback, private, link-local, CGNAT or otherwise non-public addresses unless the operator
 * allowed private targets (AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS), checked on the URL at creation
 * and again on every address DNS gives at call time (`resolveGuarded`, once for a run of calls to
 * one URL, such as a batch of webhook attempts). The connection then goes to a vetted
 * address only, so a name that re-resolves between the check and the connect (DNS rebinding)
 * cannot reach anything that was not checked. Redirects are returned, never followed; every
 * call has a total deadline and a body size cap. Connections are kept alive for a moment and
 * reused only by calls whose vetted addresses are the very same (`poolFor`), through undici's
 * client (a third of node:http's CPU per call: docs/webhooks.md "The sending thread").
 */
import type { LookupAddress } from 'node:dns';
import { Resolver } from 'node:dns/promises';
import { EventEmitter } from 'node:events';
import type { IncomingHttpHeaders } from 'node:http';
import { BlockList, isIP, type LookupFunction } from 'node:net';
import { Pool, type Dispatcher } from 'undici';
import { ServiceError } from '../errors/errors.ts';

/** Browsers and proxies commonly cap URLs near here; a longer one is a mistake or an attack. */
export const OUTBOUND_URL_LENGTH_MAX = 2048;

// ---------------------------------------------------------------------------------------------
// Address classes

/**
 * IPv4 ranges that are not the public internet (IANA IPv4 Special-Purpose Address Registry,
 * plus multicast and the reserved class E). 192.0.0.0/24 includes 192.0.0.9/.10, which are
 * globally reachable anycast, but nothing a webhook needs.
 */
const NON_PUBLIC_IPV4: ReadonlyArray<[string, number]> = [
  ['0.0.0.0', 8], // "this network", incl. the unspecified 0.0.0.0 (Linux connects it to itself)
  ['10.0.0.0', 8], // private
  ['100.64.0.0', 10], // shared address space (carrier-grade NAT)
  ['127.0.0.0', 8], // loopback
  ['169.254.0.0', 16], // link-local, incl. cloud metadata at 169.254.169.254
  ['172.16.0.0', 12], // private
  ['192.0.0.0', 24], // IETF protocol assignments
  ['192.0.2.0', 24], // TEST-NET-1
  ['192.88.99.0', 24], // 6to4 relay anycast (deprecated)
  ['192.168.0.0', 16], // private
  ['198.18.0.0', 15], // benchmarking
  ['198.51.100.0', 24], // TEST-NET-2
  ['203.0.113.0', 24], // TEST-NET-3
  ['224.0.0.0', 4], // multicast
  ['240.0.0.0', 4], // reserved, incl. broadcast 255.255.255.255
];

/**
 * IPv6 ranges that are not the public internet (IANA IPv6 Special-Purpose Address Registry).
 * IPv4-mapped (::ffff:0:0/96), NAT64 (64:ff9b::/96) and 6to4 (2002::/16) addresses are not
 * listed: they carry an IPv4 address, which is judged by the IPv4 list instead.
 */
const NON_PUBLIC_IPV6: ReadonlyArray<[string, number]> = [
  ['::', 96], // unspecified, loopback and the deprecated IPv4-compatible form (::a.b.c.d)
  ['::ffff:0:0:0', 96], // IPv4-translated (SIIT)
  ['64:ff9b:1::', 48], // local-use NAT64
  ['100::', 64], // discard-only
  ['2001::', 23], // IETF protocol assignments, incl. Teredo and ORCHID
  ['2001:db8::', 32], // documentation
  ['3fff::', 20], // documentation (RFC 9637)
  ['fc00::', 7], // unique local
  ['fe80::', 10], // link-local
  ['fec0::', 10], // site-local (deprecated)
  ['ff00::', 8], // multicast
];

function blockListOf(ranges: ReadonlyArray<[string, number]>, family: 'ipv4' | 'ipv6'): BlockList {
  const list = new BlockList();
  for (const [network, prefix] of ranges) list.addSubnet(network, prefix, family);
  return list;
}

const NON_PUBLIC_IPV4_LIST = blockListOf(NON_PUBLIC_IPV4, 'ipv4');
const NON_PUBLIC_IPV6_LIST = blockListOf(NON_PUBLIC_IPV6, 'ipv6');

/** The 16 bytes of an IPv6 address already known to be valid (net.isIP === 6), zone id dropped. */
function ipv6Bytes(text: string): Uint8Array {
  let address = text.split('%')[0]!;
  const lastColon = address.lastIndexOf(':');
  const tail = address.slice(lastColon + 1);
  if (tail.includes('.')) {
    const [a, b, c, d] = tail.split('.').map(Number) as [number, number, number, number];
    address = `${address.slice(0, lastColon + 1)}${((a << 8) | b).toString(16)}:${((c << 8) | d).toString(16)}`;
  }
  const groupsOf = (part: string): number[] => (part === '' ? [] : part.split(':').map((group) => parseInt(group, 16)));
  const [head = '', rest] = address.split('::');
  const headGroups = groupsOf(head);
  const restGroups = rest === undefined ? [] : groupsOf(rest);
  const groups = [...headGroups, ...new Array<number>(8 - headGroups.length - restGroups.length).fill(0), ...restGroups];
  const bytes = new Uint8Array(16);
  groups.forEach((group, i) => { bytes[2 * i] = group >> 8; bytes[2 * i + 1] = group & 0xff; });
  return bytes;
}

const startsWith = (bytes: Uint8Array, prefix: readonly number[]): boolean => prefix.every((byte, i) => bytes[i] === byte);
const ipv4Of = (bytes: Uint8Array, from: number): string => Array.from(bytes.subarray(from, from + 4)).join('.');

/** The IPv4 address an IPv6 one stands for (mapped, NAT64 or 6to4), or null. */
function embeddedIpv4(bytes: Uint8Array): string | null {
  if (startsWith(bytes, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff])) return ipv4Of(bytes, 12);
  if (startsWith(bytes, [0x00, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0])) return ipv4Of(bytes, 12);
  if (startsWith(bytes, [0x20, 0x02])) return ipv4Of(bytes, 2);
  return null;
}

/**
 * Whether an IP address is on the public internet. Anything that is not an IP address, and
 * every loopback, private, link-local, CGNAT, unspecified, multicast, documentation or reserved
 * address, is not; an IPv6 address carrying an IPv4 one is judged by that IPv4 address.
 */
export function isPublicAddress(address: string): boolean {
  const bare = address.split('%')[0]!;
  const family = isIP(bare);
  if (family === 4) return !NON_PUBLIC_IPV4_LIST.check(bare, 'ipv4');
  if (family !== 6) return false;
  if (NON_PUBLIC_IPV6_LIST.check(bare, 'ipv6')) return false;
  const embedded = embeddedIpv4(ipv6Bytes(bare));
  return embedded === null || !NON_PUBLIC_IPV4_LIST.check(embedded, 'ipv4');
}

// ---------------------------------------------------------------------------------------------
// URLs, at creation

/** The host of a URL without IPv6 brackets or a trailing root dot ("example.com." = "example.com"). */
function hostOf(url: URL): string {
  const host = url.hostname.startsWith('[') ? url.hostname.slice(1, -1) : url.hostname;
  return host.endsWith('.') ? host.slice(0, -1) : host;
}

/** Why a URL may never be called, or null when its form is acceptable. */
function urlFormProblem(url: URL): string | null {
  if (url.protocol !== 'http:' && url.protocol !== 'https:') return 'must be an http or https URL';
  if (url.username || url.password) return 'must not carry credentials (user:password@)';
  if (!hostOf(url)) return 'has no host';
  return null;
}

/**
 * The URL a caller registers (a webhook endpoint, a verifier), checked by its text alone: http
 * or https, no credentials, and unless `allowPrivate`, a host that is neither `localhost` nor a
 * literal non-public IP address (in any spelling the URL standard accepts: `127.1`, `0x7f.1`,
 * `[::ffff:127.0.0.1]` all mean loopback). Names are resolved again at each call
 * (fetchGuarded), since their addresses may change after creation.
 */
export function assertPublicUrl(url: string, options: { allowPrivate: boolean; param: string }): URL {
  const { param } = options;
  const refuse = (why: string): never => {
    throw new ServiceError('invalid_request', `${param} ${why}.`, { param });
  };
  if (url.length > OUTBOUND_URL_LENGTH_MAX) refuse(`must be at most ${OUTBOUND_URL_LENGTH_MAX} characters`);
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    return refuse('is not an absolute URL');
  }
  // What is stored and called is the parsed form, which percent-encodes: `é` becomes six characters.
  if (parsed.href.length > OUTBOUND_URL_LENGTH_MAX) refuse(`must be at most ${OUTBOUND_URL_LENGTH_MAX} characters once percent-encoded`);
  const problem = urlFormProblem(parsed);
  if (problem) refuse(problem);
  if (options.allowPrivate) return parsed;
  // Every trailing dot: `localhost..` is localhost too.
  const host = hostOf(parsed).toLowerCase().replace(/\.+$/, '');
  if (isLocalhostName(host)) refuse(`must not point at localhost${allowPrivateHint(host)}`);
  if (isIP(host) && !isPublicAddress(host)) {
    refuse(`must point at a public address: loopback, private, link-local, CGNAT and reserved addresses are refused${allowPrivateHint(host)}`);
  }
  return parsed;
}

/** `localhost` and its subdomains: loopback by name (RFC 6761), never asked of DNS. */
function isLocalhostName(host: string): boolean {
  const name = host.toLowerCase();
  return name === 'localhost' || name.endsWith('.localhost');
}

/**
 * What a refusal of a private target ends with, at creation and at call time: the service's
 * operator can allow such targets for local development, said because the developer who meets
 * the refusal first is often also the one running the service. Only where the URL's own text
 * shows the target private (a localhost name, a literal address); empty for a name DNS answers
 * for, whose refusal must read the same whether it resolved to a private address or to nothing,
 * and must not tell which.
 */
function allowPrivateHint(host: string): string {
  return isLocalhostName(host) || isIP(host) !== 0
    ? ' (a service run for local development can allow them: AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS=on)' : '';
}

// ---------------------------------------------------------------------------------------------
// Calls

export type OutboundFailure = 'bad_url' | 'refused_address' | 'timeout' | 'too_large' | 'network';

/**
 * Why an outbound call failed. `message` is written for the owner of the target (a webhook's
 * delivery log shows it): it never names the address a refused host resolved to, so the service
 * does not become an oracle for its own network's DNS.
 */
export class OutboundError extends Error {
  /** `statusCode`: the status the endpoint answered with, when an answer came (a body too large) */
  constructor(readonly reason: OutboundFailure, message: string, readonly statusCode: number | null = null) {
    super(message);
    this.name = 'OutboundError';
  }
}

export interface OutboundRequest {
  /** GET unless given */
  method?: string;
  headers?: Record<string, string>;
  body?: string | Buffer;
  /** for the whole call: DNS, connect, request, response headers and body */
  timeoutMs: number;
  /** a response body larger than this fails the call with `too_large` */
  maxBytes: number;
  allowPrivate: boolean;
}

export interface OutboundResponse {
  status: number;
  headers: IncomingHttpHeaders;
  body: Buffer;
  latencyMs: number;
}

/** RFC 6761: `localhost` and names under it are loopback, answered without asking DNS. */
const LOOPBACK: readonly LookupAddress[] = [{ address: '127.0.0.1', family: 4 }, { address: '::1', family: 6 }];

/**
 * Every address of a name (IPv4 first), or an OutboundError. Asked of DNS through c-ares
 * (`dns.promises.Resolver`), not `dns.lookup`: getaddrinfo runs on libuv's pool of 4 threads,
 * which the whole process shares (file writes such as the validator's snapshots), and cannot be
 * cancelled, so names a tenant chooses whose DNS never answers could hold that pool past any
 * deadline. A c-ares query takes no pool thread and is cancelled at the deadline. c-ares reads
 * no /etc/hosts: localhost names are answered here, anything else must be in DNS.
 */
async function resolveAll(host: string, timeoutMs: number): Promise<LookupAddress[]> {
  const name = host.toLowerCase();
  if (isLocalhostName(name)) return [...LOOPBACK];
  const resolver = new Resolver({ timeout: Math.max(1, Math.ceil(timeoutMs)), tries: 1 });
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => {
      resolver.cancel();
      reject(new OutboundError('timeout', `resolving ${host} took longer than the call's deadline`));
    }, timeoutMs);
  });
  let graceTimer: NodeJS.Timeout | undefined;
  try {
    const queries = [settleQuery(resolver.resolve4(name), 4), settleQuery(resolver.resolve6(name), 6)] as const;
    const first = await Promise.race([...queries, deadline]);
    // One family answered with addresses: the other gets a moment more, not the whole deadline
    // (a DNS server that drops AAAA queries would otherwise leave the endpoint no time at all).
    const other = first.addresses.length === 0 ? await Promise.race([queries[first.family === 4 ? 1 : 0], deadline])
      : await Promise.race([queries[first.family === 4 ? 1 : 0],
        new Promise<null>((resolve) => { graceTimer = setTimeout(() => resolve(null), OTHER_FAMILY_GRACE_MS); })]);
    const answers = [first, ...(other ? [other] : [])].sort((a, b) => a.family - b.family);
    const addresses = answers.flatMap((answer) => answer.addresses);
    if (addresses.length > 0) return addresses;
    const codes = answers.map((answer) => answer.code);
    if (codes.includes('ETIMEOUT')) throw new OutboundError('timeout', `resolving ${host} timed out`);
    throw new OutboundError('network', `${host} did not resolve (${codes.find((code) => code !== 'ENODATA') ?? 'no address'})`);
  } finally {
    clearTimeout(timer);
    clearTimeout(graceTimer);
    // A query still out (the family that did not answer in its grace) is given up.
    resolver.cancel();
  }
}

/** How long the other address family's query may still take once one family has answered (RFC 8305's resolution delay, doubled). */
const OTHER_FAMILY_GRACE_MS = 100;

interface FamilyAnswer {
  family: 4 | 6;
  addresses: LookupAddress[];
  /** the query's error code; ENODATA for an empty answer */
  code: string | undefined;
}

function settleQuery(query: Promise<string[]>, family: 4 | 6): Promise<FamilyAnswer> {
  return query.then(
    (list) => ({ family, addresses: list.map((address) => ({ address, family })), code: list.length ? undefined : 'ENODATA' }),
    (error: NodeJS.ErrnoException) => ({ family, addresses: [], code: error.code }));
}

/** A `lookup` for net.connect that answers only with addresses vetted beforehand. */
function pinnedLookup(addresses: readonly LookupAddress[]): LookupFunction {
  return (_host, options, callback) => {
    const family = typeof options === 'object' && options.family ? Number(options.family) : 0;
    const usable = family ? addresses.filter((entry) => entry.family === family) : [...addresses];
    if (!usable.length) {
      const error = Object.assign(new Error('no vetted address of the requested family'), { code: 'ENOTFOUND' });
      callback(error, '', 0);
      return;
    }
    if (typeof options === 'object' && options.all) (callback as unknown as (e: null, a: LookupAddress[]) => void)(null, usable);
    else callback(null, usable[0]!.address, usable[0]!.family);
  };
}

/**
 * A URL checked, resolved and vetted, ready for calls (`requestGuarded`): they go to its vetted
 * addresses only, over connections kept for exactly that set of addresses.
 */
export interface GuardedTarget {
  readonly url: URL;
  /** without IPv6 brackets or a trailing root dot */
  readonly host: string;
  readonly addresses: readonly LookupAddress[];
  /** the pool's key: scheme, host, port and every vetted address */
  readonly key: string;
  /** path and query, as the request line has them */
  readonly path: string;
}

/**
 * Checks a URL, resolves its host (within `timeoutMs`) and vets every address it resolves to,
 * unless `allowPrivate`; rejects with an OutboundError (`bad_url`, `refused_address`, `timeout`,
 * `network`). Calls made with the target later do not resolve the name again: a caller making
 * several calls to one URL in a short while (a batch of webhook attempts) resolves it once.
 */
export async function resolveGuarded(url: string, options: { timeoutMs: number; allowPrivate: boolean }): Promise<GuardedTarget> {
  let target: URL;
  try {
    target = new URL(url);
  } catch {
    throw new OutboundError('bad_url', 'the URL is not an absolute URL');
  }
  const problem = url.length > OUTBOUND_URL_LENGTH_MAX ? `is longer than ${OUTBOUND_URL_LENGTH_MAX} characters` : urlFormProblem(target);
  if (problem) throw new OutboundError('bad_url', `the URL ${problem}`);

  const host = hostOf(target);
  const literalFamily = isIP(host);
  // Guarded, a name that does not resolve and one that resolves to a refused address fail alike:
  // telling them apart would let a tenant map which internal names exist (a webhook's delivery
  // log shows the message).
  const notPublic = () => new OutboundError('refused_address',
    `${host} does not resolve to a public address (a loopback, private, link-local, CGNAT or reserved address, or none, is not called)`
    + allowPrivateHint(host));
  let addresses: LookupAddress[];
  if (literalFamily) {
    addresses = [{ address: host, family: literalFamily }];
  } else {
    try {
      addresses = await resolveAll(host, options.timeoutMs);
    } catch (error) {
      if (!options.allowPrivate && error instanceof OutboundError && error.reason === 'network') throw notPublic();
      throw error;
    }
  }
  if (!options.allowPrivate && !addresses.every((entry) => isPublicAddress(entry.address))) {
    throw literalFamily
      ? new OutboundError('refused_address',
        `${host} is a loopback, private, link-local, CGNAT or reserved address, which this service does not call${allowPrivateHint(host)}`)
      : notPublic();
  }
  const key = `${target.origin} ${addresses.length === 1 ? addresses[0]!.address : addresses.map((entry) => entry.address).sort().join(',')}`;
  return { url: target, host, addresses, key, path: `${target.pathname}${target.search}` };
}

/** A call's options once its target is resolved. */
export type GuardedCall = Omit<OutboundRequest, 'allowPrivate'>;

/**
 * One HTTP request to a target, resolved already or still being resolved (`resolveGuarded`'s
 * promise). Never follows redirects (a 3xx is returned like any status), never takes longer than
 * `timeoutMs` from now, the wait for the target included, nor reads more than `maxBytes` of
 * body, and only ever rejects with an OutboundError. The wait is bounded by the resolution's own
 * deadline: one begun no later than this call, with the same `timeoutMs`, settles within it.
 */
export async function requestGuarded(target: GuardedTarget | Promise<GuardedTarget>, options: GuardedCall): Promise<OutboundResponse> {
  const startedMs = performance.now();
  const resolved = await target;
  const remainingMs = startedMs + options.timeoutMs - performance.now();
  if (remainingMs <= 0) throw timeoutError(options.timeoutMs);
  return send(resolved, options, remainingMs, startedMs);
}

/**
 * One HTTP request to a URL the service does not control: `resolveGuarded`, then
 * `requestGuarded`, with one deadline over both.
 */
export async function fetchGuarded(url: string, options: OutboundRequest): Promise<OutboundResponse> {
  if (!(options.timeoutMs > 0) || !(options.maxBytes >= 0)) throw new Error('fetchGuarded needs a positive timeoutMs and a maxBytes');
  return requestGuarded(resolveGuarded(url, options), options);
}

// ---------------------------------------------------------------------------------------------
// Keep-alive connections

/** Destinations whose connections are kept (least recently used dropped first). */
const POOL_DESTINATIONS_MAX = 256;
/**
 * Connections open at once to one destination: above what the service sends concurrently (the
 * webhook dispatcher has at most 256 attempts in flight), so a call never queues behind others
 * on our side, which would eat into its deadline and fail a receiver that is not slow.
 */
const POOL_SOCKETS_PER_DESTINATION = 320;
/**
 * An idle connection is closed after this: below the 5 s keep-alive of common servers (Node's),
 * so the server rarely closes it first. A shorter keep-alive the server announces is honoured.
 */
const POOL_IDLE_MS = 2_000;
const pools = new Map<string, Pool>();

/**
 * The connection pool of one destination: scheme, host, port and the exact set of addresses
 * vetted for this call. A pooled connection was opened to one of those addresses by an earlier
 * call that vetted the same set, so reusing it skips no check; when DNS answers otherwise, the
 * call gets another pool and new connections. TLS names the host (SNI and the certificate
 * check), never the address connected to.
 */
function poolFor(target: GuardedTarget): Pool {
  const { key } = target;
  let pool = pools.get(key);
  if (pool) {
    if (pools.size > 1) pools.delete(key); // re-inserted below: the map's order is the recency order
  } else {
    pool = new Pool(target.url.origin, {
      connections: POOL_SOCKETS_PER_DESTINATION,
      pipelining: 1,
      keepAliveTimeout: POOL_IDLE_MS,
      keepAliveMaxTimeout: POOL_IDLE_MS,
      // The call's own deadline governs (fetchGuarded); these would only cut it shorter.
      headersTimeout: 0,
      bodyTimeout: 0,
      connect: {
        lookup: pinnedLookup(target.addresses),
        ...(target.url.protocol === 'https:' && !isIP(target.host) ? { servername: target.host } : {}),
      },
    });
    if (pools.size >= POOL_DESTINATIONS_MAX) {
      const [oldestKey, oldest] = pools.entries().next().value!;
      pools.delete(oldestKey);
      void oldest.close(); // calls in flight on it finish first
    }
  }
  pools.set(key, pool);
  return pool;
}

/**
 * Sends on a kept-alive connection; if the server had closed that connection just before it was
 * reused (it closes under the request before any answer), once more. The receiver may then see
 * the request twice, which at-least-once delivery allows.
 */
async function send(target: GuardedTarget, options: GuardedCall, remainingMs: number, startedMs: number): Promise<OutboundResponse> {
  try {
    return await sendOnce(target, options, remainingMs, startedMs);
  } catch (error) {
    const retryMs = startedMs + options.timeoutMs - performance.now();
    if (!(error instanceof StaleConnectionError) || retryMs <= 0) throw error instanceof StaleConnectionError ? error.failure : error;
    return sendOnce(target, options, retryMs, startedMs).catch((again: unknown) => {
      throw again instanceof StaleConnectionError ? again.failure : again;
    });
  }
}

/** A reused connection closed before any answer: the server had closed it. */
class StaleConnectionError extends Error {
  constructor(readonly failure: OutboundError) {
    super(failure.message);
  }
}

async function sendOnce(target: GuardedTarget, options: GuardedCall, remainingMs: number, startedMs: number): Promise<OutboundResponse> {
  const headers: Record<string, string> = { ...options.headers };
  if (options.body !== undefined && headers['content-length'] === undefined && headers['Content-Length'] === undefined) {
    headers['content-length'] = String(Buffer.byteLength(options.body));
  }
  // undici takes an EventEmitter as the abort signal: the deadline without an AbortController
  // per call, which cost a webhook attempt ~5 µs of its ~50.
  const deadline = new EventEmitter();
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    deadline.emit('abort');
  }, remainingMs);
  let answer: Dispatcher.ResponseData;
  try {
    answer = await poolFor(target).request({
      path: target.path,
      method: (options.method ?? 'GET') as Dispatcher.HttpMethod,
      headers,
      body: options.body,
      signal: deadline,
    });
  } catch (error) {
    clearTimeout(timer);
    if (timedOut) throw timeoutError(options.timeoutMs);
    const { code, socket } = error as { code?: string; socket?: { bytesRead?: number } };
    const failure = new OutboundError('network', `the request failed (${code ?? 'connection error'})`);
    // Closed by the server under the request, on a connection that had already read bytes: most
    // often a kept-alive one it closed just before reuse (undici's bytesRead is cumulative, so a
    // fresh connection that sent part of an answer and closed is sent again too, which
    // at-least-once allows; a reset, ECONNRESET, is not retried).
    const stale = code === 'UND_ERR_SOCKET' && (socket?.bytesRead ?? 0) > 0;
    throw stale ? new StaleConnectionError(failure) : failure;
  }
  return readAnswer(answer, options.maxBytes, timer, () => timedOut, options.timeoutMs, startedMs);
}

function timeoutError(timeoutMs: number): OutboundError {
  return new OutboundError('timeout', `no complete answer within ${timeoutMs} ms`);
}

/** Reads an answer's body up to `maxBytes`, then ends the call's deadline `timer`. */
function readAnswer(
  answer: Dispatcher.ResponseData, maxBytes: number, timer: NodeJS.Timeout, timedOut: () => boolean, timeoutMs: number, startedMs: number,
): Promise<OutboundResponse> {
  const { statusCode, headers, body } = answer;
  return new Promise<OutboundResponse>((resolve, reject) => {
    const fail = (error: OutboundError): void => {
      clearTimeout(timer);
      body.destroy();
      reject(error);
    };
    body.on('error', () => fail(timedOut() ? timeoutError(timeoutMs) : new OutboundError('network', 'the connection broke while reading the response')));
    const declared = Number(headers['content-length']);
    if (Number.isFinite(declared) && declared > maxBytes) {
      fail(new OutboundError('too_large', `the response body (${declared} bytes) is larger than ${maxBytes} bytes`, statusCode));
      return;
    }
    const chunks: Buffer[] = [];
    let size = 0;
    body.on('data', (chunk: Buffer) => {
      size += chunk.length;
      if (size > maxBytes) fail(new OutboundError('too_large', `the response body is larger than ${maxBytes} bytes`, statusCode));
      else chunks.push(chunk);
    });
    body.on('end', () => {
      clearTimeout(timer);
      resolve({ status: statusCode, headers, body: Buffer.concat(chunks, size), latencyMs: Math.round(performance.now() - startedMs) });
    });
  });
}
