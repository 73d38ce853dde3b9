/**
 * Builds the HTTP API as a Fastify instance; never listens (server.ts owns the process).
 * Conventions of DESIGN §2–3 live here once: request ids, the error shape, body limits,
 * unknown fields rejected, snake_case aliases, rate limits, the OpenAPI document.
 */
import { STATUS_CODES, type IncomingMessage, type ServerResponse } from 'node:http';
import type { Duplex } from 'node:stream';
import Fastify, {
  LogController,
  type FastifyBaseLogger, type FastifyError, type FastifyInstance, type FastifyReply, type FastifyRequest, type RawServerDefault,
} from 'fastify';
import rateLimit from '@fastify/rate-limit';
import underPressure from '@fastify/under-pressure';
import { SOLANA_ERROR__JSON_RPC__SERVER_ERROR_NODE_UNHEALTHY, SOLANA_ERROR__RPC__TRANSPORT_HTTP_ERROR, isSolanaError } from '@solana/kit';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import { ChainUnavailableError } from '../chain/client.ts';
import { postgresUnreachable } from '../db/unreachable.ts';
import { ERROR_CODES, ServiceError, invalidRequest, retryShortly, type ErrorCode } from '../errors/errors.ts';
import { newId } from '../ids/ids.ts';
import { authenticate, principalOf } from './auth.ts';
import { duplicateKeyPath } from './duplicate-keys.ts';
import { ERROR_CODE_KEYWORD, PATTERN_TEXT_KEYWORD } from './fields.ts';
import type { AppContext } from './context.ts';
import { registerDocs } from './docs.ts';
import { registerRoutes } from './routes.ts';

export type App = FastifyInstance<RawServerDefault, IncomingMessage, ServerResponse, FastifyBaseLogger, TypeBoxTypeProvider>;

/** Request bodies are small JSON documents; policies, whose lists may be long, have a limit of their own (policies/routes.ts). */
export const BODY_LIMIT_BYTES = 64 * 1024;

export interface BuildAppOptions {
  /** server.ts's pino logger; none = silent (tests) */
  logger?: FastifyBaseLogger;
  /** the wall clock of the outage log's minute (tests) */
  wallNowMs?: () => number;
}

/**
 * A failure that repeats during an outage (a request answered 503, a job failing at each run) is
 * logged at its first, then at most this often with the count: an outage of two minutes logged
 * some 4,000 lines from the jobs and 1,259 from requests, each with its error's stack.
 */
export const FAILURE_LOG_EVERY_MS = 60_000;

/** The most a client may take to send its request's headers, within the whole request's time. */
const HEADERS_TIMEOUT_MS = 10_000;
/** A CONNECT socket (answered 400, outside the server's timeouts) is destroyed after this at the latest. */
const CONNECT_CLOSE_MS = 5_000;
/** A connection silent both ways this long is closed (see connectionTimeout below). */
const CONNECTION_IDLE_MS = 120_000;

