/**
 * Idempotency keys on the real database: replay, conflict, and what happens when the first
 * request stops without answering (a crash, a lost reply): the key's lease runs out, and a
 * retry answers with what was recorded — or runs again when nothing was.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { ServiceError } from '../errors/errors.ts';
import { IDEMPOTENCY_LEASE_MS, IDEMPOTENCY_TTL_MS, purgeExpiredKeys, runIdempotent } from './idempotency.ts';

describe('idempotency keys', () => {
  let t: TestService;
  let counter = 0;
  before(async () => { t = await startTestService({ workers: false }); });
  after(async () => { await t.close(); });

  // Leases measured on the same made-up clock as the rest, so that a test can move past one.
  const op = (key: string, nowMs: number, extra: Record<string, unknown> = {}) => ({
    orgId: t.orgId, key, operation: 'test.op', params: { a: 1 }, nowMs, leaseNowMs: nowMs, ...extra,
  });
  const newKey = () => `key-${process.pid}-${(counter += 1)}`;

  test('a replay answers the first answer; other parameters and a running first request are conflicts', async () => {
    const key = newKey();
    let runs = 0;
    let release!: () => void;
    const gate = new Promise<void>((resolve) => { release = resolve; });
    let started!: () => void;
    const claimed = new Promise<void>((resolve) => { started = resolve; }); // the work runs once the key is claimed
    const first = runIdempotent(t.service.ctx.db, op(key, 1_000), async () => {
      runs += 1;
      started();
      await gate;
      return { status: 200, body: { n: runs } };
    });
    await claimed;
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 2_000), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'idempotency_conflict' && /still being processed/.test(error.message));
    release();
    assert.deepEqual(await first, { status: 200, body: { n: 1 }, replayed: false });
    assert.deepEqual(await runIdempotent(t.service.ctx.db, op(key, 3_000), async () => ({ status: 500, body: {} })),
      { status: 200, body: { n: 1 }, replayed: true, stored: true });
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 3_000, { params: { a: 2 } }), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'idempotency_conflict' && /other parameters/.test(error.message));
    assert.equal(runs, 1);
  });

  test('a refusal of the credentials is not kept: a retry with valid ones runs, other refusals are replayed', async () => {
    for (const code of ['session_token_expired', 'session_token_invalid', 'authentication_failed', 'insufficient_permissions'] as const) {
      const key = newKey();
      await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 500_000), async () => { throw new ServiceError(code, 'refused'); }),
        (error: ServiceError) => error.code === code && !error.replayed);
      assert.deepEqual(await runIdempotent(t.service.ctx.db, op(key, 500_001), async () => ({ status: 200, body: { paid: code } })),
        { status: 200, body: { paid: code }, replayed: false });
    }
    const key = newKey();
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 500_000), async () => { throw new ServiceError('invalid_recipient', 'refused'); }));
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 500_001), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'invalid_recipient' && error.replayed === true);
  });

  test('a first request that recorded its work and then failed is answered from the record, never run twice', async () => {
    const key = newKey();
    let runs = 0;
    const recover = async (resourceId: string) => ({ status: 200, body: { recovered: resourceId } });
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 10_000, { recover }), async (mark) => {
      runs += 1;
      await t.service.ctx.db.transaction(async (tx) => { await mark(tx, 'tx_recorded'); });
      throw new Error('the process lost its database connection after the commit');
    }), /lost its database connection/);
    const retried = await runIdempotent(t.service.ctx.db, op(key, 10_001, { recover }), async () => {
      runs += 1;
      return { status: 200, body: { ranAgain: true } };
    });
    assert.deepEqual(retried, { status: 200, body: { recovered: 'tx_recorded' }, replayed: true },
      'the record is the first request\'s work, so the answer is a replay');
    assert.equal(runs, 1, 'the work ran once');
    const replay = await runIdempotent(t.service.ctx.db, op(key, 10_002, { recover }), async () => ({ status: 500, body: {} }));
    assert.equal(replay.replayed, true);
  });

  test('a first request whose answer the database failed to store ends its lease: a retry at once answers from the record', async () => {
    const key = newKey();
    const { db } = t.service.ctx;
    // The database fails the one statement that stores the answer, as a connection dropped at
    // that moment would; every other statement (the lease's end among them) reaches it.
    const failing = new Proxy(db, {
      get(target, name) {
        if (name === 'query') {
          return (sql: string, params?: unknown[]) => (/SET state = 'done'/.test(sql)
            ? Promise.reject(Object.assign(new Error('terminating connection due to administrator command'), { code: '57P01' }))
            : target.query(sql, params));
        }
        const value: unknown = Reflect.get(target, name, target);
        return typeof value === 'function' ? value.bind(target) : value;
      },
    });
    const recover = async (resourceId: string) => ({ status: 200, body: { recovered: resourceId } });
    await assert.rejects(runIdempotent(failing, op(key, 20_000, { recover }), async (mark) => {
      await db.transaction(async (tx) => { await mark(tx, 'tx_recorded'); });
      return { status: 200, body: { made: true } };
    }), /terminating connection/);
    assert.deepEqual(await runIdempotent(db, op(key, 20_001, { recover }), async () => ({ status: 200, body: { ranAgain: true } })),
      { status: 200, body: { recovered: 'tx_recorded' }, replayed: true }, 'within what was the lease: answered from the record');
  });

  test('a first request that stopped before recording anything runs again once its lease is over', async () => {
    const key = newKey();
    // A request that never answers (its process died): its work never settles.
    await new Promise<void>((started) => { void runIdempotent(t.service.ctx.db, op(key, 100_000), () => { started(); return new Promise(() => {}); }); });
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 100_000 + IDEMPOTENCY_LEASE_MS - 1), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'idempotency_conflict', 'within the lease: still running');
    const taken = await runIdempotent(t.service.ctx.db, op(key, 100_000 + IDEMPOTENCY_LEASE_MS), async () => ({ status: 200, body: { second: true } }));
    assert.deepEqual(taken, { status: 200, body: { second: true }, replayed: false });
  });

  test('a first request that resumes after a retry took its key over records nothing and answers for nothing', async () => {
    const key = newKey();
    const db = t.service.ctx.db;
    let release!: () => void;
    const gate = new Promise<void>((resolve) => { release = resolve; });
    // Held up past its lease (a chain call that took a minute), then recording its work.
    let started!: () => void;
    const claimed = new Promise<void>((resolve) => { started = resolve; });
    const first = runIdempotent(db, op(key, 300_000), async (mark) => {
      started();
      await gate;
      await db.transaction(async (tx) => { await mark(tx, 'tx_first'); });
      return { status: 200, body: { first: true } };
    });
    await claimed;
    const second = await runIdempotent(db, op(key, 300_000 + IDEMPOTENCY_LEASE_MS), async (mark) => {
      await db.transaction(async (tx) => { await mark(tx, 'tx_second'); });
      return { status: 200, body: { second: true } };
    });
    assert.deepEqual(second, { status: 200, body: { second: true }, replayed: false });
    release();
    await assert.rejects(first, (error: ServiceError) => error.code === 'idempotency_conflict' && /took the key over/.test(error.message));
    const replay = await runIdempotent(db, op(key, 300_000 + IDEMPOTENCY_LEASE_MS + 1), async () => ({ status: 500, body: {} }));
    assert.deepEqual(replay, { status: 200, body: { second: true }, replayed: true, stored: true });
    const [row] = await db.query<{ resource_id: string }>('SELECT resource_id FROM idempotency_keys WHERE org_id = $1 AND key = $2', [t.orgId, key]);
    assert.equal(row!.resource_id, 'tx_second', 'the first request\'s record was rolled back with its mark');
  });

  test('a test clock moved past a running request\'s lease does not end it: the lease is wall time', async () => {
    const key = newKey();
    let release!: () => void;
    const gate = new Promise<void>((resolve) => { release = resolve; });
    let started!: () => void;
    const claimed = new Promise<void>((resolve) => { started = resolve; });
    const serviceNowMs = t.service.ctx.clock.nowMs();
    const { leaseNowMs: _wall, ...first } = op(key, serviceNowMs);
    const running = runIdempotent(t.service.ctx.db, first, async () => { started(); await gate; return { status: 200, body: { settled: true } }; });
    await claimed;
    // The service clock a minute and more ahead (POST /v1/test_helpers/clock/advance), the wall clock not.
    const { leaseNowMs: _alsoWall, ...retry } = op(key, serviceNowMs + IDEMPOTENCY_LEASE_MS + 1_000);
    await assert.rejects(runIdempotent(t.service.ctx.db, retry, async () => ({ status: 200, body: { ranAgain: true } })),
      (error: ServiceError) => error.code === 'idempotency_conflict' && /still being processed/.test(error.message));
    release();
    assert.deepEqual(await running, { status: 200, body: { settled: true }, replayed: false });
    assert.deepEqual(await runIdempotent(t.service.ctx.db, retry, async () => ({ status: 500, body: {} })),
      { status: 200, body: { settled: true }, replayed: true, stored: true }, 'the first answer is the key\'s');
  });

  test('a refusal recovered from a dead first request\'s record is marked as a replay', async () => {
    const key = newKey();
    const recover = async (): Promise<{ status: number; body: unknown }> => {
      throw new ServiceError('policy_violation', 'The payment breaks the max_per_tx rule.', { tx_id: 'tx_blocked' });
    };
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 400_000, { recover }), async (mark) => {
      await t.service.ctx.db.transaction(async (tx) => { await mark(tx, 'tx_blocked'); });
      throw new Error('the process died after recording');
    }));
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 400_001, { recover }), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'policy_violation' && error.replayed === true);
  });

  test('a recorded first request without a way to recover it keeps refusing the key', async () => {
    const key = newKey();
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 200_000), async (mark) => {
      await t.service.ctx.db.transaction(async (tx) => { await mark(tx, 'x'); });
      throw new Error('crash');
    }));
    await assert.rejects(runIdempotent(t.service.ctx.db, op(key, 200_001), async () => ({ status: 200, body: {} })),
      (error: ServiceError) => error.code === 'idempotency_conflict' && /new key/.test(error.message));
  });

  test('an Idempotency-Key on a request that does not take one is refused, not ignored; nothing is made', async () => {
    const headers = { 'idempotency-key': newKey() };
    const webhooks = async () => (await t.request('GET', '/v1/webhooks?limit=100')).body.data.length;
    const before = await webhooks();
    const created = await t.request('POST', '/v1/webhooks', { headers, body: { url: 'https://hooks.example.com/once', events: '*' } });
    assert.deepEqual([created.status, created.body.error?.code, created.body.error?.param], [400, 'invalid_request', 'idempotency_key']);
    assert.match(created.body.error.message, /only payments, escrow creation, wallet creation, funding, batch funding and withdrawals/);
    assert.equal(await webhooks(), before, 'no webhook made');
    const patched = await t.request('PATCH', '/v1/policies/pol_x', { headers, body: { name: 'x' } });
    assert.equal(patched.body.error?.param, 'idempotency_key');
    // A path that does not exist is 404 whatever the headers.
    assert.equal((await t.request('POST', '/v1/nothing-here', { headers, body: {} })).status, 404);
    // Reads repeat harmlessly: the header changes nothing there.
    assert.equal((await t.request('GET', '/v1/webhooks', { headers })).status, 200);
    // Where it is taken, it still is.
    const wallet = await t.request('POST', '/v1/wallets', { headers, body: { agentId: `idem-${process.pid}`, label: 'x', policyId: 'pol_moderate' } });
    assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
    const again = await t.request('POST', '/v1/wallets', { headers, body: { agentId: `idem-${process.pid}`, label: 'x', policyId: 'pol_moderate' } });
    assert.equal(again.headers['idempotency-replayed'], 'true');
  });

  test('expired keys are purged, batch after batch, and can be used again', async () => {
    const keys = [newKey(), newKey(), newKey()];
    for (const key of keys) await runIdempotent(t.service.ctx.db, op(key, 300_000), async () => ({ status: 200, body: { first: true } }));
    const young = newKey();
    await runIdempotent(t.service.ctx.db, op(young, 400_000), async () => ({ status: 200, body: { first: true } }));
    const purged = await purgeExpiredKeys(t.service.ctx.db, 300_000 + IDEMPOTENCY_TTL_MS, 1);
    assert.ok(purged >= 3, `the expired keys were purged, one per statement (${purged})`);
    const left = async (key: string) => (await t.service.ctx.db.query(
      'SELECT 1 FROM idempotency_keys WHERE org_id = $1 AND key = $2', [t.orgId, key])).length;
    for (const key of keys) assert.equal(await left(key), 0, 'purged');
    assert.equal(await left(young), 1, 'a key not yet 24 hours old stays');
  });
});
