/**
 * How many vaults, API keys, policies and open escrows an organisation may have
 * (AGENT_VAULT_WALLETS_PER_ORG_MAX, AGENT_VAULT_API_KEYS_PER_ORG_MAX, AGENT_VAULT_POLICIES_PER_ORG_MAX,
 * AGENT_VAULT_OPEN_ESCROWS_PER_ORG_MAX; here 3 of each): the next creation is refused and creates
 * nothing; revoking a key, or a policy's or a settled escrow's accounts on chain being closed,
 * makes room, archiving a vault does not (its accounts stay open); creations side by side never go
 * over; another organisation has its own count.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { fundedWallet, newRecipient } from '../../test/fixtures.ts';
import { closeSettledEscrows } from '../escrow/close.ts';
import { tickEscrows } from '../escrow/escrows.ts';
import { closeDeletedPolicies, POLICY_CLOSE_LIMITS } from '../policies/close.ts';

describe('counts per organisation', () => {
  let t: TestService;
  before(async () => {
    t = await startTestService({ env: {
      AGENT_VAULT_WALLETS_PER_ORG_MAX: '3', AGENT_VAULT_API_KEYS_PER_ORG_MAX: '3', AGENT_VAULT_POLICIES_PER_ORG_MAX: '3',
      AGENT_VAULT_OPEN_ESCROWS_PER_ORG_MAX: '3',
    } });
  });
  after(async () => { await t.close(); });

  const countOf = async (sql: string, orgId: string) => (await t.service.ctx.db.query<{ n: number }>(sql, [orgId]))[0]!.n;

  test('vaults: the one over the limit is refused; creations side by side stop at it; an archived one still counts', async () => {
    const org = await t.createOrganization('Vault hoarder');
    const create = (agentId: string) => t.request('POST', '/v1/wallets', {
      key: org.adminKey, body: { agentId, label: 'Agent', policyId: 'pol_permissive' },
    });
    const answers = await Promise.all(['a1', 'a2', 'a3', 'a4', 'a5'].map(create));
    assert.deepEqual(answers.map((a) => a.status).sort(), [200, 200, 200, 400, 400], JSON.stringify(answers.map((a) => a.body)));
    const refused = answers.find((a) => a.status === 400)!;
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.match(refused.body.error.message, /limit of 3 vaults \(archived ones count: their chain accounts stay open\)/);
    const countWallets = () => countOf('SELECT count(*)::int AS n FROM wallets WHERE org_id = $1', org.orgId);
    assert.equal(await countWallets(), 3, 'nothing created by the refused ones');
    const made = answers.filter((a) => a.status === 200).map((a) => a.body as { wallet_id: string; agent_id: string });
    const again = await create(made[0]!.agent_id);
    assert.equal(again.body.error.code, 'wallet_agent_id_conflict', 'an existing agent is told so, not about the limit');
    // Archived, its accounts on chain (and their rent) stay: no room is made, or a loop of
    // creations and archives would spend the operator key's SOL without a bound.
    assert.equal((await t.request('DELETE', `/v1/wallets/${made[0]!.wallet_id}`, { key: org.adminKey })).status, 200);
    assert.equal((await create('a6')).status, 400, 'an archived vault leaves no room');
    assert.equal((await t.request('POST', '/v1/wallets', { body: { agentId: `other-${process.pid}`, label: 'Agent', policyId: 'pol_permissive' } })).status, 200,
      'another organisation counts its own');
  });

  test('API keys: the one over the limit is refused; revoking makes room; the operator\'s command is not limited', async () => {
    const org = await t.createOrganization('Key hoarder');
    const create = () => t.request('POST', '/v1/api-keys', { key: org.adminKey, body: { name: 'agent', role: 'agent' } });
    const first = await create();
    const second = await create();
    assert.deepEqual([first.status, second.status], [200, 200], 'with the admin key, three');
    const over = await create();
    assert.equal(over.status, 400, JSON.stringify(over.body));
    assert.match(over.body.error.message, /limit of 3 API keys not revoked/);
    const keys = () => countOf('SELECT count(*)::int AS n FROM api_keys WHERE org_id = $1', org.orgId);
    assert.equal(await keys(), 3);
    assert.equal((await t.request('DELETE', `/v1/api-keys/${first.body.api_key_id}`, { key: org.adminKey })).status, 200);
    assert.equal((await create()).status, 200, 'a revoked key leaves room');
    const { createKeyCommand } = await import('../api-keys/command.ts');
    await createKeyCommand({ db: t.service.ctx.db, clock: t.service.ctx.clock }, { role: 'admin', org: org.orgId });
    assert.equal(await keys(), 5, 'the operator can always add a key');
  });

  test('policies: creations and clones side by side stop at the limit; presets do not count; deleting makes room', async () => {
    const org = await t.createOrganization('Policy hoarder');
    const create = (name: string) => t.request('POST', '/v1/policies', { key: org.adminKey, body: { name, maxPerTx: '1000000' } });
    const clone = (name: string) => t.request('POST', '/v1/policies/pol_conservative/clone', { key: org.adminKey, body: { name } });
    const answers = await Promise.all([create('p1'), create('p2'), clone('c1'), clone('c2'), create('p3')]);
    assert.deepEqual(answers.map((a) => a.status).sort(), [200, 200, 200, 400, 400], JSON.stringify(answers.map((a) => a.body)));
    const refused = answers.find((a) => a.status === 400)!;
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.match(refused.body.error.message, /limit of 3 policies: delete policies no vault uses/);
    const policies = () => countOf('SELECT count(*)::int AS n FROM policies WHERE org_id = $1 AND NOT is_preset', org.orgId);
    assert.equal(await policies(), 3, 'nothing created by the refused ones');
    const listed = await t.request('GET', '/v1/policies?limit=100', { key: org.adminKey });
    assert.ok(listed.body.data.some((p: { policy_id: string }) => p.policy_id === 'pol_conservative'), 'presets are still listed');
    const made = answers.find((a) => a.status === 200)!.body as { policy_id: string };
    assert.equal((await t.request('DELETE', `/v1/policies/${made.policy_id}`, { key: org.adminKey })).status, 200);
    // Deleting alone does not give the rent back: create and delete in a loop would pass the bound.
    assert.equal((await create('p4')).status, 400, 'a deleted policy counts while its account is open on chain');
    const grace = POLICY_CLOSE_LIMITS.graceMs / 1000 + 1;
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: grace } })).status, 200);
    assert.deepEqual(await closeDeletedPolicies(t.service.ctx), { closed: 1, refused: 0 });
    assert.equal((await create('p4')).status, 200, 'once its account is closed, room');
    assert.equal((await clone('c3')).status, 400);
    assert.equal((await t.request('POST', '/v1/policies', { body: { name: 'elsewhere', maxPerTx: '1000000' } })).status, 200,
      'another organisation counts its own');
  });

  test('escrows: open ones count until their accounts on chain are closed; creations side by side stop at the limit', async () => {
    const org = await t.createOrganization('Escrow hoarder');
    const from = await fundedWallet(t, '10', 'pol_permissive', org.adminKey);
    const to = await newRecipient();
    const open = (timeoutSeconds = 3600) => t.request('POST', '/v1/payments/a2a', {
      key: org.adminKey, body: { fromWallet: from.wallet_id, toWallet: to, amount: '1', currency: 'USDC', taskDescription: 'a task', timeoutSeconds },
    });
    const first = await open(60);
    assert.equal(first.status, 200, JSON.stringify(first.body));
    const answers = await Promise.all([open(), open(), open(), open()]);
    assert.deepEqual(answers.map((a) => a.status).sort(), [200, 200, 400, 400], JSON.stringify(answers.map((a) => a.body)));
    const refused = answers.find((a) => a.status === 400)!;
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.match(refused.body.error.message, /limit of 3 escrows open on chain/);
    assert.equal((await t.request('GET', `/v1/wallets/${from.wallet_id}`, { key: org.adminKey })).body.usdc_balance, '7.00', 'the refused locked nothing');
    // Settled (refunded at its timeout), an escrow still counts while its accounts hold the rent.
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } })).status, 200);
    await tickEscrows(t.service.ctx);
    assert.equal((await t.request('GET', `/v1/payments/a2a/${first.body.escrow_id}`, { key: org.adminKey })).body.status, 'refunded');
    assert.equal((await open()).status, 400, 'settled, its accounts still open');
    for (let i = 0; i < 10 && (await closeSettledEscrows(t.service.ctx)).closed > 0; i += 1);
    assert.equal((await open()).status, 200, 'once its accounts are closed, room');
  });
});
