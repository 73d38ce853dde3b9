/**
 * Wallets through the real HTTP stack, the real database and the embedded validator.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address } from '@solana/kit';
import { fundedWallet, newPolicy, newRecipient } from '../../test/fixtures.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { syncPendingWallets } from './wallets.ts';

let agentCounter = 0;
const nextAgent = () => `agent-${process.pid}-${(agentCounter += 1)}`;

async function createWallet(t: TestService, body: Record<string, unknown> = {}, key?: string) {
  const response = await t.request('POST', '/v1/wallets', {
    key, body: { agentId: nextAgent(), label: 'Research agent', policyId: 'pol_moderate', ...body },
  });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

async function eventsOf(t: TestService, walletId: string, type: string) {
  return t.service.ctx.db.query<{ severity: string; payload: Record<string, unknown> }>(
    'SELECT severity, payload FROM events WHERE wallet_id = $1 AND type = $2 ORDER BY id', [walletId, type]);
}

describe('wallets', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('creating a wallet provisions its vault on chain at the derived address, with its policy', async () => {
    const agentId = nextAgent();
    const wallet = await createWallet(t, { agentId, tags: ['research', 'eu'] });
    assert.match(wallet.wallet_id, /^wal_/);
    assert.equal(wallet.agent_id, agentId);
    assert.equal(wallet.usdc_balance, '0.00');
    assert.equal(wallet.status, 'active');
    assert.deepEqual(wallet.tags, ['eu', 'research']);
    assert.deepEqual(wallet.policy, {
      policy_id: 'pol_moderate', name: 'Moderate', max_per_tx: '100.00', max_per_day: '1000.00', max_per_month: '10000.00',
    });
    const { chain } = t.service.ctx;
    const { vault } = await chain.vaultAddresses(t.orgId, agentId);
    assert.equal(wallet.chain_address, vault);
    const onChain = await chain.getVault(address(wallet.chain_address));
    assert.ok(onChain, 'the vault account exists');
    assert.equal(onChain.policy, await chain.policyAddress(t.orgId, 'pol_moderate'));
    assert.equal(onChain.frozen, false);
    const created = await eventsOf(t, wallet.wallet_id, 'wallet.created');
    assert.equal(created.length, 1);
    assert.equal(created[0]!.payload.chain_address, wallet.chain_address);
    assert.equal(created[0]!.severity, 'info');
  });

  test('snake_case fields of the getting-started examples are accepted', async () => {
    const response = await t.request('POST', '/v1/wallets', {
      body: { agent_id: nextAgent(), label: 'snake', policy_id: 'pol_conservative', owner_org: t.orgId },
    });
    assert.equal(response.status, 200);
    assert.equal(response.body.policy.policy_id, 'pol_conservative');
  });

  test('an agent id is unique in the organisation and never reused', async () => {
    const agentId = nextAgent();
    await createWallet(t, { agentId });
    const again = await t.request('POST', '/v1/wallets', { body: { agentId, label: 'other', policyId: 'pol_moderate' } });
    assert.equal(again.status, 409);
    assert.equal(again.body.error.code, 'wallet_agent_id_conflict');
  });

  test('the same agent\'s vault asked for by several requests at once, without an idempotency key: one creates it, the others are told it exists', async () => {
    const agentId = nextAgent();
    const answers = await Promise.all(Array.from({ length: 5 }, () =>
      t.request('POST', '/v1/wallets', { body: { agentId, label: 'Research agent', policyId: 'pol_moderate' } })));
    assert.deepEqual(answers.map((a) => a.status).sort(), [200, 409, 409, 409, 409], JSON.stringify(answers.map((a) => a.body)));
    for (const refused of answers.filter((a) => a.status === 409)) {
      assert.equal(refused.body.error.code, 'wallet_agent_id_conflict');
      assert.equal(refused.body.error.param, 'agent_id');
    }
    const rows = await t.service.ctx.db.query<{ id: string }>('SELECT id FROM wallets WHERE agent_id = $1', [agentId]);
    assert.deepEqual(rows.map((r) => r.id), [answers.find((a) => a.status === 200)!.body.wallet_id]);
  });

  test('a creation answered 503 (its vault not created on chain) is resumed by the same request sent again, not by another one', async () => {
    const agentId = nextAgent();
    const body = { agentId, label: 'Research agent', policyId: 'pol_moderate' };
    const chain = t.service.ctx.chain;
    const { submit, waitForOutcome } = chain;
    // The chain refuses the vault's creation once: the request answers 503 and its wallet row stays.
    chain.submit = async () => { chain.submit = submit; };
    chain.waitForOutcome = async (signature) => {
      chain.waitForOutcome = waitForOutcome;
      return { signature, slot: 0n, err: { instructionIndex: 0, code: 1, name: 'RefusedForTheTest', raw: null } };
    };
    let first;
    try {
      first = await t.request('POST', '/v1/wallets', { body });
    } finally {
      chain.submit = submit;
      chain.waitForOutcome = waitForOutcome;
    }
    assert.equal(first.status, 503, JSON.stringify(first.body));
    assert.equal(first.body.error.code, 'service_unavailable');
    const other = await t.request('POST', '/v1/wallets', { body: { ...body, label: 'Another agent' } });
    assert.equal(other.body.error.code, 'wallet_agent_id_conflict', 'other parameters are another request');
    const again = await t.request('POST', '/v1/wallets', { body });
    assert.equal(again.status, 200, JSON.stringify(again.body));
    assert.ok(await t.service.ctx.chain.getVault(address(again.body.chain_address)), 'its vault is on chain');
    const rows = await t.service.ctx.db.query<{ id: string }>('SELECT id FROM wallets WHERE agent_id = $1', [agentId]);
    assert.deepEqual(rows.map((r) => r.id), [again.body.wallet_id], 'the same wallet, resumed');
    assert.equal((await t.request('POST', '/v1/wallets', { body })).body.error.code, 'wallet_agent_id_conflict', 'once created, a conflict');
  });

  test('bad input is refused with the field named, and creates nothing', async () => {
    const before = await t.service.ctx.db.query<{ n: bigint }>('SELECT count(*)::bigint AS n FROM wallets');
    const cases: Array<[Record<string, unknown>, number, string, string]> = [
      [{ agentId: 'has space', label: 'x', policyId: 'pol_moderate' }, 400, 'invalid_request', 'agent_id'],
      [{ agentId: nextAgent(), policyId: 'pol_moderate' }, 400, 'invalid_request', 'label'],
      [{ agentId: nextAgent(), label: 'x', policyId: 'pol_moderate', colour: 'red' }, 400, 'invalid_request', 'colour'],
      [{ agentId: nextAgent(), label: 'x', policyId: 'pol_nope' }, 404, 'policy_not_found', 'policy_id'],
      [{ agentId: nextAgent(), label: 'x', policyId: 'pol_moderate', tags: ['a,b'] }, 400, 'invalid_request', 'tags.0'],
      [{ agentId: nextAgent(), label: 'x', policyId: 'pol_moderate', owner_org: 'org_other' }, 400, 'invalid_request', 'owner_org'],
    ];
    for (const [body, status, code, param] of cases) {
      const response = await t.request('POST', '/v1/wallets', { body });
      assert.equal(response.status, status, JSON.stringify(body));
      assert.equal(response.body.error.code, code);
      assert.equal(response.body.error.param, param);
    }
    const afterCount = await t.service.ctx.db.query<{ n: bigint }>('SELECT count(*)::bigint AS n FROM wallets');
    assert.equal(afterCount[0]!.n, before[0]!.n);
  });

  test('creation is idempotent: a replay returns the same wallet, other parameters conflict', async () => {
    const body = { agentId: nextAgent(), label: 'Idem', policyId: 'pol_moderate', idempotencyKey: `create-${nextAgent()}` };
    const first = await t.request('POST', '/v1/wallets', { body });
    const replay = await t.request('POST', '/v1/wallets', { body });
    assert.equal(first.status, 200);
    assert.equal(replay.status, 200);
    assert.equal(replay.body.wallet_id, first.body.wallet_id);
    assert.equal(replay.headers['idempotency-replayed'], 'true');
    const conflict = await t.request('POST', '/v1/wallets', { body: { ...body, label: 'Other' } });
    assert.equal(conflict.status, 409);
    assert.equal(conflict.body.error.code, 'idempotency_conflict');
    // Tags are a set: another order, a repeat, or [] for none name the same wallet.
    const tagged = { agentId: nextAgent(), label: 'Tagged', policyId: 'pol_moderate', tags: ['b', 'a'], idempotencyKey: `create-${nextAgent()}` };
    const made = await t.request('POST', '/v1/wallets', { body: tagged });
    assert.equal(made.status, 200, JSON.stringify(made.body));
    const reordered = await t.request('POST', '/v1/wallets', { body: { ...tagged, tags: ['a', 'b', 'a'] } });
    assert.deepEqual([reordered.status, reordered.body.wallet_id, reordered.headers['idempotency-replayed']], [200, made.body.wallet_id, 'true']);
    const empty = await t.request('POST', '/v1/wallets', { body: { ...body, tags: [] } });
    assert.deepEqual([empty.status, empty.body.wallet_id], [200, first.body.wallet_id]);
  });

  test('roles: a viewer reads but cannot create; another organisation sees 404', async () => {
    const wallet = await createWallet(t);
    const viewer = await t.createKey('viewer');
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`, { key: viewer })).status, 200);
    const refused = await t.request('POST', '/v1/wallets', { key: viewer, body: { agentId: nextAgent(), label: 'x', policyId: 'pol_moderate' } });
    assert.equal(refused.status, 403);
    assert.equal(refused.body.error.code, 'insufficient_permissions');
    const other = await t.createOrganization();
    for (const [method, url, body] of [
      ['GET', `/v1/wallets/${wallet.wallet_id}`, undefined],
      ['PATCH', `/v1/wallets/${wallet.wallet_id}`, { label: 'stolen' }],
      ['DELETE', `/v1/wallets/${wallet.wallet_id}`, undefined],
      ['POST', `/v1/wallets/${wallet.wallet_id}/rotate-token`, {}],
    ] as const) {
      const response = await t.request(method, url, { key: other.adminKey, body });
      assert.equal(response.status, 404, `${method} ${url}`);
      assert.equal(response.body.error.code, 'wallet_not_found');
    }
    const missing = await t.request('GET', '/v1/wallets/wal_doesnotexist');
    assert.equal(missing.status, 404);
  });

  test('list: tags match all, status filters, keyset pagination newest first', async () => {
    const tag = `batch${agentCounter}`;
    const a = await createWallet(t, { tags: [tag, 'x'] });
    const b = await createWallet(t, { tags: [tag] });
    const c = await createWallet(t, { tags: [tag, 'x'] });
    const both = await t.request('GET', `/v1/wallets?tags=${tag},x`);
    assert.deepEqual(both.body.data.map((w: { wallet_id: string }) => w.wallet_id), [c.wallet_id, a.wallet_id]);
    const page1 = await t.request('GET', `/v1/wallets?tags=${tag}&limit=2`);
    assert.equal(page1.body.has_more, true);
    assert.deepEqual(page1.body.data.map((w: { wallet_id: string }) => w.wallet_id), [c.wallet_id, b.wallet_id]);
    const page2 = await t.request('GET', `/v1/wallets?tags=${tag}&limit=2&cursor=${page1.body.next_cursor}`);
    assert.deepEqual(page2.body.data.map((w: { wallet_id: string }) => w.wallet_id), [a.wallet_id]);
    assert.equal(page2.body.has_more, false);
    assert.equal(page2.body.next_cursor, null);
    await t.request('PATCH', `/v1/wallets/${b.wallet_id}`, { body: { status: 'frozen' } });
    const frozen = await t.request('GET', `/v1/wallets?status=frozen&tags=${tag}`);
    assert.deepEqual(frozen.body.data.map((w: { wallet_id: string }) => w.wallet_id), [b.wallet_id]);
    assert.equal((await t.request('GET', '/v1/wallets?limit=101')).body.error.code, 'invalid_request');
    assert.equal((await t.request('GET', '/v1/wallets?status=sleeping')).status, 400);
  });

  test('freeze and unfreeze reach the vault on chain and write their events', async () => {
    const wallet = await createWallet(t);
    const frozen = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } });
    assert.equal(frozen.status, 200);
    assert.equal(frozen.body.status, 'frozen');
    const { chain } = t.service.ctx;
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, true);
    const frozenEvents = await eventsOf(t, wallet.wallet_id, 'wallet.frozen');
    assert.equal(frozenEvents.length, 1);
    assert.equal(frozenEvents[0]!.severity, 'critical');
    const active = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'active' } });
    assert.equal(active.body.status, 'active');
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, false);
    assert.equal((await eventsOf(t, wallet.wallet_id, 'wallet.unfrozen')).length, 1);
  });

  test('attaching another policy changes the vault\'s policy account on chain; label and tags change too', async () => {
    const wallet = await createWallet(t);
    const updated = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, {
      body: { policyId: 'pol_conservative', label: 'Renamed', tags: ['b', 'a'] },
    });
    assert.equal(updated.status, 200);
    assert.equal(updated.body.policy.policy_id, 'pol_conservative');
    assert.equal(updated.body.label, 'Renamed');
    assert.deepEqual(updated.body.tags, ['a', 'b']);
    assert.ok(Date.parse(updated.body.updated_at) >= Date.parse(wallet.updated_at), 'updated_at moves forward');
    const { chain } = t.service.ctx;
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.policy, await chain.policyAddress(t.orgId, 'pol_conservative'));
    const bad = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'archived' } });
    assert.equal(bad.status, 400);
    const empty = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: {} });
    assert.equal(empty.status, 400);
    const unknownPolicy = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { policyId: 'pol_missing' } });
    assert.equal(unknownPolicy.body.error.code, 'policy_not_found');
  });

  test('a vault whose chain state lags is finished by the wallets.sync job', async () => {
    const wallet = await createWallet(t);
    // As if the process died between committing a freeze and sending it to the chain.
    await t.service.ctx.db.query(`UPDATE wallets SET status = 'frozen', chain_status = 'pending' WHERE id = $1`, [wallet.wallet_id]);
    await t.service.jobs.runOnce();
    assert.equal((await t.service.ctx.chain.getVault(address(wallet.chain_address)))!.frozen, true);
    const [row] = await t.service.ctx.db.query<{ chain_status: string }>('SELECT chain_status FROM wallets WHERE id = $1', [wallet.wallet_id]);
    assert.equal(row!.chain_status, 'ready');
  });

  test('a freeze whose chain write is slow and an unfreeze meanwhile: the vault ends as the wallet says, one sync at a time', async () => {
    // Also with both changes in one millisecond (two requests at once, or two processes whose
    // clocks agree): they share an updated_at, which must not pass for "nothing changed".
    for (const sameMillisecond of [false, true]) await freezeWhileUnfreezing(sameMillisecond);
  });

  async function freezeWhileUnfreezing(sameMillisecond: boolean): Promise<void> {
    const wallet = await createWallet(t);
    const { chain, db, clock } = t.service.ctx;
    const { nowMs } = clock;
    if (sameMillisecond) {
      const pinned = clock.nowMs();
      clock.nowMs = () => pinned;
    }
    const submit = chain.submit;
    let letFreezeLand!: () => void;
    const freezeHeld = new Promise<void>((resolve) => { letFreezeLand = resolve; });
    let calls = 0;
    // The freeze's transaction is slow to land (a far RPC node, a cluster's confirmation).
    chain.submit = async (...args: Parameters<typeof submit>) => {
      calls += 1;
      if (calls === 1) await freezeHeld;
      return submit.apply(chain, args);
    };
    try {
      const freeze = t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } });
      while (calls === 0) await new Promise((resolve) => setTimeout(resolve, 5));
      // Committed while the freeze is in flight; its sync must not find "nothing to send" and call it ready.
      const unfreeze = await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'active' } });
      assert.equal(unfreeze.status, 200);
      assert.equal(unfreeze.body.status, 'active');
      letFreezeLand();
      assert.equal((await freeze).status, 200);
    } finally {
      chain.submit = submit;
      clock.nowMs = nowMs;
    }
    const [row] = await db.query<{ status: string; chain_status: string; sync_holder: string | null }>(
      'SELECT status, chain_status, sync_holder FROM wallets WHERE id = $1', [wallet.wallet_id]);
    assert.deepEqual(row, { status: 'active', chain_status: 'ready', sync_holder: null }, `same millisecond: ${sameMillisecond}`);
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, false, 'the vault on chain is not frozen');
  }

  test('a sync whose chain calls were slow holds the wallet for 90 s after its last send, not after its start', async () => {
    const wallet = await createWallet(t);
    const { chain, db, clock } = t.service.ctx;
    const { getVault, submit, waitForOutcome } = chain;
    const nowMs = clock.nowMs;
    let offsetMs = 0;
    clock.nowMs = () => nowMs.call(clock) + offsetMs;
    let lateFreeze: Parameters<typeof submit>[0] | null = null;
    // The freeze's sync: its read of the vault takes 35 s, then its send is made but does not
    // land yet, and its confirmation never comes (30 s). What it sent can land for a minute after.
    chain.getVault = async (...args: Parameters<typeof getVault>) => {
      chain.getVault = getVault;
      offsetMs += 35_000;
      return getVault.apply(chain, args);
    };
    chain.submit = async (prepared) => {
      chain.submit = submit;
      lateFreeze = prepared;
    };
    chain.waitForOutcome = async () => {
      chain.waitForOutcome = waitForOutcome;
      offsetMs += 30_000;
      throw new Error('not confirmed within 30000 ms');
    };
    try {
      assert.equal((await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'frozen' } })).status, 200);
      assert.equal((await t.request('PATCH', `/v1/wallets/${wallet.wallet_id}`, { body: { status: 'active' } })).status, 200);
      // 91 s after the sync started, 56 s after its send: still its wallet.
      offsetMs += 26_000;
      await syncPendingWallets(t.service.ctx);
      const [held] = await db.query<{ chain_status: string }>('SELECT chain_status FROM wallets WHERE id = $1', [wallet.wallet_id]);
      assert.equal(held!.chain_status, 'pending', 'not taken over while what it sent can land');
      assert.ok(lateFreeze, 'the freeze was sent');
      const landed = lateFreeze as Parameters<typeof submit>[0];
      await submit.call(chain, landed); // it lands
      await waitForOutcome.call(chain, landed.signature);
      // The lease lapses; the job takes the wallet over (what was sent has landed) and unfreezes the vault.
      offsetMs += 35_000;
      await syncPendingWallets(t.service.ctx);
    } finally {
      Object.assign(chain, { getVault, submit, waitForOutcome });
      clock.nowMs = nowMs;
    }
    const [row] = await db.query<{ status: string; chain_status: string }>('SELECT status, chain_status FROM wallets WHERE id = $1', [wallet.wallet_id]);
    assert.deepEqual(row, { status: 'active', chain_status: 'ready' });
    assert.equal((await chain.getVault(address(wallet.chain_address)))!.frozen, false, 'the vault on chain is not frozen');
  });

  test('archive: a payment awaiting its co-signature is named as what to decide first', async () => {
    const policyId = await newPolicy(t, { requireCoSign: '0.5' });
    const wallet = await fundedWallet(t, '1', policyId);
    const awaiting = await t.request('POST', '/v1/payments', {
      body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '0.9', currency: 'USDC' },
    });
    assert.equal(awaiting.body.approval?.status, 'awaiting', JSON.stringify(awaiting.body));
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    const refused = await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`);
    assert.equal(refused.status, 422);
    assert.equal(refused.body.error.code, 'wallet_balance_not_zero');
    assert.match(refused.body.error.message, /has 1 payment awaiting co-signature: approve or reject them/);
    assert.equal((await t.request('POST', `/v1/payments/${awaiting.body.tx_id}/reject`, { body: {} })).status, 200);
    assert.equal((await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`)).status, 200, 'then it archives');
  });

  test('archive: refused with a balance, then only reads are answered', async () => {
    const wallet = await createWallet(t);
    await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '5' } });
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: '1', currency: 'USDC' } });
    const refused = await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`);
    assert.equal(refused.status, 422);
    assert.equal(refused.body.error.code, 'wallet_balance_not_zero');
    await t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { body: { amount: 'all' } });
    const archived = await t.request('DELETE', `/v1/wallets/${wallet.wallet_id}`);
    assert.equal(archived.status, 200);
    assert.equal(archived.body.status, 'archived');
    assert.equal((await t.service.ctx.chain.getVault(address(wallet.chain_address)))!.frozen, true, 'frozen on chain');
    for (const [method, url, body] of [
      ['PATCH', `/v1/wallets/${wallet.wallet_id}`, { label: 'again' }],
      ['POST', `/v1/wallets/${wallet.wallet_id}/fund`, { amount: '1' }],
      ['POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { amount: '1' }],
      ['POST', `/v1/wallets/${wallet.wallet_id}/rotate-token`, {}],
      ['PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`, { enabled: false }],
      ['DELETE', `/v1/wallets/${wallet.wallet_id}`, undefined],
    ] as const) {
      const response = await t.request(method, url, { body });
      assert.equal(response.status, 422, `${method} ${url}`);
      assert.equal(response.body.error.code, 'wallet_archived');
    }
    assert.equal((await t.request('GET', `/v1/wallets/${wallet.wallet_id}`)).body.status, 'archived');
    const listed = await t.request('GET', '/v1/wallets?limit=100');
    assert.ok(!listed.body.data.some((w: { wallet_id: string }) => w.wallet_id === wallet.wallet_id), 'hidden from the default list');
    const archivedList = await t.request('GET', '/v1/wallets?status=archived');
    assert.ok(archivedList.body.data.some((w: { wallet_id: string }) => w.wallet_id === wallet.wallet_id), 'listed with status=archived');
  });

  test('session tokens: an agent key reads its own vault with its current token only', async () => {
    const wallet = await createWallet(t);
    const otherWallet = await createWallet(t);
    const agentKey = await t.createKey('agent');
    const url = `/v1/wallets/${wallet.wallet_id}`;
    const missing = await t.request('GET', url, { key: agentKey });
    assert.equal(missing.status, 403);
    assert.equal(missing.body.error.code, 'session_token_invalid');
    const rotated = await t.request('POST', `${url}/rotate-token`, { body: { ttlSeconds: 3600 } });
    assert.equal(rotated.status, 200);
    assert.match(rotated.body.session_token, /^avst_/);
    const token = rotated.body.session_token as string;
    assert.equal((await t.request('GET', url, { key: agentKey, headers: { 'session-token': token } })).status, 200);
    const stored = await t.service.ctx.db.query<{ session_public_key: string }>('SELECT session_public_key FROM wallets WHERE id = $1', [wallet.wallet_id]);
    assert.ok(!stored[0]!.session_public_key.includes(token.slice(5)), 'only the public key is stored');
    const foreign = await t.request('GET', `/v1/wallets/${otherWallet.wallet_id}`, { key: agentKey, headers: { 'session-token': token } });
    assert.equal(foreign.body.error.code, 'session_token_invalid');
    const second = await t.request('POST', `${url}/rotate-token`, { body: {} });
    const revoked = await t.request('GET', url, { key: agentKey, headers: { 'session-token': token } });
    assert.equal(revoked.status, 403, 'rotation revokes the previous token at once');
    assert.equal((await t.request('GET', url, { key: agentKey, headers: { 'session-token': second.body.session_token } })).status, 200);
    const list = await t.request('GET', '/v1/wallets', { key: agentKey });
    assert.deepEqual([list.status, list.body.error.message], [403, 'A key with role "agent" cannot do this; keys that can: '
      + '"admin", "operator", "viewer", "arbiter". An agent reads its own vault: GET /v1/wallets/{wallet_id} and '
      + '/v1/wallets/{wallet_id}/transactions, with its Session-Token.'], 'agents cannot list');
    const short = await t.request('POST', `${url}/rotate-token`, { body: { ttlSeconds: 60 } });
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } });
    const expired = await t.request('GET', url, { key: agentKey, headers: { 'session-token': short.body.session_token } });
    assert.equal(expired.status, 401);
    assert.equal(expired.body.error.code, 'session_token_expired');
    assert.match(expired.body.error.message, /an admin or operator makes a new one with POST \/v1\/wallets\/\{wallet_id\}\/rotate-token/);
    assert.equal((await t.request('POST', `${url}/rotate-token`, { body: { ttlSeconds: 5 } })).status, 400);
  });

  test('auto-topup settings are validated and read back', async () => {
    const wallet = await createWallet(t);
    const url = `/v1/wallets/${wallet.wallet_id}/auto-topup`;
    const incomplete = await t.request('PUT', url, { body: { enabled: true, triggerBelow: '5' } });
    assert.equal(incomplete.status, 400);
    assert.equal(incomplete.body.error.param, 'topup_amount');
    const badAmount = await t.request('PUT', url, { body: { enabled: true, triggerBelow: '5', topupAmount: '-1' } });
    assert.equal(badAmount.body.error.code, 'invalid_amount');
    const set = await t.request('PUT', url, { body: { enabled: true, trigger_below: '5', topup_amount: '20.5' } });
    assert.equal(set.status, 200);
    assert.deepEqual(set.body.auto_topup, { enabled: true, trigger_below: '5.00', topup_amount: '20.50' });
    const read = await t.request('GET', `/v1/wallets/${wallet.wallet_id}`);
    assert.deepEqual(read.body.auto_topup, { enabled: true, trigger_below: '5.00', topup_amount: '20.50' });
  });

  test('creating a wallet races deleting its policy: never a wallet on a deleted policy', async () => {
    for (let round = 0; round < 8; round += 1) {
      const policy = await t.request('POST', '/v1/policies', { body: { name: `racing-${process.pid}-${round}` } });
      const [created, deleted] = await Promise.all([
        t.request('POST', '/v1/wallets', { body: { agentId: `racer-${process.pid}-${round}`, label: 'Racer', policyId: policy.body.policy_id } }),
        t.request('DELETE', `/v1/policies/${policy.body.policy_id}`),
      ]);
      if (created.status === 200) {
        assert.equal(deleted.status, 422, 'a policy with a wallet is not deleted');
        assert.equal(deleted.body.error.code, 'policy_in_use');
        assert.equal((await t.request('GET', `/v1/wallets/${created.body.wallet_id}`)).status, 200, 'the wallet works');
      } else {
        assert.equal(deleted.status, 200, JSON.stringify(deleted.body));
        assert.equal(created.body.error.code, 'policy_not_found');
      }
    }
  });
});
