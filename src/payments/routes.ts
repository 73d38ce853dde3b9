/**
 * Payment endpoints: pay (and its getting-started alias), the preflight check, and the
 * co-signature decisions. Reads of a payment are the transaction view (src/transactions).
 */
import { Type } from 'typebox';
import { NoFields, amountField, amountOf, currencyField, patternString, recipientField } from '../http/fields.ts';
import { ServiceError } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { principalOf, type Principal } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { idempotencyKeyOf, runIdempotent, sendIdempotent } from '../http/idempotency.ts';
import { formatUsdc } from '../money/money.ts';
import { findPolicy, rulesOf } from '../policies/policies.ts';
import { CATEGORY_PATTERN, CATEGORY_TEXT, assertChainPayable, malformedRecipient, recipientName, recipientTarget } from '../recipients/recipients.ts';
import { settleKnownOutcomes, type TransactionRow } from '../transactions/settlement.ts';
import { PaymentView, getTransaction, paymentView } from '../transactions/views.ts';
import { assertNotArchived, assertVaultAccess, walletNotFound } from '../wallets/wallets.ts';
import { SpendingView, spendingOf } from './budgets.ts';
import { MEMO_MAX_CHARS, approvePayment, awaitingFull, pay, readPayment, rejectPayment, type PaymentOutcome } from './payments.ts';
import { evaluate } from './policy-engine.ts';
import { spendStateOf, spendWindowsAt } from './spend-state.ts';

const PaymentFields = {
  to: recipientField('a chain address or a domain of your recipient directory'),
  amount: amountField(),
  currency: currencyField(),
  memo: Type.Optional(Type.String({ maxLength: MEMO_MAX_CHARS, description: 'stored off chain; the attestation hash commits to it' })),
  category: Type.Optional(patternString(CATEGORY_PATTERN, CATEGORY_TEXT, {
    description: 'used when the recipient directory has none; case-insensitive, read lowercase as the directory stores them',
  })),
  idempotencyKey: Type.Optional(Type.String({ description: 'or the Idempotency-Key header' })),
  waitForConfirmation: Type.Optional(Type.Boolean({
    default: true, description: 'false: answer `pending` once the payment is recorded (and, on an external chain, taken by it), without waiting for confirmation',
  })),
};

interface PaymentBody {
  to: string;
  amount: string;
  currency: string;
  memo?: string;
  category?: string;
  idempotencyKey?: string;
  waitForConfirmation?: boolean;
}


function assertUsdc(currency: string): void {
  if (currency !== 'USDC') throw new ServiceError('invalid_currency', `Only USDC is supported, not "${currency}".`, { param: 'currency' });
}

