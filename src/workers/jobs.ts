/**
 * The job catalogue: every background job of the service, in one visible list.
 */
import { reconcilePending } from '../transactions/settlement.ts';
import { syncPendingWallets } from '../wallets/wallets.ts';
import type { Job } from './runner.ts';

export const JOBS: readonly Job[] = [
  {
    name: 'clock.refresh',
    intervalMs: 1_000,
    timeoutMs: 5_000,
    run: (ctx) => ctx.clock.refresh(),
  },
  {
    // Settles every pending chain transaction a request did not (crash, timeout, lost answer).
    name: 'transactions.reconcile',
    intervalMs: 2_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await reconcilePending(ctx); },
  },
  {
    // Brings vault accounts on chain to the wallets' state (creation, policy, freeze).
    name: 'wallets.sync',
    intervalMs: 2_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await syncPendingWallets(ctx); },
  },
];
