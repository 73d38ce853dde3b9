/**
 * The job catalogue: every background job of the service, in one visible list.
 */
import { expirePolicies, runWalletAutomation, scanAlerts } from '../automation/automation.ts';
import { RPC_CALL_TIMEOUT_MS } from '../chain/client.ts';
import { closeSettledEscrows } from '../escrow/close.ts';
import { resendEscrowMoves, tickEscrows } from '../escrow/escrows.ts';
import { maintainTables } from '../db/maintenance.ts';
import { deleteExpiredEvents } from '../events/events.ts';
import { buildDueExports, expireExports } from '../exports/exports.ts';
import { purgeExpiredKeys } from '../http/idempotency.ts';
import { detectDeposits } from '../organizations/deposit-detector.ts';
import { setUpPendingOrganizations } from '../organizations/organizations.ts';
import { closeDeletedPolicies } from '../policies/close.ts';
import { syncPendingPolicies } from '../policies/policies.ts';
import { expireApprovals } from '../payments/payments.ts';
import { reconcilePending } from '../transactions/settlement.ts';
import { syncPendingWallets } from '../wallets/wallets.ts';
import { dispatchWebhooks, expireDeliveryLog } from '../webhooks/delivery.ts';
import type { Job } from './runner.ts';

/** The one job every process runs, workers or not: the service clock re-read (test-clock advances). */
export const CLOCK_REFRESH_JOB = 'clock.refresh';

export const JOBS: readonly Job[] = [
  {
    name: CLOCK_REFRESH_JOB,
    intervalMs: 1_000,
    timeoutMs: 5_000,
    run: async (ctx) => {
      await ctx.clock.refresh();
      // A standalone local validator (`agent-vault validator`) keeps a clock of its own, which a
      // restart sets back by the time it was down: brought up to the service's again (it never
      // moves back), or escrow timeouts the service sees as due are refused as not yet expired.
      // Bounded as the client's calls are: a hung validator must not hold the clock's refresh.
      if (!ctx.validator && ctx.cheatcodes) {
        await ctx.cheatcodes.agentVault_setTime(ctx.clock.nowMs()).send({ abortSignal: AbortSignal.timeout(RPC_CALL_TIMEOUT_MS) });
      }
    },
  },
  {
    // Settles every pending chain transaction a request did not (crash, timeout, lost answer).
    name: 'transactions.reconcile',
    intervalMs: 2_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await reconcilePending(ctx); },
  },
  {
    // Blocks payments whose co-signature did not come in time.
    name: 'payments.expire_approvals',
    intervalMs: 5_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await expireApprovals(ctx); },
  },
  {
    // Brings vault accounts on chain to the wallets' state (creation, policy, freeze).
    name: 'wallets.sync',
    intervalMs: 2_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await syncPendingWallets(ctx); },
  },
  {
    // Sends again the escrow moves in flight the chain may not have (a release racing the
    // escrow's expiry among them): its own job, never held up by escrows.tick's waits.
    name: 'escrows.resend',
    intervalMs: 1_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await resendEscrowMoves(ctx); },
  },
  {
    // Refunds escrows past their timeout; settles disputes whose chain outcome no request saw.
    name: 'escrows.tick',
    intervalMs: 1_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await tickEscrows(ctx); },
  },
  {
    // Closes the chain accounts of settled escrows, their rent back to the operator key; after
    // escrows.tick, so a run of every job also closes what its refunds settled.
    name: 'escrows.close',
    intervalMs: 5_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await closeSettledEscrows(ctx); },
  },
  {
    // Closes the chain accounts of deleted policies nothing can need any more, their rent back to
    // the operator key (src/policies/close.ts). After the jobs whose work may hold a close back:
    // the reconciler, the wallets' sync, the escrows' moves.
    name: 'policies.close',
    intervalMs: 5_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await closeDeletedPolicies(ctx); },
  },
  {
    // A policy past its expiry freezes its vaults and writes policy.expired, once.
    name: 'policies.expire',
    intervalMs: 1_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await expirePolicies(ctx); },
  },
  {
    // Auto-topups and balance.low, once per crossing.
    name: 'wallets.automation',
    intervalMs: 1_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await runWalletAutomation(ctx); },
  },
  {
    // Inactivity and velocity-spike alerts.
    name: 'alerts.scan',
    intervalMs: 30_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await scanAlerts(ctx); },
  },
  {
    // The activity feed keeps 90 days. A run deletes for up to 20 s; every 5 minutes keeps up
    // with far more events a day than one PostgreSQL takes in.
    name: 'events.retention',
    intervalMs: 300_000,
    timeoutMs: 60_000,
    run: async (ctx) => { await deleteExpiredEvents(ctx.db, ctx.clock.nowMs()); },
  },
  {
    // Idempotency keys are kept 24 hours; then they go.
    name: 'idempotency.purge',
    intervalMs: 60_000,
    timeoutMs: 30_000,
    run: async (ctx) => { await purgeExpiredKeys(ctx.db, ctx.clock.nowMs()); },
  },
  { name: 'deposits.detect', intervalMs: 2_000, timeoutMs: 20_000, run: async (ctx) => { await detectDeposits(ctx); } },
  // Organisations still pending on chain (a setup that did not land): tried again, later and later.
  { name: 'organizations.setup', intervalMs: 5_000, timeoutMs: 60_000, run: async (ctx) => { await setUpPendingOrganizations(ctx); } },
  // Transaction exports: built in the background; files deleted when they expire (docs/exports.md).
  { name: 'exports.build', intervalMs: 1_000, timeoutMs: 30 * 60_000, run: async (ctx) => { await buildDueExports(ctx); } },
  { name: 'exports.expire', intervalMs: 60_000, timeoutMs: 60_000, run: async (ctx) => { await expireExports(ctx.db, ctx.clock.nowMs()); } },
  { name: 'policies.sync', intervalMs: 2_000, timeoutMs: 30_000, run: async (ctx) => { await syncPendingPolicies(ctx); } },
  // The webhook delivery log keeps 30 days; before the dispatcher, so a run of every job gives up
  // what is past it rather than sending it.
  { name: 'webhooks.retention', intervalMs: 60_000, timeoutMs: 30_000, run: async (ctx) => { await expireDeliveryLog(ctx.db, ctx.clock.nowMs()); } },
  // Statistics (and PGlite's dead rows) where no autovacuum keeps them (src/db/maintenance.ts).
  { name: 'db.maintain', intervalMs: 60_000, timeoutMs: 10 * 60_000, run: async (ctx) => { await maintainTables(ctx.db); } },
  // Webhook deliveries: streams of events and due attempts, claimed and sent (docs/webhooks.md); last,
  // so a run of every job (runOnce) also delivers the events the jobs before it wrote. A run claims
  // for 20 s, and a stream batch it claimed last can take 45 s more against slow endpoints.
  { name: 'webhooks.deliver', intervalMs: 500, timeoutMs: 90_000, run: async (ctx) => { await dispatchWebhooks(ctx); } },
];
