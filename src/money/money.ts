/**
 * USDC amounts: integers of micro-USDC (6 decimals) as bigint, never floats.
 * Input is a positive decimal string with at most 6 fractional digits; output has at least
 * two fractional digits ("0.00", "12.50", "0.000001").
 */
export const MICRO_PER_USDC = 1_000_000n;
/**
 * The largest amount the service takes: amounts and balances are stored as PostgreSQL BIGINT
 * (signed 64-bit), below the chain's u64. Anything larger is malformed input, not a 500.
 */
export const MAX_MICRO_USDC = 0x7fff_ffff_ffff_ffffn;
/** The longest amount text that can parse: 14 whole digits, a point and 6 decimals. */
export const AMOUNT_TEXT_MAX = 21;

const AMOUNT = /^(0|[1-9]\d{0,13})(\.\d{1,6})?$/;

/** Parses a decimal USDC string to micro-USDC; null when malformed (the caller names the error). */
export function parseUsdc(text: unknown, { allowZero = false } = {}): bigint | null {
  if (typeof text !== 'string') return null;
  const match = AMOUNT.exec(text);
  if (!match) return null;
  const whole = BigInt(match[1]!);
  const fraction = (match[2] ?? '.').slice(1).padEnd(6, '0');
  const micro = whole * MICRO_PER_USDC + BigInt(fraction);
  if (micro === 0n && !allowZero) return null;
  if (micro > MAX_MICRO_USDC) return null;
  return micro;
}

export function formatUsdc(micro: bigint): string {
  const negative = micro < 0n;
  const absolute = negative ? -micro : micro;
  const whole = absolute / MICRO_PER_USDC;
  let fraction = (absolute % MICRO_PER_USDC).toString().padStart(6, '0').replace(/0+$/, '');
  if (fraction.length < 2) fraction = fraction.padEnd(2, '0');
  return `${negative ? '-' : ''}${whole}.${fraction}`;
}
