/**
 * Settlement of the money moves the service records (DESIGN §5): a transaction row is written
 * `pending` with its chain signature before anything is sent, and settled exactly once from the
 * chain's outcome — by the request that sent it (for a payment's confirmation, just after its
 * answer), by a read that finds it pending with its outcome on chain, or by the reconciler after
 * a crash.
 *
 * Each type says what confirmation and failure mean for the balances it touched when it was
 * recorded: the source was debited at once (so concurrent requests can never overdraw it); a
 * confirmation credits the destination, a failure gives the source its amount back.
 *
 * Lock order, everywhere: organisation rows before wallet rows, each by id. A settlement
 * batch locks the organisations whose reserve it moves before any wallet.
 */
import type { Base64EncodedWireTransaction, Signature } from '@solana/kit';
import type { PreparedTransaction, TransactionOutcome } from '../chain/client.ts';
import type { Database, Queryable } from '../db/database.ts';
import { GroupCommit } from '../db/group-commit.ts';
import { Params } from '../db/params.ts';
import { recordEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';

/** The memo of a funding made by auto-topup (its `wallet.funded` says `source: auto_topup`). */
export const AUTO_TOPUP_MEMO = 'auto-topup';
/** The failure of a transaction the chain never ran and no longer can (past its last valid block height). */
export const EXPIRED = 'Expired';

export type TransactionType =
  | 'payment' | 'funding' | 'withdrawal' | 'a2a_send' | 'a2a_receive' | 'escrow_lock' | 'escrow_release' | 'escrow_refund';
export type TransactionStatus = 'pending' | 'confirmed' | 'blocked' | 'failed';

export interface TransactionRow {
  id: string;
  org_id: string;
  wallet_id: string | null;
  type: TransactionType;
  status: TransactionStatus;
  amount: bigint;
  currency: string;
  recipient: string | null;
  policy_id: string | null;
  policy_triggered: boolean;
  violation: unknown;
  memo: string | null;
  /** a payment's resolved category (the directory entry's, else the request's) */
  category: string | null;
  /** the instant the attestation hash commits to; null for other types and rows older than it */
  attested_at: Date | null;
  attestation_hash: string | null;
  tx_signature: string | null;
  last_valid_block_height: bigint | null;
  on_chain_slot: bigint | null;
  failure_reason: string | null;
  batch_id: string | null;
  escrow_id: string | null;
  created_at: Date;
  updated_at: Date;
  settled_at: Date | null;
}

export interface NewTransaction {
  /** chosen before signing when the chain transaction names it (referenceMemoIx) */
  id?: string;
  orgId: string;
  walletId: string;
  type: TransactionType;
  status?: TransactionStatus;
  amount: bigint;
  recipient: string | null;
  policyId?: string | null;
  memo?: string | null;
  attestationHash?: string | null;
  signature: string | null;
  lastValidBlockHeight: bigint | null;
  /** the signed transaction (base64), kept while pending so that the reconciler can send it again */
  wire?: string | null;
  batchId?: string | null;
  /** the escrow an escrow or A2A transaction belongs to */
  escrowId?: string | null;
  /** a payment's resolved recipient address and category */
  recipientAddress?: string | null;
  category?: string | null;
  policyTriggered?: boolean;
  /** co-signature state (JSON) and when it lapses */
  approval?: unknown;
  approvalExpiresAt?: Date | null;
  /** when the amount started counting toward the policy windows (ms of the service clock) */
  spendAtMs?: number | null;
  /** the rule a blocked spend broke */
  violation?: unknown;
  /** the instant its attestation hash commits to (read before signing), shown as `attested_at` */
  attestedAtMs?: number;
}

export async function insertTransaction(tx: Queryable, nowMs: number, t: NewTransaction): Promise<TransactionRow> {
  return (await insertTransactions(tx, nowMs, [t]))[0]!;
}

const json = (value: unknown): string | null => (value === undefined || value === null ? null : JSON.stringify(value));
const text = (value: bigint | number | null | undefined): string | null => (value === undefined || value === null ? null : String(value));

/** Records several transactions in one statement; answers their rows in the order given. */
export async function insertTransactions(tx: Queryable, nowMs: number, list: readonly NewTransaction[]): Promise<TransactionRow[]> {
  if (list.length === 0) return [];
  const params = new Params();
  const insert = insertTransactionsSql(params, nowMs, list);
  return insert.inOrder(await tx.query<TransactionRow>(`${insert.sql} RETURNING *`, params.values));
}

/**
 * The INSERT of several transactions, its placeholders taken from `params` (a part of a larger
 * statement); `inOrder` puts the rows it returns in the order given.
 */
export function insertTransactionsSql(
  params: Params, nowMs: number, list: readonly NewTransaction[],
): { sql: string; inOrder(rows: readonly TransactionRow[]): TransactionRow[] } {
  const ids = list.map((t) => t.id ?? newId('tx', nowMs));
  const now = params.add(new Date(nowMs).toISOString());
  const column = (type: string, pick: (t: NewTransaction) => unknown) => params.array(type, list.map(pick));
  const columns = `id, org_id, wallet_id, type, status, amount, recipient, policy_id, memo, attestation_hash,
       tx_signature, last_valid_block_height, batch_id, escrow_id, recipient_address, category, policy_triggered, approval,
       approval_expires_at, spend_at_ms, violation, attested_at, wire`;
  // A row recorded already final (a spend the policy blocked) is settled when it is recorded.
  const sql = `INSERT INTO transactions (${columns}, created_at, updated_at, settled_at)
     SELECT r.*, ${now}::timestamptz, ${now}::timestamptz, CASE WHEN r.status = 'pending' THEN NULL ELSE ${now}::timestamptz END FROM unnest(${params.array('text', ids)}, ${column('text', (t) => t.orgId)},
       ${column('text', (t) => t.walletId)}, ${column('text', (t) => t.type)}, ${column('text', (t) => t.status ?? 'pending')},
       ${column('bigint', (t) => String(t.amount))}, ${column('text', (t) => t.recipient)}, ${column('text', (t) => t.policyId ?? null)},
       ${column('text', (t) => t.memo ?? null)}, ${column('text', (t) => t.attestationHash ?? null)}, ${column('text', (t) => t.signature)},
       ${column('bigint', (t) => text(t.lastValidBlockHeight))}, ${column('text', (t) => t.batchId ?? null)},
       ${column('text', (t) => t.escrowId ?? null)}, ${column('text', (t) => t.recipientAddress ?? null)},
       ${column('text', (t) => t.category ?? null)}, ${column('boolean', (t) => t.policyTriggered ?? false)},
       ${column('jsonb', (t) => json(t.approval))}, ${column('timestamptz', (t) => t.approvalExpiresAt?.toISOString() ?? null)},
       ${column('bigint', (t) => text(t.spendAtMs))}, ${column('jsonb', (t) => json(t.violation))},
       ${column('timestamptz', (t) => (t.attestedAtMs === undefined ? null : new Date(t.attestedAtMs).toISOString()))},
       ${column('text', (t) => t.wire ?? null)})
       AS r(${columns})`;
  return {
    sql,
    inOrder(rows) {
      const byId = new Map(rows.map((row) => [row.id, row]));
      return ids.map((id) => byId.get(id)!);
    },
  };
}

/** What a settled transaction does to balances and which event it writes. */
interface SettlementRule {
  confirmed(tx: Queryable, nowMs: number, row: TransactionRow): Promise<void>;
  failed(tx: Queryable, nowMs: number, row: TransactionRow): Promise<void>;
  /** the same as `confirmed` for each row, for several rows at once (a type settled in bulk) */
  confirmedAll?(tx: Queryable, nowMs: number, rows: TransactionRow[]): Promise<void>;
}

/** Credits a vault; its balance after, and its label (the feed names a vault by it). */
async function creditWallet(tx: Queryable, nowMs: number, walletId: string, amount: bigint): Promise<{ balance: bigint; label: string }> {
  const rows = await tx.query<{ balance: bigint; label: string }>(
    'UPDATE wallets SET balance = balance + $2, last_transaction_at = $3 WHERE id = $1 RETURNING balance, label',
    [walletId, amount, new Date(nowMs)]);
  return rows[0]!;
}

async function creditReserve(tx: Queryable, orgId: string, amount: bigint): Promise<bigint> {
  const rows = await tx.query<{ reserve_balance: bigint }>(
    'UPDATE organizations SET reserve_balance = reserve_balance + $2 WHERE id = $1 RETURNING reserve_balance',
    [orgId, amount]);
  return rows[0]!.reserve_balance;
}

/**
 * `transaction.failed`, written when a move that was recorded (and answered `pending` to a
 * client that did not wait) ends failed: the chain refused it, or it never landed. Its amount
 * is given back by the type's rule. `what` begins the summary ("Payment of 1.00 USDC to …").
 */
export async function recordTransactionFailed(tx: Queryable, nowMs: number, row: TransactionRow, what: string): Promise<void> {
  await recordEvent(tx, nowMs, {
    orgId: row.org_id, type: 'transaction.failed', walletId: row.wallet_id,
    // Expired: it never landed (the chain did not run it before its blockhash expired), which
    // "failed on chain" would misstate.
    summary: row.failure_reason === EXPIRED
      ? `${what} failed: it never landed on chain before its blockhash expired (Expired); its amount is back`
      : `${what} failed on chain (${row.failure_reason}); its amount is back`,
    payload: {
      wallet_id: row.wallet_id, tx_id: row.id, type: row.type, tx_signature: row.tx_signature, amount: formatUsdc(row.amount),
      recipient: row.recipient, reason: row.failure_reason, ...(row.escrow_id ? { escrow_id: row.escrow_id } : {}),
    },
  });
}

const RULES: Partial<Record<TransactionType, SettlementRule>> = {
  funding: {
    async confirmed(tx, nowMs, row) {
      const { balance, label } = await creditWallet(tx, nowMs, row.wallet_id!, row.amount);
      const autoTopup = row.memo === AUTO_TOPUP_MEMO;
      await recordEvent(tx, nowMs, {
        orgId: row.org_id, type: 'wallet.funded', walletId: row.wallet_id,
        summary: autoTopup
          ? `Wallet ${label} topped up automatically with ${formatUsdc(row.amount)} USDC from the reserve (auto-topup)`
          : `Wallet ${label} funded with ${formatUsdc(row.amount)} USDC from the reserve`,
        payload: {
          wallet_id: row.wallet_id, tx_id: row.id, amount: formatUsdc(row.amount), source: autoTopup ? 'auto_topup' : 'reserve',
          usdc_balance: formatUsdc(balance), tx_signature: row.tx_signature, on_chain_slot: Number(row.on_chain_slot),
          ...(row.batch_id ? { batch_id: row.batch_id } : {}),
        },
      });
    },
    async failed(tx, nowMs, row) {
      await creditReserve(tx, row.org_id, row.amount);
      await recordTransactionFailed(tx, nowMs, row, `Funding of ${formatUsdc(row.amount)} USDC from the reserve`);
      // An auto-topup that never ran (its process died before sending it, or it was lost) is
      // tried again at the automation's next tick. One the chain ran and refused keeps its latch:
      // trying it every second would fail the same way. So does a vault topped up since (its
      // latch re-armed and taken again while this one waited to expire): the latch is the later
      // topup's now; and one withdrawn from since (the withdrawal took the latch as its own, so
      // that a vault its operator empties is not refilled: docs/automation.md).
      if (row.memo === AUTO_TOPUP_MEMO && row.failure_reason === EXPIRED) {
        await tx.query(
          `UPDATE wallets SET topup_fired_at = NULL WHERE id = $1 AND NOT EXISTS (
             SELECT 1 FROM transactions o WHERE o.wallet_id = $1 AND o.id <> $2 AND (
               (o.type = 'funding' AND o.memo = $3 AND (o.status = 'pending' OR (o.status = 'confirmed' AND o.created_at >= $4)))
               OR (o.type = 'withdrawal' AND o.status <> 'failed' AND o.created_at >= $4)))`,
          [row.wallet_id, row.id, AUTO_TOPUP_MEMO, row.created_at]);
      }
    },
  },
  withdrawal: {
    async confirmed(tx, nowMs, row) {
      await tx.query('UPDATE wallets SET last_transaction_at = $2 WHERE id = $1', [row.wallet_id, new Date(nowMs)]);
      const reserve = await creditReserve(tx, row.org_id, row.amount);
      const wallet = await tx.query<{ balance: bigint; label: string }>('SELECT balance, label FROM wallets WHERE id = $1', [row.wallet_id]);
      await recordEvent(tx, nowMs, {
        orgId: row.org_id, type: 'wallet.withdrawn', walletId: row.wallet_id,
        summary: `${formatUsdc(row.amount)} USDC returned from wallet ${wallet[0]!.label} to the reserve`,
        payload: {
          wallet_id: row.wallet_id, tx_id: row.id, amount: formatUsdc(row.amount), destination: 'reserve',
          usdc_balance: formatUsdc(wallet[0]!.balance), org_balance: formatUsdc(reserve),
          tx_signature: row.tx_signature, on_chain_slot: Number(row.on_chain_slot),
        },
      });
    },
    async failed(tx, nowMs, row) {
      await creditWallet(tx, nowMs, row.wallet_id!, row.amount);
      await recordTransactionFailed(tx, nowMs, row, `Withdrawal of ${formatUsdc(row.amount)} USDC to the reserve`);
    },
  },
};

/** Another feature (payments, escrow) adds what its transaction types mean when settled. */
export function registerSettlementRule(type: TransactionType, rule: SettlementRule): void {
  RULES[type] = rule;
}

type ChainOutcome = { slot: bigint | null; err: { name: string } | null };

/** A signature's outcome to settle; `settledAtMs` (default: the batch's time) is the rows' `settled_at`. */
interface SettlementItem {
  signature: string;
  outcome: ChainOutcome;
  settledAtMs?: number;
}

/**
 * Settles several signatures in one database transaction: one statement marks every row, and
 * the rules run per row — or once for all rows of a type that settles in bulk. Answers the rows
 * each signature settled, in order.
 */
export async function settleSignatures(
  db: Database, nowMs: number, settled: readonly SettlementItem[],
): Promise<TransactionRow[][]> {
  // One item per signature; the time a request answered with wins over a read's or a batch's.
  const bySignature = new Map<string, SettlementItem>();
  for (const item of settled) {
    const seen = bySignature.get(item.signature);
    if (!seen || (seen.settledAtMs === undefined && item.settledAtMs !== undefined)) bySignature.set(item.signature, item);
  }
  const unique = [...bySignature.values()];
  return db.transaction(async (tx) => {
    const rows = await tx.query<TransactionRow>(
      `UPDATE transactions t SET status = s.status, on_chain_slot = s.slot, failure_reason = s.reason, settled_at = s.at, updated_at = s.at,
         wire = NULL
       FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::timestamptz[]) AS s(signature, status, slot, reason, at)
       WHERE t.tx_signature = s.signature AND t.status = 'pending' RETURNING t.*`,
      [unique.map((s) => s.signature), unique.map((s) => (s.outcome.err ? 'failed' : 'confirmed')),
        unique.map((s) => text(s.outcome.slot)), unique.map((s) => s.outcome.err?.name ?? null),
        unique.map((s) => new Date(s.settledAtMs ?? nowMs).toISOString())]);
    // The organisations whose reserve a rule moves (a withdrawal confirmed, a funding failed)
    // are locked first, in id order, then the wallets in id order, as everywhere: a funding
    // request holds its reserve and then waits for its vault, so a settlement that took a vault
    // before a reserve could close a cycle with it.
    const movesReserve = (row: TransactionRow) =>
      (row.type === 'withdrawal' && row.status === 'confirmed') || (row.type === 'funding' && row.status === 'failed');
    const reserves = [...new Set(rows.filter(movesReserve).map((row) => row.org_id))].sort();
    if (reserves.length) {
      await tx.query('SELECT id FROM organizations WHERE id = ANY($1::text[]) ORDER BY id FOR NO KEY UPDATE', [reserves]);
    }
    rows.sort((a, b) => (a.wallet_id ?? '').localeCompare(b.wallet_id ?? ''));
    const inBulk = new Map<TransactionType, TransactionRow[]>();
    for (const row of rows) {
      const rule = RULES[row.type];
      if (!rule) throw new Error(`no settlement rule for ${row.type}`);
      if (row.status === 'confirmed' && rule.confirmedAll) inBulk.set(row.type, [...(inBulk.get(row.type) ?? []), row]);
      else await rule[row.status as 'confirmed' | 'failed'](tx, nowMs, row);
    }
    for (const [type, list] of inBulk) await RULES[type]!.confirmedAll!(tx, nowMs, list);
    const bySignature = new Map<string, TransactionRow[]>();
    for (const row of rows) bySignature.set(row.tx_signature!, [...(bySignature.get(row.tx_signature!) ?? []), row]);
    return settled.map(({ signature }) => bySignature.get(signature) ?? []);
  });
}

/** Settlements of one process are written in batches (src/db/group-commit.ts). */
const settlers = new WeakMap<Database, GroupCommit<SettlementItem, TransactionRow[]>>();

function settlerOf(ctx: Pick<AppContext, 'db' | 'clock'>): GroupCommit<SettlementItem, TransactionRow[]> {
  let settler = settlers.get(ctx.db);
  if (!settler) {
    settler = new GroupCommit(async (items) => (await settleSignatures(ctx.db, ctx.clock.nowMs(), items))
      .map((value) => ({ ok: true as const, value })), { maxBatch: 256, concurrency: 1, gather: true });
    settlers.set(ctx.db, settler);
  }
  return settler;
}

/**
 * Settlements written behind an answer (a payment not waited for, a confirmation already
 * answered) are left to the reconciler past this backlog: with the database slower than the
 * payments arrive (a soak review saw statistics missing make each settlement 17 s a batch),
 * every one waiting in memory grew the process without a bound while the rows, recorded
 * `pending`, wait safely in the database. Reads and the reconciler still queue theirs: they wait
 * for them, a bounded number at a time.
 */
export const SETTLE_BEHIND_BACKLOG_MAX = 10_000;

/**
 * Settles an outcome behind its answer through the process's settler, or, past `backlogMax`
 * settlements waiting, leaves it to the reconciler (which settles pending rows older than
 * RECONCILE_GRACE_MS). Null when left.
 */
export function settleBehind(
  ctx: Pick<AppContext, 'db' | 'clock'>, item: SettlementItem, backlogMax = SETTLE_BEHIND_BACKLOG_MAX,
): Promise<TransactionRow[]> | null {
  const settler = settlerOf(ctx);
  return settler.backlog >= backlogMax ? null : settler.submit(item);
}

/** Resolves once this process has written every settlement it started (before its database closes). */
export async function settlementsWritten(db: Database): Promise<void> {
  await settlers.get(db)?.idle();
}

/** A chain outcome, and the rows this process settled from it (none when another settled them first). */
export interface Settlement {
  outcome: TransactionOutcome;
  rows: TransactionRow[];
}

async function outcomeWithin(ctx: Pick<AppContext, 'chain'>, signature: string, timeoutMs: number): Promise<TransactionOutcome | null> {
  try {
    return await ctx.chain.waitForOutcome(signature as Signature, timeoutMs);
  } catch {
    return null;
  }
}

/** How often a transaction whose send failed is sent again while this process waits for its outcome. */
const RESEND_EVERY_MS = 1_000;
/**
 * How often one the chain took is sent again while its outcome has not come: a node that took it
 * can still lose it (it crashed before its slot, a cluster's leader dropped it), and only the
 * sender holds its bytes.
 */
const RESEND_TAKEN_EVERY_MS = 2_000;

/**
 * Sends a recorded transaction (a payment, a funding, a withdrawal) and sends it again, the same
 * bytes, which the chain runs at most once, until the wait for its outcome is over
 * (`waiting.over`, set by the caller once the outcome came or it gave up) or `untilMs`
 * (performance.now()) passes: each second while no send was taken (a chain that did not answer
 * for a moment), then, on a chain of its own, every two seconds (a node that took it and lost
 * it, restarted say; the embedded validator loses nothing it took but with this process).
 * `first` resolves with whether the first send was taken. One that never lands fails when its
 * blockhash expires, its amount given back; without the sends again, a chain back within a
 * second still never saw it.
 */
export function sendUntilTaken(
  ctx: Pick<AppContext, 'chain' | 'log'>, prepared: PreparedTransaction, waiting: { over: boolean }, untilMs: number,
): { first: Promise<boolean> } {
  // Not sent, or sent without an answer: the signature is recorded, the reconciler will know.
  // The first failure is logged; the sends again only when one is taken (an outage would
  // otherwise log twenty lines a transaction).
  const attempt = () => ctx.chain.submit(prepared).then(() => true, (error: unknown) => error);
  const first = attempt().then((result) => {
    if (result === true) return true;
    ctx.log.warn({ err: result, signature: prepared.signature }, 'submitting a transaction failed; sent again each second while awaited');
    return false;
  });
  void first.then(async (taken) => {
    let attempts = 1;
    for (;;) {
      // The embedded validator loses what it took only with this process, and this loop with it.
      if (taken && ctx.chain.embedded) return;
      const everyMs = taken ? RESEND_TAKEN_EVERY_MS : RESEND_EVERY_MS;
      if (performance.now() + everyMs >= untilMs) return;
      await new Promise((resolve) => setTimeout(resolve, everyMs));
      if (waiting.over) return;
      attempts += 1;
      const now = (await attempt()) === true;
      if (now && !taken) ctx.log.info({ signature: prepared.signature, attempts }, 'a transaction whose send failed was taken when sent again');
      taken ||= now;
    }
  });
  return { first };
}

/** Waits for the chain's outcome and settles; null when it did not come in time (the reconciler will). */
export async function awaitSettlement(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock'>, signature: string, timeoutMs: number,
): Promise<Settlement | null> {
  const outcome = await outcomeWithin(ctx, signature, timeoutMs);
  if (!outcome) return null;
  return { outcome, rows: await settlerOf(ctx).submit({ signature, outcome }) };
}

/**
 * Settles a sent transaction behind its answer (the reconciler covers a process that stops
 * before, and one whose settlements are too far behind: settleBehind), then marks `waiting`
 * over, which ends sendUntilTaken's resends.
 */
export function settleInBackground(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock' | 'log'>, signature: string, timeoutMs: number, waiting: { over: boolean },
): void {
  outcomeWithin(ctx, signature, timeoutMs)
    .then((outcome) => (outcome ? settleBehind(ctx, { signature, outcome }) : null))
    .finally(() => { waiting.over = true; })
    .catch((error: unknown) => ctx.log.warn({ err: error, signature }, 'background settlement failed'));
}

/**
 * For a transaction whose confirmation moves no balance (a payment: its vault was debited when
 * it was recorded), the row as the chain's outcome leaves it, without waiting for the index
 * when that outcome is a confirmation. The settlement is then written behind the answer: the
 * outcome is final and durable on the chain, a read of the transaction settles it first
 * (settleKnownOutcomes), and the reconciler writes it if this process stops before. A failure
 * is answered once settled, so its amount is back in the vault when the client hears of it.
 * Null when no outcome came in time, or another process settled the failure.
 */
export async function awaitConfirmation(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock' | 'log'>, recorded: TransactionRow, timeoutMs: number,
): Promise<TransactionRow | null> {
  const signature = recorded.tx_signature!;
  const outcome = await outcomeWithin(ctx, signature, timeoutMs);
  if (!outcome) return null;
  const settledAtMs = ctx.clock.nowMs();
  if (outcome.err) return (await settlerOf(ctx).submit({ signature, outcome, settledAtMs })).find((row) => row.id === recorded.id) ?? null;
  settleBehind(ctx, { signature, outcome, settledAtMs })
    ?.catch((error: unknown) => ctx.log.warn({ err: error, signature }, 'settling a confirmed payment failed; a read or the reconciler will'));
  const at = new Date(settledAtMs);
  return { ...recorded, status: 'confirmed', on_chain_slot: outcome.slot, failure_reason: null, settled_at: at, updated_at: at };
}

/** How long a read waits for the chain's statuses before it shows its rows as stored. */
export const READ_OUTCOMES_TIMEOUT_MS = 1_000;

/**
 * The rows as the chain has decided them: a pending row whose outcome the chain already has is
 * settled before it is shown (its request may still be writing that settlement; the first write
 * wins and the other changes nothing), so a read does not show `pending` a payment that was
 * answered `confirmed`. A chain that cannot be asked (or does not answer within
 * READ_OUTCOMES_TIMEOUT_MS), or a settlement that cannot be written, leaves the rows as they are
 * stored: a read never fails or hangs for either.
 */
export async function settleKnownOutcomes(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock' | 'log'>, rows: TransactionRow[],
): Promise<TransactionRow[]> {
  const signatures = [...new Set(rows.filter((row) => row.status === 'pending' && row.tx_signature !== null)
    .map((row) => row.tx_signature!))];
  if (signatures.length === 0) return rows;
  const known: SettlementItem[] = [];
  const asked = (async () => {
    for (let start = 0; start < signatures.length; start += STATUS_BATCH_MAX) {
      const batch = signatures.slice(start, start + STATUS_BATCH_MAX);
      const outcomes = await ctx.chain.getOutcomes(batch as Signature[]);
      batch.forEach((signature, i) => {
        const outcome = outcomes[i];
        if (outcome) known.push({ signature, outcome });
      });
    }
  })();
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([asked, new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`the chain did not answer within ${READ_OUTCOMES_TIMEOUT_MS} ms`)), READ_OUTCOMES_TIMEOUT_MS);
    })]);
  } catch (error) {
    asked.catch(() => {});
    ctx.log.warn({ err: error }, 'reading outcomes from the chain failed; pending rows shown as stored');
    return rows;
  } finally {
    clearTimeout(timer);
  }
  if (known.length === 0) return rows;
  // A settlement that fails here (another process settling the same rows in another order can
  // deadlock it) is left to the request or the reconciler: the rows are read back as they stand.
  await Promise.all(known.map((item) => settlerOf(ctx).submit(item).catch((error: unknown) => {
    ctx.log.warn({ err: error, signature: item.signature }, 'settling a transaction on read failed; shown as stored');
  })));
  const settled = new Set(known.map((item) => item.signature));
  const ids = rows.filter((row) => row.status === 'pending' && settled.has(row.tx_signature!)).map((row) => row.id);
  try {
    const fresh = new Map((await ctx.db.query<TransactionRow>('SELECT * FROM transactions WHERE id = ANY($1::text[])', [ids]))
      .map((row) => [row.id, row]));
    return rows.map((row) => fresh.get(row.id) ?? row);
  } catch (error) {
    ctx.log.warn({ err: error }, 'reading settled transactions back failed; shown as stored');
    return rows;
  }
}

