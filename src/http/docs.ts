/**
 * The API reference: the OpenAPI 3.1 document generated from the route schemas
 * (`/openapi.json`), a browsable reference at `/docs`, and `/docs/errors` with every error code
 * (the `docs` link of every error points into it).
 */
import { createHash } from 'node:crypto';
import { gzipSync } from 'node:zlib';
import swagger from '@fastify/swagger';
import swaggerUi from '@fastify/swagger-ui';
import { Type } from 'typebox';
import { ERROR_CODES } from '../errors/errors.ts';
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { App } from './app.ts';
import type { AppContext } from './context.ts';
import { OPERATION_IDS } from './operation-ids.ts';

/** Every error response, as `/docs/errors` describes it (more fields by code: `violation`, `available`…). */
const ErrorResponse = Type.Object({
  error: Type.Object({
    code: Type.Union(Object.keys(ERROR_CODES).map((code) => Type.Literal(code)), { description: 'one of /docs/errors' }),
    message: Type.String({ description: 'for people; may change' }),
    docs: Type.String({ description: 'the code\'s entry in /docs/errors' }),
    request_id: Type.String({ description: 'equals the Request-Id header' }),
    param: Type.Optional(Type.String({ description: 'the field at fault (snake_case), for validation errors' })),
  }, { additionalProperties: true }),
}, { description: 'An error: see /docs/errors for every code and its status' });

/** Permissions of the routes an `agent` key reaches, with its vault's session token. */
const AGENT_PERMISSIONS = new Set(['pay', 'vault_read']);

/**
 * What the document adds to each route's schema (for the document only: answers are not
 * serialised with it): the error responses, and the headers a route reads beyond
 * Authorization — `Idempotency-Key` where the body takes `idempotencyKey`, `Session-Token`
 * where an agent key may call it.
 */
function documented({ schema, url, route }: { schema: Record<string, any>; url: string; route: { config?: unknown; method?: string | string[] } }) {
  if (!schema || schema.hide) return { schema, url };
  const method = [route.method ?? []].flat().find((name) => name !== 'HEAD');
  const permission = (route.config as { permission?: string } | undefined)?.permission;
  const headers: Record<string, ReturnType<typeof Type.Optional<ReturnType<typeof Type.String>>>> = {};
  if (schema.body?.properties?.idempotencyKey) {
    headers['idempotency-key'] = Type.Optional(Type.String({
      description: 'makes the request safe to retry: a replay answers the first answer (or idempotencyKey in the body); '
        + '1 to 255 printable ASCII characters, no space',
    }));
  }
  if (permission !== undefined && AGENT_PERMISSIONS.has(permission)) {
    headers['session-token'] = Type.Optional(Type.String({ description: 'with an agent key (and only then) required: the session token of the vault acted on (POST /v1/wallets/{id}/rotate-token)' }));
  }
  // A success is described by the operation's summary ("A wallet, with its balance and policy"),
  // not by "Default Response".
  const success = Object.fromEntries(Object.entries(schema.response ?? { 200: {} })
    .map(([status, response]) => [status, (response as { description?: string }).description ? response
      : { ...(response as object), description: schema.summary ?? 'Success' }]));
  return {
    url,
    schema: {
      ...schema,
      ...(method && OPERATION_IDS[`${method} ${url}`] ? { operationId: OPERATION_IDS[`${method} ${url}`] } : {}),
      ...(Object.keys(headers).length ? { headers: Type.Object(headers) } : {}),
      response: { ...success, '4xx': ErrorResponse, '5xx': ErrorResponse },
    },
  };
}

/**
 * A POST whose body has no required field may be sent without one (it is then `{}`: app.ts), so
 * its request body is optional in the document; @fastify/swagger marks every body required.
 * A PATCH keeps it: it needs at least one field.
 */
function optionalBodies({ openapiObject }: { openapiObject: Record<string, any> }): Record<string, any> {
  for (const item of Object.values(openapiObject.paths ?? {}) as Array<Record<string, any>>) {
    const body = item.post?.requestBody;
    const schema = body?.content?.['application/json']?.schema;
    if (schema && !(schema.required?.length > 0)) body.required = false;
    // A route that answers files (an export's download: `produces` CSV, JSON, JSON Lines) answers
    // its errors in JSON alone; @fastify/swagger gives every response each media type produced.
    for (const operation of Object.values(item) as Array<{ responses?: Record<string, { content?: Record<string, unknown> }> }>) {
      for (const [status, response] of Object.entries(operation.responses ?? {})) {
        const json = response.content?.['application/json'];
        if (!status.startsWith('2') && json) response.content = { 'application/json': json };
      }
    }
  }
  return openapiObject;
}

