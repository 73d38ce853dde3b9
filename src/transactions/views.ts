/**
 * The transaction index as clients see it: one view of a transaction row (every endpoint that
 * returns a transaction uses it) and the list query behind the transaction lists.
 */
import { Type } from 'typebox';
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';
import type { AppContext } from '../http/context.ts';
import { PageFilter, type PageRequest } from '../http/pagination.ts';
import { formatUsdc } from '../money/money.ts';
import { recipientName } from '../recipients/recipients.ts';
import type { TransactionRow, TransactionStatus, TransactionType } from './settlement.ts';

export const TransactionTypeSchema = Type.Union([
  Type.Literal('payment'), Type.Literal('funding'), Type.Literal('withdrawal'), Type.Literal('a2a_send'),
  Type.Literal('a2a_receive'), Type.Literal('escrow_lock'), Type.Literal('escrow_release'), Type.Literal('escrow_refund'),
]);
export const TransactionStatusSchema = Type.Union([
  Type.Literal('confirmed'), Type.Literal('pending'), Type.Literal('blocked'), Type.Literal('failed'),
]);

const StringOrNull = Type.Union([Type.String(), Type.Null()]);
const PolicyValue = Type.Union([Type.String(), Type.Number()]);

export const TransactionView = Type.Object({
  tx_id: Type.String(),
  wallet_id: Type.Union([Type.String(), Type.Null()], { description: 'the vault involved' }),
  type: TransactionTypeSchema,
  recipient: Type.Union([Type.String(), Type.Null()], { description: 'chain address or domain, as the payment named it' }),
  amount: Type.String({ description: 'decimal USDC' }),
  currency: Type.String(),
  status: TransactionStatusSchema,
  tx_signature: Type.Union([Type.String(), Type.Null()], { description: 'null until the chain transaction is signed' }),
  on_chain_slot: Type.Union([Type.Integer(), Type.Null()], { description: 'slot of the chain outcome; null until settled' }),
  policy_id: StringOrNull,
  policy_triggered: Type.Boolean(),
  violation: Type.Union([
    Type.Object({ rule: Type.String(), limit: PolicyValue, attempted: PolicyValue }),
    Type.Null(),
  ], { description: 'the policy rule a blocked payment broke' }),
  memo: StringOrNull,
  agent_attestation_hash: Type.Union([Type.String(), Type.Null()], { description: '`sha256:<hex>` of the payment intent' }),
  explorer_url: Type.Union([Type.String(), Type.Null()], { description: 'Solana Explorer; null without a signature' }),
  explorer_url_alt: Type.Union([Type.String(), Type.Null()], { description: 'Solscan; null without a signature' }),
  failure_reason: Type.Union([Type.String(), Type.Null()], { description: 'why the chain refused it; null unless failed' }),
  approval: Type.Union([
    Type.Object({
      required: Type.Boolean(),
      status: Type.String({ description: 'awaiting, approved, rejected or expired' }),
      expires_at: StringOrNull,
      decided_by: Type.Union([Type.String(), Type.Null()], { description: 'id of the API key that decided' }),
      decided_at: StringOrNull,
    }),
    Type.Null(),
  ], { description: 'co-signature of a payment above the policy\'s requireCoSign; null when none was needed' }),
  timestamp: Type.String({ description: 'when the transaction was recorded' }),
  settled_at: Type.Union([Type.String(), Type.Null()], { description: 'when it reached its final status' }),
  // Last, so that they are the last columns of a CSV export too (added after the others).
  category: Type.Union([Type.String(), Type.Null()], {
    description: 'the category a payment counted under (its directory entry\'s, else the one it was sent with)',
  }),
  attested_at: Type.Union([Type.String(), Type.Null()], {
    description: 'the instant the attestation hash commits to (`time`), just before signing; null for other types',
  }),
  escrow_id: Type.Union([Type.String(), Type.Null()], {
    description: 'the escrow an a2a_send, escrow_lock, escrow_release, a2a_receive or escrow_refund row belongs to; null for other types',
  }),
  batch_id: Type.Union([Type.String(), Type.Null()], {
    description: 'the `POST /v1/wallets/fund-batch` a funding was made by (its answer\'s `batch_id`); null for other transactions',
  }),
});

