import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import type { PolicyRules } from '../policies/presets.ts';
import {
  DAY_MS, HOUR_MS, addToWindow, evaluate, leavingRange, monthKey, nextMonthStartMs, remainingBudgets, scanWindow,
  slideWindow, type Spend, type SpendState, type WindowState,
} from './policy-engine.ts';

const USDC = 1_000_000n;
const OPEN: PolicyRules = {
  maxPerTx: null, maxPerDay: null, maxPerMonth: null, velocityCap: null,
  allowedRecipients: [], blockedCategories: [], requireCoSign: null, expiry: null,
};
const NOTHING_SPENT: SpendState = { daySpent: 0n, hourCount: 0, monthSpent: 0n };
const AT = Date.parse('2026-05-31T23:59:59.500Z');
const ADDRESS = '9xQeWvG816bUx9EPjHmaT23yvVM2ZWbrrpZb9PusVFin';

function pay(amount: bigint, extra: Partial<Parameters<typeof evaluate>[2]> = {}) {
  return { amount, recipient: ADDRESS, atMs: AT, ...extra };
}

describe('policy engine: each rule', () => {
  test('an open policy allows anything and needs no approval', () => {
    assert.deepEqual(evaluate(OPEN, NOTHING_SPENT, pay(10n ** 15n)), { allowed: true, requiresApproval: false });
  });

  test('expiry: at or after the expiry instant every payment is refused', () => {
    const rules = { ...OPEN, expiry: new Date(AT) };
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n)), {
      allowed: false, violation: { rule: 'expiry', limit: new Date(AT).toISOString(), attempted: new Date(AT).toISOString() },
    });
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n, { atMs: AT - 1 })).allowed, true);
  });

  test('allowed_recipients: an empty list allows anyone; otherwise only listed names or resolved addresses', () => {
    const rules = { ...OPEN, allowedRecipients: ['api.openai.com', ADDRESS] };
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n)).allowed, true);
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n, { recipient: 'API.OpenAI.com' })).allowed, true, 'domains ignore case');
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n, { recipient: 'other.example', recipientAddress: ADDRESS })).allowed, true);
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { recipient: 'evil.example' })), {
      allowed: false, violation: { rule: 'allowed_recipients', limit: 'allowlist', attempted: 'evil.example' },
    });
  });

  test('blocked_categories: a listed category is refused', () => {
    const rules = { ...OPEN, blockedCategories: ['gambling', 'adult'] };
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'gambling' })), {
      allowed: false, violation: { rule: 'blocked_categories', limit: 'gambling,adult', attempted: 'gambling' },
    });
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'compute' })).allowed, true);
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n)).allowed, true, 'no category, nothing to block');
  });

  // Guarantee (docs/recipients.md): a payment is judged by every category its address counts
  // under, so naming it by another domain (or the bare address) dodges none of them.
  test('blocked_categories: every category of the recipient is judged, and the first blocked one is reported', () => {
    const rules = { ...OPEN, blockedCategories: ['gambling', 'adult'] };
    const blocked = (attempted: string) => ({
      allowed: false, violation: { rule: 'blocked_categories', limit: 'gambling,adult', attempted },
    });
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'shopping', categories: ['shopping', 'gambling'] })), blocked('gambling'),
      'another entry of the address is blocked: the payment is');
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: null, categories: ['gambling'] })), blocked('gambling'),
      'categories alone are judged');
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { categories: ['food', 'adult', 'gambling'] })), blocked('adult'),
      'the first blocked one in their order');
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'gambling', categories: ['adult'] })), blocked('gambling'),
      'the recorded category comes first');
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'Food', categories: ['ADULT'] })), blocked('adult'),
      'codes compare case-insensitively and are reported lowercase');
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, { category: 'gambling', categories: ['gambling', 'gambling'] })), blocked('gambling'),
      'repeats change nothing');
    for (const payment of [{ category: 'food', categories: ['food', 'compute'] }, { category: null, categories: [] }, { categories: ['', 'food'] }]) {
      assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(1n, payment)), { allowed: true, requiresApproval: false }, JSON.stringify(payment));
    }
    assert.equal(evaluate(OPEN, NOTHING_SPENT, pay(1n, { category: 'gambling', categories: ['adult'] })).allowed, true, 'an empty list blocks nothing');
  });

  test('blocked_categories keeps its place in the order: after allowed_recipients, before max_per_tx, whichever category is blocked', () => {
    const rules = { ...OPEN, allowedRecipients: ['only.example'], blockedCategories: ['gambling'], maxPerTx: 1n };
    const ruleOf = (categories: string[], recipient = 'only.example') => {
      const decision = evaluate(rules, NOTHING_SPENT, pay(5n, { recipient, category: 'food', categories }));
      return decision.allowed ? null : decision.violation.rule;
    };
    assert.equal(ruleOf(['gambling'], 'evil.example'), 'allowed_recipients');
    assert.equal(ruleOf(['food', 'gambling']), 'blocked_categories');
    assert.equal(ruleOf(['food']), 'max_per_tx');
  });

  test('max_per_tx: the limit itself passes, one micro-USDC more does not', () => {
    const rules = { ...OPEN, maxPerTx: 10n * USDC };
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(10n * USDC)).allowed, true);
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(10n * USDC + 1n)), {
      allowed: false, violation: { rule: 'max_per_tx', limit: '10.00', attempted: '10.000001' },
    });
  });

  test('velocity_cap counts this payment: at the cap, the next one is refused', () => {
    const rules = { ...OPEN, velocityCap: 3 };
    assert.equal(evaluate(rules, { ...NOTHING_SPENT, hourCount: 2 }, pay(1n)).allowed, true);
    assert.deepEqual(evaluate(rules, { ...NOTHING_SPENT, hourCount: 3 }, pay(1n)), {
      allowed: false, violation: { rule: 'velocity_cap', limit: 3, attempted: 4 },
    });
  });

  test('max_per_day and max_per_month report the total the payment would reach', () => {
    const rules = { ...OPEN, maxPerDay: 100n * USDC, maxPerMonth: 150n * USDC };
    assert.deepEqual(evaluate(rules, { ...NOTHING_SPENT, daySpent: 95n * USDC }, pay(6n * USDC)), {
      allowed: false, violation: { rule: 'max_per_day', limit: '100.00', attempted: '101.00' },
    });
    assert.equal(evaluate(rules, { ...NOTHING_SPENT, daySpent: 95n * USDC }, pay(5n * USDC)).allowed, true);
    assert.deepEqual(evaluate(rules, { ...NOTHING_SPENT, monthSpent: 149n * USDC }, pay(2n * USDC)), {
      allowed: false, violation: { rule: 'max_per_month', limit: '150.00', attempted: '151.00' },
    });
  });

  test('a zero limit refuses everything (the locked preset)', () => {
    const rules = { ...OPEN, maxPerTx: 0n };
    assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n)).allowed, false);
  });

  test('requireCoSign: above the threshold the payment is allowed but needs an approval', () => {
    const rules = { ...OPEN, requireCoSign: 50n * USDC };
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(50n * USDC)), { allowed: true, requiresApproval: false });
    assert.deepEqual(evaluate(rules, NOTHING_SPENT, pay(50n * USDC + 1n)), { allowed: true, requiresApproval: true });
  });

  test('the first failing rule in DESIGN order is the one reported', () => {
    const everything: PolicyRules = {
      maxPerTx: 1n, maxPerDay: 1n, maxPerMonth: 1n, velocityCap: 0, allowedRecipients: ['only.example'],
      blockedCategories: ['x'], requireCoSign: null, expiry: new Date(AT - 1),
    };
    const spent: SpendState = { daySpent: 10n, hourCount: 10, monthSpent: 10n };
    const order = ['expiry', 'allowed_recipients', 'blocked_categories', 'max_per_tx', 'velocity_cap', 'max_per_day', 'max_per_month'];
    let rules = everything;
    const relax: Array<(r: PolicyRules) => PolicyRules> = [
      (r) => ({ ...r, expiry: null }), (r) => ({ ...r, allowedRecipients: [] }), (r) => ({ ...r, blockedCategories: [] }),
      (r) => ({ ...r, maxPerTx: null }), (r) => ({ ...r, velocityCap: null }), (r) => ({ ...r, maxPerDay: null }),
      (r) => ({ ...r, maxPerMonth: null }),
    ];
    for (const [index, rule] of order.entries()) {
      const decision = evaluate(rules, spent, pay(5n, { category: 'x' }));
      assert.equal(decision.allowed, false);
      assert.equal(!decision.allowed && decision.violation.rule, rule);
      rules = relax[index]!(rules);
    }
    assert.equal(evaluate(rules, spent, pay(5n, { category: 'x' })).allowed, true);
  });

  test('remaining budgets never go below zero and say null for no limit', () => {
    const budgets = remainingBudgets({ ...OPEN, maxPerDay: 10n, velocityCap: 2 }, { daySpent: 12n, hourCount: 5, monthSpent: 0n });
    assert.equal(budgets.day.remaining, 0n);
    assert.equal(budgets.hour.remaining, 0);
    assert.equal(budgets.month.remaining, null);
    assert.equal(budgets.perTx, null);
  });
});

