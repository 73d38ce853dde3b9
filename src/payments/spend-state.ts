/**
 * A vault's spend in its policy windows — the rolling 24 hours, the rolling hour (velocity) and
 * the UTC calendar month — kept incrementally in `spend_windows` so that a busy vault costs the
 * same per payment as a quiet one: each spend is added once when it starts counting and taken
 * out once when its window moves past it (only those rows are read, through an index).
 *
 * Callers hold the wallet's row lock: the state is read, moved and written under it.
 */
import type { Queryable } from '../db/database.ts';
import { Params } from '../db/params.ts';
import {
  DAY_MS, HOUR_MS, addToWindow, monthKey, slideWindowBy, type Spend, type SpendState, type WindowState,
} from './policy-engine.ts';

export interface SpendWindows {
  day: WindowState;
  hour: WindowState;
  month: { key: string; sum: bigint };
}

interface SpendWindowsRow {
  wallet_id: string;
  day_sum: bigint;
  day_count: number;
  day_removed_through_ms: bigint;
  hour_sum: bigint;
  hour_count: number;
  hour_removed_through_ms: bigint;
  month_key: string;
  month_sum: bigint;
}

/**
 * The total and number of the spends leaving the day or hour window of the row `s` (a lateral
 * part of the read below): those `leavingRange` names, made after the window last moved and no
 * later than its new start `throughMs` (a placeholder). Summed where they are stored: a vault
 * that was busy and then went quiet has a whole day of spends leaving at once, which its reads
 * (the wallet's view, a preflight) see until its next payment writes the window moved.
 */
const leavingTotal = (window: 'day' | 'hour', throughMs: string): string =>
  `SELECT COALESCE(SUM(t.amount), 0)::bigint AS sum, COUNT(*)::int AS count FROM transactions t
   WHERE s.${window}_count > 0 AND t.wallet_id = s.wallet_id
     AND t.spend_at_ms > s.${window}_removed_through_ms AND t.spend_at_ms <= ${throughMs}::bigint`;

/**
 * The windows of several vaults as they stand at `atMs` (moved forward; nothing written), in
 * one statement whatever the number of vaults, one row each.
 */
export async function spendWindowsOf(q: Queryable, walletIds: readonly string[], atMs: number): Promise<Map<string, SpendWindows>> {
  const rows = await q.query<SpendWindowsRow & { day_leaving_sum: bigint; day_leaving_count: number; hour_leaving_sum: bigint; hour_leaving_count: number }>(
    `SELECT s.*, d.sum AS day_leaving_sum, d.count AS day_leaving_count, h.sum AS hour_leaving_sum, h.count AS hour_leaving_count
     FROM spend_windows s
     CROSS JOIN LATERAL (${leavingTotal('day', '$2')}) d
     CROSS JOIN LATERAL (${leavingTotal('hour', '$3')}) h
     WHERE s.wallet_id = ANY($1::text[])`,
    [walletIds, String(atMs - DAY_MS), String(atMs - HOUR_MS)]);
  const stored = new Map(rows.map((row) => [row.wallet_id, row]));
  const key = monthKey(atMs);
  const windows = new Map<string, SpendWindows>();
  for (const walletId of new Set(walletIds)) {
    const row = stored.get(walletId);
    const day: WindowState = { sum: row?.day_sum ?? 0n, count: row?.day_count ?? 0, removedThroughMs: Number(row?.day_removed_through_ms ?? 0n) };
    const hour: WindowState = { sum: row?.hour_sum ?? 0n, count: row?.hour_count ?? 0, removedThroughMs: Number(row?.hour_removed_through_ms ?? 0n) };
    windows.set(walletId, {
      day: slideWindowBy(day, atMs, DAY_MS, { sum: row?.day_leaving_sum ?? 0n, count: row?.day_leaving_count ?? 0 }),
      hour: slideWindowBy(hour, atMs, HOUR_MS, { sum: row?.hour_leaving_sum ?? 0n, count: row?.hour_leaving_count ?? 0 }),
      // A month key never moves back: a payment whose time was read before it waited for the
      // vault's lock, across the turn of a month, counts toward the month already begun.
      month: row && row.month_key >= key ? { key: row.month_key, sum: row.month_sum } : { key, sum: 0n },
    });
  }
  return windows;
}

/**
 * The latest time the windows were moved to, over several vaults: a spend recorded then has
 * slid each window to start at its time less the window's length (0 when none ever moved).
 */
function latestSpendMs(windows: ReadonlyMap<string, SpendWindows>): number {
  let latest = 0;
  for (const w of windows.values()) latest = Math.max(latest, w.day.removedThroughMs + DAY_MS, w.hour.removedThroughMs + HOUR_MS);
  return latest;
}

/**
 * The windows of vaults whose rows are locked, and the time to decide and record a spend at:
 * `atMs`, or the time of their latest spend when that is later (committed while the caller
 * waited for the locks after reading the clock, or by a process whose clock is ahead). Decided
 * at `atMs` then, a spend would be judged against windows that have already let go of spends
 * still counting at `atMs`, and recorded before the spend committed ahead of it. `read`: the
 * windows at `atMs` when already read (with the locks, in one round trip).
 */
