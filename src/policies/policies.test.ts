/**
 * Policies through the real HTTP stack, the real database and the embedded validator: every
 * refusal with its exact code and param, and that a refusal changes nothing (the policy, its
 * audit log, its events and its account on chain read the same after); isolation between
 * organisations, roles, presets, the delete rule, list paging; and that an update governs the
 * very next payment of an attached wallet, in the service and in the program on chain.
 * The successful paths are in policies.happy.test.ts.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { address, generateKeyPairSigner } from '@solana/kit';
import { NO_LIMIT } from '../chain/program.ts';
import { hashApiKey } from '../auth/api-keys.ts';
import { withAnotherKey } from '../../test/fixtures.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { AUDIT_PAGE_BYTES_MAX, POLICY_PAGE_BYTES_MAX, syncPendingPolicies, syncPolicyToChain } from './policies.ts';
import { ConfirmationTimeoutError, type PreparedTransaction } from '../chain/client.ts';

const ADDRESS = 'So11111111111111111111111111111111111111112';
const USDC = 1_000_000n;

let counter = 0;
const unique = (prefix: string) => `${prefix}-${process.pid}-${(counter += 1)}`;

async function createPolicy(t: TestService, body: Record<string, unknown>, key?: string) {
  const response = await t.request('POST', '/v1/policies', { key, body: { name: unique('policy'), ...body } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

async function createWallet(t: TestService, policyId: string) {
  const response = await t.request('POST', '/v1/wallets', { body: { agentId: unique('agent'), label: 'Agent', policyId } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body as { wallet_id: string; agent_id: string };
}

/** A wallet under `policyId` holding `balance` USDC, funded from a fresh deposit. */
async function fundedWallet(t: TestService, policyId: string, balance: string) {
  const deposit = await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: balance } });
  assert.equal(deposit.status, 200, JSON.stringify(deposit.body));
  const wallet = await createWallet(t, policyId);
  const funded = await t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { body: { amount: balance } });
  assert.equal(funded.status, 200, JSON.stringify(funded.body));
  return wallet;
}

/**
 * Everything a refused request must leave as it was: the policy as the API shows it, its audit
 * log, the events naming it, and its account on chain (limits and the program's revision).
 */
async function snapshot(t: TestService, policyId: string, key?: string) {
  const policy = await t.request('GET', `/v1/policies/${policyId}`, { key });
  assert.equal(policy.status, 200, JSON.stringify(policy.body));
  const audit = await t.request('GET', `/v1/policies/${policyId}/audit-log?limit=100`, { key });
  assert.equal(audit.status, 200, JSON.stringify(audit.body));
  const events = await t.service.ctx.db.query<{ type: string }>(
    `SELECT type FROM events WHERE payload->>'policy_id' = $1 ORDER BY created_at, id`, [policyId]);
  const row = await t.service.ctx.db.query<{ chain_status: string; revision: number }>(
    'SELECT chain_status, revision FROM policies WHERE id = $1 AND chain_address = $2', [policyId, policy.body.chain_address]);
  const onChain = await t.service.ctx.chain.getPolicy(address(policy.body.chain_address));
  assert.ok(onChain, 'the policy account exists on chain');
  return { policy: policy.body, audit: audit.body.data, events: events.map((e) => e.type), row: row[0], onChain };
}

async function policyCount(t: TestService, orgId: string): Promise<number> {
  const rows = await t.service.ctx.db.query<{ count: bigint }>('SELECT count(*) AS count FROM policies WHERE org_id = $1', [orgId]);
  return Number(rows[0]!.count);
}

async function keyIdOf(t: TestService, key: string): Promise<string> {
  const rows = await t.service.ctx.db.query<{ id: string }>('SELECT id FROM api_keys WHERE key_hash = $1', [hashApiKey(key)]);
  return rows[0]!.id;
}

function assertError(response: { status: number; body: any }, status: number, code: string, param?: string, what = ''): void {
  assert.equal(response.status, status, `${what}: ${JSON.stringify(response.body)}`);
  assert.equal(response.body.error.code, code, what);
  if (param !== undefined) assert.equal(response.body.error.param, param, `${what}: param`);
}

