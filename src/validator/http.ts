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

export async function startRpcServer(validator: LocalValidator, options: RpcServerOptions): Promise<RpcServer> {
  const host = options.host ?? '127.0.0.1';
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