export async function registerDocs(app: App, _ctx: AppContext): Promise<void> {
  await app.register(swagger, {
    transform: documented,
    transformObject: optionalBodies as never,
    openapi: {
      openapi: '3.1.0',
      info: {
        title: 'Agent Vault API',
        version: '1.0.0-beta',
        description: 'Policy-governed USDC vaults on Solana for software agents. Amounts are decimal strings of USDC '
          + '(at most 6 fractional digits). Errors: see /docs/errors. Request bodies are described in camelCase; every '
          + 'field is also accepted in snake_case, as SPEC.md writes it (`wallet_id` for `walletId`, `owner_org` for '
          + '`ownerOrg`), at any depth, and errors name fields in snake_case (`param`). An `Idempotency-Key` header is '
          + 'taken where it is listed, and refused on other POST and PATCH requests.',
      },
      components: {
        securitySchemes: { apiKey: { type: 'http', scheme: 'bearer', description: 'Authorization: Bearer <API_KEY>' } },
      },
      security: [{ apiKey: [] }],
    },
  });
  // The document, in JSON at /openapi.json and /docs/json and in YAML at /docs/yaml, is made once,
  // on its first request (the routes are all registered by then), and kept with its gzip: no key
  // is needed to read it, and making it takes ~8 ms of the event loop, so a client looping it
  // would slow every other request. Each later request is answered from the copy.
  const documents = new Map<string, StoredDocument>();
  const served = (request: FastifyRequest, reply: FastifyReply): FastifyReply | null => {
    const stored = documents.get(request.routeOptions.url ?? '');
    return stored ? sendStored(request, reply, stored) : null;
  };
  // The reference's routes in a scope of their own, so that the hook keeping their copies runs
  // for them alone, not for every request of the API.
  await app.register(async (scope) => {
    scope.addHook('onSend', async (request, reply, payload) => {
      const url = request.routeOptions.url;
      if ((url === '/docs/json' || url === '/docs/yaml') && reply.statusCode === 200 && !documents.has(url) && typeof payload === 'string') {
        documents.set(url, storedDocument(payload, String(reply.getHeader('content-type') ?? 'application/json')));
      }
      return payload;
    });
    await scope.register(swaggerUi, {
      routePrefix: '/docs', staticCSP: true,
      uiHooks: { onRequest: async (request: FastifyRequest, reply: FastifyReply) => served(request, reply) ?? undefined },
    });
  });
  app.get('/openapi.json', { schema: { hide: true } }, async (request, reply) => {
    if (!documents.has('/openapi.json')) documents.set('/openapi.json', storedDocument(JSON.stringify(app.swagger()), 'application/json; charset=utf-8'));
    return served(request, reply);
  });
  app.get('/docs/errors', { schema: { hide: true } }, async (_request, reply) => {
    const rows = Object.entries(ERROR_CODES).map(([code, { status, description }]) =>
      `<tr id="${code}"><td><a href="#${code}"><code>${code}</code></a></td><td>${status}</td><td>${descriptionHtml(description)}</td></tr>`);
    return reply.type('text/html; charset=utf-8').send(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Agent Vault — errors</title>
<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.5rem;text-align:left;vertical-align:top}
tr:target{background:#fff6d5}</style></head><body>
<h1>Errors</h1>
<p>Every error response is <code>{"error": {"code", "message", "docs", "request_id", ...}}</code>.
Validation errors add <code>param</code>; policy violations add <code>violation</code> {rule, limit, attempted},
<code>wallet_id</code>, <code>policy_id</code> and <code>tx_id</code> (the blocked attempt, recorded). The <code>Request-Id</code> header equals <code>request_id</code>.</p>
<table><thead><tr><th>code</th><th>status</th><th>meaning</th></tr></thead><tbody>
${rows.join('\n')}
</tbody></table></body></html>`);
  });
}

/**
 * A description of ERROR_CODES as HTML: its `backticked` spans (field names, headers, routes)
 * as <code>. Escaped first, so that the only markup is ours; a backtick is not escaped, so the
 * spans are found as written.
 */
function descriptionHtml(description: string): string {
  return escapeHtml(description).replace(/`([^`]+)`/g, '<code>$1</code>');
}

function escapeHtml(text: string): string {
  return text.replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]!);
}

interface StoredDocument { text: string; gzip: Buffer; type: string; etag: string }

function storedDocument(text: string, type: string): StoredDocument {
  const tag = createHash('sha256').update(text).digest('base64url').slice(0, 27);
  return { text, gzip: gzipSync(text), type, etag: tag };
}

/**
 * The stored document, gzipped when the client takes gzip (a `q` of 0 refuses it), or 304 when
 * the client holds it (`If-None-Match`: a list, weak or strong tags, or `*`). Each coding has its
 * own tag, as RFC 9110 asks.
 */
function sendStored(request: FastifyRequest, reply: FastifyReply, stored: StoredDocument): FastifyReply {
  const gzip = acceptsGzip(String(request.headers['accept-encoding'] ?? ''));
  const etag = gzip ? `"${stored.etag}-gz"` : `"${stored.etag}"`;
  reply.type(stored.type).header('ETag', etag).header('Vary', 'Accept-Encoding');
  const held = String(request.headers['if-none-match'] ?? '').split(',').map((tag) => tag.trim().replace(/^W\//, ''));
  if (held.includes(etag) || held.includes('*')) return reply.code(304).send();
  return gzip ? reply.header('Content-Encoding', 'gzip').send(stored.gzip) : reply.send(stored.text);
}

function acceptsGzip(header: string): boolean {
  return header.split(',').some((entry) => {
    const [coding = '', ...params] = entry.split(';').map((part) => part.trim().toLowerCase());
    const q = params.find((param) => param.startsWith('q='));
    return (coding === 'gzip' || coding === 'x-gzip') && (q === undefined || Number(q.slice(2)) > 0);
  });
}
