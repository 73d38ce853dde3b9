/**
 * Paying: an agent's vault pays a recipient. The policy decides before anything reaches the
 * chain; the chain settles; nothing is paid twice and no vault is overspent.
 *
 * The flow (DESIGN §5): resolve the recipient; sign the pay instruction (its signature is known
 * before anything is sent); under the wallet's row lock check frozen, the policy against the
 * spend windows at this instant, and the balance; record the payment `pending`, debit the
 * balance and count the spend; commit; send; settle from the chain's outcome. A refused payment
 * is recorded `blocked` with its violation and `transaction.blocked`, and nothing is sent.
 *
 * A payment above the policy's `requireCoSign` is recorded `pending` awaiting an approval; it is
 * checked again, debited and sent only when an admin or operator approves it.
 */
import { createHash } from 'node:crypto';
import type { Instruction } from '@solana/kit';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import { alertPolicyViolation, largeTransactionAlerts } from '../automation/automation.ts';
import { toAddress } from '../chain/base58.ts';
import { NoDistinctBlockhashError, referenceMemoIx, type PreparedTransaction } from '../chain/client.ts';
import type { Database, Queryable, Transaction } from '../db/database.ts';
import { GroupCommit, type BatchOutcome } from '../db/group-commit.ts';
import { Params } from '../db/params.ts';
import { retryShortly, ServiceError } from '../errors/errors.ts';
import { recordEvent, recordEvents, recordEventsSql, type NewEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { invalidKeyError } from '../http/auth.ts';
import { canonicalJson, type RecordMarker } from '../http/idempotency.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';
import { RULE_COLUMNS, findPolicy, rulesOf, type RuleColumns } from '../policies/policies.ts';
import {
  assertChainPayable, recipientEntrySql, recipientTarget, resolveRecipient, resolvedRecipient, serviceAccountSql, type RecipientTarget, type ResolvedRecipient,
} from '../recipients/recipients.ts';
import {
  awaitConfirmation, insertTransaction, insertTransactionsSql, recordTransactionFailed, registerSettlementRule, settleInBackground,
  sendUntilTaken, type NewTransaction, type TransactionRow,
} from '../transactions/settlement.ts';
import {
  WALLET_SELECT, archivedError, assertNotArchived, lockWallet, sessionExpiredError, sessionTokenInvalid, walletNotFound, type WalletRow,
  type WalletWithPolicy,
} from '../wallets/wallets.ts';
import { evaluate, type Violation } from './policy-engine.ts';
import {
  saveSpendWindows, saveSpendWindowsSql, spendStateOf, spendWindowsAt, spendWindowsFrom, spendWindowsOf, withSpend, withdrawSpend,
  type SpendWindows,
} from './spend-state.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

/** Memos are stored off chain (the attestation hash commits to them). */
export const MEMO_MAX_CHARS = 500;
/** How long a payment waits for its co-signature before it is blocked. */
export const APPROVAL_TTL_MS = 24 * 60 * 60 * 1000;
/**
 * Payments of one vault awaiting their co-signature at once: each is a row, an event and its
 * webhook deliveries, and an operator's decision; an agent looping above the threshold would
 * otherwise fill the approval queue without bound (nothing is debited while they wait).
 */
export const AWAITING_PER_WALLET_MAX = 100;
/** How long a request waits for the chain before answering `pending`. */
export const PAYMENT_WAIT_MS = 20_000;

export interface PaymentInput {
  walletId: string;
  to: string;
  amount: bigint;
  memo: string | null;
  category: string | null;
}

export interface PaymentOutcome {
  row: TransactionRow;
  /** when the payment was refused by the policy (the row is `blocked`) */
  violation: Violation | null;
}

/** `sha256:<hex>` of the canonical JSON of the payment intent as sent (DESIGN §6). */
export function attestationHashOf(intent: {
  walletId: string; recipient: string; amount: bigint; currency: string; memo: string | null; category: string | null; atMs: number;
}): string {
  const canonical = canonicalJson({
    wallet: intent.walletId, recipient: intent.recipient, amount: formatUsdc(intent.amount), currency: intent.currency,
    memo: intent.memo, category: intent.category, time: new Date(intent.atMs).toISOString(),
  });
  return `sha256:${createHash('sha256').update(canonical).digest('hex')}`;
}

function attestationBytes(hash: string): Uint8Array {
  return new Uint8Array(Buffer.from(hash.slice('sha256:'.length), 'hex'));
}

async function payInstructions(ctx: Ctx, wallet: WalletRow, txId: string, recipient: string, amount: bigint, attestation: string): Promise<Instruction[]> {
  return [
    referenceMemoIx(txId),
    await ctx.chain.payIx({
      orgId: wallet.org_id, agentId: wallet.agent_id, policyId: wallet.policy_id, recipient: toAddress(recipient),
      amount, attestation: attestationBytes(attestation),
    }),
  ];
}

export async function rulesFor(q: Queryable, wallet: WalletRow) {
  const policy = await findPolicy(q, wallet.org_id, wallet.policy_id);
  if (!policy) throw new Error(`wallet ${wallet.id} has no policy ${wallet.policy_id}`);
  return rulesOf(policy);
}


/**
 * The category a refused spend is recorded under, and the attestation hash that goes with it: the
 * category that refused it when the rule is `blocked_categories` (the one it was judged by, which
 * may be another than the one it was signed with: every category of its address is judged), the
 * hash then made again over the same intent with that category, so that it stays reproducible
 * from the transaction view. Otherwise both as signed.
 */
export function judgedRecord(
  intent: Omit<Parameters<typeof attestationHashOf>[0], 'category'>, signed: { category: string | null; attestation: string },
  violation: Violation,
): { category: string | null; attestation: string } {
  if (violation.rule !== 'blocked_categories' || violation.attempted === signed.category) return signed;
  const category = String(violation.attempted);
  return { category, attestation: attestationHashOf({ ...intent, category }) };
}

/**
 * Records a spend the policy refused (a payment, or an escrow's `a2a_send`): `blocked`, with its
 * violation, the vault marked as in violation, and `transaction.blocked`. `attestation` is the
 * hash signed at `attestedAtMs`; see `judgedRecord` for the category recorded.
 */
export async function recordBlocked(
  tx: Queryable, nowMs: number, wallet: WalletRow, input: PaymentInput, recipient: ResolvedRecipient, attestation: string,
  violation: Violation, txId: string | undefined, type: 'payment' | 'a2a_send', attestedAtMs: number,
): Promise<TransactionRow> {
  const judged = judgedRecord(
    { walletId: wallet.id, recipient: input.to, amount: input.amount, currency: 'USDC', memo: input.memo, atMs: attestedAtMs },
    { category: recipient.category, attestation }, violation);
  const row = await insertTransaction(tx, nowMs, {
    attestedAtMs,
    id: txId, orgId: wallet.org_id, walletId: wallet.id, type, status: 'blocked', amount: input.amount,
    recipient: input.to, policyId: wallet.policy_id, memo: input.memo, attestationHash: judged.attestation,
    signature: null, lastValidBlockHeight: null, policyTriggered: true, violation,
    recipientAddress: recipient.address, category: judged.category,
  });
  await tx.query('UPDATE wallets SET policy_violation_at = $2 WHERE id = $1', [wallet.id, new Date(nowMs)]);
  await writeBlockedEvent(tx, nowMs, wallet, row.id, input.amount, input.to, violation);
  await alertPolicyViolation(tx, nowMs, wallet, row.id, violation);
  return { ...row, policy_triggered: true, violation };
}

/**
 * `transaction.blocked`. Its summary says why: the rule that failed, or, for a payment that
 * waited for its co-signature (`coSign`), that it was rejected or not co-signed in time.
 */
async function writeBlockedEvent(
  tx: Queryable, nowMs: number, wallet: Pick<WalletRow, 'id' | 'org_id' | 'policy_id'>, txId: string, amount: bigint, recipient: string, violation: Violation,
  coSign?: 'rejected' | 'expired',
): Promise<void> {
  const payment = `Payment of ${formatUsdc(amount)} USDC to ${recipient}`;
  await recordEvent(tx, nowMs, {
    orgId: wallet.org_id, type: 'transaction.blocked', walletId: wallet.id,
    summary: coSign === 'rejected' ? `${payment} rejected by a co-signer; nothing was sent`
      : coSign === 'expired' ? `${payment} not co-signed before its approval expired; nothing was sent`
        : `${payment} blocked by ${violation.rule}`,
    payload: {
      wallet_id: wallet.id, tx_id: txId, attempted_amount: formatUsdc(amount), recipient, violation, policy_id: wallet.policy_id,
    },
  });
}

/** `transaction.pending`: the payment is debited and about to be submitted (SPEC: submitted, not yet confirmed). */
function pendingEventOf(t: Pick<NewTransaction, 'orgId' | 'walletId' | 'amount' | 'recipient' | 'signature'> & { id: string }): NewEvent {
  return {
    orgId: t.orgId, type: 'transaction.pending', walletId: t.walletId,
    summary: `Payment of ${formatUsdc(t.amount)} USDC to ${t.recipient} submitted`,
    payload: {
      wallet_id: t.walletId, tx_id: t.id, amount: formatUsdc(t.amount), recipient: t.recipient,
      tx_signature: t.signature,
    },
  };
}

/**
 * `transaction.awaiting_approval`: the payment is above the policy's `requireCoSign` and waits
 * for an admin or operator to approve or reject it before `expires_at` (it is then blocked).
 */
function awaitingEventOf(t: Pick<NewTransaction, 'orgId' | 'walletId' | 'amount' | 'recipient' | 'policyId' | 'approval'> & { id: string }): NewEvent {
  const approval = t.approval as { expires_at: string; threshold: string };
  return {
    orgId: t.orgId, type: 'transaction.awaiting_approval', walletId: t.walletId,
    summary: `Payment of ${formatUsdc(t.amount)} USDC to ${t.recipient} awaits co-signature (above ${approval.threshold} USDC)`,
    payload: {
      wallet_id: t.walletId, tx_id: t.id, amount: formatUsdc(t.amount), recipient: t.recipient, policy_id: t.policyId,
      threshold: approval.threshold, expires_at: approval.expires_at,
    },
  };
}

/**
 * Counts a spend in the windows and debits the vault (its row is locked). The spend's row must
 * carry `spend_at_ms = nowMs` (written with it), so the windows can take it out again.
 */
export async function commitSpend(
  tx: Queryable, nowMs: number, wallet: WalletRow, amount: bigint, windows: Awaited<ReturnType<typeof spendWindowsAt>>,
): Promise<void> {
  await saveSpendWindows(tx, wallet.id, withSpend(windows, { atMs: nowMs, amount }));
  await tx.query('UPDATE wallets SET balance = balance - $2, policy_violation_at = NULL, last_transaction_at = $3 WHERE id = $1',
    [wallet.id, amount, new Date(nowMs)]);
}

export function insufficientBalance(wallet: WalletRow, amount: bigint): ServiceError {
  return new ServiceError('wallet_insufficient_balance',
    `Wallet ${wallet.id} holds ${formatUsdc(wallet.balance)} USDC; the payment needs ${formatUsdc(amount)}.`,
    { wallet_id: wallet.id, available: formatUsdc(wallet.balance) });
}

export function frozenError(wallet: WalletRow): ServiceError {
  return new ServiceError('wallet_frozen', `Wallet ${wallet.id} is frozen.`, { wallet_id: wallet.id });
}

/** How many times signing is redone when the wallet's policy changed in between. */
const SIGN_ATTEMPTS_MAX = 5;

/**
 * Makes a payment. Returns the recorded row (pending, confirmed, failed, or blocked with its
 * violation); throws ServiceError for refusals that record nothing. `wallet`, when the caller
 * has just read it, saves reading it again before signing (the decision reads it under lock).
 * `keyId`, the API key paying: the payment is recorded only if that key is still live then.
 */
export async function pay(
  ctx: Ctx, orgId: string, input: PaymentInput,
  options: {
    wait: boolean; mark?: RecordMarker; wallet?: WalletRow; recipient?: () => ResolvedRecipient; keyId?: string;
    /** an `agent` key's payment: the session public key its token matched when the request was read */
    sessionKey?: string | null;
  },
): Promise<PaymentOutcome> {
  // An archived vault is refused before its recipient is resolved, as the preflight does.
  if (options.wallet) assertNotArchived(options.wallet);
  const recipient = options.recipient?.() ?? await resolveRecipient(ctx.db, orgId, input.to, input.category);
  assertChainPayable(ctx.chain, recipient.address, 'to');
  for (let attempt = 0; attempt < SIGN_ATTEMPTS_MAX; attempt += 1) {
    let unlocked = attempt === 0 ? options.wallet : undefined;
    if (!unlocked) {
      [unlocked] = await ctx.db.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = $2', [orgId, input.walletId]);
      if (!unlocked) throw walletNotFound(input.walletId);
    }
    assertNotArchived(unlocked);
    const signedAtMs = ctx.clock.nowMs();
    const txId = newId('tx', signedAtMs);
    const attestation = attestationHashOf({
      walletId: unlocked.id, recipient: input.to, amount: input.amount, currency: 'USDC', memo: input.memo,
      category: recipient.category, atMs: signedAtMs,
    });
    const prepared = await ctx.chain.prepare(await payInstructions(ctx, unlocked, txId, recipient.address, input.amount, attestation));
    const decided = await recorderOf(ctx).submit({
      orgId, input, recipient, signedForPolicy: unlocked.policy_id, txId, attestation, attestedAtMs: signedAtMs, prepared, mark: options.mark,
      keyId: options.keyId ?? null, sessionKey: options.sessionKey ?? null,
    });
    if (decided.kind === 'resign') continue; // signed for another policy account: sign again
    if (decided.kind === 'blocked') return { row: decided.row, violation: decided.violation };
    if (decided.awaiting) return { row: decided.row, violation: null };
    return { row: await send(ctx, prepared, decided.row, options.wait), violation: null };
  }
  throw new ServiceError('service_unavailable', 'The wallet\'s policy kept changing while the payment was signed; retry.');
}

/** What a payment request reads before it is signed: the paying vault and the directory entry of `to`. */
interface PaymentRead {
  orgId: string;
  walletId: string;
  target: RecipientTarget | null;
}

type PaymentReadRow = WalletWithPolicy & {
  request_index: bigint; recipient_entry_id: string | null; recipient_entry_address: string; recipient_entry_category: string | null;
  recipient_entry_categories: string[] | null; recipient_service_account: boolean;
};

/** The reads of concurrent payment requests are made together, one statement for a group (src/db/group-commit.ts). */
const paymentReaders = new WeakMap<Queryable, GroupCommit<PaymentRead, PaymentReadRow | null>>();
const READ_BATCH_MAX = 128;
const READ_CONCURRENCY = 2;

/**
 * The read of a group, from `k` (org_id, wallet_id, address, domain, request_index): a lone
 * request's from scalar parameters, a group's from arrays. PostgreSQL plans a prepared
 * statement once only when its generic plan costs about what a plan for the actual values does;
 * `unnest` of an array parameter is estimated at 10 rows, so the group's statement was planned
 * afresh on every execution (~0.5 ms of PostgreSQL's CPU, more than running it), while the lone
 * request's keeps its plan. At half the full rate most groups are of one.
 */
const PAYMENT_READ_ONE = '(SELECT $1::text AS org_id, $2::text AS wallet_id, $3::text AS address, $4::text AS domain, 1::bigint AS request_index) k';
const PAYMENT_READ_MANY = 'unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS k(org_id, wallet_id, address, domain, request_index)';
const paymentReadSql = (source: string) =>
  `SELECT k.request_index, wallet.*, entry.id AS recipient_entry_id, entry.address AS recipient_entry_address,
     entry.category AS recipient_entry_category, entry.categories AS recipient_entry_categories,
     ${serviceAccountSql('COALESCE(entry.address, k.address)')} AS recipient_service_account
   FROM ${source}
   LEFT JOIN LATERAL (${WALLET_SELECT} WHERE w.org_id = k.org_id AND w.id = k.wallet_id) wallet ON TRUE
   LEFT JOIN LATERAL (${recipientEntrySql('k')}) entry ON TRUE`;

function paymentReaderOf(db: Queryable): GroupCommit<PaymentRead, PaymentReadRow | null> {
  let reader = paymentReaders.get(db);
  if (!reader) {
    reader = new GroupCommit(async (reads) => {
      const columns = [reads.map((r) => r.orgId), reads.map((r) => r.walletId), reads.map((r) => r.target?.address ?? null),
        reads.map((r) => r.target?.domain ?? null)];
      const rows = reads.length === 1
        ? await db.query<PaymentReadRow>(paymentReadSql(PAYMENT_READ_ONE), columns.map((column) => column[0]))
        : await db.query<PaymentReadRow>(paymentReadSql(PAYMENT_READ_MANY), columns);
      const byIndex = new Map(rows.map((row) => [Number(row.request_index), row]));
      return reads.map((_, i) => ({ ok: true as const, value: byIndex.get(i + 1)?.id ? byIndex.get(i + 1)! : null }));
    }, { maxBatch: READ_BATCH_MAX, concurrency: READ_CONCURRENCY });
    paymentReaders.set(db, reader);
  }
  return reader;
}

/**
 * What a payment request reads before it is signed, made with the reads of the requests arriving
 * meanwhile in one statement: the paying vault (with its policy, as `getWallet` answers it; null
 * when the organisation has none of that id) and the directory entry of `to`. `recipient()`
 * resolves `to` from it, or throws `invalid_recipient`: called when the payment is made (not for
 * an idempotent replay), after the vault was checked.
 */
export async function readPayment(
  db: Queryable, orgId: string, walletId: string, to: string, category: string | null,
): Promise<{ wallet: WalletWithPolicy | null; recipient: () => ResolvedRecipient }> {
  const target = recipientTarget(to);
  const row = await paymentReaderOf(db).submit({ orgId, walletId, target });
  if (!row) return { wallet: null, recipient: () => resolvedRecipient(to, target, undefined, category) };
  const {
    request_index: _index, recipient_entry_id: id, recipient_entry_address: address, recipient_entry_category: entryCategory,
    recipient_entry_categories: categories, recipient_service_account: serviceAccount, ...wallet
  } = row;
  const entry = id === null ? undefined : { id, address, category: entryCategory, categories: categories ?? [] };
  return { wallet, recipient: () => resolvedRecipient(to, target, entry, category, serviceAccount) };
}

/** A signed payment on its way to being decided and recorded. */
interface PaymentToRecord {
  orgId: string;
  input: PaymentInput;
  recipient: ResolvedRecipient;
  /** the policy the pay instruction was signed for (its account is one of the instruction's) */
  signedForPolicy: string;
  txId: string;
  attestation: string;
  /** the instant the attestation hash commits to */
  attestedAtMs: number;
  prepared: PreparedTransaction;
  mark: RecordMarker | undefined;
  /** the API key paying; checked live in the recording transaction (its lookup may be cached) */
  keyId: string | null;
  /**
   * an `agent` key's payment: the vault's session public key its token matched when read,
   * checked again (and its expiry) under the vault's lock: a rotation revokes with its commit
   */
  sessionKey: string | null;
}

type Decided =
  | { kind: 'blocked'; row: TransactionRow; violation: Violation }
  | { kind: 'recorded'; row: TransactionRow; awaiting: boolean }
  | { kind: 'resign' };

/** Payments of one process are decided and recorded in batches (src/db/group-commit.ts). */
const recorders = new WeakMap<Database, GroupCommit<PaymentToRecord, Decided>>();
const RECORD_BATCH_MAX = 128;
/**
 * One batch at a time: two overlapped only their first round trips, then the second waited on
 * the first's row locks while holding a connection, and the batches were half the size (the
 * bench measured ~15% more payments per second and a shorter tail with one).
 */
const RECORD_CONCURRENCY = 1;

function recorderOf(ctx: Ctx): GroupCommit<PaymentToRecord, Decided> {
  let recorder = recorders.get(ctx.db);
  if (!recorder) {
    recorder = new GroupCommit(async (items, retried) => (retried && await alreadyRecorded(ctx, items[0]!)) || recordPayments(ctx, items),
      { maxBatch: RECORD_BATCH_MAX, concurrency: RECORD_CONCURRENCY });
    recorders.set(ctx.db, recorder);
  }
  return recorder;
}

/**
 * A vault's row as a batch locks it, with the rules of its policy (`has_policy` false: the policy
 * is deleted, or the vault's policy changed while the lock was awaited — see `lockWallets`).
 */
type LockedWallet = WalletRow & RuleColumns & { has_policy: boolean };

/** What a vault spent in a batch, and whether its last payment there was blocked. */
interface Spent { amount: bigint; lastBlocked: boolean }

/**
 * A payment written again on its own after its batch's write threw: the batch may have been
 * committed all the same (the connection lost with COMMIT's answer). Then it is answered as
 * recorded — and sent by its request — rather than decided a second time against a vault it
 * has already debited. Null when it was not written.
 */
async function alreadyRecorded(ctx: Ctx, item: PaymentToRecord): Promise<Array<BatchOutcome<Decided>> | null> {
  const [row] = await ctx.db.query<AwaitingRow>('SELECT * FROM transactions WHERE id = $1', [item.txId]);
  if (!row) return null;
  const decided: Decided = row.status === 'blocked'
    ? { kind: 'blocked', row, violation: row.violation as Violation }
    : { kind: 'recorded', row, awaiting: row.approval?.status === 'awaiting' };
  return [{ ok: true, value: decided }];
}

/**
 * Decides and records a batch of payments in one database transaction, in their order: the
 * vaults' rows are locked (by id, the lock order everywhere), each payment is checked against
 * its vault as the payments before it left it — frozen, the policy against the spend windows
 * at this instant, the balance — and then every accepted one is recorded `pending`, debited and
 * counted, with its `transaction.pending`, in one statement for the whole batch. A refusal is
 * that payment's answer only; a blocked one is recorded with its violation.
 */
async function recordPayments(ctx: Ctx, items: readonly PaymentToRecord[]): Promise<Array<BatchOutcome<Decided>>> {
  return ctx.db.transaction(async (tx) => {
    const readMs = ctx.clock.nowMs();
    // Sent together, one round trip: the windows' statement runs after the locks are held. The
    // time was read before the locks were waited for: a spend committed meanwhile may be later
    // (spendWindowsFrom), and the batch is then decided at that time.
    const [wallets, liveKeys, read] = await Promise.all([
      lockWallets(tx, items), liveKeysOf(tx, items), spendWindowsOf(tx, walletIdsOf(items), readMs),
    ]);
    const { atMs: nowMs, windows } = await spendWindowsFrom(tx, walletIdsOf(items), readMs, read);

    const outcomes: Array<BatchOutcome<Decided> | { recorded: number; awaiting: boolean }> = [];
    const inserts: Array<NewTransaction & { id: string }> = [];
    const spent = new Map<string, Spent>();
    const counted = new Map<string, SpendWindows>();
    /** each vault's payments awaiting their co-signature, counted under its lock when one more would wait */
    const awaitingCounts = new Map<string, number>();
    for (const item of items) {
      const { input, recipient } = item;
      const wallet = wallets.get(input.walletId);
      // The vault first, as the request's read before signing answered it.
      const refusal = !wallet || wallet.org_id !== item.orgId ? walletNotFound(input.walletId)
        : item.keyId !== null && !liveKeys.has(item.keyId) ? invalidKeyError()
        : vaultRefusal(wallet, item.sessionKey, nowMs);
      if (refusal || !wallet) {
        outcomes.push({ ok: false, error: refusal });
        continue;
      }
      if (wallet.policy_id !== item.signedForPolicy) {
        outcomes.push({ ok: true, value: { kind: 'resign' } });
        continue;
      }
      if (!wallet.has_policy) throw new Error(`wallet ${wallet.id} has no policy ${wallet.policy_id}`);
      const current = counted.get(wallet.id) ?? windows.get(wallet.id)!;
      const decision = evaluate(rulesOf(wallet), spendStateOf(current), {
        amount: input.amount, recipient: input.to, recipientAddress: recipient.address, category: recipient.category,
        categories: recipient.categories, atMs: nowMs,
      });
      if (!decision.allowed) {
        const row = await recordBlocked(tx, nowMs, wallet, input, recipient, item.attestation, decision.violation, item.txId, 'payment', item.attestedAtMs);
        const total = spent.get(wallet.id);
        if (total) total.lastBlocked = true;
        await item.mark?.(tx, item.txId);
        outcomes.push({ ok: true, value: { kind: 'blocked', row, violation: decision.violation } });
        continue;
      }
      if (wallet.balance < input.amount) {
        outcomes.push({ ok: false, error: insufficientBalance(wallet, input.amount) });
        continue;
      }
      const awaiting = decision.requiresApproval;
      if (awaiting) {
        const waiting = awaitingCounts.get(wallet.id) ?? await awaitingCountOf(tx, wallet.id);
        if (waiting >= AWAITING_PER_WALLET_MAX) {
          outcomes.push({ ok: false, error: tooManyAwaiting(wallet.id) });
          continue;
        }
        awaitingCounts.set(wallet.id, waiting + 1);
      }
      inserts.push({
        id: item.txId, orgId: wallet.org_id, walletId: wallet.id, type: 'payment', amount: input.amount, recipient: input.to,
        policyId: wallet.policy_id, memo: input.memo, attestationHash: item.attestation,
        signature: awaiting ? null : item.prepared.signature,
        lastValidBlockHeight: awaiting ? null : item.prepared.lastValidBlockHeight,
        wire: awaiting ? null : item.prepared.wire,
        recipientAddress: recipient.address, category: recipient.category, policyTriggered: awaiting,
        // The threshold it is above, kept: a rejection or an expiry names the rule that made it wait.
        // So are the categories its address had (the view shows neither): the approval judges the
        // recipient as resolved now, not as the directory may say by then.
        approval: awaiting ? {
          required: true, status: 'awaiting', expires_at: new Date(nowMs + APPROVAL_TTL_MS).toISOString(),
          threshold: formatUsdc(rulesOf(wallet).requireCoSign!), categories: recipient.categories,
        } : null,
        approvalExpiresAt: awaiting ? new Date(nowMs + APPROVAL_TTL_MS) : null, spendAtMs: awaiting ? null : nowMs,
        attestedAtMs: item.attestedAtMs,
      });
      if (!awaiting) {
        // The next payment of this vault in the batch sees this one spent.
        wallet.balance -= input.amount;
        counted.set(wallet.id, withSpend(current, { atMs: nowMs, amount: input.amount }));
        const total = spent.get(wallet.id);
        spent.set(wallet.id, { amount: (total?.amount ?? 0n) + input.amount, lastBlocked: false });
      }
      await item.mark?.(tx, item.txId);
      outcomes.push({ recorded: inserts.length - 1, awaiting });
    }

    const rows = await recordAccepted(tx, nowMs, inserts, counted, spent);
    return outcomes.map((outcome) => ('recorded' in outcome
      ? { ok: true as const, value: { kind: 'recorded' as const, row: rows[outcome.recorded]!, awaiting: outcome.awaiting } }
      : outcome));
  });
}

async function awaitingCountOf(tx: Queryable, walletId: string): Promise<number> {
  const [row] = await tx.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM transactions WHERE wallet_id = $1 AND approval_expires_at IS NOT NULL AND status = 'pending'`, [walletId]);
  return row!.n;
}

/** Whether a payment of `walletId` above its co-sign threshold would be refused now: it has the most awaiting it may have. */
export async function awaitingFull(q: Queryable, walletId: string): Promise<boolean> {
  return (await awaitingCountOf(q, walletId)) >= AWAITING_PER_WALLET_MAX;
}

function tooManyAwaiting(walletId: string): ServiceError {
  return new ServiceError('invalid_request',
    `Wallet ${walletId} has ${AWAITING_PER_WALLET_MAX} payments awaiting their co-signature, the most it may have: approve or reject some first.`,
    { wallet_id: walletId });
}

/**
 * Why a vault (its row locked) cannot spend now, or null: archived (which also ends its session
 * authority), then, for an `agent` key's request, the session key its token matched no longer
 * the vault's or expired (a rotation revokes with its commit), then frozen.
 */
export function vaultRefusal(wallet: WalletRow, sessionKey: string | null, nowMs: number): ServiceError | null {
  if (wallet.status === 'archived') return archivedError(wallet);
  if (sessionKey !== null) {
    if (wallet.session_public_key !== sessionKey) return sessionTokenInvalid();
    const expired = sessionExpiredError(wallet, nowMs);
    if (expired) return expired;
  }
  return wallet.status === 'frozen' ? frozenError(wallet) : null;
}

function walletIdsOf(items: readonly PaymentToRecord[]): string[] {
  return [...new Set(items.map((item) => item.input.walletId))].sort();
}

/**
 * Locks the vaults' rows, by id, and reads their policies' rules in the same statement. One that
 * waited for a lock answers the locked row as it is now but a joined row as it was when the
 * statement began: a policy change takes no vault lock, so the rules are those of a moment
 * before, as if the payment had come first (the spend windows, written under the vault's lock,
 * are read after it, in a statement of their own). The join is outer so that a vault moved to
 * another policy meanwhile is still answered, and signed again.
 */
async function lockWallets(tx: Queryable, items: readonly PaymentToRecord[]): Promise<Map<string, LockedWallet>> {
  const rows = await tx.query<LockedWallet>(
    `SELECT w.*, p.id IS NOT NULL AS has_policy, ${RULE_COLUMNS}
     FROM wallets w
     LEFT JOIN policies p ON p.org_id = w.org_id AND p.id = w.policy_id AND p.deleted_at IS NULL
     WHERE w.id = ANY($1::text[]) ORDER BY w.id FOR UPDATE OF w`, [walletIdsOf(items)]);
  return new Map(rows.map((w) => [w.id, w]));
}

/**
 * Which of the paying API keys are not revoked, in a statement of its own sent behind the locks:
 * it sees a revocation committed while the batch waited for a vault (a subquery of the locking
 * statement would read the keys as they were when it began, and pay with a key revoked since).
 */
async function liveKeysOf(tx: Queryable, items: readonly PaymentToRecord[]): Promise<Set<string>> {
  const keyIds = [...new Set(items.flatMap((item) => (item.keyId === null ? [] : [item.keyId])))];
  if (keyIds.length === 0) return new Set();
  const rows = await tx.query<{ id: string }>('SELECT id FROM api_keys WHERE id = ANY($1::text[]) AND revoked_at IS NULL', [keyIds]);
  return new Set(rows.map((row) => row.id));
}

/**
 * Records a batch's accepted payments in one statement: their rows, the spends counted in the
 * windows, the vaults debited, and `transaction.pending` of each one signed to be sent (not
 * awaiting its co-signature). The parts write different tables and none reads what another
 * writes (each sees the tables as they were before the statement). It is the transaction's last
 * statement and commits it in the same round trip. Answers the rows in the order of `inserts`.
 */
async function recordAccepted(
  tx: Transaction, nowMs: number, inserts: ReadonlyArray<NewTransaction & { id: string }>,
  counted: ReadonlyMap<string, SpendWindows>, spent: ReadonlyMap<string, Spent>,
): Promise<TransactionRow[]> {
  if (inserts.length === 0) return [];
  const announced = inserts.map((t) => (t.approval ? awaitingEventOf(t) : pendingEventOf(t)));
  const params = new Params();
  const recorded = insertTransactionsSql(params, nowMs, inserts);
  const rows = await tx.queryAndCommit<TransactionRow>(
    `WITH recorded AS (${recorded.sql} RETURNING *),
       counted AS (${saveSpendWindowsSql(params, counted)}),
       debited AS (${debitWalletsSql(params, nowMs, spent)}),
       announced AS (${recordEventsSql(params, nowMs, announced).sql})
     SELECT * FROM recorded`, params.values);
  return recorded.inOrder(rows);
}

/**
 * The UPDATE debiting each vault by what it spent in the batch; a vault whose last payment went
 * through is no longer in violation (one whose last was blocked stays so).
 */
function debitWalletsSql(params: Params, nowMs: number, spent: ReadonlyMap<string, Spent>): string {
  const all = [...spent];
  return `UPDATE wallets w SET balance = w.balance - d.amount, last_transaction_at = ${params.add(new Date(nowMs))},
       policy_violation_at = CASE WHEN d.last_blocked THEN w.policy_violation_at ELSE NULL END
     FROM unnest(${params.array('text', all.map(([id]) => id))}, ${params.array('bigint', all.map(([, s]) => String(s.amount)))},
       ${params.array('boolean', all.map(([, s]) => s.lastBlocked))}) AS d(id, amount, last_blocked) WHERE w.id = d.id`;
}

/**
 * Sends a recorded payment and, when asked, waits for its outcome. Waiting, a confirmation is
 * answered as soon as the chain gives it, its settlement written behind the answer (see
 * awaitConfirmation: a confirmed payment moves no balance, its vault was debited when it was
 * recorded); a failure once settled. Not waiting, the answer goes out once a chain of its own
 * (a cluster, a validator in another process) has taken the transaction: the payment then lands
 * even if this process stops. The embedded validator stops with this process, taken or not, so
 * there the answer goes out as the transaction leaves. Whatever becomes of the send, the payment
 * is recorded with its signature, and its settlement or the reconciler learns the outcome from
 * the chain.
 */
async function send(ctx: Ctx, prepared: PreparedTransaction, recorded: TransactionRow, wait: boolean): Promise<TransactionRow> {
  const waiting = { over: false };
  const taken = sendUntilTaken(ctx, prepared, waiting, performance.now() + PAYMENT_WAIT_MS);
  if (wait) {
    const answered = await awaitConfirmation(ctx, recorded, PAYMENT_WAIT_MS).finally(() => { waiting.over = true; });
    return answered ?? reload(ctx.db, recorded.id);
  }
  settleInBackground(ctx, prepared.signature, PAYMENT_WAIT_MS, waiting);
  if (!ctx.chain.embedded) await taken.first;
  return recorded;
}

async function reload(q: Queryable, txId: string): Promise<TransactionRow> {
  const [row] = await q.query<TransactionRow>('SELECT * FROM transactions WHERE id = $1', [txId]);
  return row!;
}

// ---------------------------------------------------------------------------------------------
// Co-signature

type AwaitingRow = TransactionRow & {
  recipient_address: string;
  approval: { status: string; threshold?: string; categories?: string[] } | null;
  approval_expires_at: Date | null;
};

/*
 * Lock order. A path that locks both a payment's row and its vault's takes the payment's first:
 * settlement does (settleSignatures' UPDATE of the row, then the `failed` rule's UPDATE of the
 * vault), and so does approve (lockAwaiting, then lockWallet). Reject and the expiry job lock the
 * payment's row only; a batch of payments (recordPayments) locks vaults and only inserts new
 * rows, which nobody else can hold. An approve that took the vault first could deadlock with the
 * settlement of a first approval's chain failure (a double click).
 */

function notFound(txId: string): ServiceError {
  return new ServiceError('transaction_not_found', `No payment ${txId} in your organisation.`, { param: 'tx_id' });
}

function assertAwaiting(row: AwaitingRow, txId: string): void {
  if (row.status !== 'pending' || row.approval?.status !== 'awaiting') {
    throw new ServiceError('invalid_request', `Payment ${txId} is not awaiting approval (status ${row.status}).`, { param: 'tx_id' });
  }
}

async function lockAwaiting(tx: Queryable, orgId: string, txId: string): Promise<AwaitingRow> {
  const [row] = await tx.query<AwaitingRow>(
    `SELECT * FROM transactions WHERE org_id = $1 AND id = $2 AND type = 'payment' FOR UPDATE`, [orgId, txId]);
  if (!row) throw notFound(txId);
  assertAwaiting(row, txId);
  return row;
}

/**
 * Approves a payment awaiting its co-signature: it is checked again as of now (the policy, the
 * windows and the balance may have changed), debited and sent. Whether it still awaits is read
 * before anything is signed, so a decided payment is refused without the chain (a second click
 * while the chain is down is 400, not 503), and again under its row's lock.
 */
export async function approvePayment(ctx: Ctx, orgId: string, txId: string, approverKeyId: string, options: { wait: boolean }): Promise<PaymentOutcome> {
  const awaiting = async () => {
    const [pending] = await ctx.db.query<AwaitingRow>(
      `SELECT * FROM transactions WHERE org_id = $1 AND id = $2 AND type = 'payment'`, [orgId, txId]);
    if (!pending) throw notFound(txId);
    assertAwaiting(pending, txId);
    return pending;
  };
  for (let attempt = 0; attempt < SIGN_ATTEMPTS_MAX; attempt += 1) {
    const pending = await awaiting();
    const [unlocked] = await ctx.db.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = $2', [orgId, pending.wallet_id]);
    let prepared: PreparedTransaction;
    try {
      prepared = await ctx.chain.prepare(
        await payInstructions(ctx, unlocked!, txId, pending.recipient_address, pending.amount, pending.attestation_hash!));
    } catch (error) {
      // Many clicks at once sign the same transaction, one blockhash each: by the time one runs
      // out of them, another has decided the payment (400 as a second click), or is deciding it.
      if (!(error instanceof NoDistinctBlockhashError)) throw error;
      await awaiting();
      throw retryShortly(`Payment ${txId} is being approved by another request; ask again in a second.`, 1);
    }

    const decided = await ctx.db.transaction(async (tx) => {
      // The payment's row, then its vault's: the lock order above.
      const row = await lockAwaiting(tx, orgId, txId);
      const wallet = await lockWallet(tx, orgId, row.wallet_id!);
      // A key revoked while this waited for the locks co-signs nothing.
      await assertActingKeyLive(tx, orgId, approverKeyId);
      // Read once the vault is locked, and no earlier than its latest spend (spendWindowsFrom).
      const { atMs: nowMs, windows: read } = await spendWindowsFrom(tx, [wallet.id], ctx.clock.nowMs());
      const windows = read.get(wallet.id)!;
      if (row.approval_expires_at !== null && row.approval_expires_at.getTime() <= nowMs) return { expired: true } as const;
      if (wallet.policy_id !== unlocked!.policy_id) return null;
      const decide = async (status: 'blocked', approvalStatus: string, violation: Violation) => {
        // A row recorded before attested_at existed has a hash no view reproduces: its category stays.
        const judged = row.attested_at === null ? { category: row.category, attestation: row.attestation_hash! } : judgedRecord(
          { walletId: wallet.id, recipient: row.recipient!, amount: row.amount, currency: 'USDC', memo: row.memo, atMs: row.attested_at.getTime() },
          { category: row.category, attestation: row.attestation_hash! }, violation);
        await tx.query(
          `UPDATE transactions SET status = $2, violation = $3, approval = approval || $4::jsonb, approval_expires_at = NULL,
             updated_at = $5, settled_at = $5, policy_id = $6, category = $7, attestation_hash = $8 WHERE id = $1`,
          [txId, status, JSON.stringify(violation),
            JSON.stringify({ status: approvalStatus, decided_by: approverKeyId, decided_at: new Date(nowMs).toISOString() }), new Date(nowMs),
            wallet.policy_id, judged.category, judged.attestation]);
        await tx.query('UPDATE wallets SET policy_violation_at = $2 WHERE id = $1', [wallet.id, new Date(nowMs)]);
        await writeBlockedEvent(tx, nowMs, wallet, txId, row.amount, row.recipient!, violation);
        await alertPolicyViolation(tx, nowMs, wallet, txId, violation);
        return { blocked: await reload(tx, txId), violation };
      };
      assertNotArchived(wallet);
      if (wallet.status === 'frozen') throw frozenError(wallet);
      const rules = await rulesFor(tx, wallet);
      // The recipient as resolved when the payment was made: its address, its category and every
      // category the directory gave that address then (rows recorded before they were kept: none).
      const decision = evaluate(rules, spendStateOf(windows), {
        amount: row.amount, recipient: row.recipient!, recipientAddress: row.recipient_address, category: row.category,
        categories: row.approval?.categories ?? [], atMs: nowMs,
      });
      if (!decision.allowed) return decide('blocked', 'approved', decision.violation);
      if (wallet.balance < row.amount) throw insufficientBalance(wallet, row.amount);
      await tx.query(
        `UPDATE transactions SET tx_signature = $2, last_valid_block_height = $3, approval = approval || $4::jsonb,
           approval_expires_at = NULL, updated_at = $5, spend_at_ms = $6, policy_id = $7, wire = $8 WHERE id = $1`,
        [txId, prepared.signature, prepared.lastValidBlockHeight,
          JSON.stringify({ status: 'approved', decided_by: approverKeyId, decided_at: new Date(nowMs).toISOString() }), new Date(nowMs), nowMs,
          wallet.policy_id, prepared.wire]);
      await commitSpend(tx, nowMs, wallet, row.amount, windows);
      await recordEvent(tx, nowMs, pendingEventOf({
        id: row.id, orgId: row.org_id, walletId: row.wallet_id!, amount: row.amount, recipient: row.recipient, signature: prepared.signature,
      }));
      return { approved: true };
    });
    if (decided === null) continue;
    if ('expired' in decided) {
      // Its co-signature came too late: it is expired now, as the job would have done.
      await rejectPayment(ctx, orgId, txId, 'system', 'expired');
      throw new ServiceError('invalid_request', `Payment ${txId} waited for its co-signature past its expiry; it is blocked.`, { param: 'tx_id' });
    }
    if ('blocked' in decided) return { row: decided.blocked, violation: decided.violation };
    return { row: await send(ctx, prepared, await reload(ctx.db, txId), options.wait), violation: null };
  }
  throw new ServiceError('service_unavailable', 'The wallet\'s policy kept changing while the payment was signed; retry.');
}

/** The co-signature rule a rejected or expired payment waited on: the threshold it was above when made. */
function coSignViolation(row: TransactionRow, threshold: string): Violation {
  return { rule: 'require_co_sign', limit: threshold, attempted: formatUsdc(row.amount) };
}

/** Rejects a payment awaiting its co-signature: it is blocked, and nothing is sent. Locks the payment's row only. */
export async function rejectPayment(
  ctx: Ctx, orgId: string, txId: string, deciderKeyId: string, reason: 'rejected' | 'expired',
): Promise<TransactionRow> {
  return ctx.db.transaction(async (tx) => {
    const row = await lockAwaiting(tx, orgId, txId);
    if (reason === 'rejected') await assertActingKeyLive(tx, orgId, deciderKeyId);
    // Read once the payment's lock is held: a rejection that waited for it (behind an approval)
    // while the expiry passed finds it expired.
    const nowMs = ctx.clock.nowMs();
    // A row recorded before the threshold was kept on it: its policy's threshold now.
    const threshold = row.approval?.threshold
      ?? formatUsdc((await findPolicy(tx, orgId, row.policy_id!, { includeDeleted: true }))?.require_co_sign ?? row.amount);
    const violation = coSignViolation(row, threshold);
    // A rejection that comes after the payment's expiry finds it expired, as the job would have.
    if (reason === 'rejected' && row.approval_expires_at !== null && row.approval_expires_at.getTime() <= nowMs) {
      reason = 'expired';
      deciderKeyId = 'system';
    }
    await tx.query(
      `UPDATE transactions SET status = 'blocked', violation = $2, approval = approval || $3::jsonb, approval_expires_at = NULL,
         updated_at = $4, settled_at = $4 WHERE id = $1`,
      [txId, JSON.stringify(violation),
        JSON.stringify({ status: reason, decided_by: deciderKeyId, decided_at: new Date(nowMs).toISOString() }), new Date(nowMs)]);
    await writeBlockedEvent(tx, nowMs, { id: row.wallet_id!, org_id: orgId, policy_id: row.policy_id! }, txId, row.amount, row.recipient!, violation, reason);
    return reload(tx, txId);
  });
}

const EXPIRE_BATCH_MAX = 200;

/** The `payments.expire_approvals` job: payments left awaiting past their expiry are blocked. */
export async function expireApprovals(ctx: Ctx): Promise<number> {
  const due = await ctx.db.query<{ id: string; org_id: string }>(
    `SELECT id, org_id FROM transactions WHERE status = 'pending' AND approval_expires_at IS NOT NULL AND approval_expires_at <= $1
     ORDER BY approval_expires_at LIMIT ${EXPIRE_BATCH_MAX}`, [new Date(ctx.clock.nowMs())]);
  let expired = 0;
  for (const row of due) {
    try {
      await rejectPayment(ctx, row.org_id, row.id, 'system', 'expired');
      expired += 1;
    } catch (error) {
      // Approved or rejected meanwhile: nothing to expire.
      if (!(error instanceof ServiceError)) throw error;
    }
  }
  return expired;
}

// ---------------------------------------------------------------------------------------------
// Settlement of payments

/** `transaction.completed` of a confirmed payment. */
function completedEventOf(row: TransactionRow): NewEvent {
  return {
    orgId: row.org_id, type: 'transaction.completed', walletId: row.wallet_id,
    summary: `Paid ${formatUsdc(row.amount)} USDC to ${row.recipient}`,
    payload: {
      wallet_id: row.wallet_id, tx_id: row.id, tx_signature: row.tx_signature, amount: formatUsdc(row.amount),
      recipient: row.recipient, policy_triggered: row.policy_triggered, on_chain_slot: Number(row.on_chain_slot),
    },
  };
}

registerSettlementRule('payment', {
  // The vault's row is not touched: its balance and last_transaction_at moved when the payment was recorded.
  async confirmed(tx, nowMs, row) {
    await recordEvents(tx, nowMs, [completedEventOf(row), ...await largeTransactionAlerts(tx, [row])]);
  },
  async confirmedAll(tx, nowMs, rows) {
    await recordEvents(tx, nowMs, [...rows.map(completedEventOf), ...await largeTransactionAlerts(tx, rows)]);
  },
  async failed(tx, nowMs, row) {
    // The amount comes back and the spend stops counting: a payment that never happened.
    await tx.query('UPDATE wallets SET balance = balance + $2 WHERE id = $1', [row.wallet_id, row.amount]);
    await withdrawSpend(tx, row.wallet_id!, row.id);
    await recordTransactionFailed(tx, nowMs, row, `Payment of ${formatUsdc(row.amount)} USDC to ${row.recipient}`);
  },
});
