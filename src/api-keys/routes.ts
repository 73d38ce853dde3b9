/**
 * API key endpoints (SPEC.md "Authentication", DESIGN §7): admin keys create, list, read and
 * revoke the organisation's keys. The key itself appears once, in the creation response.
 */
import { Type } from 'typebox';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { PageQuery, pageOf, parsePageRequest } from '../http/pagination.ts';
import {
  ApiKeyView, CreatedApiKeyView, KeyNameSchema, RoleSchema,
  apiKeyView, createApiKey, createdApiKeyView, getApiKey, listApiKeys, revokeApiKey,
} from './api-keys.ts';

const ApiKeyParams = Type.Object({ api_key_id: Type.String({ maxLength: 64 }) });

export function apiKeyRoutes(app: App, ctx: AppContext): void {
  app.post('/v1/api-keys', {
    config: { permission: 'api_keys' },
    schema: {
      tags: ['API keys'], summary: 'Create an API key; the key is in this response only',
      body: Type.Object({ name: KeyNameSchema, role: RoleSchema }, { additionalProperties: false }),
      response: { 200: CreatedApiKeyView },
    },
  }, async (request) => {
    const { orgId, keyId } = principalOf(request);
    return createdApiKeyView(await createApiKey(ctx.db, ctx.clock.nowMs(), orgId, request.body,
      { max: ctx.config.apiKeysPerOrgMax, actingKeyId: keyId }));
  });

  app.get('/v1/api-keys', {
    config: { permission: 'api_keys' },
    schema: {
      tags: ['API keys'], summary: 'List the organisation\'s API keys, newest first, revoked ones included',
      querystring: Type.Object({ ...PageQuery }, { additionalProperties: false }),
      response: { 200: pageOf(ApiKeyView) },
    },
  }, async (request) => listApiKeys(ctx.db, principalOf(request).orgId, parsePageRequest(request.query)));

  app.get('/v1/api-keys/:api_key_id', {
    config: { permission: 'api_keys' },
    schema: { tags: ['API keys'], summary: 'One API key (never the key itself)', params: ApiKeyParams, response: { 200: ApiKeyView } },
  }, async (request) => apiKeyView(await getApiKey(ctx.db, principalOf(request).orgId, request.params.api_key_id)));

  app.delete('/v1/api-keys/:api_key_id', {
    config: { permission: 'api_keys' },
    schema: {
      tags: ['API keys'], summary: 'Revoke an API key at once',
      description: 'Its next request answers 401 authentication_failed. Revoking a revoked key returns it unchanged. '
        + 'The organisation\'s last active admin key cannot be revoked (400 invalid_request, param api_key_id).',
      params: ApiKeyParams, response: { 200: ApiKeyView },
    },
  }, async (request) => {
    const { orgId, keyId } = principalOf(request);
    return apiKeyView(await revokeApiKey(ctx.db, ctx.clock.nowMs(), orgId, request.params.api_key_id, { actingKeyId: keyId }));
  });
}