export async function buildApp(ctx: AppContext, options: BuildAppOptions = {}): Promise<App> {
  const requestTimeoutMs = ctx.config.requestTimeoutSeconds * 1000;
  const outage: OutageLog = { wallNowMs: options.wallNowMs ?? Date.now, toldMs: -Infinity, untold: 0 };
  const app = Fastify({
    ...(options.logger ? { loggerInstance: options.logger } : { logger: false }),
    bodyLimit: BODY_LIMIT_BYTES,
    // A client trickling its request (a byte every few seconds) would hold its connection, and a
    // body's buffer, for as long as it liked: the whole request must arrive within the timeout
    // (Node checks every connection at the interval, so a late one waits at most that long more).
    requestTimeout: requestTimeoutMs,
    // A connection with no traffic either way for this long is closed: a client that stops
    // reading its answer (the socket's buffers full) would otherwise hold it, and a place under
    // maxConnections, for ever. Longer than any answer takes to make (a payment waits 20 s).
    connectionTimeout: CONNECTION_IDLE_MS,
    http: {
      headersTimeout: Math.min(HEADERS_TIMEOUT_MS, requestTimeoutMs),
      connectionsCheckingInterval: Math.min(5_000, requestTimeoutMs),
      // Node would answer an HTTP/1.1 request without a Host header with a bare 400 of its own:
      // the onRequest hook below refuses it in the API's error shape instead.
      requireHostHeader: false,
    },
    // Refused by Node's parser or its timeouts, before Fastify has a request: the API's error shape.
    clientErrorHandler: (error, socket) => answerClientError(ctx, error, socket),
    genReqId: () => newId('req', Date.now()),
    requestIdHeader: false,
    // Request lines (incoming, completed) are logged, labelled with the request's id.
    logController: new LogController({ requestIdLogLabel: 'request_id', disableRequestLogging: false }),
    // Requests that reach a closing server are answered below, in the API's error shape.
    return503OnClosing: false,
    // Refused by the router before any hook runs: answered in the API's error shape all the same.
    frameworkErrors: (error, request, reply) => {
      reply.header('Request-Id', request.id);
      const tooLong = error.code === 'FST_ERR_MAX_PARAM_LENGTH';
      return sendError(ctx, outage, new ServiceError('invalid_request',
        tooLong ? 'A path segment is longer than any id this API has.' : 'The URL is malformed (a bad percent-encoding).', { param: 'path' }),
      request, reply);
    },
    ajv: {
      customOptions: {
        removeAdditional: false,
        coerceTypes: false,
        allErrors: false,
        useDefaults: true,
        // An error names the schema that failed, so that a field may carry its own code (fields.ts).
        // It then also carries the offending data (up to the whole body): toServiceError keeps
        // neither, and validation errors must not be logged whole.
        verbose: true,
        keywords: [ERROR_CODE_KEYWORD, PATTERN_TEXT_KEYWORD],
      },
    },
  }).withTypeProvider<TypeBoxTypeProvider>() as unknown as App;
  // Past it, Node closes each new connection as it arrives: the ones open keep working, and the
  // process keeps the file descriptors its database and chain connections need.
  app.server.maxConnections = ctx.config.maxConnections;
  // Answered by Node itself, outside Fastify, unless listened for: an `Expect` other than
  // 100-continue (a bare 417) and CONNECT (the socket closed without a word). The API's error shape.
  app.server.on('checkExpectation', (request: IncomingMessage, response: ServerResponse) => {
    const answer = rawErrorAnswer(ctx, 417, 'expect', `Expect: ${String(request.headers.expect).slice(0, 100)} is not one this API meets (only 100-continue).`);
    response.writeHead(answer.status, answer.headers).end(answer.body);
  });
  // The socket is handed over without Node's error handler or timeouts: it gets its own, its
  // answer after any earlier one it still owes (pipelined), and is destroyed once that is written
  // or after CONNECT_CLOSE_MS, whatever the client does (a reset, a side left open).
  app.server.on('connect', (_request: IncomingMessage, socket: Duplex) => {
    socket.on('error', () => socket.destroy());
    const cut = setTimeout(() => socket.destroy(), CONNECT_CLOSE_MS);
    socket.once('close', () => clearTimeout(cut));
    const answer = () => {
      if (!socket.destroyed) socket.end(rawErrorAnswer(ctx, 400, 'method', 'CONNECT is not a method of this API.').text, () => socket.destroy());
    };
    // Node attaches the next pipelined answer as each one finishes: wait for all of them.
    const afterOwed = () => {
      const owed = (socket as Duplex & { _httpMessage?: ServerResponse | null })._httpMessage;
      if (owed && !owed.writableFinished) owed.once('finish', afterOwed);
      else answer();
    };
    afterOwed();
  });

  // Bodies are JSON only: Fastify's own text/plain parser would hand a route a string, refused
  // as "must be object" instead of asking for the content type the API takes.
  app.removeContentTypeParser('text/plain');
  // A client that hung up while its request waited for its key check (a database round trip) has
  // a body stream already ended in error: Fastify's read of it would wait for events that came
  // before it listened, and the request would stay in memory for good. Ended here as the read's
  // error would have (clientHungUp).
  app.addHook('preParsing', async (request, _reply, payload) => {
    if (request.raw.destroyed && !request.raw.complete) throw Object.assign(new Error('aborted'), { code: 'ECONNRESET', statusCode: 400 });
    return payload;
  });
  // Fastify's JSON parser (a `__proto__` key refused), then a key given twice refused too: a
  // proxy or a signature check in front may read the first value where JSON.parse keeps the last.
  const parseJson = app.getDefaultJsonParser('error', 'error');
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, raw, done) => {
    // Read after the key and its permission are checked (docs/api-keys.md, the order of checks).
    // A compressed body is not decoded: refused as such, rather than run as if the header were
    // absent (a plain body so labelled) or called "not valid JSON" (a compressed one).
    const encoding = request.headers['content-encoding']?.trim().toLowerCase();
    if (encoding && encoding !== 'identity') {
      done(invalidRequest('body', `The body is sent with Content-Encoding ${encoding}, which this API does not decode: send it uncompressed.`), undefined);
      return;
    }
    // JSON is UTF-8 (RFC 8259 §8.1): bytes that are not are refused, not read with U+FFFD in their
    // place (a memo, a name, the idempotency key's hash changed). A body declared in another
    // charset is taken when it is ASCII, which every such charset reads alike; with other bytes
    // it is refused, as they mean something else there.
    const charset = CHARSET.exec(request.headers['content-type'] ?? '')?.[1]?.toLowerCase();
    if (charset !== undefined && charset !== 'utf-8' && charset !== 'utf8' && !isAscii(raw as Buffer)) {
      done(invalidRequest('body', `The body is declared as ${charset} and is not ASCII: send JSON in UTF-8 (charset=utf-8, or no charset).`), undefined);
      return;
    }
    let text: string;
    try {
      text = UTF8.decode(raw as Buffer);
    } catch {
      done(invalidRequest('body', 'The body is not valid UTF-8, which JSON must be.'), undefined);
      return;
    }
    parseJson(request, text, (error, body) => {
      if (error) {
        // Valid JSON that Fastify's parser refused: a `__proto__` key, or `constructor.prototype`.
        done(parsesAsJson(text)
          ? invalidRequest('body', 'The body has a "__proto__" or "constructor.prototype" key, which is not allowed.')
          : error, undefined);
        return;
      }
      const twice = duplicateKeyPath(text);
      if (twice) {
        const param = twice.map(toSnakeCase).join('.');
        done(invalidRequest(param, `"${param}" is given twice.`), undefined);
        return;
      }
      done(null, body);
    });
  });
  app.decorateRequest('principal', null);
  let closing = false;
  app.addHook('preClose', async () => { closing = true; });
  app.addHook('onRequest', async (request, reply) => {
    reply.header('Request-Id', request.id);
    if (closing) {
      // A request on a connection kept alive while the server drains: sent elsewhere by the client
      // (a new connection reaches the next process), at once. A wait, not an outage: not logged
      // as a dependency down.
      reply.header('Connection', 'close');
      throw retryShortly('The service is shutting down; retry.', 1);
    }
  });
  app.addHook('onRequest', async (request) => {
    const { headers } = request;
    if (headers.host === undefined && request.raw.httpVersion === '1.1') {
      throw invalidRequest('host', 'The request has no Host header, which HTTP/1.1 requires.');
    }
    // Node keeps the first of two and drops the rest; a proxy in front may have read another
    // (RFC 9112 §3.2: 400). The same for the credentials: a proxy or a log that reads the last
    // Authorization would disagree with the key this request is judged by.
    for (const [name, shown] of [['host', 'Host'], ['authorization', 'Authorization']] as const) {
      if (headerCount(request.raw.rawHeaders, name) > 1) throw invalidRequest(name, `The request has more than one ${shown} header.`);
    }
    // No body at all, with a JSON content type (a client sending the header on every call): no
    // body, as without the header, rather than "not valid JSON". A body that is sent must parse.
    if (headers['transfer-encoding'] === undefined && (headers['content-length'] === undefined || headers['content-length'] === '0')) {
      delete headers['content-type'];
    }
  });
  await registerShedding(app, ctx);
  // Every authenticated request is counted against its key, whatever its answer (DESIGN §3's 429
  // with Retry-After): authenticate calls the limiter between the key's read and the role check,
  // before any body is parsed. Unauthenticated requests are not counted (docs/decisions.md).
  await app.register(rateLimit, {
    global: false,
    max: ctx.config.rateLimitPerMinute,
    timeWindow: 60_000,
    keyGenerator: (request) => principalOf(request).keyId,
    errorResponseBuilder: (_request, context) => {
      const error = new ServiceError('rate_limited',
        `Rate limit of ${context.max} requests per minute exceeded; retry in ${Math.ceil(context.ttl / 1000)} s.`);
      (error as ServiceError & { statusCode: number }).statusCode = 429;
      return error;
    },
  });
  app.addHook('onRequest', authenticate(ctx, app.rateLimit()));
  app.addHook('preValidation', async (request) => {
    // `GET /v1/wallets/` (a trailing slash) matches `/v1/wallets/:wallet_id` with an empty id, and
    // `/v1/wallets//fund` too: there is no such route, rather than "no wallet ''".
    const params = request.params as Record<string, unknown> | undefined;
    const empty = params && !request.is404 ? Object.keys(params).find((name) => params[name] === '') : undefined;
    if (empty !== undefined) {
      throw request.routeOptions.config.emptyParam?.() ?? new ServiceError('not_found',
        `No route ${request.method} ${request.url.split('?')[0]}: its ${empty} is empty (a trailing or doubled "/").`, { param: empty });
    }
    // An Idempotency-Key is taken where the body takes `idempotencyKey` (DESIGN §2's list: the
    // money moves and the creations of wallets and escrows). Elsewhere it would protect nothing
    // — a retry would run again — so a POST or PATCH with it is refused, as the body field is,
    // rather than ignored. (GET, PUT and DELETE repeat harmlessly whatever the header.)
    if (request.headers['idempotency-key'] !== undefined && (request.method === 'POST' || request.method === 'PATCH')
      && !request.is404 && !takesIdempotencyKey(request.routeOptions.schema?.body)) {
      throw invalidRequest('idempotency_key',
        'This request does not take an Idempotency-Key: only payments, escrow creation, wallet creation, funding, batch funding '
          + 'and withdrawals do (docs/decisions.md, "Idempotency"). Send it without the header.');
    }
    // A DELETE takes no field: one sent is refused (400 naming it), as every body refuses unknown
    // fields, rather than ignored (`{"force": true}` does not force anything). Checked here, not
    // by a body schema, which the OpenAPI document would show as a required request body.
    if (request.method === 'DELETE' && request.body !== undefined && !request.is404) {
      const fields = typeof request.body === 'object' && request.body !== null && !Array.isArray(request.body) ? Object.keys(request.body) : null;
      if (fields === null) throw invalidRequest('body', 'A DELETE takes no body: send none, or {}.');
      if (fields.length > 0) throw invalidRequest(toSnakeCase(fields[0]!), `Unknown field "${fields[0]}": a DELETE takes no body.`);
    }
    // A query parameter a route does not take is refused, as its lists refuse one (their schemas
    // close the query) and every body refuses an unknown field: `DELETE /v1/webhooks/{id}?dry_run=true`
    // must not delete anything while the client believes it asked for a dry run.
    if (request.routeOptions.config.permission && !request.routeOptions.schema?.querystring && !request.is404) {
      const [unknown] = Object.keys(request.query as Record<string, unknown>);
      if (unknown !== undefined) {
        const param = shownPath(toSnakeCase(unknown));
        throw invalidRequest(param, `Unknown field "${param}": this request takes no query parameter.`);
      }
    }
    // A POST without a body is an empty object: `POST /v1/payments/:id/approve` needs no fields.
    if (request.body === undefined && request.routeOptions.schema?.body) request.body = {};
    if (request.body && typeof request.body === 'object' && !Array.isArray(request.body)) {
      request.body = camelCaseKeys(request.body as Record<string, unknown>);
    }
    // PostgreSQL stores no NUL character, in text or in JSON, and no unpaired UTF-16 surrogate in
    // JSON: refused here, with the field it is in, rather than as the database's failure (a 500)
    // once the request has come that far.
    const found = unstorableText(request.params, '') ?? unstorableText(request.query, '') ?? unstorableText(request.body, '');
    if (found !== null) {
      const param = shownPath(found.path || 'body');
      throw invalidRequest(param, `"${param}" contains ${found.what}, which is not allowed.`);
    }
  });

  app.setErrorHandler((error: FastifyError | ServiceError, request, reply) => sendError(ctx, outage, error, request, reply));
  app.setNotFoundHandler((request, reply) =>
    sendError(ctx, outage, new ServiceError('not_found', `No route ${request.method} ${request.url.split('?')[0]}.`), request, reply));

  await registerDocs(app, ctx);
  // Answered under load too (it reads the database and the chain, as it says it does), both at
  // once, each given HEALTH_CHECK_MS: a dependency that hangs is down for a probe, which would
  // otherwise wait out the chain client's 10 s and give up before the answer.
  app.get('/healthz', { schema: { hide: true }, config: { pressureHandler: () => null } }, async (_request, reply) => {
    const checks = { database: () => ctx.db.query('SELECT 1'), chain: () => ctx.chain.getHealth() };
    const results = await Promise.all(Object.entries(checks).map(async ([name, check]) => ((await answersWithin(check(), HEALTH_CHECK_MS)) ? null : name)));
    const unavailable = results.filter((name) => name !== null);
    if (unavailable.length) return reply.code(503).send({ status: 'unavailable', unavailable });
    return { status: 'ok' };
  });
  registerRoutes(app, ctx);
  return app;
}

