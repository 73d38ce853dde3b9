/**
 * A webhook receiver for tests: a real HTTP server on 127.0.0.1 that records every request and
 * checks `Service-Signature` the way docs/webhooks.md tells receivers to (HMAC-SHA256 of the raw
 * body, constant-time comparison), written with node:crypto alone so that it does not share the
 * dispatcher's code.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';
import { createServer, type IncomingHttpHeaders } from 'node:http';
import type { AddressInfo } from 'node:net';

export interface ReceivedRequest {
  path: string;
  headers: IncomingHttpHeaders;
  rawBody: string;
  body: Record<string, unknown>;
  /** whether `Service-Signature` is the HMAC of the raw body with `secret` */
  signatureValid: boolean;
  /** what `receivedAt()` said when the request arrived (the service clock, in tests) */
  receivedAtMs: number;
}

export interface Reply {
  status: number;
  headers?: Record<string, string>;
  body?: string;
  /** answer this much later (real time) */
  delayMs?: number;
}

export interface Receiver {
  /** the receiver's URL with `path` (default `/hook`), on the given host name (default 127.0.0.1) */
  url(path?: string, host?: string): string;
  port: number;
  received: ReceivedRequest[];
  /** the secret requests must be signed with; null accepts anything (and records signatureValid false) */
  secret: string | null;
  /** how to answer; default 200 `ok` for a valid signature, 401 otherwise */
  reply: (request: ReceivedRequest) => Reply;
  close(): Promise<void>;
}

function hexEqual(expected: string, presented: string | undefined): boolean {
  if (typeof presented !== 'string' || !/^[0-9a-f]{64}$/.test(presented)) return false;
  return timingSafeEqual(Buffer.from(expected, 'hex'), Buffer.from(presented, 'hex'));
}

export async function startReceiver(options: { receivedAt?: () => number } = {}): Promise<Receiver> {
  const receivedAt = options.receivedAt ?? (() => Date.now());
  const receiver: Receiver = {
    url: () => '',
    port: 0,
    received: [],
    secret: null,
    reply: (request) => (request.signatureValid ? { status: 200, body: 'ok' } : { status: 401, body: 'bad signature' }),
    close: async () => {},
  };
  const server = createServer((request, response) => {
    const chunks: Buffer[] = [];
    request.on('data', (chunk: Buffer) => chunks.push(chunk));
    request.on('end', () => {
      const rawBody = Buffer.concat(chunks).toString('utf8');
      let body: Record<string, unknown> = {};
      try {
        body = JSON.parse(rawBody) as Record<string, unknown>;
      } catch {
        // recorded with an empty body; the test sees it
      }
      const signature = request.headers['service-signature'];
      const signatureValid = receiver.secret !== null
        && hexEqual(createHmac('sha256', receiver.secret).update(rawBody).digest('hex'), typeof signature === 'string' ? signature : undefined);
      const record: ReceivedRequest = {
        path: request.url ?? '', headers: request.headers, rawBody, body, signatureValid, receivedAtMs: receivedAt(),
      };
      receiver.received.push(record);
      const reply = receiver.reply(record);
      setTimeout(() => {
        response.writeHead(reply.status, { 'content-type': 'text/plain', ...reply.headers });
        response.end(reply.body ?? '');
      }, reply.delayMs ?? 0);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  receiver.port = port;
  receiver.url = (path = '/hook', host = '127.0.0.1') => `http://${host}:${port}${path}`;
  receiver.close = () => new Promise<void>((resolve) => {
    server.closeAllConnections();
    server.close(() => resolve());
  });
  return receiver;
}