/** Bodies a create, a clone or an update refuses, with the code and the param it names. */
const INVALID_FIELDS: ReadonlyArray<[string, Record<string, unknown>, string, string]> = [
  ['negative amount', { maxPerTx: '-1' }, 'invalid_amount', 'max_per_tx'],
  ['explicit plus sign', { maxPerDay: '+1' }, 'invalid_amount', 'max_per_day'],
  ['seven decimals', { maxPerMonth: '1.0000001' }, 'invalid_amount', 'max_per_month'],
  ['non-numeric', { maxPerTx: 'ten' }, 'invalid_amount', 'max_per_tx'],
  ['exponent', { maxPerDay: '1e3' }, 'invalid_amount', 'max_per_day'],
  ['spaces', { requireCoSign: ' 5' }, 'invalid_amount', 'require_co_sign'],
  ['empty amount', { requireCoSign: '' }, 'invalid_amount', 'require_co_sign'],
  ['comma decimal', { maxPerTx: '1,5' }, 'invalid_amount', 'max_per_tx'],
  ['above the 64-bit store', { maxPerMonth: '9223372036854.775808' }, 'invalid_amount', 'max_per_month'],
  ['amount as a JSON number', { maxPerTx: 5 }, 'invalid_request', 'max_per_tx'],
  ['snake_case amount checked the same', { max_per_tx: '-3' }, 'invalid_amount', 'max_per_tx'],
  ['negative velocity', { velocityCap: -1 }, 'invalid_request', 'velocity_cap'],
  ['fractional velocity', { velocityCap: 1.5 }, 'invalid_request', 'velocity_cap'],
  ['velocity as a string', { velocityCap: '5' }, 'invalid_request', 'velocity_cap'],
  ['velocity above its maximum', { velocityCap: 1_000_001 }, 'invalid_request', 'velocity_cap'],
  ['recipient neither address nor domain', { allowedRecipients: [ADDRESS, 'not a recipient'] }, 'invalid_recipient', 'allowed_recipients.1'],
  ['recipients not an array', { allowedRecipients: ADDRESS }, 'invalid_request', 'allowed_recipients'],
  ['an empty recipient', { allowedRecipients: [ADDRESS, ''] }, 'invalid_recipient', 'allowed_recipients.1'],
  ['a recipient over 253 characters', { allowedRecipients: [`${'a'.repeat(250)}.com`] }, 'invalid_recipient', 'allowed_recipients.0'],
  ['category with a space', { blockedCategories: ['online gambling'] }, 'invalid_request', 'blocked_categories.0'],
  ['expiry without a zone', { expiry: '2099-01-01T00:00:00' }, 'invalid_request', 'expiry'],
  ['expiry in the past', { expiry: '2001-01-01T00:00:00Z' }, 'invalid_request', 'expiry'],
  ['unknown field', { maxPerWeek: '5' }, 'invalid_request', 'max_per_week'],
  ['unknown snake_case field', { max_per_week: '5' }, 'invalid_request', 'max_per_week'],
  ['blank name', { name: '   ' }, 'invalid_request', 'name'],
  ['name too long', { name: 'n'.repeat(101) }, 'invalid_request', 'name'],
];

