/**
 * The vault on chain ends as the wallet row says, however quickly the wallet's changes follow one
 * another and whichever process sends them (docs/wallets.md "The chain follows the database").
 * The real database and a real local validator throughout; the HTTP stack, except where a second
 * process's chain client is given to the use-case directly.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { address } from '@solana/kit';
import { ChainClient, type PreparedTransaction } from '../chain/client.ts';
import { quoteIdentifier, type Queryable } from '../db/database.ts';
import { insertApiKey } from '../organizations/organizations.ts';
import type { Service } from '../server.ts';
import { onDatabase, startTestService, type TestService } from '../../test/harness.ts';
import { unique } from '../../test/fixtures.ts';
import { startSharedChain } from '../../test/shared-chain.ts';
import { processClient, sameBlockhash } from '../../test/chain-processes.ts';
import { syncPendingWallets, updateWallet, type UpdateWalletInput } from './wallets.ts';

type Ctx = Service['ctx'];

async function rowOf(db: Queryable, walletId: string) {
  const [row] = await db.query<{ status: string; policy_id: string; chain_status: string; sync_holder: string | null }>(
    'SELECT status, policy_id, chain_status, sync_holder FROM wallets WHERE id = $1', [walletId]);
  return row!;
}

/**
 * Two processes, A and B, each with its own chain client (its own blockhash cache and signature
 * memory): A changes the wallet; B changes it back, then to A's state again, all within one
 * blockhash, so B's last vault update has the instructions of A's under the same blockhash.
 */
async function changeBackAndAgain(ctx: Ctx, orgId: string, walletId: string,
  there: UpdateWalletInput, back: UpdateWalletInput): Promise<void> {
  const a = { ...ctx, chain: processClient(ctx.chain) };
  const b = { ...ctx, chain: processClient(ctx.chain) };
  try {
    await sameBlockhash(a.chain, b.chain);
    await updateWallet(a, orgId, walletId, there);
    await updateWallet(b, orgId, walletId, back);
    await updateWallet(b, orgId, walletId, there);
  } finally {
    a.chain.close();
    b.chain.close();
  }
}

/** The service's memos (`agent-vault:…`) of the transactions that touched the vault, oldest first, as the SPL Memo program logged them. */
async function vaultMemos(chain: ChainClient, vault: string): Promise<string[]> {
  const signatures = await chain.rpc.getSignaturesForAddress(address(vault)).send();
  const memos: string[] = [];
  for (const { signature } of [...signatures].reverse()) {
    const tx = await chain.rpc.getTransaction(signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
    for (const line of tx?.meta?.logMessages ?? []) {
      const memo = /^Program log: (agent-vault:.*)$/.exec(line)?.[1];
      if (memo !== undefined) memos.push(memo);
    }
  }
  return memos;
}

/** Each of the vault's `count` updates carried its own memo `agent-vault:<wallet id>:<attempt>`. */
async function assertDistinctUpdateMemos(chain: ChainClient, wallet: { wallet_id: string; chain_address: string }, count: number) {
  const memos = await vaultMemos(chain, wallet.chain_address);
  assert.equal(memos.length, count, `one memo per vault update: ${JSON.stringify(memos)}`);
  assert.equal(new Set(memos).size, count, 'no two updates alike');
  for (const memo of memos) assert.ok(memo.startsWith(`agent-vault:${wallet.wallet_id}:`), memo);
}

describe('vault sync', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  async function newWallet(): Promise<{ wallet_id: string; chain_address: string }> {
    const response = await t.request('POST', '/v1/wallets', { body: { agentId: unique('agent'), label: 'Sync', policyId: 'pol_moderate' } });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    return response.body;
  }

  test('freeze, unfreeze, freeze as fast as requests go: the vault ends frozen, the wallet frozen and ready', async () => {
    const wallet = await newWallet();
    for (const status of ['frozen', 'active', 'frozen']) {
      const response = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status } });
      assert.equal(response.status, 200, JSON.stringify(response.body));
    }
    const { chain, db } = t.service.ctx;
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, true, 'frozen on chain');
    assert.deepEqual(await rowOf(db, wallet.wallet_id),
      { status: 'frozen', policy_id: 'pol_moderate', chain_status: 'ready', sync_holder: null });
  });

  // Two processes share the database and the chain; each remembers only its own signatures.
  // Without a per-attempt memo, B's second freeze was A's freeze byte for byte: the chain
  // answered with that old success and the vault stayed unfrozen under a wallet `frozen, ready`.
  test('two processes: freeze, unfreeze, freeze again within one blockhash leaves the vault frozen', async () => {
    const wallet = await newWallet();
    const { ctx } = t.service;
    await changeBackAndAgain(ctx, t.orgId, wallet.wallet_id, { status: 'frozen' }, { status: 'active' });
    assert.equal((await ctx.chain.getVault(address(wallet.chain_address)))!.frozen, true, 'frozen on chain');
    assert.deepEqual(await rowOf(ctx.db, wallet.wallet_id),
      { status: 'frozen', policy_id: 'pol_moderate', chain_status: 'ready', sync_holder: null });
    // Freeze, unfreeze, freeze: three transactions, B's freeze not A's again.
    await assertDistinctUpdateMemos(ctx.chain, wallet, 3);
  });

  // The same with policies: a vault left on the previous policy refuses every payment
  // (PolicyMismatch) while the wallet says it is in sync.
  test('two processes: policy P1 to P2, back to P1, to P2 again within one blockhash leaves the vault on P2', async () => {
    const wallet = await newWallet();
    const { ctx } = t.service;
    await changeBackAndAgain(ctx, t.orgId, wallet.wallet_id, { policyId: 'pol_conservative' }, { policyId: 'pol_moderate' });
    const vault = await ctx.chain.getVault(address(wallet.chain_address));
    assert.equal(vault!.policy, await ctx.chain.policyAddress(t.orgId, 'pol_conservative'), 'the vault is on P2');
    assert.deepEqual(await rowOf(ctx.db, wallet.wallet_id),
      { status: 'active', policy_id: 'pol_conservative', chain_status: 'ready', sync_holder: null });
    await assertDistinctUpdateMemos(ctx.chain, wallet, 3);
  });

  // The seam: the chain client's prepare hands back, for every send of one sync, a real signed
  // transaction the chain executed earlier, which is what a byte-for-byte repeat amounts to (the
  // validator answers its signature, and its outcome is the earlier success). Sending, waiting
  // and reading the vault are the real client's against the real validator.
  test('a sync told "success" by a transaction the chain ran earlier does not mark the wallet ready', async () => {
    const wallet = await newWallet();
    const { chain, db } = t.service.ctx;
    const prepare = chain.prepare;
    let firstFreeze: PreparedTransaction | null = null;
    try {
      chain.prepare = async (...args: Parameters<typeof prepare>) => (firstFreeze = await prepare.apply(chain, args));
      assert.equal((await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } })).status, 200);
      chain.prepare = prepare;
      assert.equal((await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'active' } })).status, 200);
      assert.ok(firstFreeze, 'the first freeze was prepared');
      chain.prepare = async () => firstFreeze!;
      const again = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } });
      assert.equal(again.status, 200);
      assert.equal(again.body.status, 'frozen', 'the database decided');
    } finally {
      chain.prepare = prepare;
    }
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, false, 'the old outcome changed nothing on chain');
    assert.deepEqual(await rowOf(db, wallet.wallet_id),
      { status: 'frozen', policy_id: 'pol_moderate', chain_status: 'pending', sync_holder: null },
      'left pending, its lease released, for the wallets.sync job');
    // A vault that still disagrees after the sync's last pass is a failed sync: the job tries
    // again a second later (migration 0029), not at once.
    const [backedOff] = await db.query<{ sync_failures: number }>('SELECT sync_failures FROM wallets WHERE id = $1', [wallet.wallet_id]);
    assert.equal(backedOff!.sync_failures, 1);
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 1 } })).status, 200);
    await syncPendingWallets(t.service.ctx);
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, true, 'the job froze it');
    assert.equal((await rowOf(db, wallet.wallet_id)).chain_status, 'ready');
  });
});

