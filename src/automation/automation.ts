/**
 * What the service does on its own (docs/automation.md), each as a job over bounded batches,
 * safe to run in several processes (every action is claimed by a conditional UPDATE, in the
 * database transaction that records what it did):
 *
 * - policy expiry: when a policy's expiry passes, every active vault attached to it freezes
 *   (`wallet.frozen`, reason `policy_expired`) and `policy.expired` is written, once per expiry
 *   (a PATCH that sets a new expiry starts another);
 * - auto-topup: when an active vault is below its `trigger_below` (after a spend, or already
 *   when auto-topup is turned on; a withdrawal takes the latch instead), the reserve funds
 *   `topup_amount` once, recorded and sent without waiting for the chain; a reserve too small
 *   raises `balance.low` instead, once, and the topup is made when the reserve can cover it; it
 *   fires again only after the balance was back at or above the trigger — never a loop;
 * - balance.low: once each time a vault's balance falls below its low-balance threshold;
 * - alerts (per-organisation settings, `alert.raised`): inactivity, velocity spike, large
 *   transaction, policy violation.
 */
import { ChainUnavailableError } from '../chain/client.ts';
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';
import { recordEvent, recordEvents, type NewEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { formatUsdc } from '../money/money.ts';
import { AUTO_TOPUP_MEMO, settleKnownOutcomes, type TransactionRow } from '../transactions/settlement.ts';
import { fundWallets } from '../wallets/funding.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log'>;

const BATCH = 100;

// ---------------------------------------------------------------------------------------------
// Policy expiry

/** The `policies.expire` job. Returns how many policies expired now. */
export async function expirePolicies(ctx: Ctx): Promise<number> {
  const nowMs = ctx.clock.nowMs();
  const due = await ctx.db.query<{ id: string; org_id: string }>(
    `SELECT id, org_id FROM policies WHERE expiry IS NOT NULL AND expiry <= $1 AND expired_at IS NULL AND deleted_at IS NULL
     ORDER BY expiry LIMIT ${BATCH}`, [new Date(nowMs)]);
  let expired = 0;
  for (const { id, org_id: orgId } of due) {
    const done = await ctx.db.transaction(async (tx) => {
      const now = new Date(ctx.clock.nowMs());
      const [policy] = await tx.query<{ name: string; expiry: Date }>(
        // The expiry is checked again: a PATCH may have moved it later since the policy was picked.
        `UPDATE policies SET expired_at = $3 WHERE org_id = $1 AND id = $2 AND expired_at IS NULL AND expiry <= $3 RETURNING name, expiry`,
        [orgId, id, now]);
      if (!policy) return false;
      // Lock order: wallets by id, like every other writer of wallet rows.
      const frozen = await tx.query<{ id: string; agent_id: string; label: string }>(
        `UPDATE wallets SET status = 'frozen', chain_status = 'pending', sync_retry_at = NULL, sync_failures = 0, updated_at = $3
         WHERE id IN (SELECT id FROM wallets WHERE org_id = $1 AND policy_id = $2 AND status = 'active' ORDER BY id FOR UPDATE)
         RETURNING id, agent_id, label`, [orgId, id, now]);
      // One statement for all their events: the vaults' locks (thousands, for a policy many vaults
      // share) are held no longer than that.
      await recordEvents(tx, now.getTime(), [
        ...frozen.map((wallet): NewEvent => ({
          orgId, type: 'wallet.frozen', walletId: wallet.id,
          summary: `Wallet ${wallet.label} frozen: its policy ${policy.name} expired`,
          payload: { wallet_id: wallet.id, agent_id: wallet.agent_id, reason: 'policy_expired', policy_id: id },
        })),
        {
          orgId, type: 'policy.expired',
          summary: `Policy ${policy.name} expired; ${frozen.length} vault${frozen.length === 1 ? '' : 's'} frozen`,
          payload: { policy_id: id, name: policy.name, expiry: policy.expiry.toISOString(), frozen_wallets: frozen.map((w) => w.id) },
        },
      ]);
      return true;
    });
    if (done) expired += 1;
  }
  return expired;
}

// ---------------------------------------------------------------------------------------------
// Auto-topup and balance.low

function lowBalanceEvent(
  orgId: string, walletId: string, label: string, balance: bigint, threshold: bigint, extra: Record<string, unknown> = {},
  summary = `Wallet ${label}'s balance ${formatUsdc(balance)} USDC is below ${formatUsdc(threshold)} USDC`,
): NewEvent {
  return {
    orgId, type: 'balance.low', walletId, summary,
    payload: { wallet_id: walletId, current_balance: formatUsdc(balance), threshold: formatUsdc(threshold), ...extra },
  };
}

/**
 * When a vault is due for balance.low, and for an auto-topup whose latch is free (columns of
 * `wallets`). Migration 0037's trigger marks the vaults that meet either (`automation_due`) as
 * they are written, with these very conditions: keep the two the same. The job reads only marked
 * vaults, through a partial index, and clears the marks of those no longer due.
 */
const LOW_BALANCE_DUE = `(low_balance_threshold IS NOT NULL AND low_balance_fired_at IS NULL AND status <> 'archived'
  AND (balance < low_balance_threshold OR low_balance_crossed_balance IS NOT NULL))`;
const TOPUP_DUE = `(auto_topup_enabled AND topup_fired_at IS NULL AND status = 'active' AND provisioned_at IS NOT NULL
  AND balance < auto_topup_trigger_below)`;
/** Marks cleared per run: more than a run's two batches can leave, so they never pile up. */
const MARKS_CLEARED_MAX = 1_000;

/** Sent topups settled per run: one status call to the chain. */
const SENT_TOPUPS_MAX = 256;

/**
 * Settles the topups earlier runs sent (they are not waited for) whose outcome the chain has, in
 * one bounded read of the chain (settleKnownOutcomes): a vault is credited a tick after its topup
 * rather than when the reconciler gets to it. What this leaves, the reconciler settles.
 */
async function settleSentTopups(ctx: Ctx): Promise<void> {
  // The memo as a literal, as migration 0032's index names it: a parameter would not match it.
  const sent = await ctx.db.query<TransactionRow>(
    `SELECT * FROM transactions WHERE status = 'pending' AND type = 'funding' AND memo = '${AUTO_TOPUP_MEMO}' AND tx_signature IS NOT NULL
     ORDER BY created_at LIMIT ${SENT_TOPUPS_MAX}`);
  await settleKnownOutcomes(ctx, sent);
}

/** The `wallets.automation` job: auto-topups and balance.low. */
export async function runWalletAutomation(ctx: Ctx): Promise<{ topups: number; lowBalance: number }> {
  await settleSentTopups(ctx);
  const now = new Date(ctx.clock.nowMs());
  // Latches re-arm as the balance is written back at or above their trigger (migration 0018),
  // or when the trigger or threshold is set again: nothing to scan for here (but for topups the
  // reserve could not cover, retried below).

  // Each latch is set in the transaction that writes its event (the outbox): both or neither.
  // A vault below its threshold is told and latched; one whose fall a credit undid before this
  // run (the crossing noted by migration 0033's trigger) is told with the balance the fall left,
  // and not latched: its balance is back, and its next fall is told again.
  const lows = await ctx.db.transaction(async (tx) => {
    const latched = await tx.query<{ id: string; org_id: string; label: string; balance: bigint; low_balance_threshold: bigint }>(
      `WITH due AS (
         SELECT id, low_balance_crossed_balance AS crossed FROM wallets
         WHERE automation_due AND ${LOW_BALANCE_DUE}
         LIMIT ${BATCH} FOR UPDATE SKIP LOCKED)
       UPDATE wallets w SET low_balance_fired_at = CASE WHEN w.balance < w.low_balance_threshold THEN $1::timestamptz END,
         low_balance_crossed_balance = NULL
       FROM due WHERE w.id = due.id
       RETURNING w.id, w.org_id, w.label, CASE WHEN w.balance < w.low_balance_threshold THEN w.balance ELSE due.crossed END AS balance,
         w.low_balance_threshold`, [now]);
    // One statement for all their events: the vaults' locks are held no longer than that.
    await recordEvents(tx, now.getTime(),
      latched.map((wallet) => lowBalanceEvent(wallet.org_id, wallet.id, wallet.label, wallet.balance, wallet.low_balance_threshold)));
    return latched;
  });

  // Candidates only: each topup's latch is taken in the transaction that records its funding
  // (or that writes its balance.low), so no moment exists where the latch is taken and nothing
  // was recorded — a process that dies in between loses no topup. A latch taken for a reserve
  // shortfall (migration 0030) makes its vault a candidate again once the reserve holds the
  // topup's amount: judged here from the reserve as read, and again under its lock by the funding.
  // Two index-served reads: the marked vaults, and those waiting for their reserve (migration 0030).
  const due = await ctx.db.query<{ id: string; org_id: string; auto_topup_amount: bigint }>(
    `(SELECT id, org_id, auto_topup_amount FROM wallets WHERE automation_due AND ${TOPUP_DUE} ORDER BY id LIMIT ${BATCH})
     UNION
     (SELECT w.id, w.org_id, w.auto_topup_amount FROM wallets w
      WHERE w.auto_topup_enabled AND w.topup_reserve_short_at IS NOT NULL AND w.topup_fired_at IS NOT NULL
        AND w.balance < w.auto_topup_trigger_below AND w.status = 'active' AND w.provisioned_at IS NOT NULL
        AND w.auto_topup_amount <= (SELECT o.reserve_balance FROM organizations o WHERE o.id = w.org_id)
      ORDER BY w.id LIMIT ${BATCH})
     ORDER BY id LIMIT ${BATCH}`);
  let topups = 0;
  /**
   * Takes the vault's latch if its topup is still due (checked again under the lock), with the
   * amount it was read with (a topup amount changed since is the next run's), marked as taken
   * for a reserve shortfall or not; the balance and trigger when taken. A funding may also take a
   * latch held for a shortfall (the reserve now covers it); a shortfall only a free one, so that
   * a vault still short is told once.
   */
  const takeLatch = async (tx: Queryable, wallet: (typeof due)[number], reserveShort: boolean) => (await tx.query<{ label: string; balance: bigint; auto_topup_trigger_below: bigint }>(
    `UPDATE wallets SET topup_fired_at = $2, topup_reserve_short_at = CASE WHEN $3::boolean THEN $2::timestamptz END
     WHERE id = $1 AND auto_topup_enabled AND balance < auto_topup_trigger_below AND auto_topup_amount = $4
       AND status = 'active' AND provisioned_at IS NOT NULL
       AND (topup_fired_at IS NULL OR (NOT $3::boolean AND topup_reserve_short_at IS NOT NULL))
     RETURNING label, balance, auto_topup_trigger_below`, [wallet.id, now, reserveShort, wallet.auto_topup_amount]))[0];
  for (const wallet of due) {
    /** Whether the latch was taken in the funding's transaction (which then commits, but for a failure of the commit itself). */
    let latched = false;
    try {
      // Recorded and sent, not waited for (settled in the background as its outcome comes, or by
      // the next run): a run lasts no slot per vault, and a chain that does not confirm holds up
      // neither balance.low nor other vaults.
      await fundWallets(ctx, wallet.org_id, [{ walletId: wallet.id, amount: wallet.auto_topup_amount }], async (tx) => {
        if (!await takeLatch(tx, wallet, false)) throw new TopupNotDue();
        latched = true;
      }, { memo: AUTO_TOPUP_MEMO, wait: false });
      topups += 1;
    } catch (error) {
      if (error instanceof TopupNotDue) continue; // another process took it, or the vault moved meanwhile
      if (latched) {
        // The latch was taken, then the commit failed to answer: whatever it wrote, the
        // reconciler settles, and a topup that never ran is tried again then (the funding's
        // failure rule).
        ctx.log.warn({ err: error, walletId: wallet.id }, 'auto-topup recorded but not seen through; the reconciler settles it');
        continue;
      }
      if (error instanceof ChainUnavailableError) {
        // Nothing recorded, and every other topup would wait out the same timeout: they are all
        // tried at the next tick.
        ctx.log.warn({ err: error }, 'the chain did not answer; auto-topups retried at the next tick');
        break;
      }
      if (error instanceof ServiceError && error.code === 'org_insufficient_balance') {
        // The reserve cannot cover it: said once, with the latch marked as taken for that reason,
        // and tried again when the reserve can cover it (or afresh once the balance is back). A
        // vault already marked (the reserve looked enough, and was spent before its funding) takes
        // nothing here: its shortfall was told.
        await ctx.db.transaction(async (tx) => {
          const latched = await takeLatch(tx, wallet, true);
          if (!latched) return;
          // Told apart from the vault's own low-balance warning: the operator has to fund the reserve.
          const topup = formatUsdc(wallet.auto_topup_amount);
          await recordEvent(tx, ctx.clock.nowMs(), lowBalanceEvent(wallet.org_id, wallet.id, latched.label, latched.balance, latched.auto_topup_trigger_below, {
            reason: 'auto_topup_reserve_insufficient', topup_amount: topup, org_balance: error.details.available,
          }, `Auto-topup of ${topup} USDC for wallet ${latched.label} not funded: the reserve holds ${String(error.details.available)} USDC `
            + `(wallet balance ${formatUsdc(latched.balance)} USDC, below ${formatUsdc(latched.auto_topup_trigger_below)} USDC)`));
        }).catch((failure: unknown) => ctx.log.warn({ err: failure, walletId: wallet.id }, 'auto-topup refusal not written; retried at the next tick'));
        continue;
      }
      // Nothing was recorded (the latch is taken with the funding): the next tick tries again.
      ctx.log.warn({ err: error, walletId: wallet.id }, 'auto-topup failed; retried at the next tick');
    }
  }
  // Under each vault's lock, so a write that made it due again since it was read keeps its mark.
  await ctx.db.query(
    `UPDATE wallets SET automation_due = FALSE WHERE id IN (
       SELECT id FROM wallets WHERE automation_due AND NOT COALESCE(${LOW_BALANCE_DUE}, FALSE) AND NOT COALESCE(${TOPUP_DUE}, FALSE)
       LIMIT ${MARKS_CLEARED_MAX} FOR UPDATE SKIP LOCKED)`);
  return { topups, lowBalance: lows.length };
}

/** An auto-topup's latch was no longer free when its funding was recorded: nothing is recorded. */
class TopupNotDue extends Error {}

// ---------------------------------------------------------------------------------------------
// Alerts

export interface AlertSettings {
  policyViolation: boolean;
  inactivityHours: number | null;
  velocityPerHour: number | null;
  largeTransactionAmount: bigint | null;
}

export const DEFAULT_ALERTS: AlertSettings = { policyViolation: true, inactivityHours: null, velocityPerHour: null, largeTransactionAmount: null };

interface AlertSettingsRow {
  policy_violation_enabled: boolean;
  inactivity_hours: number | null;
  velocity_per_hour: number | null;
  large_transaction_amount: bigint | null;
}

export async function alertSettingsOf(q: Queryable, orgId: string): Promise<AlertSettings> {
  const [row] = await q.query<AlertSettingsRow>('SELECT * FROM alert_settings WHERE org_id = $1', [orgId]);
  if (!row) return DEFAULT_ALERTS;
  return {
    policyViolation: row.policy_violation_enabled, inactivityHours: row.inactivity_hours,
    velocityPerHour: row.velocity_per_hour, largeTransactionAmount: row.large_transaction_amount,
  };
}

export async function saveAlertSettings(q: Queryable, nowMs: number, orgId: string, settings: AlertSettings): Promise<AlertSettings> {
  await q.query(
    `INSERT INTO alert_settings (org_id, policy_violation_enabled, inactivity_hours, velocity_per_hour, large_transaction_amount, updated_at)
     VALUES ($1, $2, $3, $4, $5, $6)
     ON CONFLICT (org_id) DO UPDATE SET policy_violation_enabled = $2, inactivity_hours = $3, velocity_per_hour = $4,
       large_transaction_amount = $5, updated_at = $6`,
    [orgId, settings.policyViolation, settings.inactivityHours, settings.velocityPerHour, settings.largeTransactionAmount, new Date(nowMs)]);
  return alertSettingsOf(q, orgId);
}

function alertEvent(orgId: string, walletId: string, alert: string, summary: string, details: Record<string, unknown>): NewEvent {
  return { orgId, type: 'alert.raised', walletId, summary, payload: { alert, wallet_id: walletId, ...details } };
}

async function raiseAlert(
  q: Queryable, nowMs: number, orgId: string, walletId: string, alert: string, summary: string, details: Record<string, unknown>,
): Promise<void> {
  await recordEvent(q, nowMs, alertEvent(orgId, walletId, alert, summary, details));
}

/** Called where a payment is blocked, in its transaction: the policy-violation alert (on by default). */
export async function alertPolicyViolation(
  q: Queryable, nowMs: number, wallet: { id: string; org_id: string; label: string }, txId: string, violation: { rule: string },
): Promise<void> {
  if (!(await alertSettingsOf(q, wallet.org_id)).policyViolation) return;
  await raiseAlert(q, nowMs, wallet.org_id, wallet.id, 'policy_violation', `Policy violation (${violation.rule}) on wallet ${wallet.label}`,
    { tx_id: txId, violation });
}

/**
 * Called when payments are confirmed, in their transaction: the large-transaction alerts they
 * raise, to be written with their other events. One read for every organisation among them, so
 * a settlement batch costs the same round trips whatever the number of tenants in it.
 */
export async function largeTransactionAlerts(
  q: Queryable, payments: ReadonlyArray<Pick<TransactionRow, 'org_id' | 'wallet_id' | 'id' | 'amount' | 'type'>>,
): Promise<NewEvent[]> {
  if (payments.length === 0) return [];
  const rows = await q.query<{ org_id: string; large_transaction_amount: bigint }>(
    'SELECT org_id, large_transaction_amount FROM alert_settings WHERE org_id = ANY($1::text[]) AND large_transaction_amount IS NOT NULL',
    [[...new Set(payments.map((p) => p.org_id))]]);
  const thresholds = new Map(rows.map((row) => [row.org_id, row.large_transaction_amount]));
  return payments.flatMap((payment) => {
    const threshold = thresholds.get(payment.org_id);
    if (threshold === undefined || payment.amount <= threshold) return [];
    return [alertEvent(payment.org_id, payment.wallet_id!, 'large_transaction',
      `${payment.type === 'a2a_send' ? 'Escrow' : 'Payment'} of ${formatUsdc(payment.amount)} USDC above the ${formatUsdc(threshold)} USDC alert threshold`,
      { tx_id: payment.id, amount: formatUsdc(payment.amount), threshold: formatUsdc(threshold) })];
  });
}

const HOUR_MS = 3_600_000;

/** The `alerts.scan` job: inactivity and velocity spikes, once per episode. */
export async function scanAlerts(ctx: Ctx): Promise<number> {
  const nowMs = ctx.clock.nowMs();
  const now = new Date(nowMs);
  // Each latch is set in the transaction that writes its alert (the outbox): both or neither.
  let raised = await ctx.db.transaction(async (tx) => {
    const inactive = await tx.query<{ id: string; org_id: string; label: string; since: Date; hours: number }>(
      `UPDATE wallets w SET inactivity_alerted_at = $1 FROM alert_settings a
       WHERE a.org_id = w.org_id AND w.id IN (
         SELECT w2.id FROM wallets w2 JOIN alert_settings a2 ON a2.org_id = w2.org_id
         WHERE a2.inactivity_hours IS NOT NULL AND w2.status = 'active'
           AND COALESCE(w2.last_transaction_at, w2.created_at) <= $1::timestamptz - make_interval(hours => a2.inactivity_hours)
           AND (w2.inactivity_alerted_at IS NULL OR w2.inactivity_alerted_at < COALESCE(w2.last_transaction_at, w2.created_at))
         LIMIT ${BATCH} FOR UPDATE OF w2 SKIP LOCKED)
       RETURNING w.id, w.org_id, w.label, COALESCE(w.last_transaction_at, w.created_at) AS since, a.inactivity_hours AS hours`, [now]);
    for (const wallet of inactive) {
      await raiseAlert(tx, nowMs, wallet.org_id, wallet.id, 'inactivity',
        `Wallet ${wallet.label} inactive for more than ${wallet.hours} h`, { inactive_since: wallet.since.toISOString(), hours: wallet.hours });
    }
    return inactive.length;
  });
  // Candidates from the stored hour count (it only over-counts until the window slides, which
  // is at the vault's next payment), then counted exactly. A vault that has not paid for an hour
  // has nothing in the window whatever its stored count says: left out, so that vaults which
  // once spiked and went quiet never fill the batch ahead of one spiking now. The most recent
  // payers come first. An archived vault is left out (it can pay no more); a frozen one is not:
  // its spike happened.
  const candidates = await ctx.db.query<{ id: string; org_id: string; label: string; per_hour: number }>(
    `SELECT w.id, w.org_id, w.label, a.velocity_per_hour AS per_hour FROM wallets w
     JOIN alert_settings a ON a.org_id = w.org_id JOIN spend_windows s ON s.wallet_id = w.id
     WHERE a.velocity_per_hour IS NOT NULL AND s.hour_count > a.velocity_per_hour AND w.status <> 'archived'
       AND w.last_transaction_at > $1::timestamptz - INTERVAL '1 hour'
       AND (w.velocity_alerted_at IS NULL OR w.velocity_alerted_at <= $1::timestamptz - INTERVAL '1 hour')
     ORDER BY w.last_transaction_at DESC
     LIMIT ${BATCH}`, [now]);
  for (const wallet of candidates) {
    // The peak: the most payments in the hour ending at any payment of the last hour. Counting
    // the hour before the scan instead missed a spike that ended between two scans (30 s).
    const [row] = await ctx.db.query<{ count: number }>(
      `SELECT COALESCE(max(n), 0)::int AS count FROM (
         SELECT spend_at_ms, count(*) OVER (ORDER BY spend_at_ms RANGE BETWEEN ${HOUR_MS - 1} PRECEDING AND CURRENT ROW) AS n
         FROM transactions WHERE wallet_id = $1 AND spend_at_ms > $2) counted
       WHERE spend_at_ms > $3`, [wallet.id, nowMs - 2 * HOUR_MS, nowMs - HOUR_MS]);
    const count = row?.count ?? 0;
    if (count <= wallet.per_hour) continue;
    raised += await ctx.db.transaction(async (tx) => {
      await tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [wallet.id]);
      // The setting as it is once the vault is locked (a statement of its own, so it sees a change
      // committed while the lock was awaited): turned off or raised since the candidates were
      // read, it raises nothing.
      const [setting] = await tx.query<{ per_hour: number | null }>(
        'SELECT velocity_per_hour AS per_hour FROM alert_settings WHERE org_id = $1', [wallet.org_id]);
      const perHour = setting?.per_hour ?? null;
      if (perHour === null || count <= perHour) return 0;
      const claimed = await tx.query(
        `UPDATE wallets SET velocity_alerted_at = $2 WHERE id = $1 AND status <> 'archived'
           AND (velocity_alerted_at IS NULL OR velocity_alerted_at <= $2::timestamptz - INTERVAL '1 hour') RETURNING id`, [wallet.id, now]);
      if (!claimed.length) return 0;
      await raiseAlert(tx, nowMs, wallet.org_id, wallet.id, 'velocity_spike',
        `Wallet ${wallet.label} made ${count} payments within an hour (alert above ${perHour})`, { count, per_hour: perHour });
      return 1;
    });
  }
  return raised;
}