/**
 * settleKnownOutcomes for an organisation's pending rows (or one wallet's), the newest first as
 * the lists show them, at most 256: before a selection by status, or a check that nothing is in
 * flight. Best effort: a failure leaves the rows as they are.
 */
export async function settlePendingOf(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock' | 'log'>, orgId: string, walletId?: string,
): Promise<void> {
  try {
    const rows = await ctx.db.query<TransactionRow>(
      `SELECT * FROM transactions WHERE status = 'pending' AND tx_signature IS NOT NULL AND org_id = $1
         ${walletId === undefined ? '' : 'AND wallet_id = $2'} ORDER BY created_at DESC LIMIT ${STATUS_BATCH_MAX}`,
      walletId === undefined ? [orgId] : [orgId, walletId]);
    await settleKnownOutcomes(ctx, rows);
  } catch (error) {
    ctx.log.warn({ err: error, orgId, walletId }, 'settling pending transactions before a read failed');
  }
}

/**
 * A transaction never seen is declared expired only this many blocks after its last valid
 * height: one that landed in its very last valid block may take a moment to show its status.
 */
export const EXPIRY_MARGIN_BLOCKS = 32n;

/** A pending row younger than this is left to the request that is still waiting for it. */
export const RECONCILE_GRACE_MS = 10_000;
const RECONCILE_BATCH_MAX = 500;
/**
 * Sends again per run (every 2 s), the oldest first: a chain that lost a few hundred pending
 * transactions has them back within seconds, well inside their blockhashes' minute, and an
 * outage costs a cluster's RPC at most 50 sends a second.
 */
