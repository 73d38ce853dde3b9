/**
 * The webhook endpoint of the benchmark's webhooks run: answers every request `200` at once, over
 * kept-alive connections. A real endpoint runs on the customer's machines; this one shares the
 * two cores with the service it measures, so it does as little as an HTTP/1.1 server can: it
 * finds each request's head, skips `Content-Length` bytes of body and writes a prebuilt answer.
 * node:http's server cost ~0.2 ms of CPU per delivery here, as much as the service's own share
 * of sending it. It accepts only what the service's dispatcher sends (requests with a
 * Content-Length, never chunked) and closes a connection whose request it cannot read.
 */
import { createServer, type AddressInfo, type Server, type Socket } from 'node:net';

const HEAD_END = Buffer.from('\r\n\r\n');
const ANSWER = Buffer.from('HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n');
/** A head longer than this is not from the dispatcher. */
const HEAD_BYTES_MAX = 16 * 1024;

export class RawReceiver {
  /** Requests answered. */
  requests = 0;
  /** Connections accepted. */
  connections = 0;
  readonly #server: Server;

  constructor() {
    this.#server = createServer({ noDelay: true }, (socket) => this.#serve(socket));
  }

  /** Listens on 127.0.0.1; answers the URL to register as a webhook. */
  async listen(): Promise<string> {
    await new Promise<void>((resolve) => this.#server.listen(0, '127.0.0.1', resolve));
    return `http://127.0.0.1:${(this.#server.address() as AddressInfo).port}/hook`;
  }

  close(): void {
    this.#server.close();
  }

  #serve(socket: Socket): void {
    this.connections += 1;
    let pending: Buffer = Buffer.alloc(0);
    /** Body bytes of the current request still to skip. */
    let bodyLeft = 0;
    socket.on('error', () => socket.destroy());
    socket.on('data', (chunk: Buffer) => {
      pending = pending.length ? Buffer.concat([pending, chunk]) : chunk;
      let answers = 0;
      for (;;) {
        if (bodyLeft > 0) {
          const skipped = Math.min(bodyLeft, pending.length);
          bodyLeft -= skipped;
          pending = pending.subarray(skipped);
          if (bodyLeft > 0) break;
          answers += 1;
        }
        const headEnd = pending.indexOf(HEAD_END);
        if (headEnd < 0) {
          if (pending.length > HEAD_BYTES_MAX) socket.destroy();
          break;
        }
        const length = /\r\ncontent-length:\s*(\d+)/i.exec(pending.subarray(0, headEnd).toString('latin1'));
        if (!length) {
          socket.destroy();
          return;
        }
        pending = pending.subarray(headEnd + HEAD_END.length);
        bodyLeft = Number(length[1]);
        if (bodyLeft === 0) answers += 1;
      }
      if (answers) {
        this.requests += answers;
        socket.write(answers === 1 ? ANSWER : Buffer.concat(Array.from({ length: answers }, () => ANSWER)));
      }
    });
  }
}
