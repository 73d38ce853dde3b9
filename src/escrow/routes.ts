/**
 * Escrow endpoints (SPEC.md `/v1/payments/a2a`): create, complete with a proof, dispute,
 * resolve (arbiter), read and list. docs/escrow.md has the decisions.
 */
import { Type } from 'typebox';
import { NOT_BLANK_PATTERN, amountField, amountOf, currencyField, patternString, recipientField } from '../http/fields.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { principalOf, type Principal } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { idempotencyKeyOf, runIdempotent, sendIdempotent } from '../http/idempotency.ts';
import { PageQuery, PageFilter, pageOf, parsePageRequest, toPage, walletIdOf, walletIdQuery } from '../http/pagination.ts';
import { formatUsdc } from '../money/money.ts';
import type { Violation } from '../payments/policy-engine.ts';
import { getTransaction } from '../transactions/views.ts';
import { assertVaultAccess, assertWalletsExist, findWallet, getWallet, walletNotFound } from '../wallets/wallets.ts';
import {
  TASK_DESCRIPTION_MAX, TIMEOUT_SECONDS_DEFAULT, TIMEOUT_SECONDS_MAX, TIMEOUT_SECONDS_MIN,
  completeEscrow, createEscrow, declineEscrow, disputeEscrow, getEscrow, isServiceArbiter, notServiceArbiter, receiverAddress, resolveEscrow,
  type EscrowRow, type PartySession,
} from './escrows.ts';
import { PROOF_MAX_CHARS, SHA256_PATTERN, SHA256_TEXT, acceptedProofTypes } from './proofs.ts';

const StringOrNull = Type.Union([Type.String(), Type.Null()]);
const EscrowStatusSchema = Type.Union([
  Type.Literal('locked'), Type.Literal('completed'), Type.Literal('released'), Type.Literal('refunded'),
  Type.Literal('disputed'), Type.Literal('resolved'), Type.Literal('failed'),
]);
const ProofTypeSchema = Type.Union([Type.Literal('output_hash'), Type.Literal('signed_attestation'), Type.Literal('webhook_callback')]);

export const EscrowView = Type.Object({
  escrow_id: Type.String(),
  from_wallet: Type.String({ description: 'the requesting vault' }),
  to_wallet: Type.String({ description: 'the receiver as the request named it: a vault id or a chain address' }),
  to_wallet_id: Type.Union([Type.String(), Type.Null()], { description: 'the receiving vault when it is one of this service' }),
  receiver_address: Type.String({ description: 'the chain address paid on release' }),
  amount: Type.String(),
  currency: Type.String(),
  status: EscrowStatusSchema,
  in_flight: Type.Union([Type.String(), Type.Null()], {
    description: 'a chain transaction moving the escrow on is pending: create, release, refund, dispute, resolve or decline',
  }),
  chain_address: Type.String({ description: 'the escrow account, separate from both vaults' }),
  task_hash: Type.String({ description: 'sha256 of taskDescription, as recorded on chain' }),
  expected_output_hash: StringOrNull,
  verifier_id: StringOrNull,
  accepted_proofs: Type.Array(Type.String(), { description: 'the proof types that can complete it (docs/escrow.md "Proofs")' }),
  proof_type: StringOrNull,
  output_url: Type.Union([Type.String(), Type.Null()], { description: 'where the output of an output_hash proof was fetched' }),
  completed_at: StringOrNull,
  dispute: Type.Union([Type.Object({
    raised_by_org: Type.String(), reason: Type.String(), evidence: StringOrNull, raised_at: Type.String(),
  }), Type.Null()]),
  resolution: Type.Union([Type.Object({
    to_receiver: Type.String(), to_sender: Type.String(), decided_by: Type.String(), decided_at: Type.String(),
  }), Type.Null()]),
  lock_tx_signature: StringOrNull,
  settle_tx_signature: StringOrNull,
  expires_at: Type.String(),
  created_at: Type.String(),
  updated_at: Type.String(),
  settled_at: StringOrNull,
});