export function paymentRoutes(app: App, ctx: AppContext): void {
  const view = (row: TransactionRow) => paymentView(row, ctx);

  /**
   * The vault a request pays from, checked to exist and to be this key's to pay from (an `agent`
   * key only from the vault whose session token it shows), and the resolution of its `to`.
   */
  const readRequest = async (principal: Principal, walletId: string, to: string, category: string | null, sessionToken: unknown) => {
    const { wallet, recipient } = await readPayment(ctx.db, principal.orgId, walletId, to, category);
    if (!wallet) throw walletNotFound(walletId);
    assertVaultAccess(principal, wallet, typeof sessionToken === 'string' ? sessionToken : undefined, ctx.clock.nowMs());
    return { wallet, recipient };
  };

  const outcomeOf = (row: TransactionRow): PaymentOutcome => ({
    row, violation: row.status === 'blocked' ? (row.violation as PaymentOutcome['violation']) : null,
  });

  /** A policy violation is answered 402 (the blocked record exists); a chain-side shortfall 422. */
  const answer = (outcome: PaymentOutcome) => {
    const { row, violation } = outcome;
    if (violation) {
      throw new ServiceError('policy_violation', `The payment breaks the ${violation.rule} rule of policy ${row.policy_id}.`,
        { violation, wallet_id: row.wallet_id!, policy_id: row.policy_id!, tx_id: row.id });
    }
    if (row.status === 'failed' && row.failure_reason === 'InsufficientFunds') {
      throw new ServiceError('wallet_insufficient_balance', 'The chain refused the payment: the vault\'s balance does not cover it.',
        { wallet_id: row.wallet_id!, tx_id: row.id });
    }
    return { status: 200, body: view(row) };
  };

  const handlePay = async (principal: Principal, walletId: string, body: PaymentBody, headers: Record<string, unknown>) => {
    assertUsdc(body.currency);
    const amount = amountOf(body.amount, 'amount');
    // Who may pay from this vault is checked on every request; whether it can pay (archived,
    // frozen) is the payment's answer, so a replay after an archive still returns the original.
    // `to` and the category as they are recorded, hashed and compared for idempotency: a domain
    // and a category in any case are one payment's (docs/decisions.md, attestation hash).
    const input = {
      walletId, to: recipientName(body.to), amount, memo: body.memo ?? null, category: body.category?.toLowerCase() ?? null,
    };
    // A malformed `to` is refused before the key is taken, as a malformed amount is: the same key
    // with the `to` corrected pays (docs/payments.md, Idempotency).
    if (recipientTarget(input.to) === null) throw malformedRecipient(input.to);
    const { wallet, recipient } = await readRequest(principal, walletId, input.to, input.category, headers['session-token']);
    return runIdempotent(ctx.db, {
      orgId: principal.orgId, key: idempotencyKeyOf(headers['idempotency-key'], body.idempotencyKey),
      operation: 'payments.create', params: { ...input, currency: body.currency }, nowMs: ctx.clock.nowMs(),
      // After a crash: the payment as it stands now (the reconciler settles it meanwhile).
      recover: async (txId) => answer(outcomeOf((await settleKnownOutcomes(ctx, [await getTransaction(ctx.db, principal.orgId, txId)]))[0]!)),
    }, async (mark) => answer(await pay(ctx, principal.orgId, input, {
      wait: body.waitForConfirmation ?? true, mark, wallet, recipient, keyId: principal.keyId,
      sessionKey: principal.role === 'agent' ? wallet.session_public_key : null,
    })));
  };

  app.post('/v1/payments', {
    config: { permission: 'pay', cachedKey: true },
    schema: {
      tags: ['Payments'], summary: 'Pay from a wallet, checked against its policy first',
      description: 'An `agent` key must send the wallet\'s `Session-Token`. A policy violation is 402 with `violation`; '
        + 'the payment is recorded `blocked` and nothing reaches the chain.',
      body: Type.Object({ walletId: Type.String({ maxLength: 64 }), ...PaymentFields }, { additionalProperties: false }),
      response: { 200: PaymentView },
    },
  }, async (request, reply) => {
    const { walletId, ...body } = request.body;
    return sendIdempotent(reply, await handlePay(principalOf(request), walletId, body, request.headers));
  });

  app.post('/v1/wallets/:wallet_id/pay', {
    config: { permission: 'pay', cachedKey: true },
    schema: {
      tags: ['Payments'], summary: 'Pay from this wallet (the same as POST /v1/payments)',
      params: Type.Object({ wallet_id: Type.String({ maxLength: 64 }) }),
      body: Type.Object(PaymentFields, { additionalProperties: false }),
      response: { 200: PaymentView },
    },
  }, async (request, reply) =>
    sendIdempotent(reply, await handlePay(principalOf(request), request.params.wallet_id, request.body, request.headers)));

  app.post('/v1/payments/check', {
    config: { permission: 'pay' },
    schema: {
      tags: ['Payments'], summary: 'Would this payment pass? Answers without recording anything',
      body: Type.Object({
        walletId: Type.String({ maxLength: 64 }), to: PaymentFields.to, amount: PaymentFields.amount,
        currency: Type.Optional(currencyField()), category: PaymentFields.category,
      }, { additionalProperties: false }),
      response: {
        200: Type.Object({
          allowed: Type.Boolean(),
          reason: Type.Union([Type.String(), Type.Null()], { description: 'the error code the payment would get, when not allowed' }),
          violation: Type.Union([Type.Object({
            rule: Type.String(), limit: Type.Union([Type.String(), Type.Number()]), attempted: Type.Union([Type.String(), Type.Number()]),
          }), Type.Null()]),
          requires_approval: Type.Boolean(),
          wallet_id: Type.String(),
          usdc_balance: Type.String(),
          spending: SpendingView,
        }),
      },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const { walletId, category } = request.body;
    const to = recipientName(request.body.to);
    if (request.body.currency !== undefined) assertUsdc(request.body.currency);
    const amount = amountOf(request.body.amount, 'amount');
    const read = await readRequest(principal, walletId, to, category?.toLowerCase() ?? null, request.headers['session-token']);
    const { wallet } = read;
    assertNotArchived(wallet);
    const recipient = read.recipient();
    assertChainPayable(ctx.chain, recipient.address, 'to');
    // Deleted ones too: the wallet may have moved to another policy and this one been deleted
    // since the wallet was read (the answer is then as of that read, as a check is).
    const policy = await findPolicy(ctx.db, principal.orgId, wallet.policy_id, { includeDeleted: true });
    const rules = rulesOf(policy!);
    const nowMs = ctx.clock.nowMs();
    const windows = await spendWindowsAt(ctx.db, wallet.id, nowMs);
    const decision = evaluate(rules, spendStateOf(windows), {
      amount, recipient: to, recipientAddress: recipient.address, category: recipient.category, categories: recipient.categories, atMs: nowMs,
    });
    // In the order paying refuses: frozen, the policy, the balance, then a co-signature the vault
    // has no room to await.
    const reason = wallet.status === 'frozen' ? 'wallet_frozen'
      : !decision.allowed ? 'policy_violation'
        : wallet.balance < amount ? 'wallet_insufficient_balance'
          : decision.requiresApproval && await awaitingFull(ctx.db, wallet.id) ? 'invalid_request' : null;
    return {
      allowed: reason === null,
      reason,
      violation: decision.allowed ? null : decision.violation,
      requires_approval: decision.allowed && decision.requiresApproval,
      wallet_id: wallet.id,
      usdc_balance: formatUsdc(wallet.balance),
      spending: await spendingOf(ctx.db, wallet.id, rules, nowMs, windows),
    };
  });

  const TxParams = Type.Object({ tx_id: Type.String({ maxLength: 64 }) });

  app.post('/v1/payments/:tx_id/approve', {
    config: { permission: 'write' },
    schema: {
      tags: ['Payments'], summary: 'Co-sign a payment awaiting approval: it is checked again, then sent',
      params: TxParams,
      body: Type.Object({ waitForConfirmation: PaymentFields.waitForConfirmation }, { additionalProperties: false }),
      response: { 200: PaymentView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const outcome = await approvePayment(ctx, principal.orgId, request.params.tx_id, principal.keyId,
      { wait: request.body.waitForConfirmation ?? true });
    return answer(outcome).body;
  });

  app.post('/v1/payments/:tx_id/reject', {
    config: { permission: 'write' },
    schema: {
      tags: ['Payments'], summary: 'Refuse a payment awaiting approval: it is blocked and nothing is sent',
      params: TxParams,
      body: NoFields,
      response: { 200: PaymentView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    return view(await rejectPayment(ctx, principal.orgId, request.params.tx_id, principal.keyId, 'rejected'));
  });
}