/** How long /healthz waits for each of the database and the chain. */
const HEALTH_CHECK_MS = 2_000;

/** Whether `work` succeeds within `ms` (its result is not waited for past that). */
async function answersWithin(work: Promise<unknown>, ms: number): Promise<boolean> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<boolean>((resolve) => { timer = setTimeout(() => resolve(false), ms); });
  try {
    return await Promise.race([work.then(() => true, () => false), late]);
  } finally {
    clearTimeout(timer);
  }
}

/** The event loop's delay is averaged over this long, and the limit applied to each average. */
const SHEDDING_SAMPLE_MS = 1_000;
/** How long a client refused for load is told to wait. */
export const OVERLOADED_RETRY_AFTER_S = 2;
/** An overload is logged at most this often, with the requests refused since. */
const OVERLOAD_LOG_INTERVAL_MS = 10_000;

/**
 * Load shedding: while the event loop's mean delay over the last second is above
 * AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS, every new request is refused 503 with Retry-After before
 * anything else is done for it (no key read, no body), so that the requests already taken finish
 * and the queue stops growing. Without it, an overloaded process (PGlite's one connection busy
 * all the time, say) took every request and answered them 10–47 s later. The mean, not the
 * longest stall: one slow statement does not refuse anyone, a loop that is late all the time does.
 */