export function escrowView(row: EscrowRow) {
  return {
    escrow_id: row.id,
    from_wallet: row.from_wallet_id,
    to_wallet: row.to_wallet,
    to_wallet_id: row.to_wallet_id,
    receiver_address: row.receiver_address,
    amount: formatUsdc(row.amount),
    currency: 'USDC',
    status: row.status,
    in_flight: row.closing,
    chain_address: row.chain_address,
    task_hash: row.task_hash,
    expected_output_hash: row.expected_output_hash,
    verifier_id: row.verifier_id,
    accepted_proofs: acceptedProofTypes(row),
    proof_type: row.proof_type,
    output_url: row.output_url,
    completed_at: row.completed_at?.toISOString() ?? null,
    dispute: row.dispute && {
      raised_by_org: row.dispute.raised_by_org, reason: row.dispute.reason, evidence: row.dispute.evidence, raised_at: row.dispute.raised_at,
    },
    resolution: row.resolution,
    lock_tx_signature: row.lock_signature,
    settle_tx_signature: row.settle_signature,
    expires_at: row.expires_at.toISOString(),
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
    settled_at: row.settled_at?.toISOString() ?? null,
  };
}

const EscrowParams = Type.Object({ escrow_id: Type.String({ maxLength: 64 }) });
const WaitField = Type.Optional(Type.Boolean({
  default: true, description: 'false: answer as soon as the chain transaction is sent (`in_flight` tells what is pending)',
}));


