/**
 * API keys and roles (SPEC.md "Authentication", DESIGN §7) through the real HTTP stack and
 * database: a key is shown once and stored as a hash, each role holds exactly its permissions,
 * revocation is immediate, an organisation always keeps an admin key, another organisation's
 * keys are invisible.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { fundedWallet, newPolicy, newRecipient, unique } from '../../test/fixtures.ts';
import { holdLocks, queuedRequest, withSecondConnection } from '../../test/locks.ts';
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';
import { revokeApiKey } from './api-keys.ts';
import { createKeyCommand, listKeysCommand, revokeKeyCommand } from './command.ts';

const sha256 = (text: string): string => createHash('sha256').update(text, 'utf8').digest('hex');

const VIEW_FIELDS = ['api_key_id', 'created_at', 'last4', 'last_used_at', 'name', 'prefix', 'revoked_at', 'role'];

describe('API keys', () => {
  let t: TestService;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService({ workers: false });
    other = await t.createOrganization();
  });
  after(async () => { await t.close(); });

  async function createKey(body: Record<string, unknown>, key = t.adminKey) {
    const response = await t.request('POST', '/v1/api-keys', { key, body });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    return response.body as { api_key_id: string; key: string; role: string; name: string; prefix: string; last4: string };
  }

  async function keyCount(orgId: string): Promise<number> {
    const rows = await t.service.ctx.db.query<{ n: bigint }>('SELECT count(*)::bigint AS n FROM api_keys WHERE org_id = $1', [orgId]);
    return Number(rows[0]!.n);
  }

  /** The admin key id of a fresh organisation (its only key). */
  async function onlyKeyId(adminKey: string): Promise<string> {
    const listed = await t.request('GET', '/v1/api-keys', { key: adminKey });
    assert.equal(listed.body.data.length, 1, 'a new organisation has exactly its admin key');
    return listed.body.data[0].api_key_id;
  }

  test('a created key is in the creation response only; lists and reads show neither it nor its hash', async () => {
    const created = await createKey({ name: 'CI deploy', role: 'operator' });
    assert.deepEqual(Object.keys(created).sort(), ['api_key_id', 'created_at', 'key', 'last4', 'name', 'prefix', 'role']);
    assert.match(created.api_key_id, /^key_[0-9a-z]{26}$/);
    assert.match(created.key, /^av_operator_[0-9A-Za-z]{32}$/);
    assert.equal(created.role, 'operator');
    assert.equal(created.name, 'CI deploy');
    assert.equal(created.prefix, created.key.slice(0, 'av_operator_'.length + 4), 'the prefix is the role part and 4 characters');
    assert.equal(created.last4, created.key.slice(-4));

    const hash = sha256(created.key);
    const read = await t.request('GET', `/v1/api-keys/${created.api_key_id}`);
    assert.equal(read.status, 200);
    assert.deepEqual(Object.keys(read.body).sort(), VIEW_FIELDS);
    assert.equal(read.body.prefix, created.prefix);
    assert.equal(read.body.last4, created.last4);
    assert.equal(read.body.revoked_at, null);
    const listed = await t.request('GET', '/v1/api-keys?limit=100');
    assert.ok(listed.body.data.some((k: { api_key_id: string }) => k.api_key_id === created.api_key_id), 'the key is listed');
    for (const text of [JSON.stringify(read.body), JSON.stringify(listed.body)]) {
      assert.ok(!text.includes(created.key), 'the key is never shown again');
      assert.ok(!text.includes(hash), 'its hash is never shown');
    }

    // At rest: the SHA-256 of the key, and the key itself nowhere in its row.
    const [row] = await t.service.ctx.db.query<{ key_hash: string; whole: string }>(
      'SELECT key_hash, row_to_json(api_keys)::text AS whole FROM api_keys WHERE id = $1', [created.api_key_id]);
    assert.equal(row!.key_hash, hash);
    assert.ok(!row!.whole.includes(created.key), 'the database does not hold the key');
  });

  test('a created key authenticates as its organisation with its role', async () => {
    const viewer = await createKey({ name: 'Dashboard', role: 'viewer' });
    const org = await t.request('GET', '/v1/organization', { key: viewer.key });
    assert.equal(org.status, 200);
    assert.equal(org.body.org_id, t.orgId);
    const write = await t.request('POST', '/v1/policies', { key: viewer.key, body: { name: 'x' } });
    assert.equal(write.status, 403);
    assert.equal(write.body.error.code, 'insufficient_permissions');
    const theirs = await createKey({ name: 'Their viewer', role: 'viewer' }, other.adminKey);
    assert.equal((await t.request('GET', '/v1/organization', { key: theirs.key })).body.org_id, other.orgId);
  });

  test('each role holds exactly its permissions; anything else is 403 insufficient_permissions', async () => {
    // One representative request per permission. Those that pass the role check stop at a
    // validation or a not-found error, so the matrix has no side effects; the status each
    // answers to an allowed role shows that the role check was passed.
    const probes: Array<{ permission: string; method: string; url: string; body?: unknown; allowedStatus: number }> = [
      { permission: 'read', method: 'GET', url: '/v1/organization', allowedStatus: 200 },
      { permission: 'read', method: 'GET', url: '/v1/wallets', allowedStatus: 200 },
      { permission: 'read', method: 'GET', url: '/v1/policies', allowedStatus: 200 },
      { permission: 'read', method: 'GET', url: '/v1/transactions', allowedStatus: 200 },
      { permission: 'read', method: 'GET', url: '/v1/recipients', allowedStatus: 200 },
      { permission: 'write', method: 'POST', url: '/v1/wallets', body: {}, allowedStatus: 400 },
      { permission: 'write', method: 'POST', url: '/v1/policies', body: {}, allowedStatus: 400 },
      { permission: 'write', method: 'PATCH', url: '/v1/policies/pol_nope', body: { name: 'x' }, allowedStatus: 404 },
      { permission: 'write', method: 'POST', url: '/v1/wallets/wal_nope/fund', body: {}, allowedStatus: 400 },
      { permission: 'write', method: 'POST', url: '/v1/recipients', body: {}, allowedStatus: 400 },
      { permission: 'api_keys', method: 'GET', url: '/v1/api-keys', allowedStatus: 200 },
      { permission: 'api_keys', method: 'POST', url: '/v1/api-keys', body: {}, allowedStatus: 400 },
      { permission: 'api_keys', method: 'GET', url: '/v1/api-keys/key_nope', allowedStatus: 404 },
      { permission: 'api_keys', method: 'DELETE', url: '/v1/api-keys/key_nope', allowedStatus: 404 },
      { permission: 'pay', method: 'POST', url: '/v1/payments', body: {}, allowedStatus: 400 },
      { permission: 'pay', method: 'POST', url: '/v1/payments/check', body: {}, allowedStatus: 400 },
      { permission: 'vault_read', method: 'GET', url: '/v1/wallets/wal_nope', allowedStatus: 404 },
      { permission: 'vault_read', method: 'GET', url: '/v1/wallets/wal_nope/transactions', allowedStatus: 404 },
      { permission: 'test_helpers', method: 'POST', url: '/v1/test_helpers/clock/advance', body: { seconds: 0 }, allowedStatus: 400 },
    ];
    // DESIGN §7: admin everything; operator all but API keys; agent pays from and reads the
    // vaults it holds a session token for; viewer reads; arbiter reads and resolves disputes.
    const matrix: Record<string, string[]> = {
      admin: ['read', 'write', 'api_keys', 'pay', 'vault_read', 'test_helpers'],
      operator: ['read', 'write', 'pay', 'vault_read', 'test_helpers'],
      agent: ['pay', 'vault_read'],
      viewer: ['read', 'vault_read'],
      arbiter: ['read', 'vault_read'],
    };
    for (const [role, permissions] of Object.entries(matrix)) {
      const { key } = await createKey({ name: `matrix ${role}`, role });
      for (const probe of probes) {
        const response = await t.request(probe.method, probe.url, { key, body: probe.body });
        const what = `${role} ${probe.method} ${probe.url}: ${JSON.stringify(response.body)}`;
        if (permissions.includes(probe.permission)) {
          assert.equal(response.status, probe.allowedStatus, what);
        } else {
          assert.equal(response.status, 403, what);
          assert.equal(response.body.error.code, 'insufficient_permissions', what);
          assert.match(response.body.error.message, new RegExp(`"${role}"`), what);
        }
      }
    }
  });

  test('a revoked key fails on its very next request; revoking it again returns it unchanged', async () => {
    const doomed = await createKey({ name: 'Leaked', role: 'operator' });
    assert.equal((await t.request('GET', '/v1/organization', { key: doomed.key })).status, 200);

    const revoked = await t.request('DELETE', `/v1/api-keys/${doomed.api_key_id}`);
    assert.equal(revoked.status, 200);
    assert.deepEqual(Object.keys(revoked.body).sort(), VIEW_FIELDS);
    assert.ok(revoked.body.revoked_at, 'the answer says when it was revoked');

    const refused = await t.request('GET', '/v1/organization', { key: doomed.key });
    assert.equal(refused.status, 401);
    assert.equal(refused.body.error.code, 'authentication_failed');

    const again = await t.request('DELETE', `/v1/api-keys/${doomed.api_key_id}`);
    assert.equal(again.status, 200);
    assert.deepEqual(again.body, revoked.body, 'revoking twice changes nothing');
    const read = await t.request('GET', `/v1/api-keys/${doomed.api_key_id}`);
    assert.equal(read.body.revoked_at, revoked.body.revoked_at, 'a revoked key stays readable, with when');
  });

  test('an organisation\'s last active admin key cannot be revoked', async () => {
    const org = await t.createOrganization('Last admin organization');
    const firstId = await onlyKeyId(org.adminKey);
    await createKey({ name: 'Not an admin', role: 'operator' }, org.adminKey);

    const refused = await t.request('DELETE', `/v1/api-keys/${firstId}`, { key: org.adminKey });
    assert.equal(refused.status, 400, 'other roles do not count as admins');
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.equal(refused.body.error.param, 'api_key_id');
    assert.equal((await t.request('GET', '/v1/organization', { key: org.adminKey })).status, 200, 'the key still works');

    // With a second admin key the first may go; then the second is the last one.
    const second = await createKey({ name: 'Second admin', role: 'admin' }, org.adminKey);
    assert.equal((await t.request('DELETE', `/v1/api-keys/${firstId}`, { key: second.key })).status, 200);
    const last = await t.request('DELETE', `/v1/api-keys/${second.api_key_id}`, { key: second.key });
    assert.equal(last.status, 400, 'a revoked admin key does not count');
    assert.equal(last.body.error.param, 'api_key_id');
  });

  // PGlite runs one transaction at a time, so there the two could not interleave and the test
  // could not fail without the lock: it runs on PostgreSQL only.
  test('two admins revoking each other at once leave exactly one admin key', {
    skip: !process.env.DATABASE_URL && 'needs DATABASE_URL (PGlite runs one transaction at a time)',
  }, async () => {
    // The last-admin check and the revocation are one step per organisation: otherwise both
    // could see the other still active and both succeed, locking everyone out. Called below
    // the HTTP layer so that both revocations are surely in flight together (over HTTP the
    // second key's own authentication may already fail).
    for (let round = 0; round < 3; round += 1) {
      const org = await t.createOrganization(`Revoking race ${round}`);
      const firstId = await onlyKeyId(org.adminKey);
      const second = await createKey({ name: 'Second admin', role: 'admin' }, org.adminKey);
      const { db, clock } = t.service.ctx;
      const outcomes = await Promise.allSettled([
        revokeApiKey(db, clock.nowMs(), org.orgId, firstId),
        revokeApiKey(db, clock.nowMs(), org.orgId, second.api_key_id),
      ]);
      assert.equal(outcomes.filter((o) => o.status === 'fulfilled').length, 1, 'exactly one revocation succeeds');
      const refused = outcomes.find((o) => o.status === 'rejected');
      assert.ok(refused?.status === 'rejected' && refused.reason instanceof ServiceError, 'the other is refused');
      assert.equal(refused.reason.code, 'invalid_request');
      assert.equal(refused.reason.details.param, 'api_key_id');
      const rows = await db.query<{ id: string }>(
        `SELECT id FROM api_keys WHERE org_id = $1 AND role = 'admin' AND revoked_at IS NULL`, [org.orgId]);
      assert.equal(rows.length, 1, 'one admin key remains active');
    }
  });

  // Guarantee: revocation is immediate for key management too: a request of a key revoked while
  // it waited for the organisation's lock (behind the revocation) neither makes nor revokes a key.
  test('a key revoked while its request waits makes no key and revokes none', async (context) => {
    await withSecondConnection(t, context, async (db) => {
      const org = await t.createOrganization('Revoked while waiting');
      const defender = await onlyKeyId(org.adminKey);
      const requests = [
        (key: string) => t.request('POST', '/v1/api-keys', { key, body: { name: 'Backdoor', role: 'admin' } }),
        (key: string) => t.request('DELETE', `/v1/api-keys/${defender}`, { key }),
      ];
      for (const request of requests) {
        const leaked = await createKey({ name: 'Leaked admin', role: 'admin' }, org.adminKey);
        // The revocation holds the organisation's lock and commits once the request waits behind it.
        const revoking = await holdLocks(db, (tx) => tx.query('SELECT id FROM organizations WHERE id = $1 FOR NO KEY UPDATE', [org.orgId]),
          (tx) => tx.query('UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL', [leaked.api_key_id]));
        const answer = await queuedRequest(db, revoking, () => request(leaked.key));
        assert.equal(answer.status, 401, JSON.stringify(answer.body));
        assert.equal(answer.body.error.code, 'authentication_failed');
      }
      const live = await t.service.ctx.db.query<{ id: string }>(
        'SELECT id FROM api_keys WHERE org_id = $1 AND revoked_at IS NULL', [org.orgId]);
      assert.deepEqual(live.map((row) => row.id), [defender], 'no key made, the defender\'s key not revoked');
    });
  });

  // Guarantee: the same for every write that waits for a lock: a co-signature, a session token,
  // a funding or withdrawal, an unfreeze, auto-topup, a policy's limits, a recipient's address.
  test('a key revoked while its write waits for a lock changes nothing: approve, rotate-token, fund, withdraw, PATCH, auto-topup, policy, recipient', async (context) => {
    await withSecondConnection(t, context, async (db) => {
      const policyId = await newPolicy(t, { requireCoSign: '1', maxPerTx: '5' });
      const wallet = await fundedWallet(t, '4', policyId);
      const awaiting = await t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '2', currency: 'USDC' } });
      assert.equal(awaiting.body.approval?.status, 'awaiting', JSON.stringify(awaiting.body));
      const frozen = await fundedWallet(t, '1');
      assert.equal((await t.request('PATCH', `/v1/wallets/${frozen.wallet_id}`, { body: { status: 'frozen' } })).status, 200);
      const recipient = await t.request('POST', '/v1/recipients', { body: { domain: `${unique('vendor')}.example`, address: await newRecipient() } });
      assert.equal(recipient.status, 200, JSON.stringify(recipient.body));
      const other = await newRecipient();
      assert.equal((await t.request('POST', '/v1/test_helpers/deposits', { body: { amount: '5' } })).status, 200, 'the reserve can fund');
      const state = async () => JSON.stringify([
        (await t.request('GET', `/v1/transactions/${awaiting.body.tx_id}`)).body.approval.status,
        await t.service.ctx.db.query('SELECT balance::text, status, session_public_key, auto_topup_enabled FROM wallets WHERE id = ANY ($1) ORDER BY id',
          [[wallet.wallet_id, frozen.wallet_id]]),
        (await t.request('GET', '/v1/organization')).body.reserve.usdc_balance,
        (await t.request('GET', `/v1/policies/${policyId}`)).body.max_per_tx,
        (await t.request('GET', `/v1/recipients/${recipient.body.recipient_id}`)).body.address,
      ]);
      const before = await state();
      const walletLock = (id: string) => (tx: Queryable) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [id]);
      const cases: Array<[string, (tx: Queryable) => Promise<unknown>, (key: string) => Promise<{ status: number; body: { error?: { code: string } } }>]> = [
        ['approve', walletLock(wallet.wallet_id), (key) => t.request('POST', `/v1/payments/${awaiting.body.tx_id}/approve`, { key, body: {} })],
        ['reject', (tx) => tx.query('SELECT id FROM transactions WHERE id = $1 FOR UPDATE', [awaiting.body.tx_id]),
          (key) => t.request('POST', `/v1/payments/${awaiting.body.tx_id}/reject`, { key, body: {} })],
        ['rotate-token', walletLock(wallet.wallet_id), (key) => t.request('POST', `/v1/wallets/${wallet.wallet_id}/rotate-token`, { key, body: {} })],
        ['fund', walletLock(wallet.wallet_id), (key) => t.request('POST', `/v1/wallets/${wallet.wallet_id}/fund`, { key, body: { amount: '1' } })],
        ['withdraw', walletLock(wallet.wallet_id), (key) => t.request('POST', `/v1/wallets/${wallet.wallet_id}/withdraw`, { key, body: { amount: '1' } })],
        ['unfreeze', walletLock(frozen.wallet_id), (key) => t.request('PATCH', `/v1/wallets/${frozen.wallet_id}`, { key, body: { status: 'active' } })],
        ['auto-topup', walletLock(wallet.wallet_id), (key) => t.request('PUT', `/v1/wallets/${wallet.wallet_id}/auto-topup`, {
          key, body: { enabled: true, triggerBelow: '1', topupAmount: '1' } })],
        ['policy', (tx) => tx.query('SELECT id FROM policies WHERE id = $1 FOR UPDATE', [policyId]),
          (key) => t.request('PATCH', `/v1/policies/${policyId}`, { key, body: { maxPerTx: '1000' } })],
        ['recipient', (tx) => tx.query('SELECT id FROM recipients WHERE id = $1 FOR UPDATE', [recipient.body.recipient_id]),
          (key) => t.request('PATCH', `/v1/recipients/${recipient.body.recipient_id}`, { key, body: { address: other } })],
      ];
      for (const [name, lock, request] of cases) {
        const leaked = await createKey({ name: `Leaked ${name}`, role: 'operator' });
        const held = await holdLocks(db, lock);
        const answer = await queuedRequest(t.service.ctx.db, held, () => request(leaked.key),
          () => t.service.ctx.db.query('UPDATE api_keys SET revoked_at = now() WHERE id = $1', [leaked.api_key_id]));
        assert.deepEqual([answer.status, answer.body.error?.code], [401, 'authentication_failed'], `${name}: ${JSON.stringify(answer.body)}`);
      }
      assert.equal(await state(), before, 'nothing changed');
    });
  });

  test('bad input is refused with the field named, and creates nothing', async () => {
    const before = await keyCount(t.orgId);
    const cases: Array<[unknown, string]> = [
      [{ name: 'x', role: 'wizard' }, 'role'],
      [{ name: 'x', role: 'ADMIN' }, 'role'],
      [{ name: 'x' }, 'role'],
      [{ role: 'viewer' }, 'name'],
      [{ name: '', role: 'viewer' }, 'name'],
      [{ name: '   ', role: 'viewer' }, 'name'],
      [{ name: 'x'.repeat(101), role: 'viewer' }, 'name'],
      [{ name: 'line\nbreak', role: 'viewer' }, 'name'],
      [{ name: 7, role: 'viewer' }, 'name'],
      [{ name: 'x', role: 'viewer', expires_at: '2030-01-01' }, 'expires_at'],
      ['{"name": "x", ', 'body'],
    ];
    for (const [body, param] of cases) {
      const response = await t.request('POST', '/v1/api-keys', { body });
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, 'invalid_request', JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    assert.equal(await keyCount(t.orgId), before, 'nothing was created');

    const longest = await createKey({ name: 'x'.repeat(100), role: 'viewer' });
    assert.equal(longest.name.length, 100, 'a name of 100 characters is accepted');
    // Characters, not UTF-16 units: 100 emoji are 100 characters, 101 are too many.
    assert.equal((await createKey({ name: '🔑'.repeat(100), role: 'viewer' })).name, '🔑'.repeat(100));
    const emojiTooLong = await t.request('POST', '/v1/api-keys', { body: { name: '🔑'.repeat(101), role: 'viewer' } });
    assert.equal(emojiTooLong.body.error?.param, 'name');

    for (const [url, param] of [
      ['/v1/api-keys?limit=0', 'limit'], ['/v1/api-keys?limit=101', 'limit'], ['/v1/api-keys?cursor=garbage', 'cursor'],
      ['/v1/api-keys?role=admin', 'role'], [`/v1/api-keys/${'k'.repeat(65)}`, 'api_key_id'],
    ] as const) {
      const response = await t.request('GET', url);
      assert.equal(response.status, 400, url);
      assert.equal(response.body.error.param, param, url);
    }
    const repeated = await t.request('GET', '/v1/api-keys?limit=1&limit=2');
    assert.deepEqual([repeated.status, repeated.body.error.param, repeated.body.error.message],
      [400, 'limit', 'Invalid value for "limit": given more than once; give it once.']);
    const listed = await t.request('POST', '/v1/api-keys', { body: { name: ['a', 'b'], role: 'viewer' } });
    assert.deepEqual([listed.status, listed.body.error.param, listed.body.error.message],
      [400, 'name', 'Invalid value for "name": must be string.'], 'an array in a body is of the wrong type, not repeated');
  });

  test('another organisation\'s key answers exactly like a missing one, and is left alone', async () => {
    const theirs = await createKey({ name: 'Theirs', role: 'viewer' }, other.adminKey);
    for (const method of ['GET', 'DELETE']) {
      const response = await t.request(method, `/v1/api-keys/${theirs.api_key_id}`);
      const missing = await t.request(method, '/v1/api-keys/key_01aaaaaaaaaaaaaaaaaaaaaaaa');
      assert.equal(response.status, 404, method);
      assert.equal(response.body.error.code, 'api_key_not_found', method);
      assert.equal(response.body.error.param, 'api_key_id', method);
      assert.equal(missing.body.error.code, 'api_key_not_found', method);
    }
    assert.equal((await t.request('GET', '/v1/organization', { key: theirs.key })).status, 200, 'their key still works');
    const ours = await t.request('GET', '/v1/api-keys?limit=100');
    assert.ok(!ours.body.data.some((k: { api_key_id: string }) => k.api_key_id === theirs.api_key_id), 'not in our list');
    const theirList = await t.request('GET', '/v1/api-keys?limit=100', { key: other.adminKey });
    const ourIds = new Set(ours.body.data.map((k: { api_key_id: string }) => k.api_key_id));
    assert.ok(!theirList.body.data.some((k: { api_key_id: string }) => ourIds.has(k.api_key_id)), 'nor ours in theirs');
  });

  test('the list is newest first, revoked keys included, and pages with limit and cursor', async () => {
    const org = await t.createOrganization('Paging organization');
    const adminId = await onlyKeyId(org.adminKey);
    const ids: string[] = [];
    for (const name of ['one', 'two', 'three']) {
      // The service clock moves a second between keys, so "newest" is unambiguous (the default
      // organisation moves it: it is every organisation's).
      await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 1 } });
      ids.push((await createKey({ name, role: 'agent' }, org.adminKey)).api_key_id);
    }
    await t.request('DELETE', `/v1/api-keys/${ids[0]}`, { key: org.adminKey });

    const first = await t.request('GET', '/v1/api-keys?limit=2', { key: org.adminKey });
    assert.equal(first.status, 200);
    assert.deepEqual(first.body.data.map((k: { api_key_id: string }) => k.api_key_id), [ids[2], ids[1]]);
    assert.equal(first.body.has_more, true);
    assert.equal(typeof first.body.next_cursor, 'string');

    // A key created between two pages does not shift the next page.
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 1 } });
    const newest = await createKey({ name: 'four', role: 'viewer' }, org.adminKey);
    const second = await t.request('GET', `/v1/api-keys?limit=2&cursor=${first.body.next_cursor}`, { key: org.adminKey });
    assert.deepEqual(second.body.data.map((k: { api_key_id: string }) => k.api_key_id), [ids[0], adminId]);
    assert.equal(second.body.has_more, false);
    assert.equal(second.body.next_cursor, null);
    assert.ok(second.body.data[0].revoked_at, 'a revoked key is listed with when it was revoked');

    const all = await t.request('GET', '/v1/api-keys', { key: org.adminKey });
    assert.deepEqual(all.body.data.map((k: { api_key_id: string }) => k.api_key_id), [newest.api_key_id, ids[2], ids[1], ids[0], adminId]);
    const times = all.body.data.map((k: { created_at: string }) => Date.parse(k.created_at));
    assert.deepEqual(times, [...times].sort((a, b) => b - a), 'created_at descends');
  });

  test('last_used_at records use, refreshed at most once a minute', async () => {
    const key = await createKey({ name: 'Usage', role: 'viewer' });
    const lastUsed = async () => (await t.request('GET', `/v1/api-keys/${key.api_key_id}`)).body.last_used_at as string | null;
    assert.equal(await lastUsed(), null, 'never used yet');

    await t.request('GET', '/v1/organization', { key: key.key });
    const firstUse = await lastUsed();
    assert.ok(firstUse, 'the first use is recorded');
    await t.request('GET', '/v1/wallets', { key: key.key });
    assert.equal(await lastUsed(), firstUse, 'a use within the minute writes nothing');

    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } });
    await t.request('GET', '/v1/organization', { key: key.key });
    const later = await lastUsed();
    assert.ok(later && Date.parse(later) - Date.parse(firstUse) >= 60_000, `refreshed after a minute: ${firstUse} → ${later}`);
  });

  test('only admin keys manage keys; an admin key may revoke itself when another admin remains', async () => {
    const operator = await createKey({ name: 'Operator', role: 'operator' });
    const victim = await createKey({ name: 'Victim', role: 'viewer' });
    const refused = await t.request('DELETE', `/v1/api-keys/${victim.api_key_id}`, { key: operator.key });
    assert.equal(refused.status, 403);
    assert.equal(refused.body.error.code, 'insufficient_permissions');
    const escalate = await t.request('POST', '/v1/api-keys', { key: operator.key, body: { name: 'mine', role: 'admin' } });
    assert.equal(escalate.status, 403, 'an operator cannot mint itself an admin key');
    assert.equal((await t.request('GET', '/v1/organization', { key: victim.key })).status, 200, 'the victim key still works');

    const spare = await createKey({ name: 'Spare admin', role: 'admin' });
    const self = await t.request('DELETE', `/v1/api-keys/${spare.api_key_id}`, { key: spare.key });
    assert.equal(self.status, 200);
    assert.equal((await t.request('GET', '/v1/api-keys', { key: spare.key })).status, 401);
  });

  test('the operator\'s commands (agent-vault keys) obey the same rules without the API\'s schema', async () => {
    // test/e2e/cli.test.ts runs the real executable; here the refusals it would print, cheaply.
    const ctx = { db: t.service.ctx.db, clock: t.service.ctx.clock };
    const before = await keyCount(t.orgId);
    for (const [options, code, param] of [
      [{ role: 'wizard' }, 'invalid_request', 'role'],
      [{ role: 'viewer', name: '   ' }, 'invalid_request', 'name'],
      [{ role: 'viewer', name: 'x'.repeat(101) }, 'invalid_request', 'name'],
      [{ role: 'viewer', org: 'org_nope' }, 'not_found', 'org'],
    ] as const) {
      await assert.rejects(createKeyCommand(ctx, options), (error: unknown) =>
        error instanceof ServiceError && error.code === code && error.details.param === param, JSON.stringify(options));
    }
    assert.equal(await keyCount(t.orgId), before, 'nothing was created');

    // Without --org: the default organisation.
    const printed = await createKeyCommand(ctx, { role: 'viewer' });
    const key = /^ {2}(av_viewer_\S+)$/m.exec(printed)?.[1];
    assert.ok(key, `the key is printed:\n${printed}`);
    assert.match(printed, new RegExp(`"viewer key \\(CLI\\)"\\) in organisation ${t.orgId}\\.`));
    assert.equal((await t.request('GET', '/v1/organization', { key })).body.org_id, t.orgId);

    const org = await t.createOrganization('Command organization');
    const adminId = await onlyKeyId(org.adminKey);
    await assert.rejects(revokeKeyCommand(ctx, { apiKeyId: adminId, org: org.orgId }), /last active admin key/);
    await assert.rejects(revokeKeyCommand(ctx, { apiKeyId: adminId }), (error: unknown) =>
      error instanceof ServiceError && error.code === 'api_key_not_found', 'another organisation\'s key is not found');
    const listed = await listKeysCommand(ctx, { org: org.orgId });
    assert.ok(listed.includes(adminId) && !listed.includes(org.adminKey), 'listed by id, never by key');
  });

  test('the unauthenticated and wrongly authenticated are refused before anything else', async () => {
    for (const key of [null, 'av_admin_notakeynotakeynotakeynotakey00']) {
      const response = await t.request('POST', '/v1/api-keys', { key, body: { name: 'x', role: 'admin' } });
      assert.equal(response.status, 401);
      assert.equal(response.body.error.code, 'authentication_failed');
    }
  });
});
