/**
 * The four preset policies every organisation has, with fixed ids. Immutable: clone one to
 * change it. Values in micro-USDC; null = no limit. Documented in docs/policies.md.
 */
import { NO_LIMIT, type PolicyLimits } from '../chain/program.ts';

export interface PolicyRules {
  maxPerTx: bigint | null;
  maxPerDay: bigint | null;
  maxPerMonth: bigint | null;
  velocityCap: number | null;
  allowedRecipients: string[];
  blockedCategories: string[];
  requireCoSign: bigint | null;
  expiry: Date | null;
}

const USDC = 1_000_000n;

export const PRESETS: ReadonlyArray<{ id: string; name: string; rules: PolicyRules }> = [
  {
    id: 'pol_conservative', name: 'Conservative',
    rules: { maxPerTx: 10n * USDC, maxPerDay: 100n * USDC, maxPerMonth: 1_000n * USDC, velocityCap: 10,
      allowedRecipients: [], blockedCategories: [], requireCoSign: null, expiry: null },
  },
  {
    id: 'pol_moderate', name: 'Moderate',
    rules: { maxPerTx: 100n * USDC, maxPerDay: 1_000n * USDC, maxPerMonth: 10_000n * USDC, velocityCap: 60,
      allowedRecipients: [], blockedCategories: [], requireCoSign: null, expiry: null },
  },
  {
    id: 'pol_permissive', name: 'Permissive',
    rules: { maxPerTx: 1_000n * USDC, maxPerDay: 10_000n * USDC, maxPerMonth: 100_000n * USDC, velocityCap: 600,
      allowedRecipients: [], blockedCategories: [], requireCoSign: null, expiry: null },
  },
  {
    id: 'pol_locked', name: 'Locked',
    rules: { maxPerTx: 0n, maxPerDay: 0n, maxPerMonth: 0n, velocityCap: 0,
      allowedRecipients: [], blockedCategories: [], requireCoSign: null, expiry: null },
  },
];

export const PRESET_IDS: ReadonlySet<string> = new Set(PRESETS.map((preset) => preset.id));

/** What the on-chain policy account enforces of a policy's rules. */
export function chainLimitsOf(rules: Pick<PolicyRules, 'maxPerTx' | 'maxPerDay' | 'expiry'>): PolicyLimits {
  return {
    maxPerTx: rules.maxPerTx ?? NO_LIMIT,
    maxPerDay: rules.maxPerDay ?? NO_LIMIT,
    expiry: rules.expiry ? BigInt(Math.floor(rules.expiry.getTime() / 1000)) : 0n,
  };
}