async function registerShedding(app: App, ctx: AppContext): Promise<void> {
  let refused = 0;
  let loggedAtMs = 0;
  // The second a process starts in, its loop is taken by the start itself (the database opened,
  // migrations, the program deployed): that second's delay says nothing of load, and the first
  // requests after it are let through.
  let readyAtMs = Infinity;
  app.addHook('onReady', async () => { readyAtMs = Date.now(); });
  await app.register(underPressure, {
    maxEventLoopDelay: ctx.config.maxEventLoopDelayMs,
    sampleInterval: SHEDDING_SAMPLE_MS,
    pressureHandler: async (request, _reply, _type, value) => {
      if (Date.now() - readyAtMs < 2 * SHEDDING_SAMPLE_MS) return;
      refused += 1;
      const nowMs = Date.now();
      if (nowMs - loggedAtMs >= OVERLOAD_LOG_INTERVAL_MS) {
        request.log.warn({ eventLoopDelayMs: Math.round(value ?? 0), refused }, 'overloaded: refusing new requests');
        loggedAtMs = nowMs;
        refused = 0;
      }
      throw retryShortly(`The service is overloaded (its event loop is ${Math.round(value ?? 0)} ms late); retry in `
        + `${OVERLOADED_RETRY_AFTER_S} s. Nothing of this request was done.`, OVERLOADED_RETRY_AFTER_S);
    },
  });
  // After the plugin's hook, so run for requests it took: the first taken after refusals (other
  // than /healthz, always taken) ends the overload, and the refusals not logged yet are.
  app.addHook('onRequest', async (request) => {
    if (refused === 0 || request.routeOptions.url === '/healthz') return;
    request.log.warn({ refused }, 'overload over: serving requests again');
    refused = 0;
    loggedAtMs = 0;
  });
}