export function escrowRoutes(app: App, ctx: AppContext): void {
  const sessionTokenOf = (headers: Record<string, unknown>) =>
    (typeof headers['session-token'] === 'string' ? headers['session-token'] : undefined);

  /**
   * An agent acts on an escrow through a vault of its organisation taking part in it, with that
   * vault's token. Answers that vault and the session key the token matched (null for other
   * roles), which a move checks again under the vault's lock when it records.
   */
  const authorizeParty = async (principal: Principal, escrow: EscrowRow, headers: Record<string, unknown>): Promise<PartySession | null> => {
    if (principal.role !== 'agent') return null;
    const token = sessionTokenOf(headers);
    const vaults = [escrow.org_id === principal.orgId ? escrow.from_wallet_id : null,
      escrow.receiver_org_id === principal.orgId ? escrow.to_wallet_id : null].filter((id): id is string => id !== null);
    let refusal: unknown = new ServiceError('session_token_invalid', 'Send the Session-Token of a vault taking part in this escrow.');
    const expired = (error: unknown) => error instanceof ServiceError && error.code === 'session_token_expired';
    for (const walletId of vaults) {
      try {
        const vault = await getWallet(ctx.db, principal.orgId, walletId);
        assertVaultAccess(principal, vault, token, ctx.clock.nowMs());
        // The token matched the vault's session key, so there is one.
        return { walletId, sessionKey: vault.session_public_key! };
      } catch (error) {
        // The token is one vault's, expired: that is the answer, whatever the other vault says.
        // Otherwise the refusal names the escrow's vaults, not "this wallet" (the request names none).
        if (expired(error)) refusal = error;
      }
    }
    throw refusal;
  };

  /** An escrow, or the policy violation that refused it (as a payment's: with the vault and its policy). */
  const answer = async (orgId: string, outcome: { escrow: EscrowRow | null; sendTxId: string }) => {
    if (outcome.escrow === null) {
      const blocked = await getTransaction(ctx.db, orgId, outcome.sendTxId);
      const violation = blocked.violation as Violation;
      throw new ServiceError('policy_violation', `The escrow breaks the ${violation.rule} rule of the requesting vault's policy.`,
        { violation, wallet_id: blocked.wallet_id!, policy_id: blocked.policy_id!, tx_id: outcome.sendTxId });
    }
    return { status: 200, body: escrowView(outcome.escrow) };
  };

  app.post('/v1/payments/a2a', {
    config: { permission: 'pay' },
    schema: {
      tags: ['Escrow'], summary: 'Lock USDC of a vault in escrow for another agent, checked against the vault\'s policy',
      description: 'An `agent` key must send the Session-Token of `fromWallet`. A policy violation is 402, recorded as a '
        + 'blocked `a2a_send`; nothing is locked.',
      body: Type.Object({
        fromWallet: Type.String({ maxLength: 64 }),
        toWallet: recipientField('a vault id of your organisation, or the chain address of any vault or account', 64),
        amount: amountField(),
        currency: currencyField(),
        taskDescription: Type.String({ minLength: 1, maxLength: TASK_DESCRIPTION_MAX, description: 'recorded on chain as its SHA-256' }),
        timeoutSeconds: Type.Optional(Type.Integer({ minimum: TIMEOUT_SECONDS_MIN, maximum: TIMEOUT_SECONDS_MAX, default: TIMEOUT_SECONDS_DEFAULT })),
        expectedOutputHash: Type.Optional(patternString(SHA256_PATTERN, SHA256_TEXT, { description: 'an output_hash proof must equal it' })),
        verifierId: Type.Optional(Type.String({ maxLength: 64, description: 'the verifier whose webhook_callback proofs complete it' })),
        idempotencyKey: Type.Optional(Type.String({ description: 'or the Idempotency-Key header' })),
        waitForConfirmation: WaitField,
      }, { additionalProperties: false }),
      response: { 200: EscrowView },
    },
  }, async (request, reply) => {
    const principal = principalOf(request);
    const body = request.body;
    if (body.currency !== 'USDC') throw new ServiceError('invalid_currency', `Only USDC is supported, not "${body.currency}".`, { param: 'currency' });
    const amount = amountOf(body.amount, 'amount');
    const from = await findWallet(ctx.db, principal.orgId, body.fromWallet);
    if (!from) throw walletNotFound(body.fromWallet, 'from_wallet');
    assertVaultAccess(principal, from, sessionTokenOf(request.headers), ctx.clock.nowMs());
    const input = {
      fromWallet: body.fromWallet, toWallet: body.toWallet.trim(), amount, taskDescription: body.taskDescription,
      timeoutSeconds: body.timeoutSeconds ?? TIMEOUT_SECONDS_DEFAULT, expectedOutputHash: body.expectedOutputHash ?? null,
      verifierId: body.verifierId ?? null,
    };
    // A malformed or unknown toWallet is refused here, before the key is taken, as a malformed
    // amount is: the corrected request may use the same key.
    if (receiverAddress(input.toWallet) === null) await assertWalletsExist(ctx.db, principal.orgId, [input.toWallet], () => 'to_wallet');
    const result = await runIdempotent(ctx.db, {
      orgId: principal.orgId, key: idempotencyKeyOf(request.headers['idempotency-key'], body.idempotencyKey),
      operation: 'escrows.create', params: input, nowMs: ctx.clock.nowMs(),
      recover: async (id) => (id.startsWith('esc_')
        ? { status: 200, body: escrowView(await getEscrow(ctx.db, principal.orgId, id)) }
        : answer(principal.orgId, { escrow: null, sendTxId: id })),
    }, async (mark) => answer(principal.orgId, await createEscrow(ctx, principal.orgId, input, {
      wait: body.waitForConfirmation ?? true, mark, sessionKey: principal.role === 'agent' ? from.session_public_key : null, keyId: principal.keyId,
    })));
    return sendIdempotent(reply, result);
  });

  app.post('/v1/payments/a2a/:escrow_id/complete', {
    config: { permission: 'pay' },
    schema: {
      tags: ['Escrow'], summary: 'Show a completion proof; verified, the escrow is released to the receiver',
      description: 'Either party may complete. Proof formats: docs/escrow.md. A proof that does not verify is 400 invalid_proof and changes nothing.',
      params: EscrowParams,
      body: Type.Object({
        proofType: ProofTypeSchema,
        proof: Type.String({ minLength: 1, maxLength: PROOF_MAX_CHARS }),
        outputUrl: Type.Optional(Type.String({ maxLength: 2048, description: 'required with an output_hash proof: fetched, and the SHA-256 of its bytes must equal the proof' })),
        waitForConfirmation: WaitField,
      }, { additionalProperties: false }),
      response: { 200: EscrowView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const escrow = await getEscrow(ctx.db, principal.orgId, request.params.escrow_id);
    const session = await authorizeParty(principal, escrow, request.headers);
    const { proofType, proof, outputUrl } = request.body;
    if (outputUrl !== undefined && proofType !== 'output_hash') throw invalidRequest('output_url', 'outputUrl goes with an output_hash proof.');
    return escrowView(await completeEscrow(ctx, principal.orgId, escrow.id,
      { proofType, proof, outputUrl: outputUrl ?? null }, { wait: request.body.waitForConfirmation ?? true, session, keyId: principal.keyId }));
  });

  app.post('/v1/payments/a2a/:escrow_id/dispute', {
    config: { permission: 'pay' },
    schema: {
      tags: ['Escrow'], summary: 'Dispute a locked escrow before its timeout: only an arbiter settles it then',
      params: EscrowParams,
      body: Type.Object({
        reason: patternString(NOT_BLANK_PATTERN, 'must not be blank: say why, for the arbiter', { minLength: 1, maxLength: 1000 }),
        evidence: Type.Optional(patternString(SHA256_PATTERN, SHA256_TEXT, { description: 'a hash of the evidence, sha256:<hex>' })),
      }, { additionalProperties: false }),
      response: { 200: EscrowView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const escrow = await getEscrow(ctx.db, principal.orgId, request.params.escrow_id);
    const session = await authorizeParty(principal, escrow, request.headers);
    return escrowView(await disputeEscrow(ctx, principal.orgId, principal.keyId, escrow.id,
      { reason: request.body.reason, evidence: request.body.evidence ?? null }, { session }));
  });

  app.post('/v1/payments/a2a/:escrow_id/decline', {
    config: { permission: 'pay' },
    schema: {
      tags: ['Escrow'], summary: 'Receiver: turn a locked escrow down; the requester has its money back at once',
      description: 'Only the receiving organisation (an agent: with the receiving vault\'s Session-Token), only a locked escrow, '
        + 'before its timeout. The escrow ends `refunded` (`escrow.refunded`, reason `declined`). docs/escrow.md, "Declining".',
      params: EscrowParams,
      body: Type.Object({ waitForConfirmation: WaitField }, { additionalProperties: false }),
      response: { 200: EscrowView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const escrow = await getEscrow(ctx.db, principal.orgId, request.params.escrow_id);
    const session = await authorizeParty(principal, escrow, request.headers);
    return escrowView(await declineEscrow(ctx, principal.orgId, escrow.id,
      { wait: request.body.waitForConfirmation ?? true, session, keyId: principal.keyId }));
  });

  app.post('/v1/payments/a2a/:escrow_id/resolve', {
    config: { permission: 'arbitrate' },
    schema: {
      tags: ['Escrow'], summary: 'Arbiter: settle a disputed escrow — release, refund, or split — written on chain',
      params: EscrowParams,
      body: Type.Object({
        decision: Type.Union([Type.Literal('release'), Type.Literal('refund'), Type.Literal('split')]),
        toReceiver: Type.Optional(amountField('split only: decimal USDC to the receiver (0 allowed)')),
        toSender: Type.Optional(amountField('split only: decimal USDC back to the requester (0 allowed)')),
        waitForConfirmation: WaitField,
      }, { additionalProperties: false }),
      response: { 200: EscrowView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const serviceArbiter = await isServiceArbiter(ctx.db, principal);
    const escrow = await getEscrow(ctx.db, principal.orgId, request.params.escrow_id, { serviceArbiter });
    // Refused before the decision is read: a key that may not decide learns nothing of its validity.
    if (!serviceArbiter) throw notServiceArbiter();
    const { decision, toReceiver, toSender } = request.body;
    if (decision !== 'split' && (toReceiver !== undefined || toSender !== undefined)) {
      throw invalidRequest('decision', 'toReceiver and toSender go with decision "split".');
    }
    let split: { toReceiver: bigint; toSender: bigint };
    if (decision === 'release') split = { toReceiver: escrow.amount, toSender: 0n };
    else if (decision === 'refund') split = { toReceiver: 0n, toSender: escrow.amount };
    else {
      if (toReceiver === undefined || toSender === undefined) throw invalidRequest('to_receiver', 'A split needs toReceiver and toSender.');
      split = { toReceiver: amountOf(toReceiver, 'to_receiver', { allowZero: true }), toSender: amountOf(toSender, 'to_sender', { allowZero: true }) };
    }
    return escrowView(await resolveEscrow(ctx, principal, escrow.id, split,
      { wait: request.body.waitForConfirmation ?? true }));
  });

  app.get('/v1/payments/a2a/:escrow_id', {
    config: { permission: 'vault_read' },
    schema: { tags: ['Escrow'], summary: 'An escrow as it stands', params: EscrowParams, response: { 200: EscrowView } },
  }, async (request) => {
    const principal = principalOf(request);
    const escrow = await getEscrow(ctx.db, principal.orgId, request.params.escrow_id,
      { serviceArbiter: await isServiceArbiter(ctx.db, principal) });
    await authorizeParty(principal, escrow, request.headers);
    return escrowView(escrow);
  });

  app.get('/v1/payments/a2a', {
    config: { permission: 'vault_read' },
    schema: {
      tags: ['Escrow'], summary: 'Escrows your organisation takes part in, newest first',
      description: 'An `agent` key lists the escrows of one vault of its organisation, as sender or receiver: '
        + 'it sends `walletId` and that vault\'s `Session-Token` (a provider agent finds the work it is offered here).',
      querystring: Type.Object({
        ...PageQuery,
        ...walletIdQuery('as sender or receiver: a vault of your organisation, or another\'s that your escrows pay'),
        status: Type.Optional(EscrowStatusSchema),
      }, { additionalProperties: false }),
      response: { 200: pageOf(EscrowView) },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const { orgId } = principal;
    const page = parsePageRequest(request.query);
    if (principal.role === 'agent') {
      // An agent sees what its own vault sends and is offered, no more: its vault, with its token.
      const vaultId = walletIdOf(request.query);
      if (vaultId === undefined) {
        throw invalidRequest('wallet_id', 'An agent lists the escrows of its own vault: send walletId and that vault\'s Session-Token.');
      }
      assertVaultAccess(principal, await getWallet(ctx.db, orgId, vaultId), sessionTokenOf(request.headers), ctx.clock.nowMs());
    }
    // The service's arbiters also see every disputed escrow, to decide them.
    const arbiter = await isServiceArbiter(ctx.db, principal);
    const where = new PageFilter('e');
    const walletId = walletIdOf(request.query);
    if (walletId !== undefined) {
      // A vault neither the organisation's nor named by an escrow it sees (either side's vault;
      // for the service's arbiters, a disputed escrow's) is 404, as for the transactions and the
      // feed: a mistyped id is not an empty list.
      const seen = `(org_id = $1 OR receiver_org_id = $1${arbiter ? ` OR status = 'disputed'` : ''})`;
      const [known] = await ctx.db.query(
        `SELECT 1 FROM wallets WHERE org_id = $1 AND id = $2
         UNION ALL SELECT 1 FROM escrows WHERE from_wallet_id = $2 AND ${seen}
         UNION ALL SELECT 1 FROM escrows WHERE to_wallet_id = $2 AND ${seen} LIMIT 1`, [orgId, walletId]);
      if (!known) throw walletNotFound(walletId);
      where.where((p) => `(e.from_wallet_id = ${p} OR e.to_wallet_id = ${p})`, walletId);
    }
    if (request.query.status) where.where((p) => `e.status = ${p}`, request.query.status);
    // The organisation's escrows, those it receives from another, and (for the service's
    // arbiters) the other disputed ones: disjoint, each read in its own index's order, merged.
    // One OR of the three read every escrow of the service. Each adds the organisation as its
    // last parameter, so all share one parameter list.
    const sides = [
      where.copy().where((p) => `e.org_id = ${p}`, orgId),
      where.copy().where((p) => `e.receiver_org_id = ${p} AND e.org_id <> ${p}`, orgId),
      ...(arbiter ? [where.copy().where((p) => `e.org_id <> ${p} AND e.receiver_org_id IS DISTINCT FROM ${p}`, orgId)
        .whereSql(`e.status = 'disputed'`)] : []),
    ].map((side) => side.page(page));
    const rows = await ctx.db.query<EscrowRow>(
      `SELECT * FROM (${sides.map((side) => `(SELECT e.* FROM escrows e ${side.sql})`).join(' UNION ALL ')}) AS e
       ORDER BY created_at DESC, id DESC LIMIT ${page.limit + 1}`, sides[0]!.params);
    return toPage(rows, page, escrowView);
  });
}