export async function spendWindowsFrom(
  q: Queryable, walletIds: readonly string[], atMs: number, read?: Map<string, SpendWindows>,
): Promise<{ atMs: number; windows: Map<string, SpendWindows> }> {
  const windows = read ?? await spendWindowsOf(q, walletIds, atMs);
  const latest = latestSpendMs(windows);
  return latest > atMs ? { atMs: latest, windows: await spendWindowsOf(q, walletIds, latest) } : { atMs, windows };
}

/** One vault's windows as they stand at `atMs` (moved forward; nothing written). */
export async function spendWindowsAt(q: Queryable, walletId: string, atMs: number): Promise<SpendWindows> {
  return (await spendWindowsOf(q, [walletId], atMs)).get(walletId)!;
}

export function spendStateOf(windows: SpendWindows): SpendState {
  return { daySpent: windows.day.sum, hourCount: windows.hour.count, monthSpent: windows.month.sum };
}

export function withSpend(windows: SpendWindows, spend: Spend): SpendWindows {
  return { day: addToWindow(windows.day, spend), hour: addToWindow(windows.hour, spend), month: { ...windows.month, sum: windows.month.sum + spend.amount } };
}

export async function saveSpendWindows(tx: Queryable, walletId: string, w: SpendWindows): Promise<void> {
  await saveSpendWindowsOf(tx, new Map([[walletId, w]]));
}

/** Writes the windows of several vaults in one statement. */
export async function saveSpendWindowsOf(tx: Queryable, windows: ReadonlyMap<string, SpendWindows>): Promise<void> {
  if (windows.size === 0) return;
  const params = new Params();
  await tx.query(saveSpendWindowsSql(params, windows), params.values);
}

/** The upsert of several vaults' windows, its placeholders taken from `params` (a part of a larger statement). */
export function saveSpendWindowsSql(params: Params, windows: ReadonlyMap<string, SpendWindows>): string {
  const all = [...windows];
  const column = (type: string, pick: (w: SpendWindows) => bigint | number | string) => params.array(type, all.map(([, w]) => String(pick(w))));
  return `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count,
       hour_removed_through_ms, month_key, month_sum)
     SELECT * FROM unnest(${params.array('text', all.map(([walletId]) => walletId))}, ${column('bigint', (w) => w.day.sum)},
       ${column('int', (w) => w.day.count)}, ${column('bigint', (w) => w.day.removedThroughMs)}, ${column('bigint', (w) => w.hour.sum)},
       ${column('int', (w) => w.hour.count)}, ${column('bigint', (w) => w.hour.removedThroughMs)}, ${column('text', (w) => w.month.key)},
       ${column('bigint', (w) => w.month.sum)})
     ON CONFLICT (wallet_id) DO UPDATE SET day_sum = excluded.day_sum, day_count = excluded.day_count,
       day_removed_through_ms = excluded.day_removed_through_ms, hour_sum = excluded.hour_sum, hour_count = excluded.hour_count,
       hour_removed_through_ms = excluded.hour_removed_through_ms, month_key = excluded.month_key, month_sum = excluded.month_sum`;
}

/**
 * Takes a spend that will never happen (a payment that failed on chain) out of every window it
 * still counts in, and stops it counting. The wallet row is locked by the caller.
 */
export async function withdrawSpend(tx: Queryable, walletId: string, transactionId: string): Promise<void> {
  const [row] = await tx.query<{ spend_at_ms: bigint | null; amount: bigint }>(
    'SELECT spend_at_ms, amount FROM transactions WHERE id = $1 FOR UPDATE', [transactionId]);
  if (!row || row.spend_at_ms === null) return;
  await tx.query('UPDATE transactions SET spend_at_ms = NULL WHERE id = $1', [transactionId]);
  const atMs = Number(row.spend_at_ms);
  const [state] = await tx.query<SpendWindowsRow>('SELECT * FROM spend_windows WHERE wallet_id = $1 FOR UPDATE', [walletId]);
  if (!state) return;
  const inDay = atMs > Number(state.day_removed_through_ms);
  const inHour = atMs > Number(state.hour_removed_through_ms);
  const inMonth = state.month_key === monthKey(atMs);
  await tx.query(
    `UPDATE spend_windows SET
       day_sum = day_sum - CASE WHEN $2::boolean THEN $5::bigint ELSE 0 END,
       day_count = day_count - CASE WHEN $2::boolean THEN 1 ELSE 0 END,
       hour_sum = hour_sum - CASE WHEN $3::boolean THEN $5::bigint ELSE 0 END,
       hour_count = hour_count - CASE WHEN $3::boolean THEN 1 ELSE 0 END,
       month_sum = month_sum - CASE WHEN $4::boolean THEN $5::bigint ELSE 0 END
     WHERE wallet_id = $1`,
    [walletId, inDay, inHour, inMonth, row.amount]);
}