/**
 * A request Node's HTTP parser refused or timed out before Fastify saw it: headers too large
 * (431), a request not received in full in time (408), anything unparsable (400). The answer has
 * the API's error shape and a request id, and the connection is closed after it. Nothing is
 * written to a connection that never sent a byte (an idle one is just closed), nor while the
 * answer to an earlier request on it is still to come (a pipelined request, or a body still
 * arriving after its refusal went out): that answer is let finish, then the connection closes —
 * a 408 there would read as the earlier request's answer, though it ran.
 */
function answerClientError(ctx: AppContext, error: Error & { code?: string }, socket: Duplex): void {
  if (error.code === 'ECONNRESET' || socket.destroyed) return;
  // The answer the socket owes next, and the request it answers: a request received in full is
  // an earlier one than the request that timed out (one whose body is still arriving is that one).
  const pending = (socket as Duplex & { _httpMessage?: ServerResponse | null })._httpMessage;
  if (pending && !pending.writableFinished && pending.req.complete) {
    pending.shouldKeepAlive = false;
    pending.once('close', () => socket.destroy());
    return;
  }
  if (socket.writable && pending?.headersSent !== true && (socket as Duplex & { bytesRead?: number }).bytesRead !== 0) {
    const [status, param, message] = error.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? [408, 'request', `The request was not received in full in time (its headers within ${Math.min(HEADERS_TIMEOUT_MS / 1000, ctx.config.requestTimeoutSeconds)} s, `
        + `all of it within ${ctx.config.requestTimeoutSeconds} s).`]
      : error.code === 'HPE_HEADER_OVERFLOW'
        ? [431, 'headers', 'The request\'s headers are larger than 16 KiB.']
        : [400, 'request', 'The request is not valid HTTP.'];
    socket.write(rawErrorAnswer(ctx, status, param, message).text);
  }
  socket.destroy(error);
}

/**
 * An `invalid_request` answered outside Fastify (Node's parser, its timeouts, its own handling of
 * `Expect` and CONNECT), in the API's error shape, with a request id and `Connection: close`:
 * its status, headers and body, and the whole answer as HTTP/1.1 text for a bare socket.
 */
function rawErrorAnswer(ctx: AppContext, status: number, param: string, message: string) {
  const requestId = newId('req', Date.now());
  const body = JSON.stringify({
    error: { code: 'invalid_request', message, docs: docsLink(ctx, 'invalid_request'), request_id: requestId, param },
  });
  const headers = {
    'Content-Type': 'application/json; charset=utf-8', 'Content-Length': String(Buffer.byteLength(body)), 'Request-Id': requestId, Connection: 'close',
  };
  const text = `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\n${Object.entries(headers).map(([name, value]) => `${name}: ${value}\r\n`).join('')}\r\n${body}`;
  return { status, headers, body, text };
}

