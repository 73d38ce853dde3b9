/**
 * The service's logger (pino): what `serve` and `worker` write. Its serializers keep secrets
 * out of the log (docs/operations.md "Logs"):
 *
 * - an error's bound parameters are dropped: PGlite's errors carry `params`, and a statement
 *   that failed may have bound a webhook's signing secret; a row a constraint refused is not
 *   written out either (PostgreSQL's "Failing row contains (…)" detail lists every column);
 * - a request's query values whose names speak of a secret (`api_key`, `token`, …) are
 *   replaced: no route takes one, but a client may send its key that way, and the request line
 *   is logged before the request is refused.
 */
import pino from 'pino';
import type { FastifyRequest } from 'fastify';

/** Error fields that hold the values a failed statement was given. */
const VALUE_FIELDS = ['params', 'queryOptions'] as const;
const FAILING_ROW = /^(Failing row contains) \(.*\)(\.?)$/s;
/** Query parameter names whose values are not logged. */
const SECRET_NAME = /key|token|secret|password|passwd|signature|auth|session|credential/i;
/** How deep an error's causes are followed. */
const CAUSES_MAX = 5;

type Serialized = Record<string, unknown>;

function withoutValues(serialized: Serialized, depth: number): Serialized {
  for (const field of VALUE_FIELDS) delete serialized[field];
  if (typeof serialized.detail === 'string') serialized.detail = serialized.detail.replace(FAILING_ROW, '$1 (values not logged)$2');
  const cause = serialized.cause;
  if (depth < CAUSES_MAX && cause !== null && typeof cause === 'object') withoutValues(cause as Serialized, depth + 1);
  return serialized;
}

/** pino's error serializer, without the values a failed statement was given. */
export function serializeError(error: Error): Serialized {
  return withoutValues(pino.stdSerializers.err(error) as unknown as Serialized, 0);
}

/** A request's path and query, secret-named query values replaced by `[redacted]`. */
export function loggedUrl(url: string): string {
  const at = url.indexOf('?');
  if (at < 0) return url;
  const query = url.slice(at + 1).split('&').map((pair) => {
    const eq = pair.indexOf('=');
    if (eq < 0) return pair;
    let name = pair.slice(0, eq);
    try {
      name = decodeURIComponent(name.replace(/\+/g, ' '));
    } catch {
      // a malformed escape: judged as written
    }
    return SECRET_NAME.test(name) ? `${pair.slice(0, eq)}=[redacted]` : pair;
  });
  return `${url.slice(0, at)}?${query.join('&')}`;
}

/** Fastify's request serializer, with the URL as `loggedUrl` writes it. */
function serializeRequest(request: FastifyRequest) {
  return {
    method: request.method,
    url: loggedUrl(request.url),
    host: request.host,
    remoteAddress: request.ip,
    remotePort: request.socket?.remotePort,
  };
}

export function serviceLogger(level: string, destination?: pino.DestinationStream): pino.Logger {
  const options: pino.LoggerOptions = { level, serializers: { err: serializeError, req: serializeRequest } };
  return destination ? pino(options, destination) : pino(options);
}