describe('policies: refusals and their effects', () => {
  let t: TestService;
  before(async () => { t = await startTestService(); });
  after(async () => { await t.close(); });

  test('a create with an invalid field is refused with its code and param, and creates nothing', async () => {
    const before = await policyCount(t, t.orgId);
    for (const [what, fields, code, param] of INVALID_FIELDS) {
      assertError(await t.request('POST', '/v1/policies', { body: { name: 'Refused', ...fields } }), 400, code, param, what);
    }
    assertError(await t.request('POST', '/v1/policies', { body: { maxPerTx: '5' } }), 400, 'invalid_request', 'name', 'no name');
    assertError(await t.request('POST', '/v1/policies', { body: '{"name":' }), 400, 'invalid_request', 'body', 'malformed JSON');
    assert.equal(await policyCount(t, t.orgId), before, 'no policy row was written');
    const created = await t.service.ctx.db.query(`SELECT 1 FROM events WHERE org_id = $1 AND type = 'policy.created'`, [t.orgId]);
    assert.equal(created.length, 0, 'no policy.created event');
  });

  test('the longest lists a policy allows fit in one request; one entry more is refused', async () => {
    // 1,000 distinct domains of 253 characters each (labels of at most 63).
    const domain = (i: number) => `${String(i).padStart(4, '0')}${'a'.repeat(59)}.${'b'.repeat(63)}.${'c'.repeat(63)}.${'d'.repeat(57)}.com`;
    const recipients = Array.from({ length: 1_000 }, (_, i) => domain(i));
    assert.equal(recipients[0]!.length, 253);
    const categories = Array.from({ length: 100 }, (_, i) => `category_${i}_${'x'.repeat(50)}`);
    const created = await t.request('POST', '/v1/policies', {
      body: { name: 'Long lists', allowedRecipients: recipients, blockedCategories: categories },
    });
    assert.equal(created.status, 200, JSON.stringify(created.body).slice(0, 300));
    assert.equal(created.body.allowed_recipients.length, 1_000);
    assert.equal(created.body.blocked_categories.length, 100);
    const before = await policyCount(t, t.orgId);
    assertError(await t.request('POST', '/v1/policies', {
      body: { name: 'Too long', allowedRecipients: [...recipients, domain(1_000)] },
    }), 400, 'invalid_request', 'allowed_recipients', 'one entry more');
    const huge = await t.request('POST', '/v1/policies', { body: { name: 'Huge', padding: 'x'.repeat(330 * 1024) } });
    assertError(huge, 400, 'invalid_request', 'body', 'beyond the policy body limit');
    assert.match(huge.body.error.message, /larger than 327680 bytes/);
    assert.equal(await policyCount(t, t.orgId), before);
  });

  test('both spellings of one field in one body are refused as ambiguous', async () => {
    const before = await policyCount(t, t.orgId);
    const camelFirst = await t.request('POST', '/v1/policies', { body: { name: 'Twice', maxPerTx: '1', max_per_tx: '2' } });
    assertError(camelFirst, 400, 'invalid_request', 'max_per_tx', 'camelCase then snake_case');
    // The param names the key as the body spelled it second (see the report: it is not always snake_case).
    const snakeFirst = await t.request('POST', '/v1/policies', { body: { name: 'Twice', velocity_cap: 1, velocityCap: 2 } });
    assertError(snakeFirst, 400, 'invalid_request', undefined, 'snake_case then camelCase');
    assert.ok(['velocity_cap', 'velocityCap'].includes(snakeFirst.body.error.param), `param names the field: ${snakeFirst.body.error.param}`);
    assert.equal(await policyCount(t, t.orgId), before, 'no policy row was written');

    const policy = await createPolicy(t, { maxPerTx: '1' });
    const state = await snapshot(t, policy.policy_id);
    const patched = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: '3', max_per_tx: '3' } });
    assertError(patched, 400, 'invalid_request', 'max_per_tx', 'PATCH with both spellings');
    assert.deepEqual(await snapshot(t, policy.policy_id), state, 'the policy is unchanged');
  });

  test('no relation between limits is enforced: a per-transaction limit above the daily one is accepted as sent', async () => {
    // The tighter limit simply wins when a payment is checked; refusing would make a two-step
    // change (lower the day, then the transaction) fail half-way. Documented in docs/policies.md.
    const policy = await createPolicy(t, { maxPerTx: '100', maxPerDay: '10', maxPerMonth: '5', requireCoSign: '500' });
    assert.deepEqual([policy.max_per_tx, policy.max_per_day, policy.max_per_month, policy.require_co_sign],
      ['100.00', '10.00', '5.00', '500.00']);
  });

  test('an update with an invalid field is refused with its code and param, and changes nothing', async () => {
    const policy = await createPolicy(t, {
      maxPerTx: '10', maxPerDay: '100', maxPerMonth: '1000', velocityCap: 5, requireCoSign: '8',
      allowedRecipients: [ADDRESS], blockedCategories: ['gambling'], expiry: '2099-01-01T00:00:00Z',
    });
    const state = await snapshot(t, policy.policy_id);
    assert.equal(state.audit.length, 1, 'the creation');
    for (const [what, fields, code, param] of INVALID_FIELDS) {
      const response = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: fields });
      assertError(response, 400, code, param, what);
    }
    // A valid change beside an invalid one is refused whole.
    assertError(await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerDay: '1', maxPerTx: 'x' } }),
      400, 'invalid_amount', 'max_per_tx', 'valid and invalid together');
    assertError(await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: {} }), 400, 'invalid_request', 'body', 'empty body');
    assertError(await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { name: null } }), 400, 'invalid_request', 'name', 'null name');
    assertError(await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { allowedRecipients: null } }),
      400, 'invalid_request', 'allowed_recipients', 'null list');
    assert.deepEqual(await snapshot(t, policy.policy_id), state, 'the policy, its audit log, events and chain account are unchanged');
  });

  test('a clone with an invalid override is refused and creates nothing; the source is untouched', async () => {
    const source = await createPolicy(t, { maxPerTx: '4' });
    const state = await snapshot(t, source.policy_id);
    const before = await policyCount(t, t.orgId);
    for (const [what, fields, code, param] of INVALID_FIELDS) {
      const response = await t.request('POST', `/v1/policies/${source.policy_id}/clone`, { body: { name: 'Clone', ...fields } });
      assertError(response, 400, code, param, what);
    }
    assertError(await t.request('POST', `/v1/policies/${source.policy_id}/clone`, { body: {} }), 400, 'invalid_request', 'name', 'no name');
    assertError(await t.request('POST', '/v1/policies/pol_conservative/clone', { body: { name: 'C', maxPerTx: '-1' } }),
      400, 'invalid_amount', 'max_per_tx', 'a preset clone is validated the same');
    assert.equal(await policyCount(t, t.orgId), before, 'no policy row was written');
    assert.deepEqual(await snapshot(t, source.policy_id), state);
  });

  test('presets: update and delete are policy_immutable and change nothing; a clone of each is allowed', async () => {
    const presets = {
      pol_conservative: ['Conservative', '10.00', '100.00', '1000.00', 10],
      pol_moderate: ['Moderate', '100.00', '1000.00', '10000.00', 60],
      pol_permissive: ['Permissive', '1000.00', '10000.00', '100000.00', 600],
      pol_locked: ['Locked', '0.00', '0.00', '0.00', 0],
    } as const;
    for (const [presetId, [name, maxPerTx, maxPerDay, maxPerMonth, velocityCap]] of Object.entries(presets)) {
      const state = await snapshot(t, presetId);
      for (const body of [{ maxPerTx: '1' }, { name: 'Mine now' }, { maxPerTx: maxPerTx }]) {
        const response = await t.request('PATCH', `/v1/policies/${presetId}`, { body });
        assertError(response, 422, 'policy_immutable', undefined, `PATCH ${presetId} ${JSON.stringify(body)}`);
        assert.equal(response.body.error.policy_id, presetId);
      }
      const deleted = await t.request('DELETE', `/v1/policies/${presetId}`);
      assertError(deleted, 422, 'policy_immutable', undefined, `DELETE ${presetId}`);
      assert.equal(deleted.body.error.policy_id, presetId);
      assert.deepEqual(await snapshot(t, presetId), state, `${presetId} is unchanged`);
      assert.deepEqual(state.audit, [], 'a preset has no audit entries');

      const clone = await t.request('POST', `/v1/policies/${presetId}/clone`, { body: { name: `${name} copy` } });
      assert.equal(clone.status, 200, JSON.stringify(clone.body));
      assert.equal(clone.body.is_preset, false);
      assert.deepEqual([clone.body.max_per_tx, clone.body.max_per_day, clone.body.max_per_month, clone.body.velocity_cap],
        [maxPerTx, maxPerDay, maxPerMonth, velocityCap], `the clone of ${presetId} has its values`);
    }
  });

  test('delete while a wallet is attached is policy_in_use and changes nothing; after detaching it succeeds', async () => {
    const policy = await createPolicy(t, { maxPerTx: '5' });
    const first = await createWallet(t, policy.policy_id);
    const second = await createWallet(t, policy.policy_id);
    const state = await snapshot(t, policy.policy_id);
    assert.equal(state.policy.wallet_count, 2, 'wallet_count counts attached wallets');

    const refused = await t.request('DELETE', `/v1/policies/${policy.policy_id}`);
    assertError(refused, 422, 'policy_in_use', undefined, 'two wallets attached');
    assert.equal(refused.body.error.policy_id, policy.policy_id);
    assert.equal(refused.body.error.wallet_count, 2);
    assert.deepEqual(await snapshot(t, policy.policy_id), state, 'still there, no audit entry, no event');

    assert.equal((await t.request('PATCH', `/v1/wallets/${first.wallet_id}`, { body: { policyId: 'pol_moderate' } })).status, 200);
    assert.equal((await t.request('GET', `/v1/policies/${policy.policy_id}`)).body.wallet_count, 1);
    const stillRefused = await t.request('DELETE', `/v1/policies/${policy.policy_id}`);
    assertError(stillRefused, 422, 'policy_in_use', undefined, 'one wallet attached');
    assert.equal(stillRefused.body.error.wallet_count, 1);

    assert.equal((await t.request('PATCH', `/v1/wallets/${second.wallet_id}`, { body: { policyId: 'pol_moderate' } })).status, 200);
    assert.equal((await t.request('GET', `/v1/policies/${policy.policy_id}`)).body.wallet_count, 0);
    const deleted = await t.request('DELETE', `/v1/policies/${policy.policy_id}`);
    assert.equal(deleted.status, 200, JSON.stringify(deleted.body));
    assert.equal(deleted.body.wallet_count, 0);
    assertError(await t.request('GET', `/v1/policies/${policy.policy_id}`), 404, 'policy_not_found', 'policy_id', 'after delete');
    // A deleted policy can no longer be attached.
    assertError(await t.request('PATCH', `/v1/wallets/${first.wallet_id}`, { body: { policyId: policy.policy_id } }),
      404, 'policy_not_found', 'policy_id', 'attach a deleted policy');
  });

  test('another organisation\'s policy answers 404 policy_not_found everywhere, and stays untouched', async () => {
    const other = await t.createOrganization();
    const theirs = await createPolicy(t, { maxPerTx: '3' }, other.adminKey);
    const state = await snapshot(t, theirs.policy_id, other.adminKey);
    const before = await policyCount(t, t.orgId);
    const id = theirs.policy_id;
    for (const policyId of [id, 'pol_missing']) {
      const calls: Array<[string, string, unknown]> = [
        ['GET', `/v1/policies/${policyId}`, undefined],
        ['PATCH', `/v1/policies/${policyId}`, { maxPerTx: '1000' }],
        ['DELETE', `/v1/policies/${policyId}`, undefined],
        ['POST', `/v1/policies/${policyId}/clone`, { name: 'Stolen' }],
        ['GET', `/v1/policies/${policyId}/audit-log`, undefined],
      ];
      for (const [method, url, body] of calls) {
        const response = await t.request(method, url, { body });
        assertError(response, 404, 'policy_not_found', 'policy_id', `${method} ${url}`);
        assert.ok(!JSON.stringify(response.body).includes(other.orgId), 'the other organisation is not named');
      }
    }
    const list = await t.request('GET', '/v1/policies?limit=100');
    assert.ok(!list.body.data.some((p: { policy_id: string }) => p.policy_id === id), 'not in my list');
    assertError(await t.request('POST', '/v1/wallets', { body: { agentId: unique('agent'), label: 'x', policyId: id } }),
      404, 'policy_not_found', 'policy_id', 'attach another organisation\'s policy');
    assert.equal(await policyCount(t, t.orgId), before, 'no clone was made');
    assert.deepEqual(await snapshot(t, id, other.adminKey), state, 'their policy is unchanged');
  });

  test('viewer, agent and arbiter keys are refused every write with 403 and change nothing', async () => {
    const policy = await createPolicy(t, { maxPerTx: '2' });
    const state = await snapshot(t, policy.policy_id);
    const before = await policyCount(t, t.orgId);
    for (const role of ['viewer', 'agent', 'arbiter'] as const) {
      const key = await t.createKey(role);
      const writes: Array<[string, string, unknown]> = [
        ['POST', '/v1/policies', { name: 'By a reader' }],
        ['PATCH', `/v1/policies/${policy.policy_id}`, { maxPerTx: '1000' }],
        ['POST', `/v1/policies/${policy.policy_id}/clone`, { name: 'Copy' }],
        ['DELETE', `/v1/policies/${policy.policy_id}`, undefined],
        ['PATCH', '/v1/policies/pol_conservative', { maxPerTx: '1000' }],
      ];
      for (const [method, url, body] of writes) {
        assertError(await t.request(method, url, { key, body }), 403, 'insufficient_permissions', undefined, `${role} ${method} ${url}`);
      }
    }
    // An agent acts on its vault only: the policy endpoints are not open to it, reads included.
    const agent = await t.createKey('agent');
    for (const url of [`/v1/policies/${policy.policy_id}`, '/v1/policies', `/v1/policies/${policy.policy_id}/audit-log`]) {
      assertError(await t.request('GET', url, { key: agent }), 403, 'insufficient_permissions', undefined, `agent GET ${url}`);
    }
    assertError(await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { key: null, body: { maxPerTx: '1' } }),
      401, 'authentication_failed', undefined, 'no key');
    assert.equal(await policyCount(t, t.orgId), before, 'no policy was created or cloned');
    assert.deepEqual(await snapshot(t, policy.policy_id), state, 'the policy is unchanged');
  });

  test('the list: presets with their documented values, page limits checked, pages stable under inserts', async () => {
    const org = await t.createOrganization();
    const key = org.adminKey;
    const fresh = await t.request('GET', '/v1/policies', { key });
    assert.equal(fresh.status, 200);
    assert.equal(fresh.body.has_more, false);
    const presets = Object.fromEntries(fresh.body.data.map((p: any) => [p.policy_id, p]));
    const rules = (name: string, maxPerTx: string | null, maxPerDay: string | null, maxPerMonth: string | null, velocityCap: number) => ({
      name, max_per_tx: maxPerTx, max_per_day: maxPerDay, max_per_month: maxPerMonth, velocity_cap: velocityCap,
      allowed_recipients: [], blocked_categories: [], require_co_sign: null, expiry: null, wallet_count: 0, is_preset: true,
    });
    const expected = {
      pol_conservative: rules('Conservative', '10.00', '100.00', '1000.00', 10),
      pol_moderate: rules('Moderate', '100.00', '1000.00', '10000.00', 60),
      pol_permissive: rules('Permissive', '1000.00', '10000.00', '100000.00', 600),
      pol_locked: rules('Locked', '0.00', '0.00', '0.00', 0),
    };
    /** What the program enforces of each: max per transaction and the daily cap, in micro-USDC. */
    const onChainLimits = {
      pol_conservative: [10n * USDC, 100n * USDC],
      pol_moderate: [100n * USDC, 1_000n * USDC],
      pol_permissive: [1_000n * USDC, 10_000n * USDC],
      pol_locked: [0n, 0n],
    };
    assert.deepEqual(Object.keys(presets).sort(), Object.keys(expected).sort(), 'a new organisation has exactly the four presets');
    for (const [id, values] of Object.entries(expected)) {
      const { policy_id, chain_address, created_at, updated_at, ...shown } = presets[id];
      assert.deepEqual(shown, values, id);
      const onChain = await t.service.ctx.chain.getPolicy(address(chain_address));
      assert.deepEqual([onChain!.maxPerTx, onChain!.maxPerDay, onChain!.expiry], [...onChainLimits[id as keyof typeof expected], 0n],
        `${id} on chain`);
    }

    for (const query of ['limit=0', 'limit=101', 'limit=abc', 'limit=-1', 'limit=1.5']) {
      assertError(await t.request('GET', `/v1/policies?${query}`, { key }), 400, 'invalid_request', 'limit', query);
    }
    assertError(await t.request('GET', '/v1/policies?cursor=not-a-cursor', { key }), 400, 'invalid_request', 'cursor', 'bad cursor');
    assertError(await t.request('GET', '/v1/policies?status=active', { key }), 400, 'invalid_request', 'status', 'unknown filter');
    assertError(await t.request('GET', `/v1/policies/pol_conservative/audit-log?limit=500`, { key }), 400, 'invalid_request', 'limit', 'audit limit');
    assert.equal((await t.request('GET', '/v1/policies?limit=100', { key })).status, 200, 'limit=100 is the maximum');

    const made: string[] = [];
    for (let i = 0; i < 5; i += 1) made.push((await createPolicy(t, { name: `Org policy ${i}` }, key)).policy_id);
    const first = await t.request('GET', '/v1/policies?limit=3', { key });
    assert.deepEqual(first.body.data.map((p: any) => p.policy_id), made.slice(2).reverse(), 'newest first');
    assert.equal(first.body.has_more, true);
    // A policy created between two pages never shifts the pages that follow.
    const late = (await createPolicy(t, { name: 'Late' }, key)).policy_id;
    const seen = first.body.data.map((p: any) => p.policy_id);
    let cursor: string | null = first.body.next_cursor;
    while (cursor) {
      const page: any = await t.request('GET', `/v1/policies?limit=3&cursor=${cursor}`, { key });
      assert.equal(page.status, 200, JSON.stringify(page.body));
      seen.push(...page.body.data.map((p: any) => p.policy_id));
      cursor = page.body.has_more ? page.body.next_cursor : null;
    }
    assert.ok(!seen.includes(late), 'the late policy is not on a later page');
    assert.equal(new Set(seen).size, seen.length, 'no policy twice');
    assert.deepEqual(seen.slice(0, 5), [...made].reverse());
    assert.deepEqual(seen.slice(5).sort(), Object.keys(expected).sort(), 'presets come last, all four');
    const mine = await t.request('GET', '/v1/policies?limit=100');
    assert.ok(!mine.body.data.some((p: any) => made.includes(p.policy_id)), 'another organisation\'s policies are not listed');
  });

  test('an update that changes nothing writes nothing: no audit entry, no event, no chain write', async () => {
    const policy = await createPolicy(t, {
      name: 'Same', maxPerTx: '7', velocityCap: null, allowedRecipients: [ADDRESS, 'shop.example.com'],
      blockedCategories: ['adult', 'gambling'], expiry: '2099-06-30T12:00:00Z',
    });
    const state = await snapshot(t, policy.policy_id);
    const noOps: Array<Record<string, unknown>> = [
      { name: 'Same' },
      { maxPerTx: '7.000000' },
      { max_per_tx: '7' },
      { maxPerDay: null, velocityCap: null, requireCoSign: null },
      { expiry: '2099-06-30T12:00:00.750Z' }, // kept to the second, as the chain stores it
      { expiry: '2099-06-30T14:00:00+02:00' },
      { allowedRecipients: [ADDRESS, 'SHOP.example.com', ADDRESS] }, // domains lowercased, duplicates dropped
      { allowedRecipients: ['shop.example.com', ADDRESS] }, // an allowlist is a set: its order means nothing
      { blockedCategories: ['gambling', 'adult'] },
    ];
    for (const body of noOps) {
      const response = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body });
      assert.equal(response.status, 200, JSON.stringify(response.body));
      assert.deepEqual(response.body, state.policy, `answers the policy as it is: ${JSON.stringify(body)}`);
      assert.deepEqual(await snapshot(t, policy.policy_id), state, `nothing written: ${JSON.stringify(body)}`);
    }
  });

  test('an update governs the next payment of an attached wallet at once, in the service and in the program on chain', async () => {
    const operator = await t.createKey('operator');
    const policy = await createPolicy(t, { maxPerTx: '10', maxPerDay: '100' });
    const wallet = await fundedWallet(t, policy.policy_id, '50');
    const to = (await generateKeyPairSigner()).address;
    const pay = (amount: string) => t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to, amount, currency: 'USDC' } });
    const { chain } = t.service.ctx;
    const before = await chain.getPolicy(address(policy.chain_address));

    assert.equal((await pay('3')).status, 200, 'under the first limit');
    const lowered = await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { key: operator, body: { maxPerTx: '2' } });
    assert.equal(lowered.status, 200, JSON.stringify(lowered.body));

    // On chain when the response is sent: the new limit, a new revision of the account.
    const onChain = await chain.getPolicy(address(policy.chain_address));
    assert.equal(onChain!.maxPerTx, 2n * USDC);
    assert.equal(onChain!.maxPerDay, 100n * USDC);
    assert.equal(onChain!.revision, before!.revision + 1n);

    // The service refuses the next payment over it...
    const blocked = await pay('3');
    assertError(blocked, 402, 'policy_violation', undefined, 'over the lowered limit');
    assert.deepEqual(blocked.body.error.violation, { rule: 'max_per_tx', limit: '2.00', attempted: '3.00' });
    assert.equal(blocked.body.error.policy_id, policy.policy_id);
    // ...and so does the program, for a payment sent straight to the chain past the service.
    const { vault } = await chain.vaultAddresses(t.orgId, wallet.agent_id);
    const direct = await chain.execute([await chain.payIx({
      orgId: t.orgId, agentId: wallet.agent_id, policyId: policy.policy_id, recipient: to, amount: 3n * USDC,
      attestation: new Uint8Array(32),
    })]);
    assert.equal(direct.err?.name, 'OverMaxPerTx', 'the program enforces the new limit');
    assert.equal(await chain.getUsdcBalance(vault), 47n * USDC, 'nothing left the vault');
    assert.equal((await pay('2')).status, 200, 'at the new limit');

    // Raising a limit takes effect as fast: 15 passes at once, in the service and on chain.
    assert.equal((await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: '20' } })).status, 200);
    const raised = await pay('15');
    assert.equal(raised.status, 200, JSON.stringify(raised.body));
    assert.equal(raised.body.status, 'confirmed');

    // The daily cap too: 20 spent today, a cap of 21 leaves 1.
    assert.equal((await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerDay: '21' } })).status, 200);
    assert.equal((await chain.getPolicy(address(policy.chain_address)))!.maxPerDay, 21n * USDC);
    const overDay = await pay('1.01');
    assertError(overDay, 402, 'policy_violation', undefined, 'over the lowered day cap');
    assert.deepEqual(overDay.body.error.violation, { rule: 'max_per_day', limit: '21.00', attempted: '21.01' });
    const directDay = await chain.execute([await chain.payIx({
      orgId: t.orgId, agentId: wallet.agent_id, policyId: policy.policy_id, recipient: to, amount: 1_010_000n,
      attestation: new Uint8Array(32),
    })]);
    assert.equal(directDay.err?.name, 'OverDailyCap', 'the program enforces the new daily cap');
    assert.equal((await pay('1')).status, 200, 'exactly at the cap');
    assert.equal(await chain.getUsdcBalance(vault), 29n * USDC, 'only the accepted payments left the vault');

    // The audit log names the operator key and the snake_case diffs, in order.
    const audit = await t.request('GET', `/v1/policies/${policy.policy_id}/audit-log`);
    assert.deepEqual(audit.body.data.slice(1).map((e: any) => e.changes), [
      { max_per_tx: { from: '10.00', to: '2.00' } },
      { max_per_tx: { from: '2.00', to: '20.00' } },
      { max_per_day: { from: '100.00', to: '21.00' } },
    ]);
    assert.equal(audit.body.data[1].changed_by, await keyIdOf(t, operator), 'changed_by is the id of the key that made the change');
    const events = await t.service.ctx.db.query<{ payload: Record<string, any> }>(
      `SELECT payload FROM events WHERE type = 'policy.updated' AND payload->>'policy_id' = $1 ORDER BY created_at, id`, [policy.policy_id]);
    assert.deepEqual(events.map((e) => e.payload.changes), audit.body.data.slice(1).map((e: any) => e.changes),
      'each policy.updated event carries the same diff as its audit entry');
  });

  // Guarantee: a write whose outcome was lost cannot leave older limits on chain behind a row
  // marked ready: the row stays pending until it has landed or can no longer, then the newest
  // limits are written again.
  test('a write whose outcome was lost and that lands after a newer one: the newer limits end on chain', async () => {
    const policy = await createPolicy(t, { maxPerTx: '100' });
    const { ctx } = t.service;
    const { chain } = ctx;
    const { submit, waitForOutcome } = chain;
    let held: PreparedTransaction | null = null;
    // The first write is not sent yet, and its wait times out (a slow cluster, a far RPC node).
    chain.submit = async (prepared) => {
      chain.submit = submit;
      held = prepared;
    };
    chain.waitForOutcome = async (signature, timeoutMs) => {
      if (held && signature === held.signature) throw new ConfirmationTimeoutError(signature, timeoutMs ?? 0);
      return waitForOutcome.call(chain, signature, timeoutMs);
    };
    const statusOf = async () => (await ctx.db.query<{ chain_status: string }>(
      'SELECT chain_status FROM policies WHERE org_id = $1 AND id = $2', [t.orgId, policy.policy_id]))[0]!.chain_status;
    const onChain = async () => (await chain.getPolicy(address(policy.chain_address)))!.maxPerTx;
    try {
      assert.equal((await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: '1000' } })).status, 200);
      assert.equal((await t.request('PATCH', `/v1/policies/${policy.policy_id}`, { body: { maxPerTx: '50' } })).status, 200);
      assert.equal(await onChain(), 50n * USDC, 'the newer limit written');
      assert.equal(await statusOf(), 'pending', 'not ready while the first write may still land');
      // The first write lands now, after the second.
      await submit.call(chain, held!);
      assert.equal((await waitForOutcome.call(chain, held!.signature, 10_000)).err, null);
      assert.equal(await onChain(), 1000n * USDC);
    } finally {
      chain.submit = submit;
      chain.waitForOutcome = waitForOutcome;
    }
    await syncPendingPolicies(ctx);
    assert.equal(await onChain(), 50n * USDC, 'written again once the first had landed');
    assert.equal(await statusOf(), 'ready');
  });

  test('a clone of a policy whose expiry has passed needs a new expiry (or null)', async () => {
    const clock = (await t.request('GET', '/v1/test_helpers/clock')).body;
    const nowMs = Date.parse(clock.now);
    assert.ok(Number.isFinite(nowMs), `the clock answers a time: ${JSON.stringify(clock)}`);
    const source = await createPolicy(t, { maxPerTx: '1', expiry: new Date(nowMs + 3_600_000).toISOString() });
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 7200 } })).status, 200);
    const before = await policyCount(t, t.orgId);
    assertError(await t.request('POST', `/v1/policies/${source.policy_id}/clone`, { body: { name: 'Stale' } }),
      400, 'invalid_request', 'expiry', 'inherited expiry in the past');
    assert.equal(await policyCount(t, t.orgId), before, 'no clone was made');
    const renewed = await t.request('POST', `/v1/policies/${source.policy_id}/clone`, { body: { name: 'Fresh', expiry: null } });
    assert.equal(renewed.status, 200, JSON.stringify(renewed.body));
    assert.equal(renewed.body.expiry, null);
    assert.equal(renewed.body.max_per_tx, '1.00');
  });

  test('an audit page stops early past 4 MiB of changes (lists of 1,000 domains weigh 500 KB an entry); the next page goes on', async () => {
    const domains = (variant: number) => Array.from({ length: 1_000 }, (_, i) =>
      `${`v${variant}-${i}-`.padEnd(50, 'q')}.${'x'.repeat(63)}.${'y'.repeat(63)}.${'z'.repeat(63)}.io`);
    const created = await t.request('POST', '/v1/policies', { body: { name: `heavy-audit-${process.pid}`, allowedRecipients: domains(0) } });
    assert.equal(created.status, 200, JSON.stringify(created.body).slice(0, 300));
    const url = `/v1/policies/${created.body.policy_id}`;
    for (let variant = 1; variant <= 10; variant += 1) {
      const changed = await t.request('PATCH', url, { body: { allowedRecipients: domains(variant) } });
      assert.equal(changed.status, 200, JSON.stringify(changed.body).slice(0, 300));
    }
    const seen: string[] = [];
    let cursor: string | null = null;
    let pages = 0;
    do {
      const response: { status: number; body: any } = await t.request('GET', `${url}/audit-log?limit=100${cursor ? `&cursor=${cursor}` : ''}`);
      assert.equal(response.status, 200);
      const bytes = Buffer.byteLength(JSON.stringify(response.body));
      assert.ok(bytes < AUDIT_PAGE_BYTES_MAX + 600_000, `a page of ${bytes} bytes`);
      seen.push(...response.body.data.map((entry: { timestamp: string }) => entry.timestamp));
      cursor = response.body.next_cursor;
      assert.equal(response.body.has_more, cursor !== null);
      pages += 1;
    } while (cursor);
    assert.equal(seen.length, 11, 'the creation and ten changes, each once');
    assert.equal(new Set(seen).size, 11);
    assert.ok(pages >= 2, `${pages} pages`);

    // The events name the entries added and removed, 50 of each at most, with their counts: a
    // feed page or a webhook delivery of them stays small. The audit log has every entry.
    const feed = await t.request('GET', '/v1/events?type=policy.created,policy.updated&limit=100');
    const mine = feed.body.data.filter((event: any) => event.details.policy_id === created.body.policy_id);
    assert.equal(mine.length, 11);
    assert.ok(Buffer.byteLength(JSON.stringify(feed.body)) < 400_000, 'eleven events of a few KB');
    const [last, first] = [mine[0].details.changes.allowed_recipients, mine.at(-1).details.changes.allowed_recipients];
    assert.deepEqual([first.added.length, first.added_count, first.removed, first.removed_count], [50, 1_000, [], 0], 'the creation');
    assert.deepEqual([last.added, last.added_count, last.removed, last.removed_count],
      [domains(10).slice(0, 50), 1_000, domains(9).slice(0, 50), 1_000], 'the last change');
  });

  test('a page of policies stops early past 4 MiB of lists (1,000 domains weigh 260 KB a policy); the next page goes on', async () => {
    const { adminKey: key } = await t.createOrganization('Heavy policies');
    const domains = (variant: number) => Array.from({ length: 1_000 }, (_, i) =>
      `${`p${variant}-${i}-`.padEnd(50, 'q')}.${'x'.repeat(63)}.${'y'.repeat(63)}.${'z'.repeat(63)}.io`);
    const heavy = Math.ceil(POLICY_PAGE_BYTES_MAX / 250_000) + 1;
    const created: string[] = [];
    for (let variant = 0; variant < heavy; variant += 1) {
      const response = await t.request('POST', '/v1/policies', { key, body: { name: `heavy-${variant}`, allowedRecipients: domains(variant) } });
      assert.equal(response.status, 200, JSON.stringify(response.body).slice(0, 300));
      created.push(response.body.policy_id);
    }
    const seen: string[] = [];
    let cursor: string | null = null;
    let pages = 0;
    do {
      const response: { status: number; body: any } = await t.request('GET', `/v1/policies?limit=100${cursor ? `&cursor=${cursor}` : ''}`, { key });
      assert.equal(response.status, 200);
      const bytes = Buffer.byteLength(JSON.stringify(response.body));
      assert.ok(bytes < POLICY_PAGE_BYTES_MAX + 300_000, `a page of ${bytes} bytes`);
      assert.ok(response.body.data.length >= 1, 'a page holds at least one policy');
      seen.push(...response.body.data.map((policy: { policy_id: string }) => policy.policy_id));
      cursor = response.body.next_cursor;
      assert.equal(response.body.has_more, cursor !== null);
      pages += 1;
    } while (cursor);
    assert.deepEqual(seen.slice(0, heavy), [...created].reverse(), 'newest first, each once');
    assert.equal(seen.length, heavy + 4, 'and the four presets');
    assert.equal(new Set(seen).size, seen.length);
    assert.ok(pages >= 2, `${pages} pages`);
  });
});