describe('policy engine: properties', () => {
  const limit = fc.option(fc.bigInt({ min: 0n, max: 10n ** 12n }), { nil: null });
  const rulesArb = fc.record({
    maxPerTx: limit, maxPerDay: limit, maxPerMonth: limit,
    velocityCap: fc.option(fc.integer({ min: 0, max: 100 }), { nil: null }),
  }).map((r): PolicyRules => ({ ...OPEN, ...r }));
  const spendArb = fc.record({
    daySpent: fc.bigInt({ min: 0n, max: 10n ** 12n }),
    hourCount: fc.integer({ min: 0, max: 200 }),
    monthSpent: fc.bigInt({ min: 0n, max: 10n ** 12n }),
  });

  test('it never accepts an amount that would exceed any limit', () => {
    fc.assert(fc.property(rulesArb, spendArb, fc.bigInt({ min: 1n, max: 10n ** 12n }), (rules, spend, amount) => {
      const decision = evaluate(rules, spend, pay(amount));
      if (!decision.allowed) return;
      if (rules.maxPerTx !== null) assert.ok(amount <= rules.maxPerTx);
      if (rules.maxPerDay !== null) assert.ok(spend.daySpent + amount <= rules.maxPerDay);
      if (rules.maxPerMonth !== null) assert.ok(spend.monthSpent + amount <= rules.maxPerMonth);
      if (rules.velocityCap !== null) assert.ok(spend.hourCount + 1 <= rules.velocityCap);
    }), { numRuns: 2_000 });
  });

  test('it accepts every amount that fits every limit', () => {
    fc.assert(fc.property(rulesArb, spendArb, fc.bigInt({ min: 1n, max: 10n ** 12n }), (rules, spend, amount) => {
      const fits = (rules.maxPerTx === null || amount <= rules.maxPerTx)
        && (rules.maxPerDay === null || spend.daySpent + amount <= rules.maxPerDay)
        && (rules.maxPerMonth === null || spend.monthSpent + amount <= rules.maxPerMonth)
        && (rules.velocityCap === null || spend.hourCount + 1 <= rules.velocityCap);
      assert.equal(evaluate(rules, spend, pay(amount)).allowed, fits);
    }), { numRuns: 2_000 });
  });

  test('blocked_categories refuses exactly when some category is listed, names the first listed one, whatever their order', () => {
    const code = fc.constantFrom('gambling', 'adult', 'food', 'compute', 'shopping', 'Gambling', 'FOOD');
    fc.assert(fc.property(fc.uniqueArray(fc.constantFrom<string>('gambling', 'adult', 'food'), { maxLength: 3 }), fc.option(code, { nil: null }),
      fc.array(code, { maxLength: 6 }), (blockedCategories, category, categories) => {
        const rules = { ...OPEN, blockedCategories };
        const all = [category, ...categories].flatMap((c) => (c === null ? [] : [c.toLowerCase()]));
        const firstBlocked = all.find((c) => blockedCategories.includes(c));
        const decision = evaluate(rules, NOTHING_SPENT, pay(1n, { category, categories }));
        if (firstBlocked === undefined) {
          assert.equal(decision.allowed, true);
        } else {
          assert.deepEqual(decision, {
            allowed: false, violation: { rule: 'blocked_categories', limit: blockedCategories.join(','), attempted: firstBlocked },
          });
        }
        // Whether it passes depends on the set of categories, not on their order.
        assert.equal(evaluate(rules, NOTHING_SPENT, pay(1n, { category, categories: [...categories].reverse() })).allowed, decision.allowed);
      }), { numRuns: 2_000 });
  });

  test('the incremental rolling window equals a full scan at every payment, edges included', () => {
    // Gaps include exact window lengths, so spends land exactly on the window's edge.
    const gapArb = fc.oneof(fc.constantFrom(0, 1, DAY_MS, DAY_MS - 1, DAY_MS + 1, HOUR_MS), fc.integer({ min: 0, max: 2 * DAY_MS }));
    fc.assert(fc.property(fc.array(fc.tuple(gapArb, fc.bigInt({ min: 1n, max: 1_000n })), { minLength: 1, maxLength: 60 }),
      fc.constantFrom(DAY_MS, HOUR_MS), (steps, windowMs) => {
        const spends: Spend[] = [];
        let state: WindowState = { sum: 0n, count: 0, removedThroughMs: -Infinity };
        let atMs = AT;
        for (const [gap, amount] of steps) {
          atMs += gap;
          const range = leavingRange(state, atMs, windowMs);
          const leaving = range ? spends.filter((s) => s.atMs > range.afterMs && s.atMs <= range.throughMs) : [];
          state = slideWindow(state, atMs, windowMs, leaving);
          const scanned = scanWindow(spends, atMs, windowMs);
          assert.equal(state.sum, scanned.sum);
          assert.equal(state.count, scanned.count);
          const spend = { atMs, amount };
          spends.push(spend);
          state = addToWindow(state, spend);
        }
      }), { numRuns: 500 });
  });

  test('a spend exactly 24 hours before the payment no longer counts; one a millisecond later does', () => {
    const spends: Spend[] = [{ atMs: AT, amount: 5n }];
    assert.equal(scanWindow(spends, AT + DAY_MS, DAY_MS).sum, 0n);
    assert.equal(scanWindow(spends, AT + DAY_MS - 1, DAY_MS).sum, 5n);
  });

  test('calendar months roll over in UTC, whatever the local time zone', () => {
    const zone = process.env.TZ;
    // The process's zone far east and far west of UTC, where a local-time month would differ.
    for (const tz of ['Pacific/Kiritimati', 'America/Los_Angeles', 'UTC']) {
      process.env.TZ = tz;
      try {
        assert.equal(monthKey(Date.parse('2026-05-31T23:59:59.999Z')), '2026-05', tz);
        assert.equal(monthKey(Date.parse('2026-06-01T00:00:00.000Z')), '2026-06', tz);
        assert.equal(monthKey(Date.parse('2026-05-31T23:30:00-05:00')), '2026-06', tz);
        assert.equal(nextMonthStartMs(Date.parse('2026-12-15T10:00:00Z')), Date.parse('2027-01-01T00:00:00Z'), tz);
        fc.assert(fc.property(fc.integer({ min: 0, max: 4_102_444_800_000 }), (ms) => {
          assert.ok(nextMonthStartMs(ms) > ms);
          assert.notEqual(monthKey(nextMonthStartMs(ms)), monthKey(ms));
          assert.equal(monthKey(nextMonthStartMs(ms) - 1), monthKey(ms));
          assert.equal(new Date(nextMonthStartMs(ms)).getUTCDate(), 1, 'a month starts on the 1st, UTC');
        }), { numRuns: 200 });
      } finally {
        if (zone === undefined) delete process.env.TZ;
        else process.env.TZ = zone;
      }
    }
  });
});