// Two services, as two processes, on one PostgreSQL schema and one chain (test/shared-chain.ts).
test('two services on one database and chain: freeze, unfreeze, freeze again leaves the vault frozen', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has one process per data dir)');
    return;
  }
  const chain = await startSharedChain();
  const schema = `t_${randomBytes(6).toString('hex')}`;
  const dirs = [0, 1, 2].map(() => mkdtempSync(join(tmpdir(), 'av-vault-sync-')));
  const services: Service[] = [];
  try {
    await onDatabase(databaseUrl, `CREATE SCHEMA ${quoteIdentifier(schema)}`);
    // The first sets up the organisation and the wallet; A and B start after it, with nothing
    // cached, so that both can hold the same blockhash.
    for (const dataDir of dirs) services.push(await chain.start({ databaseUrl, schema, dataDir }));
    const [setup, a, b] = services as [Service, Service, Service];
    const orgId = setup.defaultOrgId;
    const { key } = await insertApiKey(setup.ctx.db, setup.ctx.clock.nowMs(), orgId, 'admin', 'vault sync test');
    const created = await setup.app.inject({
      method: 'POST', url: '/v1/wallets', headers: { authorization: `Bearer ${key}` },
      payload: { agentId: unique('agent'), label: 'Sync', policyId: 'pol_moderate' },
    });
    assert.equal(created.statusCode, 200, created.body);
    const wallet = created.json() as { wallet_id: string; chain_address: string };
    const patch = async (service: Service, status: string) => {
      const response = await service.app.inject({
        method: 'PATCH', url: `/v1/wallets/${wallet.wallet_id}`, headers: { authorization: `Bearer ${key}` }, payload: { status },
      });
      assert.equal(response.statusCode, 200, response.body);
    };
    await sameBlockhash(a.ctx.chain, b.ctx.chain);
    await patch(a, 'frozen');
    await patch(b, 'active');
    await patch(b, 'frozen');
    assert.equal((await setup.ctx.chain.getVault(address(wallet.chain_address)))!.frozen, true, 'frozen on chain');
    assert.deepEqual(await rowOf(setup.ctx.db, wallet.wallet_id),
      { status: 'frozen', policy_id: 'pol_moderate', chain_status: 'ready', sync_holder: null });
    await assertDistinctUpdateMemos(setup.ctx.chain, wallet, 3);
  } finally {
    for (const service of services) await service.close();
    await onDatabase(databaseUrl, `DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
    await chain.close();
  }
});
