/**
 * The policy engine: decides a payment against a policy and the vault's spend state at the
 * payment's time. Pure — no I/O, no clock — so every rule is unit- and property-tested.
 *
 * Rules are checked in DESIGN §6's order and the first failure is reported:
 * expiry, allowed_recipients, blocked_categories, max_per_tx, velocity_cap, max_per_day,
 * max_per_month. A payment above requireCoSign is not a violation: it needs an approval.
 * blocked_categories judges every category the recipient counts under (the caller reads them
 * from the directory) and reports the first one blocked.
 */
import { formatUsdc } from '../money/money.ts';
import type { PolicyRules } from '../policies/presets.ts';

export const HOUR_MS = 60 * 60 * 1000;
export const DAY_MS = 24 * HOUR_MS;

export type RuleName =
  | 'expiry' | 'allowed_recipients' | 'blocked_categories' | 'max_per_tx' | 'velocity_cap' | 'max_per_day' | 'max_per_month'
  // never returned by evaluate: a co-signature refused or not given in time blocks the payment
  | 'require_co_sign';

export interface Violation {
  rule: RuleName;
  /** decimal USDC for amounts, an integer for velocity_cap, ISO 8601 for expiry, text for lists */
  limit: string | number;
  attempted: string | number;
}

/**
 * What the vault has spent in each window ending at the payment's time:
 * the 24 hours before it, the 60 minutes before it (count), its UTC calendar month.
 */
export interface SpendState {
  daySpent: bigint;
  hourCount: number;
  monthSpent: bigint;
}

export interface PaymentIntent {
  amount: bigint;
  /** the recipient as the payer named it: a chain address or a domain */
  recipient: string;
  /** the resolved chain address, when the recipient was a domain */
  recipientAddress?: string | null;
  /** the category the payment is recorded under */
  category?: string | null;
  /**
   * every other category that applies to the recipient (each one the directory gives its
   * address): blocked_categories refuses the payment when any of these or `category` is listed
   */
  categories?: readonly string[];
  atMs: number;
}

export type Decision =
  | { allowed: true; requiresApproval: boolean }
  | { allowed: false; violation: Violation };

function normaliseRecipient(recipient: string): string {
  // Chain addresses are case-sensitive base58; domains are compared case-insensitively.
  return recipient.includes('.') ? recipient.toLowerCase() : recipient;
}

/**
 * The first of the payment's categories (`category`, then `categories` in their order) that the
 * rules block, lowercase, or null. Categories are codes compared case-insensitively.
 */
function blockedCategoryOf(rules: PolicyRules, payment: PaymentIntent): string | null {
  if (rules.blockedCategories.length === 0) return null;
  const blocked = new Set(rules.blockedCategories.map((category) => category.toLowerCase()));
  for (const category of [payment.category, ...(payment.categories ?? [])]) {
    if (category && blocked.has(category.toLowerCase())) return category.toLowerCase();
  }
  return null;
}

export function evaluate(rules: PolicyRules, spend: SpendState, payment: PaymentIntent): Decision {
  const deny = (violation: Violation): Decision => ({ allowed: false, violation });

  if (rules.expiry && payment.atMs >= rules.expiry.getTime()) {
    return deny({ rule: 'expiry', limit: rules.expiry.toISOString(), attempted: new Date(payment.atMs).toISOString() });
  }
  if (rules.allowedRecipients.length > 0) {
    const allowed = new Set(rules.allowedRecipients.map(normaliseRecipient));
    const named = normaliseRecipient(payment.recipient);
    const resolved = payment.recipientAddress ?? null;
    if (!allowed.has(named) && !(resolved !== null && allowed.has(resolved))) {
      return deny({ rule: 'allowed_recipients', limit: 'allowlist', attempted: payment.recipient });
    }
  }
  const blockedCategory = blockedCategoryOf(rules, payment);
  if (blockedCategory !== null) {
    return deny({ rule: 'blocked_categories', limit: rules.blockedCategories.join(','), attempted: blockedCategory });
  }
  if (rules.maxPerTx !== null && payment.amount > rules.maxPerTx) {
    return deny({ rule: 'max_per_tx', limit: formatUsdc(rules.maxPerTx), attempted: formatUsdc(payment.amount) });
  }
  if (rules.velocityCap !== null && spend.hourCount + 1 > rules.velocityCap) {
    return deny({ rule: 'velocity_cap', limit: rules.velocityCap, attempted: spend.hourCount + 1 });
  }
  if (rules.maxPerDay !== null && spend.daySpent + payment.amount > rules.maxPerDay) {
    return deny({ rule: 'max_per_day', limit: formatUsdc(rules.maxPerDay), attempted: formatUsdc(spend.daySpent + payment.amount) });
  }
  if (rules.maxPerMonth !== null && spend.monthSpent + payment.amount > rules.maxPerMonth) {
    return deny({ rule: 'max_per_month', limit: formatUsdc(rules.maxPerMonth), attempted: formatUsdc(spend.monthSpent + payment.amount) });
  }
  return { allowed: true, requiresApproval: rules.requireCoSign !== null && payment.amount > rules.requireCoSign };
}