const RESENDS_PER_RUN_MAX = 100;
const STATUS_BATCH_MAX = 256;

/**
 * Settles every pending transaction from the chain (after a crash, a timeout, a lost
 * response): executed → settled with its outcome; never executed and past its last valid
 * block height → failed (it can never land). One the chain has not seen and that can still land
 * is sent again from its stored bytes: a process stopped between recording it and sending it,
 * or the embedded validator's unsealed slot lost with the process, does not make an acknowledged
 * payment fail. The chain runs a signature once, so a send it already has changes nothing.
 * Returns how many rows were settled.
 */
export async function reconcilePending(
  ctx: Pick<AppContext, 'db' | 'chain' | 'clock'>, graceMs = RECONCILE_GRACE_MS, resendsMax = RESENDS_PER_RUN_MAX,
): Promise<number> {
  const nowMs = ctx.clock.nowMs();
  const pending = await ctx.db.query<{ tx_signature: string; last_valid_block_height: bigint | null; wire: string | null }>(
    `SELECT tx_signature, MAX(last_valid_block_height) AS last_valid_block_height, MAX(wire) AS wire FROM transactions
     WHERE status = 'pending' AND tx_signature IS NOT NULL AND created_at < $1
     GROUP BY tx_signature ORDER BY MIN(created_at) LIMIT ${RECONCILE_BATCH_MAX}`,
    [new Date(nowMs - graceMs)]);
  if (!pending.length) return 0;
  const blockHeight = await ctx.chain.getBlockHeight();
  let settled = 0;
  let resent = 0;
  for (let start = 0; start < pending.length; start += STATUS_BATCH_MAX) {
    const batch = pending.slice(start, start + STATUS_BATCH_MAX);
    const outcomes = await ctx.chain.getOutcomes(batch.map((row) => row.tx_signature as Signature));
    const resends: Promise<unknown>[] = [];
    // Settled together, through the process's settler: in batches, one that fails written again
    // a signature at a time.
    const outcomesKnown: SettlementItem[] = [];
    for (const [index, row] of batch.entries()) {
      const outcome = outcomes[index];
      if (outcome) {
        outcomesKnown.push({ signature: row.tx_signature, outcome });
      } else if (row.last_valid_block_height !== null && blockHeight > row.last_valid_block_height + EXPIRY_MARGIN_BLOCKS) {
        outcomesKnown.push({ signature: row.tx_signature, outcome: { slot: null, err: { name: EXPIRED } } });
      } else if (resent < resendsMax && row.wire !== null && row.last_valid_block_height !== null
        && blockHeight <= row.last_valid_block_height) {
        // Refused (its blockhash gone meanwhile, the chain unreachable): the next run asks again.
        resent += 1;
        resends.push(ctx.chain.submit({
          signature: row.tx_signature as Signature, wire: row.wire as Base64EncodedWireTransaction, lastValidBlockHeight: row.last_valid_block_height,
        }).catch(() => {}));
      }
    }
    const settler = settlerOf(ctx);
    for (const rows of await Promise.all(outcomesKnown.map((item) => settler.submit(item)))) settled += rows.length;
    await Promise.all(resends);
  }
  return settled;
}