function docsLink(ctx: AppContext, code: ErrorCode): string {
  return `${ctx.config.docsUrl}/errors#${code}`;
}

/** When the last line about requests answered 503 went out, and how many were answered since. */
interface OutageLog {
  wallNowMs: () => number;
  toldMs: number;
  untold: number;
}

function sendError(ctx: AppContext, outage: OutageLog, error: FastifyError | ServiceError, request: FastifyRequest, reply: FastifyReply): FastifyReply {
  const service = toServiceError(error, request.routeOptions.bodyLimit ?? BODY_LIMIT_BYTES);
  if (service.code === 'internal_error') {
    request.log.error({ err: error }, 'unhandled error');
  } else if (clientHungUp(error)) {
    // No answer reaches it, and it is no sign of the database or the chain being down.
    request.log.info('the client closed its connection before its body arrived');
  } else if (service.code === 'service_unavailable' && service.retryAfterS === null) {
    // A 503 that says when to retry (retryShortly) is a wait, not an outage. Each request's own
    // line (at info) still has its status.
    const nowMs = outage.wallNowMs();
    if (nowMs - outage.toldMs < FAILURE_LOG_EVERY_MS) {
      outage.untold += 1;
    } else {
      const more = outage.untold ? `; ${outage.untold} more answered 503 since the last such line` : '';
      request.log.warn({ err: error, untold: outage.untold }, `dependency unavailable${more}`);
      outage.toldMs = nowMs;
      outage.untold = 0;
    }
  }
  if (service.replayed) reply.header('Idempotency-Replayed', 'true');
  // Refused before its body was read (a bad key, a rate limit): the client may still be sending
  // it, and a connection kept alive would have to take the rest first. Closed instead.
  const { headers } = request.raw;
  const hasBody = headers['transfer-encoding'] !== undefined || Number(headers['content-length'] ?? 0) > 0;
  if (hasBody && request.raw.complete === false) reply.header('Connection', 'close');
  // When to ask again: a refusal that knows says so (a 503 whose cause passes soon, a quota);
  // a rate limit always does (60 s when it does not know, unless the limiter said already).
  if (service.retryAfterS !== null) reply.header('Retry-After', String(service.retryAfterS));
  else if (service.code === 'rate_limited' && !reply.getHeader('retry-after')) reply.header('Retry-After', '60');
  return reply.code(service.status).send({
    error: {
      code: service.code,
      message: service.message,
      docs: docsLink(ctx, service.code),
      request_id: request.id,
      ...service.details,
    },
  });
}

/** Whether a route's body schema has the `idempotencyKey` field, and so takes the header too. */
function takesIdempotencyKey(body: unknown): boolean {
  return typeof body === 'object' && body !== null
    && Object.hasOwn((body as { properties?: object }).properties ?? {}, 'idempotencyKey');
}

