/**
 * How long a job waits before it tries again something that keeps failing (a wallet's chain
 * sync, an escrow's refused refund, an organisation's setup): `firstMs` after the first failure,
 * twice as long after each next one, at most `maxMs`.
 */
export function backoffMs(failures: number, firstMs: number, maxMs: number): number {
  return Math.min(maxMs, firstMs * 2 ** Math.min(30, Math.max(0, failures - 1)));
}
