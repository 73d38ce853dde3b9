/**
 * Verifier endpoints (docs/verifiers.md): register a trusted third party whose signed proofs can
 * complete an escrow, read and list them, rotate a secret, revoke.
 */
import { Type } from 'typebox';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { NAME_PATTERN, NAME_TEXT, NoFields, patternString } from '../http/fields.ts';
import { PageQuery, pageOf, parsePageRequest } from '../http/pagination.ts';
import { OUTBOUND_URL_LENGTH_MAX } from '../net/outbound.ts';
import {
  VERIFIER_NAME_MAX, VerifierView, VerifierWithSecretView,
  createVerifier, getVerifier, listVerifiers, revokeVerifier, rotateVerifierSecret, verifierView, verifierWithSecretView,
} from './verifiers.ts';

const VerifierParams = Type.Object({ verifier_id: Type.String({ maxLength: 64 }) });

export function verifierRoutes(app: App, ctx: AppContext): void {
  app.post('/v1/verifiers', {
    config: { permission: 'write' },
    schema: {
      tags: ['Verifiers'], summary: 'Register a verifier; its signing secret is in this response only',
      description: 'A `url` that is not http(s), carries credentials, or points at localhost or a non-public address '
        + '(unless AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS is on) answers 400 `invalid_request` with `param: "url"`.',
      body: Type.Object({
        name: patternString(NAME_PATTERN, NAME_TEXT, { minLength: 1, maxLength: VERIFIER_NAME_MAX }),
        url: Type.Optional(Type.String({ maxLength: OUTBOUND_URL_LENGTH_MAX, description: 'where the verifier can be reached, for your records' })),
      }, { additionalProperties: false }),
      response: { 200: VerifierWithSecretView },
    },
  }, async (request) => verifierWithSecretView(await createVerifier(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.body, { allowPrivateUrls: ctx.config.allowPrivateWebhooks })));

  app.get('/v1/verifiers', {
    config: { permission: 'read' },
    schema: {
      tags: ['Verifiers'], summary: 'List the organisation\'s verifiers, newest first, revoked ones included',
      querystring: Type.Object({ ...PageQuery }, { additionalProperties: false }),
      response: { 200: pageOf(VerifierView) },
    },
  }, async (request) => listVerifiers(ctx.db, principalOf(request).orgId, parsePageRequest(request.query)));

  app.get('/v1/verifiers/:verifier_id', {
    config: { permission: 'read' },
    schema: {
      tags: ['Verifiers'], summary: 'One verifier (never its secret)',
      params: VerifierParams, response: { 200: VerifierView },
    },
  }, async (request) => verifierView(await getVerifier(ctx.db, principalOf(request).orgId, request.params.verifier_id)));

  app.post('/v1/verifiers/:verifier_id/rotate-secret', {
    config: { permission: 'write' },
    schema: {
      tags: ['Verifiers'], summary: 'A new signing secret, in this response only; the previous one keeps verifying for 24 hours',
      description: 'Only one previous secret is kept: rotating again within 24 hours ends the older one at once. '
        + 'A revoked verifier answers 400 `invalid_request` with `param: "verifier_id"`.',
      params: VerifierParams, body: NoFields, response: { 200: VerifierWithSecretView },
    },
  }, async (request) => verifierWithSecretView(await rotateVerifierSecret(
    ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.params.verifier_id)));

  app.delete('/v1/verifiers/:verifier_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Verifiers'], summary: 'Revoke a verifier at once: its proofs stop verifying and new escrows cannot name it',
      description: 'The verifier stays readable with `status: "revoked"`; its secrets are erased. Revoking a revoked verifier returns it unchanged.',
      params: VerifierParams, response: { 200: VerifierView },
    },
  }, async (request) => verifierView(await revokeVerifier(ctx.db, ctx.clock.nowMs(), principalOf(request).orgId, request.params.verifier_id)));
}
