/**
 * The transaction index (SPEC.md "Transactions"): one transaction, the organisation's
 * transactions and one wallet's, with filters. docs/transactions.md has the decisions.
 */
import { Type } from 'typebox';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import {
  DATE_MS_MAX, DATE_MS_MIN, PageQuery, pageOf, parsePageRequest, toPage, walletIdOf, walletIdQuery, type PageRequest,
} from '../http/pagination.ts';
import { assertVaultAccess, getWallet } from '../wallets/wallets.ts';
import { settleKnownOutcomes, settlePendingOf, type TransactionStatus, type TransactionType } from './settlement.ts';
import {
  PaymentView, TransactionStatusSchema, TransactionTypeSchema, TransactionView, getTransaction, listTransactions, paymentView, transactionView,
  type TransactionFilter,
} from './views.ts';

const TxParams = Type.Object({ tx_id: Type.String({ maxLength: 64 }) });
const WalletParams = Type.Object({ wallet_id: Type.String({ maxLength: 64 }) });
const TIME_MAX_CHARS = 40;
/** How many times a `status=pending` page is selected while its rows keep settling. */
const PENDING_SELECT_ROUNDS = 4;

/**
 * `GET /v1/transactions/exports` (and `…/export`, the path of the POST) reach the route of one
 * transaction: exports are not listed, and a client trying to list them is told how they are
 * read rather than that no transaction has that id.
 */
const EXPORTS_SEGMENTS = new Set(['exports', 'export']);

export function exportsAreReadById(param = 'tx_id'): ServiceError {
  return new ServiceError('not_found', 'Exports are not listed: create one with POST /v1/transactions/export, then read it by '
    + 'its id at GET /v1/transactions/exports/{export_id} (docs/exports.md).', { param });
}

/** The filters both lists take (SPEC: status, from, to, type, limit, cursor). */
const WalletListFields = {
  ...PageQuery,
  status: Type.Optional(TransactionStatusSchema),
  type: Type.Optional(TransactionTypeSchema),
  from: Type.Optional(Type.String({ maxLength: TIME_MAX_CHARS, description: 'ISO 8601, inclusive' })),
  to: Type.Optional(Type.String({ maxLength: TIME_MAX_CHARS, description: 'ISO 8601, exclusive' })),
};
const WalletListQuery = Type.Object(WalletListFields, { additionalProperties: false });
const OrganizationListQuery = Type.Object({
  ...WalletListFields,
  ...walletIdQuery(),
  recipient: Type.Optional(Type.String({ minLength: 1, maxLength: 256, description: 'an address exactly, a domain in any case' })),
}, { additionalProperties: false });

const ISO_8601 = /^(\d{4})-(\d{2})-(\d{2})(?:T(\d{2}):(\d{2})(?::(\d{2})(?:\.(\d{1,9}))?)?(Z|[+-]\d{2}:\d{2}))?$/;

/**
 * A time bound of a list filter: a UTC date (its midnight) or a date-time with `Z` or an offset
 * (a time without one would depend on the server's zone). Rows are stamped in whole
 * milliseconds, so a bound with a finer fraction is rounded up: both `created_at >= from` and
 * `created_at < to` then select exactly the rows the exact bound would.
 */
export function parseTimeBound(param: 'from' | 'to', raw: string): Date {
  // An unencoded `+` in a query string arrives as a space: "…T10:00:00 02:00" meant "+02:00".
  const text = raw.replace(/ (\d{2}:\d{2})$/, '+$1');
  const match = ISO_8601.exec(text);
  const refuse = () => invalidRequest(param, `${param} must be an ISO 8601 date ("2026-04-01") or date-time with a zone ("2026-04-01T10:00:00Z").`);
  if (!match) throw refuse();
  const [, year, month, day, hour = '0', minute = '0', second = '0', fraction = '', zone = 'Z'] = match;
  const date = new Date(0);
  date.setUTCFullYear(Number(year), Number(month) - 1, Number(day));
  if (date.getUTCFullYear() !== Number(year) || date.getUTCMonth() !== Number(month) - 1 || date.getUTCDate() !== Number(day)
    || Number(hour) > 23 || Number(minute) > 59 || Number(second) > 59) {
    throw refuse();
  }
  let offsetMinutes = 0;
  if (zone !== 'Z') {
    const [zoneHours, zoneMinutes] = zone.slice(1).split(':').map(Number) as [number, number];
    if (zoneHours > 23 || zoneMinutes > 59) throw refuse();
    offsetMinutes = (zone.startsWith('-') ? -1 : 1) * (zoneHours * 60 + zoneMinutes);
  }
  const fractionMs = fraction ? Math.ceil(Number(`0.${fraction}`) * 1000 - 1e-9) : 0;
  const ms = date.getTime() + ((Number(hour) * 60 + Number(minute) - offsetMinutes) * 60 + Number(second)) * 1000 + fractionMs;
  if (ms < DATE_MS_MIN || ms > DATE_MS_MAX) throw invalidRequest(param, `${param} must be from the year 0001 to the year 9999 (UTC).`);
  return new Date(ms);
}

export interface ListQuery {
  status?: TransactionStatus;
  type?: TransactionType;
  from?: string;
  to?: string;
  walletId?: string;
  wallet_id?: string;
  recipient?: string;
}

