/**
 * For the tests of the jobs that close chain accounts (escrows.close, policies.close: both send
 * through src/chain/account-close.ts, which reads which accounts are still open after its claim).
 */
import type { ChainClient } from '../src/chain/client.ts';

/**
 * Holds the next run of the job when it reads the chain, after its claim, until another run
 * reads the chain too (a run that took the same records) or `release` is called.
 */
export function holdFirstRead(chain: ChainClient) {
  const getProgramOwned = chain.getProgramOwned;
  let reached!: () => void;
  const firstReached = new Promise<void>((resolve) => { reached = resolve; });
  let release!: () => void;
  const held = new Promise<void>((resolve) => { release = resolve; });
  let reads = 0;
  chain.getProgramOwned = async (accounts) => {
    reads += 1;
    if (reads === 1) {
      reached();
      await held;
    } else {
      release();
    }
    return getProgramOwned.call(chain, accounts);
  };
  return {
    firstReached,
    release: () => release(),
    restore: () => {
      chain.getProgramOwned = getProgramOwned;
      release();
    },
  };
}
