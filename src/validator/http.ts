/**
 * The local validator over HTTP, for `agent-vault validator` and for clients in other
 * processes: POST JSON-RPC at any path, like a Solana node (GET /health answers "ok" as well).
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { createRpcHandler, JSON_RPC_ERRORS } from './rpc.ts';
import type { LocalValidator } from './validator.ts';

/** Largest request body: a full batch of transactions fits with room to spare. */
export const MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024;
/** Connections open at once (each may hold a body of up to MAX_REQUEST_BODY_BYTES); more are closed as they come. */
export const MAX_CONNECTIONS = 256;
/** A request must arrive within this. */
const REQUEST_TIMEOUT_MS = 30_000;

export interface RpcServer {
  server: Server;
  url: string;
  port: number;
  close(): Promise<void>;
}

export interface RpcServerOptions {
  port: number;
  host?: string;
  log?: (entry: Record<string, unknown>) => void;
}

function send(response: ServerResponse, status: number, body: string): void {
  response.writeHead(status, { 'content-type': 'application/json; charset=utf-8', 'content-length': Buffer.byteLength(body) });
  response.end(body);
}

function errorBody(code: number, message: string): string {
  return JSON.stringify({ jsonrpc: '2.0', id: null, error: { code, message } });
}

function isJson(contentType: string | undefined): boolean {
  return contentType?.split(';')[0]?.trim().toLowerCase() === 'application/json';
}

const LOOPBACK_HOSTS = new Set(['localhost', '127.0.0.1', '::1', '[::1]']);

function isLoopbackName(host: string): boolean {
  return LOOPBACK_HOSTS.has(host.toLowerCase()) || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
}

/** A Host header naming loopback (its port aside). */
function isLoopbackHost(header: string | undefined): boolean {
  if (!header) return false;
  const name = header.startsWith('[') ? header.slice(0, header.indexOf(']') + 1) : header.replace(/:\d+$/, '');
  return isLoopbackName(name);
}

export async function startRpcServer(validator: LocalValidator, options: RpcServerOptions): Promise<RpcServer> {
  const host = options.host ?? '127.0.0.1';
  const loopback = isLoopbackName(host);
  const handler = createRpcHandler(validator, { log: options.log });
  const server = createServer({ requestTimeout: REQUEST_TIMEOUT_MS }, (request: IncomingMessage, response: ServerResponse) => {
    if (request.method === 'GET' && request.url === '/health') {
      // As getHealth: not ok while the validator cannot persist its state (halted).
      let unhealthy: string | null = null;
      try {
        validator.assertHealthy();
      } catch (error) {
        unhealthy = (error as Error).message;
      }
      response.writeHead(unhealthy === null ? 200 : 503, { 'content-type': 'text/plain' });
      response.end(unhealthy ?? 'ok');
      return;
    }
    if (request.method !== 'POST') {
      response.writeHead(405, { allow: 'POST' });
      response.end();
      return;
    }
    // A web page may POST to any address its browser reaches, but only as a "simple" request
    // (text/plain, a form) unless the server answers a CORS preflight, which this one never does:
    // JSON alone, as Solana's own RPC requires, keeps pages from calling the cheatcodes (mint,
    // set the clock). Bound to loopback, the Host must name loopback too: a page's own name
    // rebound to 127.0.0.1 (DNS rebinding) is refused.
    if (!isJson(request.headers['content-type'])) {
      send(response, 415, errorBody(JSON_RPC_ERRORS.invalidRequest, 'Content-Type: application/json is required'));
      request.resume();
      return;
    }
    if (loopback && !isLoopbackHost(request.headers.host)) {
      send(response, 403, errorBody(JSON_RPC_ERRORS.invalidRequest, 'this RPC listens on loopback: its Host must be localhost or a loopback address'));
      request.resume();
      return;
    }
    const declared = Number(request.headers['content-length'] ?? 0);
    if (declared > MAX_REQUEST_BODY_BYTES) {
      send(response, 413, errorBody(JSON_RPC_ERRORS.invalidRequest, `request body exceeds ${MAX_REQUEST_BODY_BYTES} bytes`));
      request.resume();
      return;
    }
    const chunks: Buffer[] = [];
    let size = 0;
    let refused = false;
    request.on('data', (chunk: Buffer) => {
      if (refused) return;
      size += chunk.length;
      if (size > MAX_REQUEST_BODY_BYTES) {
        refused = true;
        send(response, 413, errorBody(JSON_RPC_ERRORS.invalidRequest, `request body exceeds ${MAX_REQUEST_BODY_BYTES} bytes`));
        return;
      }
      chunks.push(chunk);
    });
    request.on('end', () => {
      if (refused) return;
      handler.handle(Buffer.concat(chunks).toString('utf8')).then(
        (body) => {
          if (body === '') {
            response.writeHead(204);
            response.end();
          } else {
            send(response, 200, body);
          }
        },
        (error: unknown) => {
          options.log?.({ level: 'error', msg: 'rpc request failed', err: String(error) });
          send(response, 500, errorBody(JSON_RPC_ERRORS.internalError, 'Internal error'));
        },
      );
    });
  });
  server.maxConnections = MAX_CONNECTIONS;
  await new Promise<void>((resolveListen, rejectListen) => {
    server.once('error', rejectListen);
    server.listen(options.port, host, () => {
      server.off('error', rejectListen);
      resolveListen();
    });
  });
  const port = (server.address() as AddressInfo).port;
  const urlHost = host.includes(':') ? `[${host}]` : host;
  return {
    server,
    url: `http://${urlHost}:${port}`,
    port,
    close: () => new Promise<void>((resolveClose) => {
      server.close(() => resolveClose());
      server.closeIdleConnections();
    }),
  };
}
