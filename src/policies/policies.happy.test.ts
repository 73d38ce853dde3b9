/**
 * Policies through the real HTTP stack, the real database and the embedded validator: what
 * succeeds, and what it leaves behind (audit entries, events, the policy account on chain).
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address } from '@solana/kit';
import { NO_LIMIT } from '../chain/program.ts';
import { CHAIN_EXPIRY_GRACE_SECONDS } from './presets.ts';
import { startTestService, type TestService } from '../../test/harness.ts';

const ADDRESS = 'So11111111111111111111111111111111111111112';

async function createPolicy(t: TestService, body: Record<string, unknown>, key?: string) {
  const response = await t.request('POST', '/v1/policies', { key, body: { name: 'Research', ...body } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

async function eventsOf(t: TestService, policyId: string, type: string) {
  return t.service.ctx.db.query<{ severity: string; payload: Record<string, any> }>(
    `SELECT severity, payload FROM events WHERE org_id = $1 AND type = $2 AND payload->>'policy_id' = $3 ORDER BY created_at, id`,
    [t.orgId, type, policyId]);
}

async function chainStatusOf(t: TestService, policyId: string): Promise<string> {
  const rows = await t.service.ctx.db.query<{ chain_status: string }>(
    'SELECT chain_status FROM policies WHERE org_id = $1 AND id = $2', [t.orgId, policyId]);
  return rows[0]!.chain_status;
}

describe('policies', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('a created policy is answered in full and its account on chain holds its limits before the response', async () => {
    const policy = await createPolicy(t, {
      maxPerTx: '25.5', maxPerDay: '0', maxPerMonth: '1000', velocityCap: 30, requireCoSign: '20',
      allowedRecipients: [ADDRESS, 'API.Example.com'], blockedCategories: ['Gambling', 'gambling'], expiry: '2099-01-01T00:00:00.250Z',
    });
    assert.match(policy.policy_id, /^pol_/);
    assert.deepEqual({ ...policy, policy_id: undefined, chain_address: undefined, created_at: undefined, updated_at: undefined }, {
      policy_id: undefined, name: 'Research', max_per_tx: '25.50', max_per_day: '0.00', max_per_month: '1000.00', velocity_cap: 30,
      allowed_recipients: [ADDRESS, 'api.example.com'], blocked_categories: ['gambling'], require_co_sign: '20.00',
      expiry: '2099-01-01T00:00:00.000Z', wallet_count: 0, is_preset: false, chain_address: undefined,
      created_at: undefined, updated_at: undefined,
    });
    const { chain } = t.service.ctx;
    assert.equal(policy.chain_address, await chain.policyAddress(t.orgId, policy.policy_id));
    const onChain = await chain.getPolicy(address(policy.chain_address));
    assert.ok(onChain, 'the policy account exists');
    assert.equal(onChain.maxPerTx, 25_500_000n);
    assert.equal(onChain.maxPerDay, 0n);
    assert.equal(onChain.expiry, BigInt(Date.UTC(2099, 0, 1) / 1000 + CHAIN_EXPIRY_GRACE_SECONDS), 'the expiry, and the grace for payments decided before it');
    assert.equal(await chainStatusOf(t, policy.policy_id), 'ready');
    const created = await eventsOf(t, policy.policy_id, 'policy.created');
    assert.equal(created.length, 1);
    assert.equal(created[0]!.payload.revision, 1);
    assert.equal(created[0]!.payload.changes.max_per_tx.to, '25.50');
  });

  test('only a name is required; everything else defaults to no limit and the chain says so', async () => {
    const policy = await createPolicy(t, { name: 'Open' });
    assert.equal(policy.max_per_tx, null);
    assert.equal(policy.velocity_cap, null);
    assert.equal(policy.require_co_sign, null);
    assert.equal(policy.expiry, null);
    assert.deepEqual(policy.allowed_recipients, []);
    assert.deepEqual(policy.blocked_categories, []);
    const onChain = await t.service.ctx.chain.getPolicy(address(policy.chain_address));
    assert.deepEqual([onChain!.maxPerTx, onChain!.maxPerDay, onChain!.expiry], [NO_LIMIT, NO_LIMIT, 0n]);
  });

  test('snake_case fields of the getting-started examples are accepted', async () => {
    const policy = await createPolicy(t, { max_per_tx: '5', velocity_cap: 2, blocked_categories: ['adult'] });
    assert.equal(policy.max_per_tx, '5.00');
    assert.equal(policy.velocity_cap, 2);
    assert.deepEqual(policy.blocked_categories, ['adult']);
  });

  test('GET answers the policy; the four presets are there with their values', async () => {
    const policy = await createPolicy(t, { maxPerTx: '1' });
    const fetched = await t.request('GET', `/v1/policies/${policy.policy_id}`);
    assert.equal(fetched.status, 200);
    assert.deepEqual(fetched.body, policy);
    const conservative = await t.request('GET', '/v1/policies/pol_conservative');
    assert.equal(conservative.status, 200);
    assert.equal(conservative.body.is_preset, true);
    assert.equal(conservative.body.max_per_tx, '10.00');
    assert.equal(conservative.body.max_per_day, '100.00');
    assert.equal(conservative.body.max_per_month, '1000.00');
    assert.equal(conservative.body.velocity_cap, 10);
    const locked = await t.request('GET', '/v1/policies/pol_locked');
    assert.equal(locked.body.max_per_tx, '0.00');
  });

  test('the list holds the organisation\'s policies and the presets, newest first, page by page', async () => {
    const other = await t.createOrganization();
    const mine = [];
    for (let i = 0; i < 3; i += 1) mine.push((await createPolicy(t, { name: `Paged ${i}` }, other.adminKey)).policy_id);
    const seen: string[] = [];
    let cursor: string | null = null;
    do {
      const query: string = cursor ? `?limit=2&cursor=${cursor}` : '?limit=2';
      const page: any = await t.request('GET', `/v1/policies${query}`, { key: other.adminKey });
      assert.equal(page.status, 200);
      assert.ok(page.body.data.length <= 2);
      seen.push(...page.body.data.map((p: { policy_id: string }) => p.policy_id));
      cursor = page.body.has_more ? page.body.next_cursor : null;
      if (!page.body.has_more) assert.equal(page.body.next_cursor, null);
    } while (cursor);
    assert.deepEqual(seen.slice(0, 3), [...mine].reverse(), 'newest first');
    assert.deepEqual([...seen.slice(3)].sort(), ['pol_conservative', 'pol_locked', 'pol_moderate', 'pol_permissive']);
    assert.equal(new Set(seen).size, seen.length, 'no policy twice across pages');
  });

  test('PATCH changes the policy, writes an audit entry and a policy.updated event, and reaches the chain', async () => {
    const policy = await createPolicy(t, { maxPerTx: '10', maxPerDay: '100', velocityCap: 5 });
    const response = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, {
      body: { maxPerTx: '12.25', maxPerDay: null, expiry: '2098-06-30T12:00:00Z', velocityCap: 5 },
    });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    assert.equal(response.body.max_per_tx, '12.25');
    assert.equal(response.body.max_per_day, null);
    assert.equal(response.body.expiry, '2098-06-30T12:00:00.000Z');
    assert.ok(response.body.updated_at > policy.updated_at);

    const onChain = await t.service.ctx.chain.getPolicy(address(policy.chain_address));
    assert.equal(onChain!.maxPerTx, 12_250_000n, 'the new max_per_tx is on chain when the response is sent');
    assert.equal(onChain!.maxPerDay, NO_LIMIT, 'a cleared limit is no limit on chain');
    assert.equal(onChain!.expiry, BigInt(Date.UTC(2098, 5, 30, 12) / 1000 + CHAIN_EXPIRY_GRACE_SECONDS));
    assert.equal(await chainStatusOf(t, policy.policy_id), 'ready');

    const changes = {
      max_per_tx: { from: '10.00', to: '12.25' },
      max_per_day: { from: '100.00', to: null },
      expiry: { from: null, to: '2098-06-30T12:00:00.000Z' },
    };
    const audit = await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log`);
    assert.equal(audit.status, 200);
    assert.equal(audit.body.data.length, 2, 'the creation and the change');
    const [creation, change] = audit.body.data;
    assert.equal(creation.changes.name.to, 'Research');
    assert.deepEqual(change.changes, changes, 'unchanged fields are not in the diff');
    assert.equal(change.timestamp, response.body.updated_at);
    const keyId = (await t.service.ctx.db.query<{ id: string }>(
      `SELECT id FROM api_keys WHERE org_id = $1 AND name = 'Bootstrap key' OR (org_id = $1 AND name = 'Admin key') ORDER BY created_at LIMIT 1`,
      [t.orgId]))[0]!.id;
    assert.equal(change.changed_by, keyId, 'changed_by is the API key id');

    const updated = await eventsOf(t, policy.policy_id, 'policy.updated');
    assert.equal(updated.length, 1);
    assert.deepEqual(updated[0]!.payload, { policy_id: policy.policy_id, changes, changed_by: keyId, revision: 2 });
    assert.equal(updated[0]!.severity, 'info');
  });

  test('the audit log is chronological across pages', async () => {
    const policy = await createPolicy(t, { maxPerTx: '1' });
    for (const amount of ['2', '3', '4']) {
      assert.equal((await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: amount } })).status, 200);
    }
    const first = await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log?limit=3`);
    assert.equal(first.body.has_more, true);
    const second = await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log?limit=3&cursor=${first.body.next_cursor}`);
    assert.equal(second.body.has_more, false);
    const entries = [...first.body.data, ...second.body.data];
    assert.deepEqual(entries.map((e: any) => e.changes.max_per_tx.to), ['1.00', '2.00', '3.00', '4.00']);
    const times = entries.map((e: any) => e.timestamp);
    assert.deepEqual(times, [...times].sort());
  });

  test('a PATCH that changes nothing writes nothing', async () => {
    const policy = await createPolicy(t, { maxPerTx: '7', blockedCategories: ['a'] });
    const response = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: '7.00', blockedCategories: ['a'] } });
    assert.equal(response.status, 200);
    assert.deepEqual(response.body, policy);
    assert.equal((await eventsOf(t, policy.policy_id, 'policy.updated')).length, 0);
    const audit = await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log`);
    assert.equal(audit.body.data.length, 1);
  });

  test('a clone copies the source\'s rules with the overrides, presets included, and is editable', async () => {
    const clone = await t.request('POST', '/v1/policies/pol_conservative/clone', {
      body: { name: 'Conservative, EU vendors', allowedRecipients: ['vendor.eu'] },
    });
    assert.equal(clone.status, 200, JSON.stringify(clone.body));
    assert.notEqual(clone.body.policy_id, 'pol_conservative');
    assert.equal(clone.body.is_preset, false);
    assert.equal(clone.body.name, 'Conservative, EU vendors');
    assert.equal(clone.body.max_per_tx, '10.00');
    assert.equal(clone.body.max_per_month, '1000.00');
    assert.equal(clone.body.velocity_cap, 10);
    assert.deepEqual(clone.body.allowed_recipients, ['vendor.eu']);
    const onChain = await t.service.ctx.chain.getPolicy(address(clone.body.chain_address));
    assert.equal(onChain!.maxPerTx, 10_000_000n);
    const created = await eventsOf(t, clone.body.policy_id, 'policy.created');
    assert.equal(created[0]!.payload.cloned_from, 'pol_conservative');
    const edited = await t.request('PATCH', `/v1/policies/${clone.body.policy_id}`, { body: { maxPerTx: null } });
    assert.equal(edited.status, 200);
    assert.equal(edited.body.max_per_tx, null);
    const preset = await t.request('GET', '/v1/policies/pol_conservative');
    assert.equal(preset.body.max_per_tx, '10.00', 'the preset is untouched');

    const source = await createPolicy(t, { maxPerTx: '3', expiry: '2097-01-01T00:00:00Z', blockedCategories: ['x'] });
    const copy = await t.request('POST', `/v1/policies/${source.policy_id}/clone`, { body: { name: 'Copy', expiry: null } });
    assert.equal(copy.body.max_per_tx, '3.00');
    assert.equal(copy.body.expiry, null);
    assert.deepEqual(copy.body.blocked_categories, ['x']);
  });

  test('DELETE removes a policy no live wallet uses; afterwards it is not found, and archived wallets do not hold it', async () => {
    const policy = await createPolicy(t, { maxPerTx: '1' });
    const { db, chain, clock } = t.service.ctx;
    const agentId = `archived-${process.pid}`;
    const { vault, vaultToken } = await chain.vaultAddresses(t.orgId, agentId);
    await db.query(
      `INSERT INTO wallets (id, org_id, agent_id, label, policy_id, status, chain_address, token_address, chain_status, created_at, updated_at)
       VALUES ($1, $2, $3, 'old', $4, 'archived', $5, $6, 'ready', $7, $7)`,
      [`wal_archived${process.pid}`, t.orgId, agentId, policy.policy_id, vault, vaultToken, new Date(clock.nowMs())]);
    const deleted = await t.request('DELETE', `/v1/policies/${policy.policy_id}`);
    assert.equal(deleted.status, 200, JSON.stringify(deleted.body));
    assert.equal(deleted.body.policy_id, policy.policy_id);
    for (const [method, url] of [['GET', ''], ['PATCH', ''], ['DELETE', ''], ['GET', '/audit-log'], ['POST', '/clone']] as const) {
      const body = method === 'PATCH' ? { maxPerTx: '2' } : method === 'POST' ? { name: 'x' } : undefined;
      const response = await t.request(method, `/v1/policies/${policy.policy_id}${url}`, { body });
      assert.equal(response.status, 404, `${method} ${url}`);
      assert.equal(response.body.error.code, 'policy_not_found');
    }
    const list = await t.request('GET', '/v1/policies?limit=100');
    assert.ok(!list.body.data.some((p: { policy_id: string }) => p.policy_id === policy.policy_id));
    assert.equal((await eventsOf(t, policy.policy_id, 'policy.deleted')).length, 1);
    const audit = await db.query<{ changes: Record<string, { from: unknown; to: unknown }> }>(
      'SELECT changes FROM policy_audit WHERE org_id = $1 AND policy_id = $2 ORDER BY created_at DESC LIMIT 1', [t.orgId, policy.policy_id]);
    assert.equal(audit[0]!.changes.deleted_at!.from, null);
    // The archived wallet still answers reads, its spending judged by the deleted policy.
    const archived = await t.request('GET', `/v1/wallets/wal_archived${process.pid}`);
    assert.equal(archived.status, 200, JSON.stringify(archived.body));
    assert.equal(archived.body.status, 'archived');
    assert.equal(archived.body.policy.policy_id, policy.policy_id);
    assert.equal(archived.body.spending.day.spent, '0.00');
  });

  test('an operator may write and a viewer may read', async () => {
    const operator = await t.createKey('operator');
    const policy = await createPolicy(t, { maxPerTx: '1' }, operator);
    const viewer = await t.createKey('viewer');
    assert.equal((await t.request('GET', `/v1/policies/${policy.policy_id}`, { key: viewer })).status, 200);
    assert.equal((await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log`, { key: viewer })).status, 200);
    assert.equal((await t.request('GET', '/v1/policies', { key: viewer })).status, 200);
  });

  test('the OpenAPI document describes the policy routes', async () => {
    const openapi = await t.request('GET', '/openapi.json', { key: null });
    for (const path of ['/v1/policies', '/v1/policies/{policy_id}', '/v1/policies/{policy_id}/clone', '/v1/policies/{policy_id}/audit-log']) {
      assert.ok(openapi.body.paths[path], path);
    }
  });
});
