/**
 * Wallet endpoints (SPEC.md "Wallets"): create, read, list, update, archive, rotate the session
 * token, auto-topup settings, and moving USDC between the reserve and vaults.
 */
import { Type } from 'typebox';
import { amountField, amountOf, currencyField, patternString } from '../http/fields.ts';
import { ServiceError } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { idempotencyKeyOf, runIdempotent, sendIdempotent } from '../http/idempotency.ts';
import { PageQuery, PageFilter, pageOf, parsePageRequest, toPage } from '../http/pagination.ts';
import { formatUsdc } from '../money/money.ts';
import type { TransactionRow } from '../transactions/settlement.ts';
import { spendingOf } from '../payments/budgets.ts';
import { findPolicy, rulesOf } from '../policies/policies.ts';
import { FUND_BATCH_MAX, assertDistinctWallets, fundWallets, recordedMove, withdrawFromWallet, type MoveResult } from './funding.ts';
import {
  SESSION_TTL_SECONDS_DEFAULT, SESSION_TTL_SECONDS_MAX, SESSION_TTL_SECONDS_MIN,
} from './session-token.ts';
import {
  AGENT_ID_PATTERN, LABEL_MAX, TAGS_MAX, TAG_PATTERN, WALLET_SELECT, WalletStatusSchema, WalletView, statusCondition,
  archiveWallet, assertVaultAccess, assertWalletsExist, createWallet, getWallet, normaliseTags, provisionedWallet, rotateSessionToken, setAutoTopup, updateWallet, walletView,
  type WalletWithPolicy,
} from './wallets.ts';

const WalletParams = Type.Object({ wallet_id: Type.String({ maxLength: 64 }) });
const IdempotencyKeyField = Type.Optional(Type.String({ description: 'or the Idempotency-Key header' }));
const Tags = Type.Array(patternString(TAG_PATTERN, 'must be 1–50 characters of letters, digits, "_", ".", ":", "/" or "-", starting with a letter or digit'),
  { maxItems: TAGS_MAX });
const Label = Type.String({ minLength: 1, maxLength: LABEL_MAX });
const PolicyId = Type.String({ minLength: 1, maxLength: 64 });

const MoveStatus = Type.Union([Type.Literal('confirmed'), Type.Literal('pending'), Type.Literal('failed')]);
const FundView = Type.Object({
  wallet_id: Type.String(),
  funded_amount: Type.String(),
  usdc_balance: Type.String(),
  org_balance_remaining: Type.String(),
  status: MoveStatus,
  tx_id: Type.String(),
  tx_signature: Type.String(),
  on_chain_slot: Type.Union([Type.Integer(), Type.Null()]),
});
const FundBatchView = Type.Object({
  batch_id: Type.String(),
  status: MoveStatus,
  total_amount: Type.String(),
  org_balance_remaining: Type.String(),
  tx_signature: Type.String(),
  on_chain_slot: Type.Union([Type.Integer(), Type.Null()]),
  allocations: Type.Array(Type.Object({
    wallet_id: Type.String(), amount: Type.String(), usdc_balance: Type.String(), tx_id: Type.String(),
  })),
});
const WithdrawView = Type.Object({
  wallet_id: Type.String(),
  withdrawn_amount: Type.String(),
  usdc_balance: Type.String(),
  org_balance: Type.String(),
  status: MoveStatus,
  tx_id: Type.String(),
  tx_signature: Type.String(),
  on_chain_slot: Type.Union([Type.Integer(), Type.Null()]),
});

function assertUsdc(currency: string | undefined): void {
  if (currency !== undefined && currency !== 'USDC') {
    throw new ServiceError('invalid_currency', `Only USDC is supported, not "${currency}".`, { param: 'currency' });
  }
}

/**
 * A settled move the chain refused for want of funds is that refusal (the index said the source
 * could pay: it must not pass silently). Any other failure (it expired unsent, after a crash) is
 * the move's answer, `status: "failed"`: its settlement gave the amount back, index and chain agree.
 */
