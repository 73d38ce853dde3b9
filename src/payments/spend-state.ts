/**
 * A vault's spend in its policy windows — the rolling 24 hours, the rolling hour (velocity) and
 * the UTC calendar month — kept incrementally in `spend_windows` so that a busy vault costs the
 * same per payment as a quiet one: each spend is added once when it starts counting and taken
 * out once when its window moves past it (only those rows are read, through an index).
 *
 * Callers hold the wallet's row lock: the state is read, moved and written under it.
 */
import type { Queryable } from '../db/database.ts';
import {
  DAY_MS, HOUR_MS, addToWindow, leavingRange, monthKey, slideWindow, type Spend, type SpendState, type WindowState,
} from './policy-engine.ts';

export interface SpendWindows {
  day: WindowState;
  hour: WindowState;
  month: { key: string; sum: bigint };
}

interface SpendWindowsRow {
  day_sum: bigint;
  day_count: number;
  day_removed_through_ms: bigint;
  hour_sum: bigint;
  hour_count: number;
  hour_removed_through_ms: bigint;
  month_key: string;
  month_sum: bigint;
}

async function leavingSpends(q: Queryable, walletId: string, state: WindowState, atMs: number, windowMs: number): Promise<Spend[]> {
  const range = leavingRange(state, atMs, windowMs);
  if (!range) return [];
  const rows = await q.query<{ spend_at_ms: bigint; amount: bigint }>(
    `SELECT spend_at_ms, amount FROM transactions
     WHERE wallet_id = $1 AND spend_at_ms > $2 AND spend_at_ms <= $3`,
    [walletId, range.afterMs, range.throughMs]);
  return rows.map((row) => ({ atMs: Number(row.spend_at_ms), amount: row.amount }));
}

/** The windows as they stand at `atMs` (moved forward; nothing written). */
export async function spendWindowsAt(q: Queryable, walletId: string, atMs: number): Promise<SpendWindows> {
  const [row] = await q.query<SpendWindowsRow>('SELECT * FROM spend_windows WHERE wallet_id = $1', [walletId]);
  let day: WindowState = { sum: row?.day_sum ?? 0n, count: row?.day_count ?? 0, removedThroughMs: Number(row?.day_removed_through_ms ?? 0n) };
  let hour: WindowState = { sum: row?.hour_sum ?? 0n, count: row?.hour_count ?? 0, removedThroughMs: Number(row?.hour_removed_through_ms ?? 0n) };
  day = slideWindow(day, atMs, DAY_MS, await leavingSpends(q, walletId, day, atMs, DAY_MS));
  hour = slideWindow(hour, atMs, HOUR_MS, await leavingSpends(q, walletId, hour, atMs, HOUR_MS));
  const key = monthKey(atMs);
  const month = row && row.month_key === key ? { key, sum: row.month_sum } : { key, sum: 0n };
  return { day, hour, month };
}

export function spendStateOf(windows: SpendWindows): SpendState {
  return { daySpent: windows.day.sum, hourCount: windows.hour.count, monthSpent: windows.month.sum };
}

export function withSpend(windows: SpendWindows, spend: Spend): SpendWindows {
  return { day: addToWindow(windows.day, spend), hour: addToWindow(windows.hour, spend), month: { ...windows.month, sum: windows.month.sum + spend.amount } };
}

export async function saveSpendWindows(tx: Queryable, walletId: string, w: SpendWindows): Promise<void> {
  await tx.query(
    `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count,
       hour_removed_through_ms, month_key, month_sum)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
     ON CONFLICT (wallet_id) DO UPDATE SET day_sum = $2, day_count = $3, day_removed_through_ms = $4, hour_sum = $5,
       hour_count = $6, hour_removed_through_ms = $7, month_key = $8, month_sum = $9`,
    [walletId, w.day.sum, w.day.count, w.day.removedThroughMs, w.hour.sum, w.hour.count, w.hour.removedThroughMs,
      w.month.key, w.month.sum]);
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
