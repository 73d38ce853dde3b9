/**
 * The service's logger (pino): what `serve` and `worker` write. Its serializers keep secrets
 * out of the log (docs/operations.md "Logs"):
 *
 * - an error's bound parameters are dropped: PGlite's errors carry `params`, and a statement
 *   that failed may have bound a webhook's signing secret; the values a constraint quotes are
 *   not written out either (PostgreSQL's "Failing row contains (…)" lists every column, "Key
 *   (…)=(…)" the key's);
 * - a request's query values whose names speak of a secret (`api_key`, `token`, …), or that look
 *   like one of the service's (`av_…`, `avst_…`, `whsec_…`), are replaced: no route takes one,
 *   but a client may send its key that way, and the request line is logged before the request
 *   is refused.
 */
import pino from 'pino';
import type { FastifyRequest } from 'fastify';

/** Error fields that hold the values a failed statement was given. */
const VALUE_FIELDS = new Set(['params', 'queryOptions']);
/** PostgreSQL's details that quote a row's values: a refused row, a key already taken or missing. */
const ROW_DETAIL = /^(Failing row contains) \(.*\)(\.?)$/s;
const KEY_DETAIL = /^(Key \(.*?\))=\(.*\)( .*)$/s;
/** Query parameter names whose values are not logged, and values that are a secret whatever their name. */
const SECRET_NAME = /key|token|secret|passw|pwd|pass\b|signature|auth|session|credential|bearer/i;
const SECRET_VALUE = /^(av_|avst_|whsec_)/i;
/** How deep an error's fields (causes, an aggregate's errors) are followed. */
const DEPTH_MAX = 5;

function withoutValues(value: unknown, depth: number): unknown {
  if (value === null || typeof value !== 'object' || depth > DEPTH_MAX) return value;
  if (Array.isArray(value)) return value.map((item) => withoutValues(item, depth + 1));
  const copy: Record<string, unknown> = {};
  for (const [field, inner] of Object.entries(value)) {
    if (VALUE_FIELDS.has(field)) continue;
    copy[field] = field === 'detail' && typeof inner === 'string'
      ? inner.replace(ROW_DETAIL, '$1 (values not logged)$2').replace(KEY_DETAIL, '$1=(values not logged)$2')
      : withoutValues(inner, depth + 1);
  }
  return copy;
}

/**
 * pino's error serializer, without the values a failed statement was given, at any depth (a
 * cause, an aggregate's errors); anything else logged as `err` (null, a string, a plain object)
 * is written as it is, its value fields dropped from a copy.
 */
export function serializeError(error: unknown): unknown {
  return withoutValues(error instanceof Error ? pino.stdSerializers.err(error) : error, 0);
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
    let value = pair.slice(eq + 1);
    try {
      value = decodeURIComponent(value.replace(/\+/g, ' '));
    } catch {
      // as written
    }
    return SECRET_NAME.test(name) || SECRET_VALUE.test(value) ? `${pair.slice(0, eq)}=[redacted]` : pair;
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
