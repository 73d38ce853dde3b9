/**
 * Creating an organisation: its admin key is shown even when its setup on chain fails (an
 * operator key without SOL on a real cluster), and the next start finishes that setup.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import type { ChainClient } from '../chain/client.ts';
import { createOrganizationCommand } from './command.ts';
import { bootstrapOrganizations, createOrganization } from './organizations.ts';

describe('creating an organisation', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ workers: false }); });
  after(async () => { await t.close(); });

  /** The service's chain, whose transactions all fail to confirm, as with an operator key that cannot pay fees. */
  const unfundedChain = (): ChainClient => new Proxy(t.service.ctx.chain, {
    get(target, property) {
      if (property === 'execute') return async () => { throw new Error('the operator cannot pay the fee'); };
      const value = Reflect.get(target, property) as unknown;
      return typeof value === 'function' ? (value as (...args: unknown[]) => unknown).bind(target) : value;
    },
  });

  test('its admin key is told before the chain setup, which the next start finishes', async () => {
    let shown: { orgId: string; key: string } | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name: 'Unfunded', onCreated: (orgId, key) => { shown = { orgId, key: key.key }; },
    }), /cannot pay the fee/);
    assert.ok(shown, 'the key was told although the setup failed');
    const { orgId, key } = shown as { orgId: string; key: string };
    // The next start provisions what is pending; the key shown then works.
    await bootstrapOrganizations(t.service.ctx, null);
    const org = await t.request('GET', '/v1/organization', { key });
    assert.equal(org.status, 200, JSON.stringify(org.body));
    assert.equal(org.body.org_id, orgId);
    const [row] = await t.service.ctx.db.query<{ chain_status: string }>('SELECT chain_status FROM organizations WHERE id = $1', [orgId]);
    assert.equal(row!.chain_status, 'ready', 'set up on chain by the next start');
  });

  test('agent-vault org create prints the key in its error when the chain setup fails', async () => {
    const error = await createOrganizationCommand({ ...t.service.ctx, chain: unfundedChain() }, { name: 'Unfunded CLI' })
      .then(() => null, (caught: Error) => caught);
    assert.ok(error);
    const key = /Its admin API key \(shown once, store it now\):\s+(\S+)/.exec(error.message)?.[1];
    assert.ok(key, error.message);
    await bootstrapOrganizations(t.service.ctx, null);
    assert.equal((await t.request('GET', '/v1/organization', { key })).status, 200);
  });
});
