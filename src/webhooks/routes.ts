/**
 * Webhook endpoints (SPEC "Webhooks", docs/webhooks.md): register an endpoint (its signing secret
 * in that response only), read, list, change, delete, rotate the secret, send a test ping, and
 * read the delivery log.
 */
import { Type } from 'typebox';
import { invalidRequest } from '../errors/errors.ts';
import { EVENT_TYPES } from '../events/events.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { NoFields } from '../http/fields.ts';
import { PageQuery, pageOf, parsePageRequest } from '../http/pagination.ts';
import { OUTBOUND_URL_LENGTH_MAX } from '../net/outbound.ts';
import { DeliveryStatusSchema, DeliveryView, PingResultView, listDeliveries, sendTestPing } from './delivery.ts';
import {
  SUBSCRIPTIONS_MAX, WebhookView, WebhookWithSecretView,
  createWebhook, deleteWebhook, getWebhook, listWebhooks, rotateSigningSecret, updateWebhook, webhookView, webhookWithSecretView,
} from './webhooks.ts';

const WebhookParams = Type.Object({ webhook_id: Type.String({ maxLength: 64 }) });
/** Names are checked by the use-case (so the message can list the known ones); the schema only bounds them. */
const Subscriptions = Type.Union([
  Type.Literal('*'),
  // An empty array is refused by the use-case, whose message says what to send instead.
  Type.Array(Type.String({ maxLength: 64, description: `an event name: ${EVENT_TYPES.join(', ')}` }), { maxItems: SUBSCRIPTIONS_MAX }),
], { description: '"*" (or ["*"]) for every event, or an array of event names (docs/events.md)' });
const Url = Type.String({ maxLength: OUTBOUND_URL_LENGTH_MAX, description: 'http(s); not localhost or a private address unless AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS is on' });
const URL_RULES = 'A `url` that is not http(s), carries credentials, or points at localhost or a non-public address '
  + '(unless AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS is on) answers 400 `invalid_request` with `param: "url"`; '
  + 'an unknown event name answers it with `param: "events"`.';

export function webhookRoutes(app: App, ctx: AppContext): void {
  const urlPolicy = { allowPrivateUrls: ctx.config.allowPrivateWebhooks };

  app.post('/v1/webhooks', {
    config: { permission: 'write' },
    schema: {
      tags: ['Webhooks'], summary: 'Register a webhook endpoint; its signing secret is in this response only',
      description: `${URL_RULES} An organisation has at most 20 webhooks.`,
      body: Type.Object({ url: Url, events: Subscriptions }, { additionalProperties: false }),
      response: { 200: WebhookWithSecretView },
    },
  }, async (request) => webhookWithSecretView(await createWebhook(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.body, urlPolicy)));

  app.get('/v1/webhooks', {
    config: { permission: 'read' },
    schema: {
      tags: ['Webhooks'], summary: 'List the organisation\'s webhooks, newest first',
      querystring: Type.Object({ ...PageQuery }, { additionalProperties: false }),
      response: { 200: pageOf(WebhookView) },
    },
  }, async (request) => listWebhooks(ctx.db, principalOf(request).orgId, parsePageRequest(request.query)));

  app.get('/v1/webhooks/:webhook_id', {
    config: { permission: 'read' },
    schema: {
      tags: ['Webhooks'], summary: 'One webhook (never its secret)',
      params: WebhookParams, response: { 200: WebhookView },
    },
  }, async (request) => webhookView(await getWebhook(ctx.db, principalOf(request).orgId, request.params.webhook_id)));

  app.patch('/v1/webhooks/:webhook_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Webhooks'], summary: 'Change the url, the subscriptions or the status',
      description: `${URL_RULES} \`status: "active"\` re-enables a degraded or disabled webhook: its paused deliveries `
        + 'start a new run of 5 attempts at once. `status: "disabled"` pauses its deliveries and stops queuing new events.',
      params: WebhookParams,
      body: Type.Object({
        url: Type.Optional(Url),
        events: Type.Optional(Subscriptions),
        status: Type.Optional(Type.Union([Type.Literal('active'), Type.Literal('disabled')], {
          description: '`degraded` is set by the service only',
        })),
      }, { additionalProperties: false, minProperties: 1 }),
      response: { 200: WebhookView },
    },
  }, async (request) => webhookView(await updateWebhook(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.params.webhook_id, request.body, urlPolicy)));

  app.delete('/v1/webhooks/:webhook_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Webhooks'], summary: 'Delete a webhook and its delivery log; nothing more is sent to it',
      params: WebhookParams,
      response: { 200: Type.Object({ webhook_id: Type.String(), deleted: Type.Literal(true) }) },
    },
  }, async (request) => {
    const { webhook_id: webhookId } = request.params;
    await deleteWebhook(ctx.db, principalOf(request).orgId, webhookId);
    return { webhook_id: webhookId, deleted: true as const };
  });

  app.post('/v1/webhooks/:webhook_id/rotate-secret', {
    config: { permission: 'write' },
    schema: {
      tags: ['Webhooks'],
      summary: 'A new signing secret, in this response only; for 24 hours deliveries are signed with both',
      description: '`Service-Signature` is made with the new secret at once; `Service-Signature-Previous` carries the signature '
        + 'with the replaced one until `previous_secret_expires_at`. Rotating again within 24 hours ends the older secret at once.',
      params: WebhookParams, body: NoFields, response: { 200: WebhookWithSecretView },
    },
  }, async (request) => webhookWithSecretView(await rotateSigningSecret(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.params.webhook_id)));

  app.post('/v1/webhooks/:webhook_id/test', {
    config: { permission: 'write' },
    schema: {
      tags: ['Webhooks'], summary: 'Send a synthetic `ping` event now and answer how the endpoint responded',
      description: 'Sent whatever the webhook\'s status, once (never retried), and recorded in the delivery log; it never '
        + 'changes the webhook\'s status. A failure is reported in the body (`success: false`), not as an HTTP error.',
      params: WebhookParams,
      body: Type.Optional(NoFields),
      response: { 200: PingResultView },
    },
  }, async (request) => sendTestPing(ctx, principalOf(request).orgId, request.params.webhook_id));

  app.get('/v1/webhooks/:webhook_id/deliveries', {
    config: { permission: 'read' },
    schema: {
      tags: ['Webhooks'], summary: 'The delivery log: the webhook\'s deliveries of the last 30 days, newest event first, with their attempts',
      params: WebhookParams,
      querystring: Type.Object({
        ...PageQuery,
        status: Type.Optional(DeliveryStatusSchema),
        eventId: Type.Optional(Type.String({ minLength: 1, maxLength: 64, description: 'only the delivery of this event' })),
        // SPEC's spelling, as the lists' `wallet_id` (walletIdQuery).
        event_id: Type.Optional(Type.String({ minLength: 1, maxLength: 64, description: 'alias of eventId' })),
      }, { additionalProperties: false }),
      response: { 200: pageOf(DeliveryView) },
    },
  }, async (request) => {
    const { limit, cursor, status } = request.query;
    if (request.query.eventId !== undefined && request.query.event_id !== undefined) {
      throw invalidRequest('event_id', 'Give eventId or event_id, not both.');
    }
    const eventId = request.query.eventId ?? request.query.event_id;
    return listDeliveries(ctx.db, principalOf(request).orgId, request.params.webhook_id, parsePageRequest({ limit, cursor }), {
      ...(status === undefined ? {} : { status }),
      ...(eventId === undefined ? {} : { eventId }),
    });
  });
}
