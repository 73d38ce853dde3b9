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

/**
 * How long after a policy's expiry the program starts refusing its vaults' spends. The service
 * refuses from the expiry itself, and freezes the vaults then; a payment it decided a moment
 * before executes later (the next slot; on a cluster, as long as its blockhash lives), and must
 * not be refused on chain for a rule it was decided under (docs/policies.md).
 */
export const CHAIN_EXPIRY_GRACE_SECONDS = 120;

/** What the on-chain policy account enforces of a policy's rules. */
export function chainLimitsOf(rules: Pick<PolicyRules, 'maxPerTx' | 'maxPerDay' | 'expiry'>): PolicyLimits {
  return {
    maxPerTx: rules.maxPerTx ?? NO_LIMIT,
    maxPerDay: rules.maxPerDay ?? NO_LIMIT,
    // The chain counts whole seconds: rounded up, never before the service's expiry.
    expiry: rules.expiry ? BigInt(Math.ceil(rules.expiry.getTime() / 1000) + CHAIN_EXPIRY_GRACE_SECONDS) : 0n,
  };
}
