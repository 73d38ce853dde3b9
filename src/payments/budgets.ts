/**
 * What a vault may still spend: per window, what was spent, what remains and when room frees
 * up. Agents read it from the wallet and from a preflight check before they pay.
 */
import { Type } from 'typebox';
import type { Queryable } from '../db/database.ts';
import { formatUsdc } from '../money/money.ts';
import type { PolicyRules } from '../policies/presets.ts';
import { DAY_MS, HOUR_MS, nextMonthStartMs, remainingBudgets } from './policy-engine.ts';
import { spendStateOf, spendWindowsAt, type SpendWindows } from './spend-state.ts';

const AmountOrNull = Type.Union([Type.String(), Type.Null()]);
const TimeOrNull = Type.Union([Type.String(), Type.Null()]);

export const SpendingView = Type.Object({
  max_per_tx: AmountOrNull,
  day: Type.Object({
    limit: AmountOrNull, spent: Type.String(), remaining: AmountOrNull,
    frees_at: Type.Union([Type.String(), Type.Null()], { description: 'when the oldest spend of the last 24 h stops counting' }),
  }),
  month: Type.Object({ limit: AmountOrNull, spent: Type.String(), remaining: AmountOrNull, resets_at: Type.String() }),
  hour: Type.Object({
    limit: Type.Union([Type.Integer(), Type.Null()]), count: Type.Integer(), remaining: Type.Union([Type.Integer(), Type.Null()]),
    frees_at: TimeOrNull,
  }),
});

async function oldestSpendSince(q: Queryable, walletId: string, afterMs: number): Promise<number | null> {
  const [row] = await q.query<{ oldest: bigint | null }>(
    'SELECT MIN(spend_at_ms) AS oldest FROM transactions WHERE wallet_id = $1 AND spend_at_ms > $2', [walletId, afterMs]);
  return row?.oldest === null || row?.oldest === undefined ? null : Number(row.oldest);
}

/** `read`: the windows at `nowMs` when the caller has them already. */
export async function spendingOf(q: Queryable, walletId: string, rules: PolicyRules, nowMs: number, read?: SpendWindows) {
  const windows = read ?? await spendWindowsAt(q, walletId, nowMs);
  const budgets = remainingBudgets(rules, spendStateOf(windows));
  const amount = (value: bigint | null) => (value === null ? null : formatUsdc(value));
  const dayOldest = windows.day.count ? await oldestSpendSince(q, walletId, nowMs - DAY_MS) : null;
  const hourOldest = windows.hour.count ? await oldestSpendSince(q, walletId, nowMs - HOUR_MS) : null;
  return {
    max_per_tx: amount(rules.maxPerTx),
    day: {
      limit: amount(rules.maxPerDay), spent: formatUsdc(budgets.day.spent), remaining: amount(budgets.day.remaining),
      frees_at: dayOldest === null ? null : new Date(dayOldest + DAY_MS).toISOString(),
    },
    month: {
      limit: amount(rules.maxPerMonth), spent: formatUsdc(budgets.month.spent), remaining: amount(budgets.month.remaining),
      resets_at: new Date(nextMonthStartMs(nowMs)).toISOString(),
    },
    hour: {
      limit: rules.velocityCap, count: budgets.hour.count, remaining: budgets.hour.remaining,
      frees_at: hourOldest === null ? null : new Date(hourOldest + HOUR_MS).toISOString(),
    },
  };
}