test('a policy account another key created first at its address is never marked ready', async () => {
  const t = await startTestService({ workers: false });
  try {
    // A row not yet on chain, as a policy is between its commit and its chain write; its account's
    // address derives from the ids alone, so another key can create it first with the same limits.
    const policyId = `pol_squatted${process.pid}`;
    const own = t.service.ctx.chain;
    const account = await own.policyAddress(t.orgId, policyId);
    const nowMs = t.service.ctx.clock.nowMs();
    await t.service.ctx.db.query(
      `INSERT INTO policies (org_id, id, name, max_per_tx, chain_address, created_at, updated_at) VALUES ($1, $2, 'Squatted', $3, $4, $5, $5)`,
      [t.orgId, policyId, 5n * USDC, account, new Date(nowMs)]);
    await withAnotherKey(own, async (theirs) => {
      const { err } = await theirs.execute([await theirs.setPolicyIx(t.orgId, policyId, { maxPerTx: 5n * USDC, maxPerDay: NO_LIMIT, expiry: 0n })]);
      assert.equal(err, null);
    });
    const squatted = await own.getPolicy(account);
    assert.equal(squatted?.maxPerTx, 5n * USDC, 'the account holds the row\'s limits');

    await assert.rejects(syncPolicyToChain(t.service.ctx, t.orgId, policyId), /created by another key/);
    const [row] = await t.service.ctx.db.query<{ chain_status: string }>(
      'SELECT chain_status FROM policies WHERE org_id = $1 AND id = $2', [t.orgId, policyId]);
    assert.equal(row!.chain_status, 'pending');
  } finally {
    await t.close();
  }
});
