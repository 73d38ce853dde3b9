/**
 * HTTP/1.1 POSTs over kept-alive raw sockets, for the benchmark's paced load. node:http's client
 * cost the load generator ~0.7 ms of CPU per request, on the same two cores as the service it
 * measures; this writes one prebuilt head and body per request and reads only the status line
 * and Content-Length of the answer (the service answers JSON with a length, never chunked).
 */
import { connect, type Socket } from 'node:net';

interface Waiter {
  body: string;
  resolve(status: number): void;
  reject(error: Error): void;
}

interface Connection {
  socket: Socket;
  waiter: Waiter | null;
  received: Buffer;
  timer: NodeJS.Timeout | null;
}

const HEAD_END = Buffer.from('\r\n\r\n');

export class RawPostClient {
  readonly #host: string;
  readonly #port: number;
  readonly #head: string;
  readonly #maxSockets: number;
  readonly #timeoutMs: number;
  readonly #idle: Connection[] = [];
  readonly #all = new Set<Connection>();
  readonly #queued: Waiter[] = [];

  constructor(url: URL, headers: Record<string, string>, options: { maxSockets: number; timeoutMs: number }) {
    this.#host = url.hostname;
    this.#port = Number(url.port);
    const lines = Object.entries(headers).map(([name, value]) => `${name}: ${value}\r\n`).join('');
    this.#head = `POST ${url.pathname} HTTP/1.1\r\nhost: ${url.host}\r\nconnection: keep-alive\r\n${lines}`;
    this.#maxSockets = options.maxSockets;
    this.#timeoutMs = options.timeoutMs;
  }

  /** Sends `body` (JSON); answers the response's status code once its whole body has arrived. */
  post(body: string): Promise<number> {
    return new Promise<number>((resolve, reject) => {
      const waiter = { body, resolve, reject };
      const connection = this.#idle.pop() ?? (this.#all.size < this.#maxSockets ? this.#open() : null);
      if (connection) this.#send(connection, waiter);
      else this.#queued.push(waiter);
    });
  }

  close(): void {
    for (const connection of this.#all) connection.socket.destroy();
  }

  #open(): Connection {
    const socket = connect({ host: this.#host, port: this.#port, noDelay: true });
    const connection: Connection = { socket, waiter: null, received: Buffer.alloc(0), timer: null };
    this.#all.add(connection);
    socket.on('data', (chunk: Buffer) => this.#onData(connection, chunk));
    const fail = (error: Error) => {
      if (!this.#all.delete(connection)) return;
      const index = this.#idle.indexOf(connection);
      if (index >= 0) this.#idle.splice(index, 1);
      this.#finish(connection, error);
      // A waiter queued behind a full pool gets the room this connection left.
      const next = this.#queued.shift();
      if (next) this.#send(this.#open(), next);
    };
    socket.on('error', fail);
    socket.on('close', () => fail(new Error('connection closed')));
    return connection;
  }

  #send(connection: Connection, waiter: Waiter): void {
    connection.waiter = waiter;
    connection.timer = setTimeout(() => connection.socket.destroy(new Error('timeout')), this.#timeoutMs);
    connection.socket.write(`${this.#head}content-length: ${Buffer.byteLength(waiter.body)}\r\n\r\n${waiter.body}`);
  }

  #onData(connection: Connection, chunk: Buffer): void {
    const received = connection.received.length === 0 ? chunk : Buffer.concat([connection.received, chunk]);
    connection.received = received;
    const headEnd = received.indexOf(HEAD_END);
    if (headEnd < 0) return;
    const head = received.subarray(0, headEnd).toString('latin1');
    const length = /\r\ncontent-length:\s*(\d+)/i.exec(head);
    if (!length) {
      connection.socket.destroy(new Error(`an answer without Content-Length: ${head.split('\r\n')[0]}`));
      return;
    }
    if (received.length < headEnd + HEAD_END.length + Number(length[1])) return;
    const status = Number(head.slice(9, 12));
    const closing = /\r\nconnection:\s*close/i.test(head);
    this.#finish(connection, null, status);
    if (closing) {
      connection.socket.destroy();
      return;
    }
    const next = this.#queued.shift();
    if (next) this.#send(connection, next);
    else this.#idle.push(connection);
  }

  #finish(connection: Connection, error: Error | null, status = 0): void {
    if (connection.timer) clearTimeout(connection.timer);
    connection.timer = null;
    const waiter = connection.waiter;
    connection.waiter = null;
    connection.received = Buffer.alloc(0);
    if (!waiter) return;
    if (error) waiter.reject(error);
    else waiter.resolve(status);
  }
}