/** A payment's answer (pay, approve, reject, `GET /v1/payments/{tx_id}`): the view and `signature`. */
export const PaymentView = Type.Intersect([TransactionView, Type.Object({
  signature: Type.Union([Type.String(), Type.Null()], { description: 'the same as tx_signature' }),
})]);

/** What the view needs to know of the service: which cluster the explorer links point at. */
export type ExplorerContext = Pick<AppContext, 'validator'> & { config: Pick<AppContext['config'], 'rpcUrl'> };

/** The address an explorer reaches the embedded validator at: the port `agent-vault validator` serves by default. */
const LOCAL_VALIDATOR_URL = 'http://127.0.0.1:8899';

/**
 * The explorers' query string for the cluster the service settles on ('' for mainnet, their
 * default). A custom RPC address is reduced to its origin (scheme, host, port): providers carry
 * API keys in its user info, path (`https://rpc.ankr.com/solana/<key>`) or query, and every
 * reader of a transaction would see them.
 */
export function explorerClusterQuery(rpcUrl: string | null, embeddedValidator: boolean): string {
  const custom = (url: string) => `?cluster=custom&customUrl=${encodeURIComponent(url)}`;
  if (embeddedValidator || rpcUrl === null) return custom(LOCAL_VALIDATOR_URL);
  const url = new URL(rpcUrl);
  const host = url.hostname.toLowerCase();
  if (host.includes('devnet')) return '?cluster=devnet';
  if (host.includes('testnet')) return '?cluster=testnet';
  if (host.includes('mainnet')) return '';
  return custom(url.origin);
}

/** A stored violation as the view shows it; anything else in the JSON stays internal. */
function violationOf(stored: unknown): { rule: string; limit: string | number; attempted: string | number } | null {
  if (!stored || typeof stored !== 'object') return null;
  const { rule, limit, attempted } = stored as Record<string, unknown>;
  if (typeof rule !== 'string') return null;
  const value = (v: unknown): string | number => (typeof v === 'number' || typeof v === 'string' ? v : String(v ?? ''));
  return { rule, limit: value(limit), attempted: value(attempted) };
}

interface StoredApproval {
  required?: boolean;
  status?: string;
  expires_at?: string;
  decided_by?: string;
  decided_at?: string;
}

function approvalOf(stored: StoredApproval | null | undefined) {
  if (!stored || typeof stored !== 'object') return null;
  return {
    required: stored.required ?? true,
    status: stored.status ?? 'awaiting',
    expires_at: stored.expires_at ?? null,
    decided_by: stored.decided_by ?? null,
    decided_at: stored.decided_at ?? null,
  };
}

/**
 * The transaction as every endpoint returns it. `approval` is a column of the payments
 * migration; rows read before it exists (or written by other features) simply have none.
 */
export function transactionView(row: TransactionRow & { approval?: StoredApproval | null }, ctx: ExplorerContext) {
  const cluster = row.tx_signature === null ? '' : explorerClusterQuery(ctx.config.rpcUrl, ctx.validator !== null);
  return {
    tx_id: row.id,
    wallet_id: row.wallet_id,
    type: row.type,
    recipient: row.recipient,
    amount: formatUsdc(row.amount),
    currency: row.currency,
    status: row.status,
    tx_signature: row.tx_signature,
    on_chain_slot: row.on_chain_slot === null ? null : Number(row.on_chain_slot),
    policy_id: row.policy_id,
    policy_triggered: row.policy_triggered,
    violation: violationOf(row.violation),
    memo: row.memo,
    agent_attestation_hash: row.attestation_hash,
    explorer_url: row.tx_signature === null ? null : `https://explorer.solana.com/tx/${row.tx_signature}${cluster}`,
    explorer_url_alt: row.tx_signature === null ? null : `https://solscan.io/tx/${row.tx_signature}${cluster}`,
    failure_reason: row.status === 'failed' ? row.failure_reason : null,
    approval: approvalOf(row.approval),
    timestamp: row.created_at.toISOString(),
    settled_at: row.settled_at?.toISOString() ?? null,
    category: row.category,
    attested_at: row.attested_at?.toISOString() ?? null,
    escrow_id: row.escrow_id,
    batch_id: row.batch_id,
  };
}