export function filterOf(query: ListQuery): TransactionFilter {
  const filter: TransactionFilter = {};
  const walletId = walletIdOf(query);
  if (walletId !== undefined) filter.walletId = walletId;
  if (query.status !== undefined) filter.status = query.status;
  if (query.type !== undefined) filter.type = query.type;
  if (query.recipient !== undefined) filter.recipient = query.recipient;
  if (query.from !== undefined) filter.from = parseTimeBound('from', query.from);
  if (query.to !== undefined) filter.to = parseTimeBound('to', query.to);
  if (filter.from && filter.to && filter.to.getTime() <= filter.from.getTime()) {
    throw invalidRequest('to', 'to must be later than from (from is inclusive, to exclusive).');
  }
  return filter;
}

export function transactionRoutes(app: App, ctx: AppContext): void {
  /**
   * A page of the organisation's transactions (or one wallet's) as the chain has decided them.
   * Selecting by `pending`, what the chain has decided among the newest 256 pending rows is
   * settled first, and the page is selected again while its rows keep settling (a few times),
   * so it holds those still pending; the rows shown are settled as any read does
   * (settleKnownOutcomes), and one that settled since it was selected is left out of a page
   * selected by a status it no longer has (the cursor follows the rows as selected).
   */
  const settledPage = async (orgId: string, filter: TransactionFilter, page: PageRequest) => {
    if (filter.status === 'pending') await settlePendingOf(ctx, orgId, filter.walletId);
    let selected = await listTransactions(ctx.db, orgId, filter, page);
    let settled = await settleKnownOutcomes(ctx, selected);
    // Rows beyond the ones settled first that settle now: selected again, a few times at most.
    for (let round = 1; filter.status === 'pending' && round < PENDING_SELECT_ROUNDS; round += 1) {
      if (settled.every((row, i) => row.status === selected[i]!.status)) break;
      selected = await listTransactions(ctx.db, orgId, filter, page);
      settled = await settleKnownOutcomes(ctx, selected);
    }
    const result = toPage(settled, page, (row) => row);
    const shown = filter.status === undefined ? result.data : result.data.filter((row) => row.status === filter.status);
    return { ...result, data: shown.map((row) => transactionView(row, ctx)) };
  };

  app.get('/v1/transactions/:tx_id', {
    config: { permission: 'read' },
    schema: {
      tags: ['Transactions'], summary: 'A transaction of any type',
      params: TxParams, response: { 200: TransactionView },
    },
  }, async (request) => {
    const { orgId } = principalOf(request);
    if (EXPORTS_SEGMENTS.has(request.params.tx_id)) throw exportsAreReadById();
    const [row] = await settleKnownOutcomes(ctx, [await getTransaction(ctx.db, orgId, request.params.tx_id)]);
    return transactionView(row!, ctx);
  });

  app.get('/v1/payments/:tx_id', {
    config: { permission: 'vault_read' },
    schema: {
      tags: ['Payments'], summary: 'A payment (any transaction id answers): the view of /v1/transactions/{tx_id} and `signature`, as paying answers',
      description: 'An `agent` key must send the `Session-Token` of the transaction\'s wallet.',
      params: TxParams, response: { 200: PaymentView },
    },
  }, async (request) => {
    const principal = principalOf(request);
    // `GET /v1/payments/check`: the preflight asked for with the wrong method, not a payment "check".
    if (request.params.tx_id === 'check') {
      throw new ServiceError('not_found', 'The preflight is POST /v1/payments/check, with the payment\'s body; GET reads a payment by its id.',
        { param: 'tx_id' });
    }
    const row = await getTransaction(ctx.db, principal.orgId, request.params.tx_id);
    if (principal.role === 'agent') {
      // An agent polls the payments of the vault it holds the token for, and nothing else.
      const wallet = row.wallet_id === null ? null : await getWallet(ctx.db, principal.orgId, row.wallet_id);
      if (wallet === null) throw invalidSession();
      assertVaultAccess(principal, wallet, sessionTokenOf(request.headers), ctx.clock.nowMs());
    }
    const [settled] = await settleKnownOutcomes(ctx, [row]);
    return paymentView(settled!, ctx);
  });

  app.get('/v1/transactions', {
    config: { permission: 'read' },
    schema: {
      tags: ['Transactions'], summary: 'The organisation\'s transactions, newest first',
      querystring: OrganizationListQuery, response: { 200: pageOf(TransactionView) },
    },
  }, async (request) => {
    const { orgId } = principalOf(request);
    const page = parsePageRequest(request.query);
    const filter = filterOf(request.query);
    // A vault not in the organisation is 404, as for an export: not an empty list that looks like a vault without transactions.
    if (filter.walletId !== undefined) await getWallet(ctx.db, orgId, filter.walletId);
    return settledPage(orgId, filter, page);
  });

  app.get('/v1/wallets/:wallet_id/transactions', {
    config: { permission: 'vault_read' },
    schema: {
      tags: ['Transactions'], summary: 'One wallet\'s transactions, newest first',
      description: 'An `agent` key must send the wallet\'s `Session-Token` header.',
      params: WalletParams, querystring: WalletListQuery, response: { 200: pageOf(TransactionView) },
    },
  }, async (request) => {
    const principal = principalOf(request);
    const wallet = await getWallet(ctx.db, principal.orgId, request.params.wallet_id);
    assertVaultAccess(principal, wallet, sessionTokenOf(request.headers), ctx.clock.nowMs());
    const page = parsePageRequest(request.query);
    return settledPage(principal.orgId, { ...filterOf(request.query), walletId: wallet.id }, page);
  });
}

function sessionTokenOf(headers: Record<string, string | string[] | undefined>): string | undefined {
  const value = headers['session-token'];
  return typeof value === 'string' ? value : undefined;
}

function invalidSession() {
  return new ServiceError('session_token_invalid', 'This transaction belongs to no wallet an agent key can act on.');
}