function parsesAsJson(text: string): boolean {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

/** Every failure becomes one code of the closed list; nothing internal reaches the client. */
function toServiceError(error: FastifyError | ServiceError, bodyLimitBytes: number): ServiceError {
  if (error instanceof ServiceError) return error;
  const fastifyError = error as FastifyError & { validation?: ValidationFailure[]; validationContext?: string };
  if (fastifyError.validation && fastifyError.validation.length) {
    const first = fastifyError.validation[0]!;
    const path = first.instancePath.replace(/^\//, '').replace(/\//g, '.');
    // An unknown or missing field is named by its full path (`allocations.1.wallet_id`).
    const within = (field: string | undefined) => (field === undefined || !path ? field : `${path}.${field}`);
    const extra = within(first.params.additionalProperty as string | undefined);
    const missing = within(first.params.missingProperty as string | undefined);
    const param = shownPath(extra ?? missing ?? (path || fastifyError.validationContext || 'body'));
    const message = extra ? `Unknown field "${param}".`
      : missing ? `Missing required field "${param}".`
        : first.keyword === 'minProperties' && !path ? 'The body has no field: send at least one field to change.'
        : `Invalid value for "${param}": ${failureText(first, fastifyError.validation, fastifyError.validationContext)}.`;
    const code = first.parentSchema?.[ERROR_CODE_KEYWORD] as ErrorCode | undefined;
    return new ServiceError(code ?? 'invalid_request', message, { param: toSnakeCase(param) });
  }
  switch (fastifyError.code) {
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return new ServiceError('invalid_request', 'The body is not valid JSON.', { param: 'body' });
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new ServiceError('invalid_request', `The body is larger than ${bodyLimitBytes} bytes.`, { param: 'body' });
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new ServiceError('invalid_request', 'Send the body as application/json.', { param: 'body' });
    default:
      break;
  }
  if (fastifyError.statusCode === 429) return new ServiceError('rate_limited', fastifyError.message);
  if (clientHungUp(error)) return new ServiceError('invalid_request', 'The connection closed before the body arrived in full.', { param: 'body' });
  if (dependencyDown(error)) {
    return new ServiceError('service_unavailable', 'The database or the chain is not answering; retry (with the same idempotency key).');
  }
  if (fastifyError.statusCode && fastifyError.statusCode >= 400 && fastifyError.statusCode < 500) {
    return new ServiceError('invalid_request', 'The request is malformed.', { param: 'body' });
  }
  return new ServiceError('internal_error', 'An internal error occurred.');
}

/** The client closed its connection while sending its body: the read's error, which Fastify marks 400. */
function clientHungUp(error: FastifyError | ServiceError): boolean {
  return !(error instanceof ServiceError) && error.code === 'ECONNRESET' && error.statusCode === 400;
}

/** An Ajv error, with the schema and data `verbose` adds. */
interface ValidationFailure {
  instancePath: string;
  keyword: string;
  params: Record<string, unknown>;
  message?: string;
  parentSchema?: Record<string, unknown>;
  data?: unknown;
}

/**
 * What is wrong with a value, said so that the client can fix it: a value outside a fixed list
 * (a union of constants: one error per constant, at the same place) names the values taken; a
 * JSON number where an amount is expected (amounts are decimal strings) shows how to send it.
 */
function failureText(first: ValidationFailure, all: readonly ValidationFailure[], context: string | undefined): string {
  const allowed = all.filter((failure) => failure.instancePath === first.instancePath && failure.keyword === 'const')
    .map((failure) => failure.params.allowedValue);
  if (first.keyword === 'const' && allowed.length > 1) return `must be one of ${allowed.map((value) => JSON.stringify(value)).join(', ')}`;
  // A constant or something else (a union with one literal): what the union's description says.
  const union = all.find((failure) => failure.instancePath === first.instancePath && failure.keyword === 'anyOf');
  const described = union?.parentSchema?.description;
  if (first.keyword === 'const' && typeof described === 'string') return `must be ${described}`;
  if (first.keyword === 'type' && first.params.type === 'string' && typeof first.data === 'number' && isAmountSchema(first.parentSchema)) {
    // The number itself when it is one an amount field would take, written as a string.
    const example = /^\d+(\.\d{1,6})?$/.test(String(first.data)) ? String(first.data) : '0.25';
    return `must be a string, such as "${example}" (amounts are decimal strings)`;
  }
  // A pattern is said in words where its schema gives them (fields.ts patternString), never as the expression.
  const patternText = first.parentSchema?.[PATTERN_TEXT_KEYWORD];
  if (first.keyword === 'pattern' && typeof patternText === 'string') return patternText;
  // `?limit=1&limit=2` arrives as an array: the field is repeated, not of the wrong type.
  if (context === 'querystring' && first.keyword === 'type' && Array.isArray(first.data) && first.data.length > 1) {
    return 'given more than once; give it once';
  }
  return first.message ?? 'not allowed';
}

/** A field of decimal USDC: a payment's amount (fields.ts) or a setting described so (a policy's limits). */
function isAmountSchema(schema: Record<string, unknown> | undefined): boolean {
  return schema?.[ERROR_CODE_KEYWORD] === 'invalid_amount' || /decimal USDC/.test(String(schema?.description ?? ''));
}

/**
 * Network failures of a connection (to PostgreSQL, to an RPC node), and undici's own (fetch, to an
 * RPC node): the other side closed the connection without an answer (a proxy or load balancer in
 * front of the node, a node going down mid-request), or a connection, answer or body not in time.
 */
const NETWORK_ERROR_CODES = new Set([
  'ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'EHOSTUNREACH', 'ENETUNREACH', 'ENOTFOUND', 'EAI_AGAIN',
  'UND_ERR_SOCKET', 'UND_ERR_CLOSED', 'UND_ERR_CONNECT_TIMEOUT', 'UND_ERR_HEADERS_TIMEOUT', 'UND_ERR_BODY_TIMEOUT',
]);

/**
 * Whether an error says that the database or the chain is down or unreachable (the error, or one
 * of its causes): the request may succeed when retried, so it is 503, not 500.
 */
export function dependencyDown(error: unknown, depth = 0): boolean {
  if (!error || typeof error !== 'object' || depth > 4) return false;
  // The chain client's own: a call the chain did not answer in time.
  if (error instanceof ChainUnavailableError) return true;
  const { code, name, cause } = error as { code?: unknown; name?: unknown; cause?: unknown };
  if (typeof code === 'string' && NETWORK_ERROR_CODES.has(code)) return true;
  if (postgresUnreachable(error)) return true;
  // The embedded validator's thread stopped; an RPC node said it is unhealthy, or answered 5xx
  // or 429 (a 4xx is a request or a configuration it will refuse again: a bad key in the URL).
  if (name === 'ValidatorThreadError' || isSolanaError(error, SOLANA_ERROR__JSON_RPC__SERVER_ERROR_NODE_UNHEALTHY)) return true;
  if (isSolanaError(error, SOLANA_ERROR__RPC__TRANSPORT_HTTP_ERROR)) {
    const { statusCode } = error.context;
    return statusCode >= 500 || statusCode === 429;
  }
  return dependencyDown(cause, depth + 1);
}

/**
 * The path (`a.0.b`, keys in snake_case) of the first string or key in `value` that PostgreSQL
 * cannot store, and what it holds: U+0000, or a UTF-16 surrogate without its pair (JSON's
 * `"\ud800"` parses to one; jsonb refuses it). Null when there is none. Walked with a stack of
 * its own: a body nested thousands deep (JSON.parse takes it) is still walked, and then refused
 * by the schema.
 */
function unstorableText(value: unknown, path: string): { path: string; what: string } | null {
  // Each entry: a value, its path, and what the key naming it holds (then its parent's path).
  const stack: Array<[unknown, string, { path: string; what: string } | null]> = [[value, path, null]];
  while (stack.length) {
    const [item, at, badKey] = stack.pop()!;
    if (badKey !== null) return badKey;
    if (typeof item === 'string') {
      const what = unstorableIn(item);
      if (what !== null) return { path: at, what };
      continue;
    }
    if (!item || typeof item !== 'object') continue;
    for (const [key, child] of Object.entries(item).reverse()) {
      const keyHolds = unstorableIn(key);
      stack.push([child, at ? `${at}.${toSnakeCase(key)}` : toSnakeCase(key), keyHolds === null ? null : { path: at, what: keyHolds }]);
    }
  }
  return null;
}

/** The charset parameter of a Content-Type (`application/json; charset="latin1"`). */
const CHARSET = /;\s*charset\s*=\s*"?([^";\s]+)"?/i;
/** Refuses bytes that are not UTF-8; leaves a byte order mark in (the JSON parser skips it). */
const UTF8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });
/** A field's path as an error names it, shortened in its middle past 120 characters (arrays nested thousands deep). */
const SHOWN_PATH_MAX = 120;
function shownPath(path: string): string {
  return path.length <= SHOWN_PATH_MAX ? path : `${path.slice(0, 60)}…${path.slice(-59)}`;
}

