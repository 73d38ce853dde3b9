/**
 * Recipient directory endpoints (DESIGN §6, docs/recipients.md): register a domain's chain
 * address and category, read, list, change and delete entries.
 */
import { Type } from 'typebox';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { patternString } from '../http/fields.ts';
import { PageQuery, pageOf, parsePageRequest } from '../http/pagination.ts';
import {
  CATEGORY_PATTERN, CATEGORY_TEXT, DOMAIN_LENGTH_MAX, RECIPIENT_LABEL_MAX, RecipientView,
  createRecipient, deleteRecipient, getRecipient, listRecipients, recipientView, updateRecipient,
} from './recipients.ts';

/**
 * Domain and address are checked by the use-case so that a bad one answers invalid_recipient;
 * the schema only bounds what reaches it.
 */
const TEXT_BOUND = 1024;

const RecipientParams = Type.Object({ recipient_id: Type.String({ maxLength: 64 }) });
const Domain = Type.String({ maxLength: TEXT_BOUND, description: `a DNS name with at least one dot, at most ${DOMAIN_LENGTH_MAX} characters; case-insensitive, stored lowercase` });
const ChainAddress = Type.String({ maxLength: TEXT_BOUND, description: 'base58 of a 32-byte public key' });
const Category = Type.Union([
  patternString(CATEGORY_PATTERN, CATEGORY_TEXT, { description: 'a category code, stored lowercase' }), Type.Null(),
]);
const Label = Type.Union([Type.String({ minLength: 1, maxLength: RECIPIENT_LABEL_MAX }), Type.Null()]);

export function recipientRoutes(app: App, ctx: AppContext): void {
  app.post('/v1/recipients', {
    config: { permission: 'write' },
    schema: {
      tags: ['Recipients'], summary: 'Add a domain to the recipient directory',
      description: 'A domain already in the directory answers 400 `invalid_request` with `param: "domain"`.',
      body: Type.Object({
        domain: Domain,
        address: ChainAddress,
        category: Type.Optional(Category),
        label: Type.Optional(Label),
      }, { additionalProperties: false }),
      response: { 200: RecipientView },
    },
  }, async (request) =>
    recipientView(await createRecipient(ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.body)));

  app.get('/v1/recipients', {
    config: { permission: 'read' },
    schema: {
      tags: ['Recipients'], summary: 'List the recipient directory, newest first',
      querystring: Type.Object({
        ...PageQuery,
        category: Type.Optional(patternString(CATEGORY_PATTERN, CATEGORY_TEXT, { description: 'only recipients of this category' })),
        domain: Type.Optional(Type.String({ maxLength: DOMAIN_LENGTH_MAX, description: 'only the recipient of this domain (case-insensitive)' })),
      }, { additionalProperties: false }),
      response: { 200: pageOf(RecipientView) },
    },
  }, async (request) => {
    const { limit, cursor, ...filter } = request.query;
    return listRecipients(ctx.db, principalOf(request).orgId, parsePageRequest({ limit, cursor }), filter);
  });

  app.get('/v1/recipients/:recipient_id', {
    config: { permission: 'read' },
    schema: {
      tags: ['Recipients'], summary: 'A recipient of the directory',
      params: RecipientParams, response: { 200: RecipientView },
    },
  }, async (request) => recipientView(await getRecipient(ctx.db, principalOf(request).orgId, request.params.recipient_id)));

  app.patch('/v1/recipients/:recipient_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Recipients'], summary: 'Change a recipient\'s address, category or label (null removes category or label)',
      description: 'The domain cannot change: sending a different one answers 400 `invalid_request` with `param: "domain"`.',
      params: RecipientParams,
      body: Type.Object({
        domain: Type.Optional(Type.String({ maxLength: TEXT_BOUND, description: 'immutable: only the current domain is accepted' })),
        address: Type.Optional(ChainAddress),
        category: Type.Optional(Category),
        label: Type.Optional(Label),
      }, { additionalProperties: false, minProperties: 1 }),
      response: { 200: RecipientView },
    },
  }, async (request) => recipientView(await updateRecipient(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.params.recipient_id, request.body, principalOf(request).keyId)));

  app.delete('/v1/recipients/:recipient_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Recipients'], summary: 'Remove a recipient: its domain stops resolving at once and may be added again',
      params: RecipientParams,
      response: { 200: Type.Object({ recipient_id: Type.String(), deleted: Type.Literal(true) }) },
    },
  }, async (request) => {
    const { recipient_id: recipientId } = request.params;
    await deleteRecipient(ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, recipientId);
    return { recipient_id: recipientId, deleted: true as const };
  });
}
