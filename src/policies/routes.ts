/**
 * Policy endpoints (SPEC.md "Policies", DESIGN §6): create, read, list, update, clone, delete,
 * and the audit log. Handlers parse, call a use-case of policies.ts, and answer.
 */
import { Type } from 'typebox';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import { NOT_BLANK_PATTERN, patternString, recipientField } from '../http/fields.ts';
import { CATEGORY_PATTERN, CATEGORY_TEXT } from '../recipients/recipients.ts';
import type { AppContext } from '../http/context.ts';
import { PageQuery, pageOf, parsePageRequest } from '../http/pagination.ts';
import {
  ALLOWED_RECIPIENTS_MAX, BLOCKED_CATEGORIES_MAX, POLICY_NAME_MAX, RECIPIENT_LENGTH_MAX, VELOCITY_CAP_MAX,
  parsePolicyFields, type PolicyFieldsInput,
} from './fields.ts';
import {
  AuditEntryView, PolicyView, clonePolicy, createPolicy, deletePolicy, getPolicyView, listPolicies, policyAuditLog,
  updatePolicy,
} from './policies.ts';

const PolicyParams = Type.Object({ policy_id: Type.String({ maxLength: 64 }) });

const Name = patternString(NOT_BLANK_PATTERN, 'must not be blank', { minLength: 1, maxLength: POLICY_NAME_MAX, description: 'human-readable name' });
/** Decimal USDC, "0" allowed (nothing may pass); null = no limit. The schema bounds the length, parsing does the rest. */
const Limit = (description: string) => Type.Optional(Type.Union([Type.String({ maxLength: 40, description: 'decimal USDC' }), Type.Null()], { description }));

/** Every creatable field but the name; create, update and clone share them. */
const RuleFields = {
  maxPerTx: Limit('maximum USDC of one payment'),
  maxPerDay: Limit('USDC ceiling of the rolling 24 hours'),
  maxPerMonth: Limit('USDC ceiling of the UTC calendar month'),
  requireCoSign: Limit('payments above this amount wait for an operator\'s approval'),
  velocityCap: Type.Optional(Type.Union([Type.Integer({ minimum: 0, maximum: VELOCITY_CAP_MAX }), Type.Null()],
    { description: 'maximum payments per rolling hour; null = no limit' })),
  allowedRecipients: Type.Optional(Type.Array(recipientField('a chain address or a domain name', RECIPIENT_LENGTH_MAX), {
    maxItems: ALLOWED_RECIPIENTS_MAX, description: 'chain addresses or domain names; empty = any recipient',
  })),
  blockedCategories: Type.Optional(Type.Array(patternString(CATEGORY_PATTERN, CATEGORY_TEXT), {
    maxItems: BLOCKED_CATEGORIES_MAX, description: 'category codes, any case: compared and stored lowercase',
  })),
  expiry: Type.Optional(Type.Union([Type.String({ maxLength: 40 }), Type.Null()], {
    description: 'ISO 8601 timestamp with a time zone, in the future; attached vaults freeze after it; null = never',
  })),
};

/**
 * A policy body may carry the longest lists its fields allow (1,000 recipients of 253
 * characters, 100 categories): ~265 KB, above the 64 KiB every other body is held to.
 */
export const POLICY_BODY_LIMIT_BYTES = 320 * 1024;

export function policyRoutes(app: App, ctx: AppContext): void {
  const actorOf = (request: Parameters<typeof principalOf>[0]) => {
    const { orgId, keyId } = principalOf(request);
    return { orgId, keyId };
  };
  const parse = (input: PolicyFieldsInput) => parsePolicyFields(input, ctx.clock.nowMs());

  app.post('/v1/policies', {
    config: { permission: 'write' },
    bodyLimit: POLICY_BODY_LIMIT_BYTES,
    schema: {
      tags: ['Policies'], summary: 'Create a policy',
      body: Type.Object({ name: Name, ...RuleFields }, { additionalProperties: false }),
      response: { 200: PolicyView },
    },
  }, async (request) => {
    const fields = parse(request.body);
    return createPolicy(ctx, actorOf(request), {
      name: request.body.name,
      maxPerTx: fields.maxPerTx ?? null,
      maxPerDay: fields.maxPerDay ?? null,
      maxPerMonth: fields.maxPerMonth ?? null,
      velocityCap: fields.velocityCap ?? null,
      allowedRecipients: fields.allowedRecipients ?? [],
      blockedCategories: fields.blockedCategories ?? [],
      requireCoSign: fields.requireCoSign ?? null,
      expiry: fields.expiry ?? null,
    });
  });

  app.get('/v1/policies/:policy_id', {
    config: { permission: 'read' },
    schema: { tags: ['Policies'], summary: 'A policy', params: PolicyParams, response: { 200: PolicyView } },
  }, async (request) => getPolicyView(ctx.db, principalOf(request).orgId, request.params.policy_id));

  app.get('/v1/policies', {
    config: { permission: 'read' },
    schema: {
      tags: ['Policies'], summary: 'The organisation\'s policies, presets included, newest first',
      querystring: Type.Object({ ...PageQuery }, { additionalProperties: false }),
      response: { 200: pageOf(PolicyView) },
    },
  }, async (request) => listPolicies(ctx.db, principalOf(request).orgId, parsePageRequest(request.query)));

  app.patch('/v1/policies/:policy_id', {
    config: { permission: 'write' },
    bodyLimit: POLICY_BODY_LIMIT_BYTES,
    schema: {
      tags: ['Policies'], summary: 'Change a policy; attached vaults follow at once (on chain within a slot)',
      description: 'null clears an optional limit. Presets answer 422 policy_immutable: clone them.',
      params: PolicyParams,
      body: Type.Object({ name: Type.Optional(Name), ...RuleFields }, { additionalProperties: false, minProperties: 1 }),
      response: { 200: PolicyView },
    },
  }, async (request) =>
    updatePolicy(ctx, actorOf(request), request.params.policy_id, parse(request.body)));

  app.post('/v1/policies/:policy_id/clone', {
    config: { permission: 'write' },
    bodyLimit: POLICY_BODY_LIMIT_BYTES,
    schema: {
      tags: ['Policies'], summary: 'A new editable policy with this one\'s rules (presets too) and the fields sent',
      params: PolicyParams,
      body: Type.Object({ name: Name, ...RuleFields }, { additionalProperties: false }),
      response: { 200: PolicyView },
    },
  }, async (request) =>
    clonePolicy(ctx, actorOf(request), request.params.policy_id, { ...parse(request.body), name: request.body.name }));

  app.delete('/v1/policies/:policy_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Policies'], summary: 'Delete a policy no wallet uses (archived wallets do not count)',
      params: PolicyParams, response: { 200: PolicyView },
    },
  }, async (request) => deletePolicy(ctx, actorOf(request), request.params.policy_id));

  app.get('/v1/policies/:policy_id/audit-log', {
    config: { permission: 'read' },
    schema: {
      tags: ['Policies'], summary: 'Every change of the policy, oldest first',
      params: PolicyParams,
      querystring: Type.Object({ ...PageQuery }, { additionalProperties: false }),
      response: { 200: pageOf(AuditEntryView) },
    },
  }, async (request) =>
    policyAuditLog(ctx.db, principalOf(request).orgId, request.params.policy_id, parsePageRequest(request.query)));
}
