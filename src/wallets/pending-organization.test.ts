/**
 * An organisation not set up on chain (`chain_status = 'pending'`: its setup never landed, or
 * another key made its reserve first; docs/operations.md "An organisation stays pending") gets
 * no vault and moves no money: each such request is refused with 503 `service_unavailable`
 * before anything is written or sent. The real HTTP stack, database and validator; the only
 * seam is the chain client given to the organisation's creation, whose sends all fail.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address } from '@solana/kit';
import type { ChainClient } from '../chain/client.ts';
import { runWalletAutomation } from '../automation/automation.ts';
import { newId } from '../ids/ids.ts';
import { bootstrapOrganizations, createOrganization } from '../organizations/organizations.ts';
import { PRESETS, chainLimitsOf } from '../policies/presets.ts';
import { startTestService, type TestResponse, type TestService } from '../../test/harness.ts';
import { unfundedChain as unfundedChainOf, unique, withAnotherKey } from '../../test/fixtures.ts';
import { syncWalletToChain } from './wallets.ts';

describe('an organisation not set up on chain', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ workers: false }); });
  after(async () => { await t.close(); });

  const unfundedChain = (): ChainClient => unfundedChainOf(t.service.ctx.chain);

  /** A new organisation whose setup on chain failed: `pending`, its admin key shown all the same. */
  async function pendingOrganization(name: string): Promise<{ orgId: string; key: string }> {
    let shown: { orgId: string; key: string } | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name, onCreated: (orgId, key) => { shown = { orgId, key: key.key }; },
    }), /cannot pay the fee/);
    const created = shown as { orgId: string; key: string } | null;
    assert.ok(created);
    return created;
  }

  function assertNotSetUp(response: TestResponse): void {
    assert.equal(response.status, 503, JSON.stringify(response.body));
    assert.equal(response.body.error.code, 'service_unavailable');
    assert.match(response.body.error.message, /organisation is not set up on chain yet/);
    assert.match(response.body.error.message, /An organisation stays pending/);
  }

  async function countOf(sql: string, params: unknown[]): Promise<number> {
    return (await t.service.ctx.db.query<{ n: number }>(sql, params))[0]!.n;
  }

  // Before, the wallet row was committed, the request answered 503 "retry the same request", and
  // no retry could ever help: the program creates a vault only under a reserve of the operator's.
  test('creating a wallet is refused before anything is written, and succeeds once the organisation is set up', async () => {
    const { orgId, key } = await pendingOrganization('Setup failed');
    const body = { agentId: unique('agent'), label: 'Agent', policyId: 'pol_moderate', idempotencyKey: unique('create') };
    const events = await countOf('SELECT count(*)::int AS n FROM events WHERE org_id = $1', [orgId]);

    assertNotSetUp(await t.request('POST', '/v1/wallets', { key, body }));
    assert.equal(await countOf('SELECT count(*)::int AS n FROM wallets WHERE org_id = $1', [orgId]), 0, 'no wallet row');
    assert.equal(await countOf('SELECT count(*)::int AS n FROM events WHERE org_id = $1', [orgId]), events, 'no event');
    assert.equal(await countOf(`SELECT count(*)::int AS n FROM idempotency_keys WHERE org_id = $1 AND state = 'done'`, [orgId]), 0,
      'the refusal is not kept under its idempotency key');
    const { vault } = await t.service.ctx.chain.vaultAddresses(orgId, body.agentId);
    assert.equal(await t.service.ctx.chain.getAccountData(vault), null, 'nothing sent');

    // The next start sets the organisation up; the same request then creates the wallet.
    const failures: string[] = [];
    await bootstrapOrganizations(t.service.ctx, null, { onPendingFailed: (id) => failures.push(id) });
    assert.ok(!failures.includes(orgId));
    const created = await t.request('POST', '/v1/wallets', { key, body });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    assert.ok(await t.service.ctx.chain.getVault(address(created.body.chain_address)), 'its vault is on chain');
  });

  // Another key made the reserve, a preset policy and a vault at the organisation's addresses
  // first: it is their authority, so the program refuses every move the service's operator key
  // signs. Before, the service adopted that vault (wallet created, `ready`), and a funding from the
  // reserve (a test deposit had indexed its balance) was recorded, sent and refused on chain.
  test('a reserve another key made first: no wallet, and no funding, batch funding, withdrawal or auto-topup is recorded or sent', async () => {
    const { orgId, key } = await pendingOrganization('Squatted');
    const { ctx } = t.service;
    const agentId = unique('agent');
    await withAnotherKey(ctx.chain, async (theirs) => {
      const moderate = PRESETS.find((preset) => preset.id === 'pol_moderate')!;
      const setUp = await theirs.execute([await theirs.initReserveIx(orgId), await theirs.setPolicyIx(orgId, moderate.id, chainLimitsOf(moderate.rules))]);
      assert.equal(setUp.err, null);
      assert.equal((await theirs.execute([await theirs.createVaultIx(orgId, agentId, moderate.id)])).err, null);
    });
    // Nothing points at the reserve the squatter controls: neither its address nor its token
    // account is shown, and no test deposit is minted into it.
    const shown = (await t.request('GET', '/v1/organization', { key })).body.reserve;
    assert.deepEqual([shown.chain_address, shown.token_account], [null, null]);
    assertNotSetUp(await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount: '10' } }));
    // A balance indexed all the same (one sent there from outside before the squatter was known).
    await ctx.db.query('UPDATE organizations SET reserve_balance = 10000000 WHERE id = $1', [orgId]);

    assertNotSetUp(await t.request('POST', '/v1/wallets', { key, body: { agentId, label: 'Agent', policyId: 'pol_moderate' } }));
    assert.equal(await countOf('SELECT count(*)::int AS n FROM wallets WHERE org_id = $1', [orgId]), 0, 'the squatter\'s vault is not adopted');

    // A wallet the service made before it refused this (its sync found the vault as it asks and
    // marked it created): the row that creation wrote, then the sync's own work.
    const nowMs = ctx.clock.nowMs();
    const walletId = newId('wal', nowMs);
    const { vault, vaultToken } = await ctx.chain.vaultAddresses(orgId, agentId);
    await ctx.db.query(
      `INSERT INTO wallets (id, org_id, agent_id, label, policy_id, tags, status, chain_address, token_address, created_at, updated_at)
       VALUES ($1, $2, $3, 'Agent', 'pol_moderate', '{}', 'active', $4, $5, $6, $6)`,
      [walletId, orgId, agentId, vault, vaultToken, new Date(nowMs)]);
    assert.equal(await syncWalletToChain(ctx, orgId, walletId), true);
    const auto = await t.request('PUT', `/v1/wallets/${walletId}/auto-topup`, { key, body: { enabled: true, triggerBelow: '1', topupAmount: '2' } });
    assert.equal(auto.status, 200, JSON.stringify(auto.body));

    assertNotSetUp(await t.request('POST', `/v1/wallets/${walletId}/fund`, { key, body: { amount: '5', idempotencyKey: unique('fund') } }));
    assertNotSetUp(await t.request('POST', '/v1/wallets/fund-batch', { key, body: { allocations: [{ walletId, amount: '5' }] } }));
    assertNotSetUp(await t.request('POST', `/v1/wallets/${walletId}/withdraw`, { key, body: { amount: 'all' } }));
    await runWalletAutomation(ctx);

    assert.equal(await countOf('SELECT count(*)::int AS n FROM transactions WHERE org_id = $1', [orgId]), 0, 'no move recorded');
    assert.equal(await countOf(`SELECT count(*)::int AS n FROM idempotency_keys WHERE org_id = $1 AND state = 'done'`, [orgId]), 0);
    const [row] = await ctx.db.query<{ reserve_balance: bigint; balance: bigint; topup_fired_at: Date | null }>(
      `SELECT o.reserve_balance, w.balance, w.topup_fired_at FROM organizations o JOIN wallets w ON w.org_id = o.id WHERE w.id = $1`, [walletId]);
    assert.deepEqual(row, { reserve_balance: 10_000_000n, balance: 0n, topup_fired_at: null });
    // Nothing sent: the vault's only transactions are the squatter's creation (and its token account's).
    assert.equal((await ctx.chain.rpc.getSignaturesForAddress(vault).send()).length, 1);
  });
});
