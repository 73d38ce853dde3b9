/**
 * The wallets.sync job backs off per wallet (migration 0029, docs/wallets.md "The chain follows
 * the database"): a sync the chain refuses is tried again after 1 s, 2 s, 4 s, … at most an hour,
 * so wallets the chain keeps refusing never hold up another wallet's sync; a user's change tries
 * at once whatever the back-off; a sync that lands clears it.
 *
 * The refusals are real: vaults of an organisation whose setup on chain never landed (rows such
 * an organisation was given before its wallets were refused), which the program refuses to
 * create without the organisation's reserve. The real database, validator and job function.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Writable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { address } from '@solana/kit';
import pino from 'pino';
import { encodeBase58 } from '../chain/base58.ts';
import type { ChainClient } from '../chain/client.ts';
import { newId } from '../ids/ids.ts';
import { bootstrapOrganizations, createOrganization } from '../organizations/organizations.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { unfundedChain as unfundedChainOf, unique } from '../../test/fixtures.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';
import { syncPendingWallets, syncRetryDelayMs, syncWalletToChain } from './wallets.ts';

interface SyncState {
  id: string;
  chain_status: string;
  sync_failures: number;
  sync_retry_at: Date | null;
}

describe('the wallets.sync back-off', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ workers: false }); });
  after(async () => { await t.close(); });

  const unfundedChain = (): ChainClient => unfundedChainOf(t.service.ctx.chain);

  async function pendingOrganization(): Promise<string> {
    let orgId: string | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name: 'Setup failed', onCreated: (id) => { orgId = id; },
    }), /cannot pay the fee/);
    assert.ok(orgId);
    return orgId;
  }

  /** `count` wallets of `orgId` waiting for their vault since `sinceMs`, as the earlier createWallet left them. */
  async function unprovisionedWallets(orgId: string, count: number, sinceMs: number): Promise<string[]> {
    const { ctx } = t.service;
    const ids: string[] = [];
    for (let i = 0; i < count; i += 1) {
      const agentId = unique('refused');
      const { vault, vaultToken } = await ctx.chain.vaultAddresses(orgId, agentId);
      const id = newId('wal', sinceMs);
      await ctx.db.query(
        `INSERT INTO wallets (id, org_id, agent_id, label, policy_id, tags, status, chain_address, token_address, created_at, updated_at)
         VALUES ($1, $2, $3, 'Refused', 'pol_moderate', '{}', 'active', $4, $5, $6, $6)`,
        [id, orgId, agentId, vault, vaultToken, new Date(sinceMs)]);
      ids.push(id);
    }
    return ids;
  }

  async function statesOf(ids: string[]): Promise<Map<string, SyncState>> {
    const rows = await t.service.ctx.db.query<SyncState>(
      'SELECT id, chain_status, sync_failures, sync_retry_at FROM wallets WHERE id = ANY($1)', [ids]);
    return new Map(rows.map((row) => [row.id, row]));
  }

  test('the retry delay doubles from 1 s and stops at an hour', () => {
    assert.deepEqual([1, 2, 3, 4, 5, 12, 13, 40, 1_000].map(syncRetryDelayMs),
      [1_000, 2_000, 4_000, 8_000, 16_000, 2_048_000, 3_600_000, 3_600_000, 3_600_000]);
  });

  // Before, the job took `ORDER BY updated_at LIMIT 50` on every run and a refusal changed
  // nothing it looked at: 51 wallets the chain keeps refusing held every place of every batch,
  // and no other wallet (another organisation's here) synced again.
  test('51 wallets the chain keeps refusing do not hold up a healthy pending wallet; their retry times grow', async () => {
    const { ctx } = t.service;
    const orgId = await pendingOrganization();
    const refused = await unprovisionedWallets(orgId, 51, ctx.clock.nowMs() - 60_000);
    const created = await t.request('POST', '/v1/wallets', { body: { agentId: unique('healthy'), label: 'Healthy', policyId: 'pol_moderate' } });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    const healthy = created.body as { wallet_id: string; chain_address: string };
    // As if the process died between committing a freeze and sending it to the chain.
    await ctx.db.query(`UPDATE wallets SET status = 'frozen', chain_status = 'pending', updated_at = $2 WHERE id = $1`,
      [healthy.wallet_id, new Date(ctx.clock.nowMs())]);

    const firstRunStartMs = ctx.clock.nowMs();
    await syncPendingWallets(ctx);
    const firstRunEndMs = ctx.clock.nowMs();
    const first = await statesOf(refused);
    await syncPendingWallets(ctx);
    assert.equal((await statesOf([healthy.wallet_id])).get(healthy.wallet_id)!.chain_status, 'ready', 'the healthy wallet synced');
    assert.equal((await ctx.chain.getVault(address(healthy.chain_address)))!.frozen, true, 'its vault is frozen on chain');

    // The first run took the 50 oldest; each is tried again a second after its refusal.
    const tried = [...first.values()].filter((state) => state.sync_failures > 0);
    assert.equal(tried.length, 50);
    for (const state of tried) {
      assert.equal(state.sync_failures, 1);
      const retryAtMs = state.sync_retry_at!.getTime();
      assert.ok(retryAtMs >= firstRunStartMs + 1_000 && retryAtMs <= firstRunEndMs + 1_000, `${state.id}: retry 1 s after its refusal`);
    }
    const second = await statesOf(refused);
    for (const state of second.values()) assert.equal(state.chain_status, 'pending');

    // Every one of them is due again: each is tried once more, and its next try waits longer.
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 10 } });
    const againStartMs = ctx.clock.nowMs();
    await syncPendingWallets(ctx);
    await syncPendingWallets(ctx);
    const againEndMs = ctx.clock.nowMs();
    const third = await statesOf(refused);
    for (const [id, state] of third) {
      const before = second.get(id)!;
      assert.ok(state.sync_failures > before.sync_failures, `${id}: ${before.sync_failures} then ${state.sync_failures} failures`);
      const delayMs = syncRetryDelayMs(state.sync_failures);
      assert.ok(delayMs >= 2 * syncRetryDelayMs(before.sync_failures));
      const failedAtMs = state.sync_retry_at!.getTime() - delayMs;
      assert.ok(failedAtMs >= againStartMs && failedAtMs <= againEndMs, `${id}: retry ${delayMs} ms after its failure`);
    }
  });

  test('a user\'s change tries at once whatever the back-off; a sync that lands clears it; a warning from the fifth failure on', async () => {
    const { ctx } = t.service;
    const orgId = await pendingOrganization();
    const [walletId] = await unprovisionedWallets(orgId, 1, ctx.clock.nowMs());
    const warnings: Array<{ failures: number }> = [];
    const log = pino({ level: 'warn' }, new Writable({
      write(chunk: Buffer, _encoding, done) { warnings.push(JSON.parse(chunk.toString()) as { failures: number }); done(); },
    }));
    for (let failures = 1; failures <= 5; failures += 1) {
      await assert.rejects(syncWalletToChain({ ...ctx, log }, orgId, walletId!), /creating vault .* failed/);
      const state = (await statesOf([walletId!])).get(walletId!)!;
      assert.equal(state.sync_failures, failures);
      assert.deepEqual(warnings.map((warning) => warning.failures), failures < 5 ? [] : [5]);
    }
    const backedOff = (await statesOf([walletId!])).get(walletId!)!;
    assert.ok(backedOff.sync_retry_at!.getTime() > ctx.clock.nowMs() + 10_000, 'the job waits 16 s');
    await syncPendingWallets(ctx);
    assert.equal((await statesOf([walletId!])).get(walletId!)!.sync_failures, 5, 'not the job\'s to try yet');

    // The organisation is set up by the next start; the user's freeze then syncs at once.
    await bootstrapOrganizations(ctx, null, { onPendingFailed: () => {} });
    const key = await t.createKey('admin', orgId);
    const frozen = await t.request('PATCH', `/v1/wallets/${walletId}`, { key, body: { status: 'frozen' } });
    assert.equal(frozen.status, 200, JSON.stringify(frozen.body));
    const state = (await statesOf([walletId!])).get(walletId!)!;
    assert.deepEqual(state, { id: walletId, chain_status: 'ready', sync_failures: 0, sync_retry_at: null });
    assert.equal((await ctx.chain.getVault(address(frozen.body.chain_address)))!.frozen, true);
  });

  test('a user\'s change made while a failing sync holds the wallet is taken by the job once that lease lapses, not after the back-off', async () => {
    const { ctx } = t.service;
    const orgId = await pendingOrganization();
    const [walletId] = await unprovisionedWallets(orgId, 1, ctx.clock.nowMs());
    await bootstrapOrganizations(ctx, null, { onPendingFailed: () => {} });
    // Twelve failures behind it (a chain outage): retried in half an hour; a sync of it still
    // holds the wallet (its lease, 90 s).
    await ctx.db.query(`UPDATE wallets SET sync_failures = 12, sync_retry_at = $2, sync_holder = 'another-process', sync_lease_until = $3
      WHERE id = $1`, [walletId, new Date(ctx.clock.nowMs() + 1_800_000), new Date(ctx.clock.nowMs() + 90_000)]);
    const key = await t.createKey('admin', orgId);
    const frozen = await t.request('PATCH', `/v1/wallets/${walletId}`, { key, body: { status: 'frozen' } });
    assert.equal(frozen.status, 200, JSON.stringify(frozen.body));
    assert.equal((await statesOf([walletId!])).get(walletId!)!.chain_status, 'pending', 'the held wallet is left to the job');
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 91 } })).status, 200);
    await syncPendingWallets(ctx);
    assert.deepEqual((await statesOf([walletId!])).get(walletId!)!, { id: walletId, chain_status: 'ready', sync_failures: 0, sync_retry_at: null });
    assert.equal((await ctx.chain.getVault(address(frozen.body.chain_address)))!.frozen, true);
  });

  test('a sync whose lease lapsed is not taken over while a vault update it sent can still land', async () => {
    const { ctx } = t.service;
    const wallet = (await t.request('POST', '/v1/wallets', { body: { agentId: unique('held'), label: 'Held', policyId: 'pol_moderate' } })).body;
    // Another process's sync sent an update and died; its lease has lapsed (a test clock moved
    // forward, or slots longer than 400 ms), but the chain is not past the update's last valid height.
    const height = await ctx.chain.getBlockHeight();
    const sent = encodeBase58(randomBytes(64)); // its update, which the chain has not seen (yet)
    const heldBy = async (validHeight: bigint) => ctx.db.query(
      `UPDATE wallets SET status = 'frozen', chain_status = 'pending', sync_holder = 'died', sync_lease_until = $2,
         sync_signature = $3, sync_valid_height = $4 WHERE id = $1`, [wallet.wallet_id, new Date(ctx.clock.nowMs() - 1), sent, validHeight]);
    await heldBy(height + 100n);
    assert.equal(await syncWalletToChain(ctx, t.orgId, wallet.wallet_id), false, 'left to the update that may land');
    assert.equal((await statesOf([wallet.wallet_id])).get(wallet.wallet_id)!.chain_status, 'pending');
    await syncPendingWallets(ctx);
    assert.equal((await statesOf([wallet.wallet_id])).get(wallet.wallet_id)!.chain_status, 'pending', 'nor by the job');
    // Past its last valid height and the reconciler's margin: it can no longer land.
    await heldBy(height - EXPIRY_MARGIN_BLOCKS - 1n);
    assert.equal(await syncWalletToChain(ctx, t.orgId, wallet.wallet_id), true);
    assert.equal((await statesOf([wallet.wallet_id])).get(wallet.wallet_id)!.chain_status, 'ready');
    assert.equal((await ctx.chain.getVault(address(wallet.chain_address)))!.frozen, true);
  });

  test('a run with a slow chain starts no sync past its time budget; the next run takes the rest', async () => {
    const { ctx } = t.service;
    const ids: string[] = [];
    for (let i = 0; i < 3; i += 1) {
      const created = await t.request('POST', '/v1/wallets', { body: { agentId: unique('slow-sync'), label: 'Slow', policyId: 'pol_moderate' } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      ids.push(created.body.wallet_id);
    }
    // Frozen by a writer that died before syncing (the job's to finish).
    await ctx.db.query(`UPDATE wallets SET status = 'frozen', chain_status = 'pending' WHERE id = ANY($1)`, [ids]);
    // Each vault update takes 300 ms to send.
    const { submit } = ctx.chain;
    ctx.chain.submit = async (...args: Parameters<typeof submit>) => {
      await new Promise((resolve) => setTimeout(resolve, 300));
      return submit.apply(ctx.chain, args);
    };
    try {
      assert.ok(await syncPendingWallets(ctx, { runBudgetMs: 100 }) <= 1, 'one sync (this suite\'s other wallets may come first), then the budget is spent');
    } finally {
      ctx.chain.submit = submit;
    }
    const pending = async () => [...(await statesOf(ids)).values()].filter((state) => state.chain_status === 'pending').length;
    assert.ok(await pending() >= 2, 'at most one of these synced in the run');
    await syncPendingWallets(ctx);
    assert.equal(await pending(), 0, 'the next run takes the rest');
  });
});