export function paymentView(row: TransactionRow & { approval?: StoredApproval | null }, ctx: ExplorerContext) {
  return { ...transactionView(row, ctx), signature: row.tx_signature };
}

export function transactionNotFound(txId: string): ServiceError {
  return new ServiceError('transaction_not_found', `No transaction ${txId} in your organisation.`, { param: 'tx_id' });
}

/** One transaction of the organisation; another organisation's answers exactly like a missing one. */
export async function getTransaction(q: Queryable, orgId: string, txId: string): Promise<TransactionRow> {
  const rows = await q.query<TransactionRow>('SELECT * FROM transactions WHERE org_id = $1 AND id = $2', [orgId, txId]);
  if (!rows[0]) throw transactionNotFound(txId);
  return rows[0];
}

export interface TransactionFilter {
  walletId?: string;
  status?: TransactionStatus;
  type?: TransactionType;
  recipient?: string;
  /** inclusive */
  from?: Date;
  /** exclusive */
  to?: Date;
}

/**
 * The conditions of a transaction filter, for a list's page or a count. A filter on a type other
 * than `payment`, or a status other than `confirmed`, also states that as a literal: the partial
 * indexes for them (migrations 0025 and 0047) leave the other values out, and a plan made for any
 * value of the parameter (PostgreSQL's generic plan, chosen after a prepared statement's fifth
 * run) could not use them otherwise.
 */
export function transactionConditions(orgId: string, filter: TransactionFilter): PageFilter {
  const where = new PageFilter().where((p) => `org_id = ${p}`, orgId);
  if (filter.walletId !== undefined) where.where((p) => `wallet_id = ${p}`, filter.walletId);
  if (filter.status !== undefined) {
    where.where((p) => `status = ${p}`, filter.status);
    if (filter.status === 'pending') where.whereSql(`status = 'pending'`);
    else if (filter.status !== 'confirmed') where.whereSql(`status NOT IN ('confirmed', 'pending')`);
  }
  if (filter.type !== undefined) {
    where.where((p) => `type = ${p}`, filter.type);
    if (filter.type !== 'payment') where.whereSql(`type <> 'payment'`);
  }
  // A domain as payments record it (its directory form, lowercase); an address as given. A
  // domain recorded before 2026-11-26 kept the case it was typed in: a filter typed in another
  // case looks for that spelling too.
  if (filter.recipient !== undefined) {
    const recorded = recipientName(filter.recipient);
    const typed = filter.recipient.trim();
    if (typed === recorded) where.where((p) => `recipient = ${p}`, recorded);
    else where.where((p) => `recipient = ANY(${p}::text[])`, [recorded, typed]);
  }
  if (filter.from !== undefined) where.where((p) => `created_at >= ${p}`, filter.from);
  if (filter.to !== undefined) where.where((p) => `created_at < ${p}`, filter.to);
  return where;
}

/**
 * A page of the organisation's transactions, newest first, LIMIT page.limit + 1 (toPage tells
 * whether there is more). Ordered and bounded the way the organisation's and the vault's
 * indexes are (and, for a filter matching few rows, its own), so each page is an index range scan.
 */
export async function listTransactions(
  q: Queryable, orgId: string, filter: TransactionFilter, page: PageRequest,
): Promise<TransactionRow[]> {
  const { sql, params } = transactionConditions(orgId, filter).page(page);
  return q.query<TransactionRow>(`SELECT * FROM transactions ${sql}`, params);
}
