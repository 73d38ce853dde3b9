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

interface LeavingRange { walletId: string; afterMs: number; throughMs: number }

/** The spends of each range, by the range's index (one query for all of them). */
async function leavingSpends(q: Queryable, ranges: readonly LeavingRange[]): Promise<Spend[][]> {
  const leaving: Spend[][] = ranges.map(() => []);
  if (ranges.length === 0) return leaving;
  const rows = await q.query<{ range: bigint; spend_at_ms: bigint; amount: bigint }>(
    `SELECT r.range, t.spend_at_ms, t.amount
     FROM unnest($1::text[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS r(wallet_id, after_ms, through_ms, range)
     JOIN transactions t ON t.wallet_id = r.wallet_id AND t.spend_at_ms > r.after_ms AND t.spend_at_ms <= r.through_ms`,
    [ranges.map((r) => r.walletId), ranges.map((r) => String(r.afterMs)), ranges.map((r) => String(r.throughMs))]);
  for (const row of rows) leaving[Number(row.range) - 1]!.push({ atMs: Number(row.spend_at_ms), amount: row.amount });
  return leaving;
}

/**
 * The windows of several vaults as they stand at `atMs` (moved forward; nothing written): one
 * read of their rows and one of the spends leaving them, whatever the number of vaults.
 */
export async function spendWindowsOf(q: Queryable, walletIds: readonly string[], atMs: number): Promise<Map<string, SpendWindows>> {
  const rows = await q.query<SpendWindowsRow & { wallet_id: string }>(
    'SELECT * FROM spend_windows WHERE wallet_id = ANY($1::text[])', [walletIds]);
  const stored = new Map(rows.map((row) => [row.wallet_id, row]));
  const key = monthKey(atMs);
  const windows = new Map<string, SpendWindows>();
  const ranges: Array<LeavingRange & { window: 'day' | 'hour' }> = [];
  for (const walletId of new Set(walletIds)) {
    const row = stored.get(walletId);
    const day: WindowState = { sum: row?.day_sum ?? 0n, count: row?.day_count ?? 0, removedThroughMs: Number(row?.day_removed_through_ms ?? 0n) };
    const hour: WindowState = { sum: row?.hour_sum ?? 0n, count: row?.hour_count ?? 0, removedThroughMs: Number(row?.hour_removed_through_ms ?? 0n) };
    const month = row && row.month_key === key ? { key, sum: row.month_sum } : { key, sum: 0n };
    windows.set(walletId, { day, hour, month });
    for (const [window, state, windowMs] of [['day', day, DAY_MS], ['hour', hour, HOUR_MS]] as const) {
      const range = leavingRange(state, atMs, windowMs);
      if (range && state.count > 0) ranges.push({ walletId, window, ...range });
    }
  }
  const leaving = await leavingSpends(q, ranges);
  const byRange = new Map(ranges.map((r, i) => [`${r.walletId}/${r.window}`, leaving[i]!]));
  const leavingOf = (walletId: string, window: 'day' | 'hour'): Spend[] => byRange.get(`${walletId}/${window}`) ?? [];
  for (const [walletId, w] of windows) {
    windows.set(walletId, {
      day: slideWindow(w.day, atMs, DAY_MS, leavingOf(walletId, 'day')),
      hour: slideWindow(w.hour, atMs, HOUR_MS, leavingOf(walletId, 'hour')),
      month: w.month,
    });
  }
  return windows;
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
  const all = [...windows];
  const column = (pick: (w: SpendWindows) => bigint | number | string) => all.map(([, w]) => String(pick(w)));
  await tx.query(
    `INSERT INTO spend_windows (wallet_id, day_sum, day_count, day_removed_through_ms, hour_sum, hour_count,
       hour_removed_through_ms, month_key, month_sum)
     SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[], $4::bigint[], $5::bigint[], $6::int[], $7::bigint[], $8::text[], $9::bigint[])
     ON CONFLICT (wallet_id) DO UPDATE SET day_sum = excluded.day_sum, day_count = excluded.day_count,
       day_removed_through_ms = excluded.day_removed_through_ms, hour_sum = excluded.hour_sum, hour_count = excluded.hour_count,
       hour_removed_through_ms = excluded.hour_removed_through_ms, month_key = excluded.month_key, month_sum = excluded.month_sum`,
    [all.map(([walletId]) => walletId), column((w) => w.day.sum), column((w) => w.day.count), column((w) => w.day.removedThroughMs),
      column((w) => w.hour.sum), column((w) => w.hour.count), column((w) => w.hour.removedThroughMs),
      column((w) => w.month.key), column((w) => w.month.sum)]);
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