/** How many times a header is given (rawHeaders alternates names and values). */
function headerCount(rawHeaders: readonly string[], name: string): number {
  let count = 0;
  for (let i = 0; i < rawHeaders.length; i += 2) if (rawHeaders[i]!.toLowerCase() === name) count += 1;
  return count;
}

function isAscii(bytes: Buffer): boolean {
  return bytes.every((byte) => byte < 0x80);
}

/** A lone surrogate: a high one not followed by a low one, or a low one not after a high one. */
const LONE_SURROGATE = /[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;

function unstorableIn(text: string): string | null {
  if (text.includes('\u0000')) return 'a NUL character (\\u0000)';
  if (LONE_SURROGATE.test(text)) return 'an unpaired UTF-16 surrogate (\\ud800-\\udfff)';
  return null;
}

/** Objects nested in arrays of a body (fund-batch allocations, policy lists) go one or two deep. */
const BODY_DEPTH_MAX = 16;

export function toSnakeCase(name: string): string {
  return name.replace(/[A-Z]/g, (letter) => `_${letter.toLowerCase()}`);
}

/**
 * Bodies take the camelCase reference names and, as aliases, the snake_case spellings of
 * SPEC.md's examples. Both spellings of one field in one body is ambiguous: refused.
 */
export function camelCaseKeys(body: Record<string, unknown>, depth = 0): Record<string, unknown> {
  // No request schema nests objects this deep: refused before the walk could exhaust the stack.
  if (depth > BODY_DEPTH_MAX) throw invalidRequest('body', `The body nests objects more than ${BODY_DEPTH_MAX} deep.`);
  const out: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(body)) {
    const camel = key.includes('_') ? key.replace(/_([a-z0-9])/g, (_m, c: string) => c.toUpperCase()) : key;
    if (Object.hasOwn(out, camel)) {
      throw new ServiceError('invalid_request', `"${key}" is given twice (camelCase and snake_case).`, { param: toSnakeCase(camel) });
    }
    out[camel] = Array.isArray(value)
      ? value.map((item) => (item && typeof item === 'object' && !Array.isArray(item) ? camelCaseKeys(item as Record<string, unknown>, depth + 1) : item))
      : value;
  }
  return out;
}

export { ERROR_CODES };