function assertNotFailed(result: MoveResult, code: 'org_insufficient_balance' | 'withdrawal_exceeds_balance'): void {
  if (result.status !== 'failed') return;
  const reason = result.transactions[0]?.failure_reason;
  if (reason === 'InsufficientFunds') throw new ServiceError(code, 'The chain refused the transfer: the source balance does not cover it.');
}

const slotOf = (row: TransactionRow): number | null => (row.on_chain_slot === null ? null : Number(row.on_chain_slot));

export function walletRoutes(app: App, ctx: AppContext): void {
  const view = (row: WalletWithPolicy) => walletView(row, ctx.clock.nowMs());
  const reserveBalance = async (orgId: string): Promise<bigint> =>
    (await ctx.db.query<{ reserve_balance: bigint }>('SELECT reserve_balance FROM organizations WHERE id = $1', [orgId]))[0]!.reserve_balance;

  /** What a fund or a withdrawal of one wallet answers, once settled (or as recorded, after a crash). */
  const singleMove = async (orgId: string, walletId: string, moved: MoveResult,
    refusal: 'org_insufficient_balance' | 'withdrawal_exceeds_balance') => {
    assertNotFailed(moved, refusal);
    const row = moved.transactions[0]!;
    const wallet = await getWallet(ctx.db, orgId, walletId);
    return {
      wallet_id: walletId, amount: formatUsdc(row.amount), usdc_balance: formatUsdc(wallet.balance),
      reserve: formatUsdc(await reserveBalance(orgId)), status: moved.status, tx_id: row.id,
      tx_signature: row.tx_signature!, on_chain_slot: slotOf(row),
    };
  };

  app.post('/v1/wallets', {
    config: { permission: 'write' },
    schema: {
      tags: ['Wallets'], summary: 'Create a wallet (a vault on chain) for an agent',
      body: Type.Object({
        agentId: patternString(AGENT_ID_PATTERN,
          'must be 1–128 characters of letters, digits, ".", "_", ":", "@" or "-", starting with a letter or digit',
          { description: 'your identifier of the agent; unique, never reused' }),
        label: Label,
        policyId: PolicyId,
        tags: Type.Optional(Tags),
        ownerOrg: Type.Optional(Type.String({ description: 'accepted for compatibility; must be your organisation' })),
        idempotencyKey: IdempotencyKeyField,
      }, { additionalProperties: false }),
      response: { 200: WalletView },
    },
  }, async (request, reply) => {
    const { orgId } = principalOf(request);
    const { idempotencyKey, ownerOrg, ...body } = request.body;
    // Tags are a set: in another order, repeated, or none against [], they name the same wallet.
    const input = { ...body, tags: normaliseTags(body.tags ?? []) };
    if (ownerOrg !== undefined && ownerOrg !== orgId) {
      throw new ServiceError('invalid_request', 'owner_org must be the organisation of your API key.', { param: 'owner_org' });
    }
    const result = await runIdempotent(ctx.db, {
      orgId, actingKeyId: principalOf(request).keyId, key: idempotencyKeyOf(request.headers['idempotency-key'], idempotencyKey),
      // No tags are hashed as none, as before tags were normalised: keys taken then still replay.
      operation: 'wallets.create', params: { ...input, tags: input.tags.length ? input.tags : undefined }, nowMs: ctx.clock.nowMs(),
      recover: async (walletId) => ({ status: 200, body: view(await provisionedWallet(ctx, orgId, walletId)) }),
    }, async (mark) => ({
      status: 200, body: view(await createWallet(ctx, orgId, input, mark)),
    }));
    return sendIdempotent(reply, result);
  });

  app.get('/v1/wallets/:wallet_id', {
    config: { permission: 'vault_read' },
    schema: {
      tags: ['Wallets'], summary: 'A wallet, with its balance and policy',
      description: 'An `agent` key must send the wallet\'s `Session-Token` header.',
      params: WalletParams, response: { 200: WalletView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const wallet = await getWallet(ctx.db, principal.orgId, request.params.wallet_id);
    assertVaultAccess(principal, wallet, request.headers['session-token'] as string | undefined, ctx.clock.nowMs());
    // An archived wallet's policy may have been deleted since: its spending is still shown by it.
    const policy = await findPolicy(ctx.db, principal.orgId, wallet.policy_id, { includeDeleted: true });
    return { ...view(wallet), spending: await spendingOf(ctx.db, wallet.id, rulesOf(policy!), ctx.clock.nowMs()) };
  });

  app.get('/v1/wallets', {
    config: { permission: 'read' },
    schema: {
      tags: ['Wallets'], summary: 'List wallets, newest first',
      querystring: Type.Object({
        ...PageQuery,
        status: Type.Optional(WalletStatusSchema),
        tags: Type.Optional(Type.String({ maxLength: 1100, description: 'comma-separated; wallets having all of them' })),
      }, { additionalProperties: false }),
      response: { 200: pageOf(WalletView) },
    },
  }, async (request) => {
    const { orgId } = principalOf(request);
    const page = parsePageRequest(request.query);
    const where = new PageFilter('w').where((p) => `w.org_id = ${p}`, orgId);
    const { status } = request.query;
    // idle and active depend on the time; the others do not name it.
    if (status === 'idle' || status === 'active') where.where((now) => `(${statusCondition(status, now)})`, new Date(ctx.clock.nowMs()));
    else if (status) where.whereSql(`(${statusCondition(status, null)})`);
    else where.whereSql(`w.status <> 'archived'`);
    if (request.query.tags) {
      const tags = request.query.tags.split(',').map((tag) => tag.trim()).filter(Boolean);
      if (tags.length > TAGS_MAX) {
        throw new ServiceError('invalid_request', `tags is a comma-separated list of at most ${TAGS_MAX} tags.`, { param: 'tags' });
      }
      const malformed = tags.find((tag) => !new RegExp(TAG_PATTERN).test(tag));
      if (malformed !== undefined) {
        throw new ServiceError('invalid_request',
          `"${malformed}" is not a tag: 1–50 characters of letters, digits and _.:/-, starting with a letter or digit.`, { param: 'tags' });
      }
      where.where((p) => `w.tags @> ${p}::text[]`, tags);
    }
    const { sql, params } = where.page(page);
    const rows = await ctx.db.query<WalletWithPolicy>(`${WALLET_SELECT} ${sql}`, params);
    return toPage(rows, page, view);
  });

  app.patch('/v1/wallets/:wallet_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Wallets'], summary: 'Change label, policy or tags; freeze (status "frozen") or unfreeze (status "active")',
      params: WalletParams,
      body: Type.Object({
        label: Type.Optional(Label),
        policyId: Type.Optional(PolicyId),
        tags: Type.Optional(Tags),
        status: Type.Optional(Type.Union([Type.Literal('active'), Type.Literal('frozen')])),
        lowBalanceThreshold: Type.Optional(Type.Union([Type.String(), Type.Null()], {
          description: 'balance.low fires once each time the balance falls below it; null turns it off',
        })),
      }, { additionalProperties: false, minProperties: 1 }),
      response: { 200: WalletView },
    },
  }, async (request) => {
    const { orgId, keyId } = principalOf(request);
    const { lowBalanceThreshold, ...rest } = request.body;
    const threshold = lowBalanceThreshold === undefined ? undefined
      : lowBalanceThreshold === null ? null : amountOf(lowBalanceThreshold, 'low_balance_threshold');
    return view(await updateWallet(ctx, orgId, request.params.wallet_id, { ...rest, lowBalanceThreshold: threshold }, keyId));
  });

  app.delete('/v1/wallets/:wallet_id', {
    config: { permission: 'write' },
    schema: {
      tags: ['Wallets'], summary: 'Archive a wallet (its balance must be zero); it then only answers reads',
      params: WalletParams, response: { 200: WalletView },
    },
  }, async (request) => view(await archiveWallet(ctx, principalOf(request).orgId, request.params.wallet_id)));

  app.post('/v1/wallets/:wallet_id/rotate-token', {
    config: { permission: 'write' },
    schema: {
      tags: ['Wallets'], summary: 'Issue a new session token for the wallet\'s agent; the previous one stops working at once',
      params: WalletParams,
      body: Type.Object({
        ttlSeconds: Type.Optional(Type.Integer({
          minimum: SESSION_TTL_SECONDS_MIN, maximum: SESSION_TTL_SECONDS_MAX, default: SESSION_TTL_SECONDS_DEFAULT,
        })),
      }, { additionalProperties: false }),
      response: { 200: Type.Object({ wallet_id: Type.String(), session_token: Type.String(), expires_at: Type.String() }) },
    },
  }, async (request) => {
    const ttl = request.body.ttlSeconds ?? SESSION_TTL_SECONDS_DEFAULT;
    const { orgId, keyId } = principalOf(request);
    return rotateSessionToken(ctx, orgId, request.params.wallet_id, ttl, keyId);
  });

  app.put('/v1/wallets/:wallet_id/auto-topup', {
    config: { permission: 'write' },
    schema: {
      tags: ['Wallets'], summary: 'Configure auto-topup from the reserve',
      params: WalletParams,
      body: Type.Object({
        enabled: Type.Boolean(),
        triggerBelow: Type.Optional(Type.String({ description: 'top up when the balance is below this (after a debit, or already when turned on)' })),
        topupAmount: Type.Optional(Type.String({ description: 'how much one topup adds' })),
      }, { additionalProperties: false }),
      response: { 200: WalletView },
    },
  }, async (request) => {
    const { enabled, triggerBelow, topupAmount } = request.body;
    if (enabled && (triggerBelow === undefined || topupAmount === undefined)) {
      throw new ServiceError('invalid_request', 'Enabling auto-topup needs triggerBelow and topupAmount.',
        { param: triggerBelow === undefined ? 'trigger_below' : 'topup_amount' });
    }
    const trigger = triggerBelow === undefined ? null : amountOf(triggerBelow, 'trigger_below', { allowZero: true });
    const amount = topupAmount === undefined ? null : amountOf(topupAmount, 'topup_amount');
    const { orgId, keyId } = principalOf(request);
    return view(await setAutoTopup(ctx, orgId, request.params.wallet_id, { enabled, triggerBelow: trigger, topupAmount: amount }, keyId));
  });

  app.post('/v1/wallets/:wallet_id/fund', {
    config: { permission: 'write' },
    schema: {
      tags: ['Funding'], summary: 'Move USDC from the organisation reserve to the wallet',
      params: WalletParams,
      body: Type.Object({
        amount: amountField(), currency: Type.Optional(currencyField()), idempotencyKey: IdempotencyKeyField,
      }, { additionalProperties: false }),
      response: { 200: FundView },
    },
  }, async (request, reply) => {
    const { orgId } = principalOf(request);
    const { wallet_id: walletId } = request.params;
    assertUsdc(request.body.currency);
    const amount = amountOf(request.body.amount, 'amount');
    const answer = async (moved: MoveResult) => {
      const { amount: funded, reserve, ...common } = await singleMove(orgId, walletId, moved, 'org_insufficient_balance');
      return { status: 200, body: { ...common, funded_amount: funded, org_balance_remaining: reserve } };
    };
    await assertWalletsExist(ctx.db, orgId, [walletId], () => 'wallet_id');
    const result = await runIdempotent(ctx.db, {
      orgId, actingKeyId: principalOf(request).keyId, key: idempotencyKeyOf(request.headers['idempotency-key'], request.body.idempotencyKey),
      operation: 'wallets.fund', params: { walletId, amount }, nowMs: ctx.clock.nowMs(),
      recover: async (signature) => answer(await recordedMove(ctx.db, orgId, signature)),
    }, async (mark) => answer(await fundWallets(ctx, orgId, [{ walletId, amount }], mark)));
    return sendIdempotent(reply, result);
  });

  app.post('/v1/wallets/fund-batch', {
    config: { permission: 'write' },
    schema: {
      tags: ['Funding'], summary: `Fund up to ${FUND_BATCH_MAX} wallets atomically (one chain transaction)`,
      body: Type.Object({
        allocations: Type.Array(Type.Object({
          walletId: Type.String({ maxLength: 64 }), amount: amountField(),
        }, { additionalProperties: false }), { minItems: 1, maxItems: FUND_BATCH_MAX }),
        idempotencyKey: IdempotencyKeyField,
      }, { additionalProperties: false }),
      response: { 200: FundBatchView },
    },
  }, async (request, reply) => {
    const { orgId } = principalOf(request);
    const allocations = request.body.allocations.map((a, i) => ({ walletId: a.walletId, amount: amountOf(a.amount, `allocations.${i}.amount`) }));
    // Malformed, so refused before the key is taken: the corrected batch may use the same key.
    assertDistinctWallets(allocations);
    await assertWalletsExist(ctx.db, orgId, allocations.map((a) => a.walletId), (i) => `allocations.${i}.wallet_id`);
    const answer = async (moved: MoveResult) => {
      assertNotFailed(moved, 'org_insufficient_balance');
      const balances = await ctx.db.query<{ id: string; balance: bigint }>(
        'SELECT id, balance FROM wallets WHERE org_id = $1 AND id = ANY($2)', [orgId, allocations.map((a) => a.walletId)]);
      const balanceOf = new Map(balances.map((w) => [w.id, w.balance]));
      const rowOf = new Map(moved.transactions.map((row) => [row.wallet_id, row]));
      const first = moved.transactions[0]!;
      return {
        status: 200,
        body: {
          batch_id: first.batch_id!,
          status: moved.status,
          total_amount: formatUsdc(allocations.reduce((sum, a) => sum + a.amount, 0n)),
          org_balance_remaining: formatUsdc(await reserveBalance(orgId)),
          tx_signature: first.tx_signature!,
          on_chain_slot: slotOf(first),
          allocations: allocations.map((a) => ({
            wallet_id: a.walletId, amount: formatUsdc(a.amount), usdc_balance: formatUsdc(balanceOf.get(a.walletId)!),
            tx_id: rowOf.get(a.walletId)!.id,
          })),
        },
      };
    };
    const result = await runIdempotent(ctx.db, {
      orgId, actingKeyId: principalOf(request).keyId, key: idempotencyKeyOf(request.headers['idempotency-key'], request.body.idempotencyKey),
      operation: 'wallets.fund_batch', params: allocations, nowMs: ctx.clock.nowMs(),
      recover: async (signature) => answer(await recordedMove(ctx.db, orgId, signature)),
    }, async (mark) => answer(await fundWallets(ctx, orgId, allocations, mark, { batch: true })));
    return sendIdempotent(reply, result);
  });

  app.post('/v1/wallets/:wallet_id/withdraw', {
    config: { permission: 'write' },
    schema: {
      tags: ['Funding'], summary: 'Return USDC from the wallet to the organisation reserve',
      params: WalletParams,
      body: Type.Object({
        amount: amountField('decimal USDC, or "all" for the whole balance'),
        currency: Type.Optional(currencyField()),
        idempotencyKey: IdempotencyKeyField,
      }, { additionalProperties: false }),
      response: { 200: WithdrawView },
    },
  }, async (request, reply) => {
    const { orgId } = principalOf(request);
    const { wallet_id: walletId } = request.params;
    assertUsdc(request.body.currency);
    const amount = request.body.amount === 'all' ? 'all' as const : amountOf(request.body.amount, 'amount', { alternative: ', or "all" (lowercase) for the whole balance' });
    const answer = async (moved: MoveResult) => {
      const { amount: withdrawn, reserve, ...common } = await singleMove(orgId, walletId, moved, 'withdrawal_exceeds_balance');
      return { status: 200, body: { ...common, withdrawn_amount: withdrawn, org_balance: reserve } };
    };
    await assertWalletsExist(ctx.db, orgId, [walletId], () => 'wallet_id');
    const result = await runIdempotent(ctx.db, {
      orgId, actingKeyId: principalOf(request).keyId, key: idempotencyKeyOf(request.headers['idempotency-key'], request.body.idempotencyKey),
      operation: 'wallets.withdraw', params: { walletId, amount }, nowMs: ctx.clock.nowMs(),
      recover: async (signature) => answer(await recordedMove(ctx.db, orgId, signature)),
    }, async (mark) => answer(await withdrawFromWallet(ctx, orgId, walletId, amount, mark)));
    return sendIdempotent(reply, result);
  });
}