export interface Budgets {
  /** null = no limit */
  perTx: bigint | null;
  day: { remaining: bigint | null; spent: bigint };
  month: { remaining: bigint | null; spent: bigint };
  hour: { remaining: number | null; count: number };
}

/** What is left in each window (for preflight checks and the wallet view). */
export function remainingBudgets(rules: PolicyRules, spend: SpendState): Budgets {
  const left = (limit: bigint | null, used: bigint) => (limit === null ? null : limit > used ? limit - used : 0n);
  return {
    perTx: rules.maxPerTx,
    day: { remaining: left(rules.maxPerDay, spend.daySpent), spent: spend.daySpent },
    month: { remaining: left(rules.maxPerMonth, spend.monthSpent), spent: spend.monthSpent },
    hour: {
      remaining: rules.velocityCap === null ? null : Math.max(0, rules.velocityCap - spend.hourCount),
      count: spend.hourCount,
    },
  };
}

/** `YYYY-MM` of an instant in UTC: the calendar month a spend counts in. */
export function monthKey(atMs: number): string {
  return new Date(atMs).toISOString().slice(0, 7);
}

/** The first instant of the UTC month after the one containing `atMs`. */
export function nextMonthStartMs(atMs: number): number {
  const at = new Date(atMs);
  return Date.UTC(at.getUTCFullYear(), at.getUTCMonth() + 1, 1);
}

export interface Spend {
  atMs: number;
  amount: bigint;
}

/**
 * A rolling window kept incrementally, so a busy vault's state costs O(1) amortised per
 * payment instead of a scan of the window: each spend is added once when made and removed
 * once when it leaves. A spend at exactly `windowMs` before the payment has left ("the 24
 * hours before the payment" excludes its first instant).
 */
export interface WindowState {
  sum: bigint;
  count: number;
  /** every spend at or before this instant has already been removed */
  removedThroughMs: number;
}

/** The spends that leave when the window moves to end at `atMs`: those in (removedThrough, atMs − windowMs]. */
export function leavingRange(state: WindowState, atMs: number, windowMs: number): { afterMs: number; throughMs: number } | null {
  const throughMs = atMs - windowMs;
  return throughMs > state.removedThroughMs ? { afterMs: state.removedThroughMs, throughMs } : null;
}

/** Moves the window to end at `atMs`, given the spends `leavingRange` named. */
export function slideWindow(state: WindowState, atMs: number, windowMs: number, leaving: readonly Spend[]): WindowState {
  const range = leavingRange(state, atMs, windowMs);
  if (!range) return state;
  let sum = 0n;
  for (const spend of leaving) {
    if (spend.atMs <= range.afterMs || spend.atMs > range.throughMs) throw new RangeError('a leaving spend outside the range');
    sum += spend.amount;
  }
  return slideWindowBy(state, atMs, windowMs, { sum, count: leaving.length });
}

/** `slideWindow` given the leaving spends' total and number (summed where they are stored). */
export function slideWindowBy(state: WindowState, atMs: number, windowMs: number, leaving: { sum: bigint; count: number }): WindowState {
  const range = leavingRange(state, atMs, windowMs);
  if (!range) return state;
  const sum = state.sum - leaving.sum;
  const count = state.count - leaving.count;
  if (sum < 0n || count < 0) throw new RangeError('window state went negative: spends were removed twice');
  return { sum, count, removedThroughMs: range.throughMs };
}

/** Adds a spend made at the window's end. */
export function addToWindow(state: WindowState, spend: Spend): WindowState {
  return { sum: state.sum + spend.amount, count: state.count + 1, removedThroughMs: state.removedThroughMs };
}

/** The reference definition: what a full scan would give (tests compare the two). */
export function scanWindow(spends: readonly Spend[], atMs: number, windowMs: number): { sum: bigint; count: number } {
  let sum = 0n;
  let count = 0;
  for (const spend of spends) {
    if (spend.atMs > atMs - windowMs && spend.atMs <= atMs) {
      sum += spend.amount;
      count += 1;
    }
  }
  return { sum, count };
}
