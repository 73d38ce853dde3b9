/**
 * Creating an organisation: its admin key is shown even when its setup on chain fails (an
 * operator key without SOL on a real cluster), and the organizations.setup job or the next start finishes that setup.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import pino from 'pino';
import { unfundedChain as unfundedChainOf, withAnotherKey } from '../../test/fixtures.ts';
import { onDatabase, startTestService, type TestService } from '../../test/harness.ts';
import { startSharedChain } from '../../test/shared-chain.ts';
import { lamports } from '@solana/kit';
import type { ChainClient } from '../chain/client.ts';
import { loadConfig } from '../config/config.ts';
import { quoteIdentifier } from '../db/database.ts';
import { buildService, type Service } from '../server.ts';
import { operatorCommand } from '../cli.ts';
import { createOrganizationCommand } from './command.ts';
import { bootstrapOrganizations, createOrganization, setUpPendingOrganizations } from './organizations.ts';

describe('creating an organisation', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ workers: false }); });
  after(async () => { await t.close(); });

  const unfundedChain = (): ChainClient => unfundedChainOf(t.service.ctx.chain);

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

  test('a pending organisation is set up by the organizations.setup job, later and later after failures, without a restart', async () => {
    let shown: { orgId: string; key: string } | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name: 'Set up later', onCreated: (orgId, key) => { shown = { orgId, key: key.key }; },
    }));
    const { orgId, key } = shown as unknown as { orgId: string; key: string };
    const statusOf = async () => (await t.service.ctx.db.query<{ chain_status: string; setup_failures: number }>(
      'SELECT chain_status, setup_failures FROM organizations WHERE id = $1', [orgId]))[0]!;
    const wallet = () => t.request('POST', '/v1/wallets', { key, body: { agentId: `later-${orgId}`, label: 'x', policyId: 'pol_moderate' } });
    assert.equal((await wallet()).status, 503, 'refused while pending');
    const advance = (seconds: number) => t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } });
    const unfunded = { ...t.service.ctx, chain: unfundedChain() };

    assert.equal(await setUpPendingOrganizations(unfunded), 0);
    assert.deepEqual(await statusOf(), { chain_status: 'pending', setup_failures: 0 }, 'its creator\'s to set up for its first 15 s');
    await advance(15);
    assert.equal(await setUpPendingOrganizations(unfunded), 0);
    assert.deepEqual(await statusOf(), { chain_status: 'pending', setup_failures: 1 }, 'the operator key still cannot pay');
    assert.equal(await setUpPendingOrganizations(t.service.ctx), 0, 'not tried again before its back-off');
    await advance(15);
    assert.equal(await setUpPendingOrganizations(t.service.ctx), 1);
    assert.equal((await statusOf()).chain_status, 'ready');
    assert.equal((await wallet()).status, 200, 'the tenant\'s retry succeeds');
  });

  test('agent-vault org create prints the key in its error when the chain setup fails', async () => {
    const error = await createOrganizationCommand({ ...t.service.ctx, chain: unfundedChain() }, { name: 'Unfunded CLI' })
      .then(() => null, (caught: Error) => caught);
    assert.ok(error);
    const key = /Its admin API key \(shown once, store it now\):\s+(\S+)/.exec(error.message)?.[1];
    assert.ok(key, error.message);
    // As the CLI prints it: whole, where any other failure is cut to its first line.
    await assert.rejects(operatorCommand(async () => { throw error; })([]), (printed: Error) => printed.message.includes(key));
    await assert.rejects(operatorCommand(async () => { throw new Error('first line\nsecond line'); })([]),
      (printed: Error) => printed.message === 'first line');
    await bootstrapOrganizations(t.service.ctx, null);
    assert.equal((await t.request('GET', '/v1/organization', { key })).status, 200);
  });

  test('another operator key, or a chain without the default reserve: serve\'s start and org create refuse, saying why, nothing made', async () => {
    const organizations = async () => (await t.service.ctx.db.query<{ n: number }>('SELECT count(*)::int AS n FROM organizations'))[0]!.n;
    const before = await organizations();
    await withAnotherKey(t.service.ctx.chain, async (theirs) => {
      // The same chain, another process's key (another data dir's): every money move would fail.
      const refusal = { name: 'ChainMismatchError', message: new RegExp(`answers to the operator key ${t.service.ctx.chain.operator.address}, not to this process's ${theirs.operator.address}`) };
      await assert.rejects(bootstrapOrganizations({ ...t.service.ctx, chain: theirs }, null), refusal);
      await assert.rejects(createOrganizationCommand({ ...t.service.ctx, chain: theirs }, { name: 'Signed elsewhere' }), refusal);
    });
    // A chain where the reserve is not (org create without the service's AGENT_VAULT_RPC_URL
    // starts an embedded one): the organisation would be set up where the service never looks.
    const elsewhere = new Proxy(t.service.ctx.chain, {
      get(target, property) {
        if (property === 'getAccountData') return async () => null;
        const value = Reflect.get(target, property) as unknown;
        return typeof value === 'function' ? (value as (...args: unknown[]) => unknown).bind(target) : value;
      },
    });
    await assert.rejects(createOrganizationCommand({ ...t.service.ctx, chain: elsewhere }, { name: 'Elsewhere' }),
      { name: 'ChainMismatchError', message: /has no reserve .* on this chain/ });
    assert.equal(await organizations(), before, 'nothing created');
  });

  test('lamports sent to the reserve\'s address before its setup do not stop it', async () => {
    let shown: { orgId: string; key: string } | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name: 'Prefunded', onCreated: (orgId, key) => { shown = { orgId, key: key.key }; },
    }));
    const { orgId, key } = shown as unknown as { orgId: string; key: string };
    // Anyone can send lamports to any address: an account of the System program, with no data.
    const { reserve } = await t.service.ctx.chain.reserveAddresses(orgId);
    await t.service.ctx.chain.rpc.requestAirdrop(reserve, lamports(1_000_000n)).send();
    assert.equal((await t.service.ctx.chain.getAccountData(reserve))?.length, 0);

    await bootstrapOrganizations(t.service.ctx, null);
    const [row] = await t.service.ctx.db.query<{ chain_status: string }>('SELECT chain_status FROM organizations WHERE id = $1', [orgId]);
    assert.equal(row!.chain_status, 'ready');
    const org = await t.request('GET', '/v1/organization', { key });
    assert.equal(typeof org.body.reserve.token_account, 'string');
  });

  test('a reserve another key set up first at its address is refused: no deposit address, a start still starts', async () => {
    // The reserve's address derives from the organisation's id alone, which its setup
    // transaction shows: another key can create the reserve there first, for the real mint.
    let shown: { orgId: string; key: string } | null = null;
    await assert.rejects(createOrganization({ ...t.service.ctx, chain: unfundedChain() }, {
      name: 'Squatted', onCreated: (orgId, key) => { shown = { orgId, key: key.key }; },
    }));
    const { orgId, key } = shown as unknown as { orgId: string; key: string };
    await withAnotherKey(t.service.ctx.chain, async (theirs) => {
      const squatted = await theirs.execute([await theirs.initReserveIx(orgId)]);
      assert.equal(squatted.err, null);
    });

    const failures: Array<{ orgId: string; message: string }> = [];
    await bootstrapOrganizations(t.service.ctx, null, { onPendingFailed: (id, error) => failures.push({ orgId: id, message: error.message }) });
    assert.equal(failures.length, 1);
    assert.equal(failures[0]!.orgId, orgId);
    assert.match(failures[0]!.message, /reserve .* was not set up by this service's operator key/);
    const [row] = await t.service.ctx.db.query<{ chain_status: string }>('SELECT chain_status FROM organizations WHERE id = $1', [orgId]);
    assert.equal(row!.chain_status, 'pending', 'never marked ready');
    const org = await t.request('GET', '/v1/organization', { key });
    assert.equal(org.status, 200);
    assert.equal(org.body.reserve.token_account, null, 'the squatter\'s token account is not shown as the deposit address');
    // Without someone to tell, the start fails saying why, as before.
    await assert.rejects(bootstrapOrganizations(t.service.ctx, null), /was not set up by this service's operator key/);
  });
});

test('processes starting together on an empty database all start, with one default organisation', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (PGlite has one process per data dir)');
    return;
  }
  const chain = await startSharedChain();
  try {
    for (let round = 0; round < 3; round += 1) {
      const schema = `t_${randomBytes(6).toString('hex')}`;
      const dirs = [mkdtempSync(join(tmpdir(), 'av-race-')), mkdtempSync(join(tmpdir(), 'av-race-'))];
      // The tests' own schema, made first (production uses the database's own schema).
      await onDatabase(databaseUrl, `CREATE SCHEMA ${quoteIdentifier(schema)}`);
      const started: Array<PromiseSettledResult<Service>> = await Promise.allSettled(
        dirs.map((dataDir) => chain.start({ databaseUrl, schema, dataDir })));
      const services = started.flatMap((result) => (result.status === 'fulfilled' ? [result.value] : []));
      try {
        assert.deepEqual(started.map((result) => (result.status === 'fulfilled' ? 'started' : String(result.reason))), ['started', 'started']);
        const defaults = await services[0]!.ctx.db.query('SELECT id FROM organizations WHERE is_default');
        assert.equal(defaults.length, 1);
        assert.equal(services.filter((service) => service.bootstrapAdminKey !== null).length, 1, 'one of them made it, and shows its key');
      } finally {
        for (const service of services) await service.close();
        await onDatabase(databaseUrl, `DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
        for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
      }
    }
  } finally {
    await chain.close();
  }
});

test('a start against another chain than the database was made with is refused, saying why', async (context) => {
  const databaseUrl = process.env.DATABASE_URL;
  if (!databaseUrl) {
    context.skip('needs DATABASE_URL (with PGlite the database lives in the data dir, beside the chain)');
    return;
  }
  const schema = `t_${randomBytes(6).toString('hex')}`;
  const dirs = [mkdtempSync(join(tmpdir(), 'av-chain-')), mkdtempSync(join(tmpdir(), 'av-chain-'))];
  const start = (dir: string): Promise<Service> => buildService(loadConfig({
    AGENT_VAULT_DATA_DIR: dir, AGENT_VAULT_SLOT_MS: '0', AGENT_VAULT_VALIDATOR_THREAD: 'off', DATABASE_URL: databaseUrl, LOG_LEVEL: 'silent',
  }), { schema, scheduleJobs: false, workers: false, logger: pino({ level: 'silent' }) });
  try {
    await (await start(dirs[0]!)).close();
    // The same database, a new data dir: a new embedded chain, without the organisation's reserve.
    await assert.rejects(start(dirs[1]!), /has no reserve .* on this chain/);
    // Its own data dir again: it starts.
    await (await start(dirs[0]!)).close();
  } finally {
    await onDatabase(databaseUrl, `DROP SCHEMA IF EXISTS ${quoteIdentifier(schema)} CASCADE`);
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
  }
});
