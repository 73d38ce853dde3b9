/**
 * Webhook deliveries end to end: events made through the API reach real HTTP receivers on
 * 127.0.0.1 (AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS on), signed as docs/webhooks.md says; the retry
 * schedule on the test clock; degradation, pausing and re-enabling; redirects; a worker that
 * dies mid-attempt, and a sending thread that does; secret rotation; and, on PostgreSQL, several dispatchers on one database,
 * a webhook deleted while its attempts are recorded, deliveries paused, resumed or expired while their successes are
 * recorded, and an event whose transaction is open across its webhook's re-enabling.
 *
 * Receivers record the service clock at each arrival, so the schedule is checked in business
 * time; the test clock is advanced to just before each due time (nothing may arrive) and then
 * past it (the attempt must arrive).
 */
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { newRecipient } from '../../test/fixtures.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { holdLocks, queuedBehind, queuedRequest, withSecondConnection } from '../../test/locks.ts';
import { openDatabase, type Queryable } from '../db/database.ts';
import { recordEvent, recordEvents } from '../events/events.ts';
import { newId } from '../ids/ids.ts';
import type { AppContext } from '../http/context.ts';
import {
  claimDueAttempts, claimStream, DELIVERY_LOG_RETENTION_MS, deliveryLag, dispatchWebhooks, expireDeliveryLog, FINAL_ATTEMPT_LEASE_MS, recordAttempt,
  recordSuccesses, recoverLapsedStreams, sendStream, settleLostFinalAttempts, STREAM_START_WITHIN_MS,
} from './delivery.ts';
import { AttemptSender } from './sender.ts';
import { deleteWebhook } from './webhooks.ts';
import { startReceiver, type ReceivedRequest, type Receiver } from './testing.ts';

const FAILED = { succeeded: false, statusCode: 500, latencyMs: 5, error: 'The endpoint answered 500: a 2xx is required.', responseExcerpt: null };

/** SPEC.md: attempt 2 after 1 minute, 3 after 5 minutes, 4 after 30 minutes, 5 after 2 hours. */
const RETRY_DELAYS_MS = [60_000, 300_000, 1_800_000, 7_200_000] as const;

const hmac = (secret: string, body: string) => createHmac('sha256', secret).update(body, 'utf8').digest('hex');

interface Delivery {
  delivery_id: string;
  event_id: string;
  event_type: string;
  status: string;
  attempt_count: number;
  next_attempt_at: string | null;
  delivered_at: string | null;
  failure_reason: string | null;
  attempts: Array<{ attempt: number; attempted_at: string; outcome: string; status_code: number | null; error: string | null; next_attempt_at: string | null }>;
}

describe('webhook deliveries', () => {
  let t: TestService;
  let receiver: Receiver;
  before(async () => {
    t = await startTestService({ env: { AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'on' } });
    receiver = await startReceiver({ receivedAt: () => t.service.ctx.clock.nowMs() });
  });
  after(async () => {
    await receiver.close();
    await t.close();
  });

  /** A fresh organisation with a webhook to `path`; the receiver checks its secret. */
  async function setUp(path: string, events: string | string[]) {
    const org = await t.createOrganization(`Webhooks ${path}`);
    const created = await t.request('POST', '/v1/webhooks', { key: org.adminKey, body: { url: receiver.url(path), events } });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    receiver.secret = created.body.signing_secret;
    return { key: org.adminKey, webhookId: created.body.webhook_id as string, secret: created.body.signing_secret as string };
  }
  const arrivals = (path: string): ReceivedRequest[] => receiver.received.filter((r) => r.path === path);
  async function deliveries(key: string, webhookId: string, query = ''): Promise<Delivery[]> {
    const response = await t.request('GET', `/v1/webhooks/${webhookId}/deliveries?limit=100${query}`, { key });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    return response.body.data;
  }
  async function newPolicyEvent(key: string, name: string): Promise<string> {
    assert.equal((await t.request('POST', '/v1/policies', { key, body: { name } })).status, 200);
    const feed = await t.request('GET', '/v1/events?type=policy.created&limit=1', { key });
    await t.othersWritesEnded();
    return feed.body.data[0].event_id;
  }
  async function serviceNowMs(): Promise<number> {
    return Date.parse((await t.request('GET', '/v1/test_helpers/clock')).body.now);
  }
  async function advance(seconds: number): Promise<void> {
    if (seconds <= 0) return;
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } })).status, 200);
  }

  test('a receiver that checks signatures gets every event it subscribed to, once, and nothing else', async () => {
    const org = await t.createOrganization('Subscriber');
    const key = org.adminKey;
    const hook = async (path: string, events: string | string[]) => {
      const response = await t.request('POST', '/v1/webhooks', { key, body: { url: receiver.url(path), events } });
      assert.equal(response.status, 200, JSON.stringify(response.body));
      return response.body as { webhook_id: string; signing_secret: string };
    };
    const everything = await hook('/everything', '*');
    const named = await hook('/named', ['wallet.created', 'wallet.funded', 'transaction.completed']);
    const secretOf: Record<string, string> = { '/everything': everything.signing_secret, '/named': named.signing_secret };
    receiver.reply = (request) => {
      const secret = secretOf[request.path];
      const valid = secret !== undefined && hmac(secret, request.rawBody) === request.headers['service-signature'];
      return valid ? { status: 204 } : { status: 401 };
    };
    try {
      // Deposit, vault creation, funding, a payment, a policy: events of many kinds, some by jobs.
      assert.equal((await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount: '30' } })).status, 200);
      const wallet = await t.request('POST', '/v1/wallets', { key, body: { agentId: 'subscriber-agent', label: 'A', policyId: 'pol_permissive' } });
      assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
      assert.equal((await t.request('POST', `/v1/wallets/${wallet.body.wallet_id}/fund`, { key, body: { amount: '20' } })).status, 200);
      const paid = await t.request('POST', '/v1/payments', {
        key, body: { walletId: wallet.body.wallet_id, to: await newRecipient(), amount: '2.5', currency: 'USDC' },
      });
      assert.equal(paid.status, 200, JSON.stringify(paid.body));
      assert.equal((await t.request('POST', '/v1/policies', { key, body: { name: 'Subscriber policy' } })).status, 200);

      // Every job runs; events that jobs write are delivered by the same or the next run.
      let feed: Array<{ event_id: string; type: string; timestamp: string; details: Record<string, unknown> }> = [];
      for (let run = 0; run < 5; run += 1) {
        await t.service.jobs.runOnce();
        feed = (await t.request('GET', '/v1/events?limit=100', { key })).body.data;
        if (arrivals('/everything').length >= feed.length) break;
      }
      const types = new Set(feed.map((e) => e.type));
      for (const type of ['org.deposit_confirmed', 'wallet.created', 'wallet.funded', 'transaction.pending', 'transaction.completed', 'policy.created']) {
        assert.ok(types.has(type), `the feed has ${type}`);
      }

      const everyArrival = arrivals('/everything');
      assert.deepEqual(everyArrival.map((r) => r.body.id).sort(), feed.map((e) => e.event_id).sort(), '"*" receives every event once');
      const namedTypes = ['wallet.created', 'wallet.funded', 'transaction.completed'];
      const namedArrival = arrivals('/named');
      assert.deepEqual(namedArrival.map((r) => r.body.id).sort(),
        feed.filter((e) => namedTypes.includes(e.type)).map((e) => e.event_id).sort(), 'named subscriptions receive those events only');

      const byId = new Map(feed.map((e) => [e.event_id, e]));
      for (const arrival of [...everyArrival, ...namedArrival]) {
        const secret = secretOf[arrival.path]!;
        assert.equal(arrival.headers['service-signature'], hmac(secret, arrival.rawBody), 'signed with the webhook\'s secret');
        assert.equal(arrival.headers['service-signature-previous'], undefined, 'no previous signature before a rotation');
        const event = byId.get(arrival.body.id as string)!;
        // The body is {event, id, timestamp, ...payload}.
        assert.deepEqual(arrival.body, { event: event.type, id: event.event_id, timestamp: event.timestamp, ...event.details });
        assert.ok(arrival.rawBody.startsWith(`{"event":"${event.type}","id":"${event.event_id}","timestamp":"`), 'envelope fields first');
        assert.equal(arrival.headers['service-event-id'], event.event_id);
        assert.equal(arrival.headers['service-delivery-attempt'], '1');
        assert.equal(arrival.headers['content-type'], 'application/json');
        assert.match(String(arrival.headers['user-agent']), /^AgentVault-Webhooks\//);
        assert.match(String(arrival.headers['service-delivery-id']), /^dlv_[0-9a-z]{26}$/);
      }
      const completed = namedArrival.find((r) => r.body.event === 'transaction.completed')!;
      assert.equal(completed.body.tx_id, paid.body.tx_id);
      assert.equal(completed.body.wallet_id, wallet.body.wallet_id);

      const log = await deliveries(key, named.webhook_id);
      assert.equal(log.length, namedArrival.length);
      for (const delivery of log) {
        assert.equal(delivery.status, 'delivered');
        assert.equal(delivery.attempt_count, 1);
        assert.equal(delivery.attempts.length, 1);
        assert.equal(delivery.attempts[0]!.outcome, 'succeeded');
        assert.equal(delivery.attempts[0]!.status_code, 204);
        assert.equal(delivery.next_attempt_at, null);
        assert.equal(typeof delivery.delivered_at, 'string');
      }
      // The benchmark hook: event time to 2xx, over what was delivered.
      const lag = await deliveryLag(t.service.ctx.db, 0);
      assert.ok(lag.delivered >= everyArrival.length + namedArrival.length, `lag covers the deliveries (${lag.delivered})`);
      assert.ok(lag.p50Ms !== null && lag.p95Ms !== null && lag.maxMs !== null && lag.p50Ms <= lag.maxMs, 'lag has percentiles');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
  });

  test('a failing receiver sees attempts at 0, +1 min, +5 min, +30 min, +2 h; then the webhook degrades and re-enabling delivers what waited', async () => {
    const { key, webhookId } = await setUp('/failing', ['policy.created']);
    let failing = true;
    receiver.reply = (request) => (failing || !request.signatureValid ? { status: 500, body: 'boom' } : { status: 200 });
    try {
      const first = await newPolicyEvent(key, 'Schedule 1');
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/failing').length, 1, 'attempt 1 immediately');
      const listedAs = async (status: string) => (await deliveries(key, webhookId, `&status=${status}`)).map((d) => d.event_id).sort();
      assert.deepEqual(await listedAs('pending'), [first], 'listed by its status: pending');
      assert.deepEqual(await listedAs('paused'), []);

      for (let k = 1; k <= 4; k += 1) {
        const [delivery] = await deliveries(key, webhookId, `&eventId=${first}`);
        const last = delivery!.attempts.at(-1)!;
        assert.equal(last.attempt, k);
        assert.equal(last.outcome, 'failed');
        assert.equal(last.status_code, 500);
        // The schedule, exactly: the next attempt is due the delay after this one began.
        const dueMs = Date.parse(last.attempted_at) + RETRY_DELAYS_MS[k - 1]!;
        assert.equal(Date.parse(last.next_attempt_at!), dueMs);
        assert.equal(Date.parse(delivery!.next_attempt_at!), dueMs);
        assert.equal(delivery!.status, 'pending');

        // Just before the due time nothing is sent…
        await advance(Math.floor((dueMs - await serviceNowMs()) / 1000) - 10);
        await t.service.jobs.runOnce();
        assert.equal(arrivals('/failing').length, k, `attempt ${k + 1} not before its time`);
        // …and once it has passed, the next attempt is.
        await advance(11);
        await t.service.jobs.runOnce();
        const hits = arrivals('/failing');
        assert.equal(hits.length, k + 1, `attempt ${k + 1} once due`);
        assert.equal(hits[k]!.headers['service-delivery-attempt'], String(k + 1));
        const lateMs = hits[k]!.receivedAtMs - dueMs;
        assert.ok(lateMs >= 0 && lateMs < 60_000, `attempt ${k + 1} came ${lateMs} ms after its due time`);
      }

      // The fifth failure degrades the webhook and pauses the delivery.
      const webhook = (await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body;
      assert.equal(webhook.status, 'degraded');
      assert.equal(typeof webhook.degraded_at, 'string');
      const [exhausted] = await deliveries(key, webhookId, `&eventId=${first}`);
      assert.equal(exhausted!.status, 'paused');
      assert.equal(exhausted!.attempt_count, 5);
      assert.equal(exhausted!.next_attempt_at, null);
      assert.equal(exhausted!.attempts.at(-1)!.next_attempt_at, null, 'no sixth attempt in a run');

      // Later events queue, paused: nothing is sent while degraded, however long.
      const second = await newPolicyEvent(key, 'Schedule 2');
      await advance(3 * 3600);
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/failing').length, 5, 'nothing sent while degraded');
      const [waiting] = await deliveries(key, webhookId, `&eventId=${second}`);
      assert.equal(waiting!.status, 'paused');
      assert.equal(waiting!.attempt_count, 0);
      assert.deepEqual(await listedAs('paused'), [first, second].sort(), 'listed by their status: paused');
      assert.deepEqual(await listedAs('pending'), []);

      // Re-enabling restarts the paused deliveries: a new run of attempts, the first at once.
      failing = false;
      const enabled = await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } });
      assert.equal(enabled.status, 200);
      assert.equal(enabled.body.status, 'active');
      await t.service.jobs.runOnce();
      const resumed = arrivals('/failing').slice(5);
      assert.deepEqual(resumed.map((r) => r.body.id).sort(), [first, second].sort(), 'both waiting events delivered');
      assert.equal(resumed.find((r) => r.body.id === first)!.headers['service-delivery-attempt'], '6', 'attempt numbers keep counting');
      assert.equal(resumed.find((r) => r.body.id === second)!.headers['service-delivery-attempt'], '1');
      for (const delivery of await deliveries(key, webhookId)) assert.equal(delivery.status, 'delivered', delivery.event_id);
      const [redone] = await deliveries(key, webhookId, `&eventId=${first}`);
      const sixth = redone!.attempts.at(-1)!;
      assert.deepEqual([sixth.attempt, sixth.outcome, sixth.next_attempt_at], [6, 'succeeded', null],
        'a retry that succeeded has nothing scheduled after it, as a first attempt that succeeded has not');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('a disabled webhook queues nothing and sends nothing; re-enabling sends what was pending', async () => {
    const { key, webhookId } = await setUp('/disabled', ['policy.created']);
    receiver.reply = () => ({ status: 500 });
    try {
      const pending = await newPolicyEvent(key, 'Before disable');
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/disabled').length, 1);
      assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } })).body.status, 'disabled');
      const [paused] = await deliveries(key, webhookId);
      assert.equal(paused!.status, 'paused');
      await newPolicyEvent(key, 'While disabled');
      await advance(3600);
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/disabled').length, 1, 'nothing sent while disabled');
      assert.equal((await deliveries(key, webhookId)).length, 1, 'events while disabled are not queued');
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } });
      await t.service.jobs.runOnce();
      assert.deepEqual(arrivals('/disabled').map((r) => r.body.id), [pending, pending]);
      assert.equal((await deliveries(key, webhookId))[0]!.status, 'delivered');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('an event written before the webhook was disabled, not yet taken by the dispatcher, is sent once it is re-enabled', async () => {
    const { key, webhookId } = await setUp('/disabled-early', ['policy.created']);
    const before = await newPolicyEvent(key, 'Written just before disabling');
    // Disabled before the dispatcher took the event (no job ran in between).
    assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } })).body.status, 'disabled');
    const [held] = await deliveries(key, webhookId, `&eventId=${before}`);
    assert.equal(held?.status, 'paused', 'kept for the webhook, paused');
    await newPolicyEvent(key, 'While disabled');
    await t.service.jobs.runOnce();
    assert.equal(arrivals('/disabled-early').length, 0, 'nothing sent while disabled');
    await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } });
    await t.service.jobs.runOnce();
    assert.deepEqual(arrivals('/disabled-early').map((r) => r.body.id), [before], 'the earlier event, and only it');
    assert.equal((await deliveries(key, webhookId)).length, 1);
  });

  test('an event committed before the disable is kept while an older transaction is still open elsewhere', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const { key, webhookId } = await setUp('/disabled-open', ['policy.created']);
      // Some other work holds a transaction open from before the event (the stream's horizon stays behind it).
      const older = await holdLocks(other, (tx) => tx.query('SELECT pg_current_xact_id()'));
      try {
        const before = await newPolicyEvent(key, 'Written while another transaction is open');
        assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } })).status, 200);
        const [held] = await deliveries(key, webhookId, `&eventId=${before}`);
        assert.equal(held?.status, 'paused', 'kept for the webhook, paused');
      } finally {
        older.release();
        await older.done;
      }
    });
  });

  test('an event still unsent after the delivery log\'s 30 days is given up unsent (expired)', async () => {
    const { key, webhookId } = await setUp('/late-dispatch', ['policy.created']);
    const event = await newPolicyEvent(key, 'Long undelivered');
    // No dispatcher ran for 30 days (the event's first attempt never happened).
    await advance(30 * 24 * 3600 + 60);
    await t.service.jobs.runOnce();
    assert.equal(arrivals('/late-dispatch').length, 0, 'not sent');
    const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.equal(delivery!.status, 'failed');
    assert.equal(delivery!.failure_reason, 'expired');
    assert.equal(delivery!.attempt_count, 0);
    assert.deepEqual(delivery!.attempts, []);
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  test('finished deliveries older than the delivery log\'s 30 days are deleted with their attempts, batch after batch', async () => {
    const { key, webhookId } = await setUp('/old-log', ['policy.created']);
    const event = await newPolicyEvent(key, 'Old log');
    await newPolicyEvent(key, 'Old log 2');
    await newPolicyEvent(key, 'Old log 3');
    await t.service.jobs.runOnce();
    const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.equal(delivery!.status, 'delivered');
    assert.equal((await deliveries(key, webhookId)).length, 3);
    await advance(30 * 24 * 3600 + 60);
    const { deleted } = await expireDeliveryLog(t.service.ctx.db, t.service.ctx.clock.nowMs(), { batch: 1 });
    assert.ok(deleted >= 3, `finished deliveries were deleted, one per statement (${deleted})`);
    assert.deepEqual(await deliveries(key, webhookId), [], 'all gone from the log');
    const [attempts] = await t.service.ctx.db.query<{ n: number }>(
      'SELECT count(*)::int AS n FROM webhook_attempts WHERE delivery_id = $1', [delivery!.delivery_id]);
    assert.equal(attempts!.n, 0, 'its attempt went with it');
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  test('a redirect is a failed attempt and is not followed', async () => {
    const { key, webhookId } = await setUp('/redirect', ['policy.created']);
    receiver.reply = (request) => (request.path === '/redirect'
      ? { status: 307, headers: { location: receiver.url('/redirect-target') } } : { status: 200 });
    try {
      const event = await newPolicyEvent(key, 'Redirected');
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/redirect').length, 1);
      assert.equal(arrivals('/redirect-target').length, 0, 'the Location was not followed');
      const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
      assert.equal(delivery!.status, 'pending');
      assert.equal(delivery!.attempts[0]!.outcome, 'failed');
      assert.equal(delivery!.attempts[0]!.status_code, 307);
      assert.match(delivery!.attempts[0]!.error!, /redirect/);
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('a batch claimed while the webhook was degraded and recorded after its re-enabling is sent, not left paused', async () => {
    const { key, webhookId } = await setUp('/reenabled', ['policy.created']);
    await t.service.ctx.db.query(`UPDATE webhooks SET status = 'degraded', degraded_at = now() WHERE id = $1`, [webhookId]);
    const event = await newPolicyEvent(key, 'Re-enabled');
    // A worker takes the degraded webhook's new events (to record them paused, unsent)…
    const stream = await claimStream(t.service.ctx.db, t.service.ctx.clock.nowMs(), 100);
    assert.ok(stream?.attempts.some((attempt) => attempt.eventId === event), 'the event is in the claimed batch');
    assert.equal(stream!.active, false);
    // …the operator re-enables the webhook before that batch is recorded…
    assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } })).body.status, 'active');
    await sendStream(t.service.ctx as AppContext, stream!);
    // …and the event is due at once, like every delivery paused before the re-enabling.
    const [recorded] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.equal(recorded!.status, 'pending', 'not paused under an active webhook');
    await t.service.jobs.runOnce();
    assert.deepEqual(arrivals('/reenabled').map((r) => r.body.id), [event], 'delivered');
    assert.equal((await deliveries(key, webhookId, `&eventId=${event}`))[0]!.status, 'delivered');
  });

  /**
   * A new organisation's webhook on `path`, answered there after `delayMs` (the receiver's reply
   * until the test puts the usual one back), and `count` events for it.
   */
  async function slowWebhook(path: string, delayMs: number, count: number): Promise<{ key: string; webhookId: string }> {
    const org = await t.createOrganization(`Slow ${path}`);
    const created = await t.request('POST', '/v1/webhooks', { key: org.adminKey, body: { url: receiver.url(path), events: ['policy.created'] } });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    receiver.secret = created.body.signing_secret;
    receiver.reply = (request) => ({ status: request.signatureValid ? 200 : 401, delayMs: request.path === path ? delayMs : 0 });
    await recordEvents(t.service.ctx.db, t.service.ctx.clock.nowMs(), Array.from({ length: count }, (_, k) => ({
      orgId: org.orgId, type: 'policy.created' as const, summary: `Policy ${k}`, payload: { policy_id: `pol_${k}` },
    })));
    await t.othersWritesEnded();
    return { key: org.adminKey, webhookId: created.body.webhook_id as string };
  }

  test('a retry is recorded delivered when its 2xx came back, not when the slowest retry beside it ended', async () => {
    const org = await t.createOrganization('Retried together');
    const webhookIds: string[] = [];
    for (const path of ['/retry-fast', '/retry-slow']) {
      const created = await t.request('POST', '/v1/webhooks', { key: org.adminKey, body: { url: receiver.url(path), events: ['policy.created'] } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      webhookIds.push(created.body.webhook_id as string);
    }
    try {
      receiver.reply = () => ({ status: 500 });
      await newPolicyEvent(org.adminKey, 'retried together');
      await t.service.jobs.runOnce();
      await advance(61);
      // The second attempts go out in one batch: one answered at once, the other 800 ms later.
      receiver.reply = (request) => ({ status: 200, delayMs: request.path === '/retry-slow' ? 800 : 0 });
      await t.service.jobs.runOnce();
      const [fast, slow] = await Promise.all(webhookIds.map(async (id) => (await deliveries(org.adminKey, id))[0]!));
      assert.deepEqual([fast!.status, slow!.status], ['delivered', 'delivered']);
      assert.ok(Date.parse(slow!.delivered_at!) - Date.parse(fast!.delivered_at!) >= 500,
        `the fast one's own time: ${fast!.delivered_at} against ${slow!.delivered_at}`);
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
  });

  test('a url changed while a batch goes slowly to the old one: the batch\'s attempts not yet started go to the new url', async () => {
    const count = 70;
    const { key, webhookId } = await slowWebhook('/old-url', STREAM_START_WITHIN_MS + 1_000, count);
    try {
      const dispatching = t.service.jobs.runOnce();
      const deadline = Date.now() + 10_000;
      while (arrivals('/old-url').length < 64) {
        assert.ok(Date.now() < deadline, `only ${arrivals('/old-url').length} attempts began`);
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { url: receiver.url('/new-url') } })).status, 200);
      await dispatching;
      assert.equal(arrivals('/old-url').length, 64, 'the attempts in flight finish where they began');
      assert.equal(arrivals('/new-url').length, count - 64, 'the others follow the change');
      const log = await deliveries(key, webhookId);
      assert.equal(log.length, count);
      assert.ok(log.every((delivery) => delivery.status === 'delivered'), JSON.stringify(log.map((d) => d.status)));
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
  });

  test('a slow batch leaves what it cannot send within its lease to the retries, due at once', async () => {
    const count = 70;
    const { key, webhookId } = await slowWebhook('/lease-end', STREAM_START_WITHIN_MS + 500, count);
    try {
      const stream = await claimStream(t.service.ctx.db, t.service.ctx.clock.nowMs(), 512);
      assert.equal(stream?.webhookId, webhookId);
      // The claim is 50 s old when its batch goes out: one round of attempts fits in its lease, not two.
      await advance(50);
      assert.equal(await sendStream(t.service.ctx as AppContext, stream!), 64, 'one round made');
      const log = await deliveries(key, webhookId);
      assert.equal(log.filter((d) => d.status === 'delivered').length, 64);
      const deferred = log.filter((d) => d.status !== 'delivered');
      assert.equal(deferred.length, count - 64);
      assert.ok(deferred.every((d) => d.status === 'pending' && d.attempt_count === 0), JSON.stringify(deferred[0]));
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/lease-end').length, count, 'the rest made as retries');
      assert.ok((await deliveries(key, webhookId)).every((d) => d.status === 'delivered'));
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
  });

  test('receivers that never answer do not hold up another organisation\'s deliveries', async () => {
    // One receiver stalls past the 5 s deadline on /stall/*; /fine answers at once.
    const stalling = await startReceiver();
    stalling.reply = (request) => (request.path.startsWith('/stall') ? { status: 200, delayMs: 6_000 } : { status: 200 });
    const made: Array<[string, string]> = []; // [key, webhook id]: deleted at the end, so that later tests' streams come first
    try {
      const slowOrg = await t.createOrganization('Stalling receivers');
      const slowIds: string[] = [];
      // More than a run has claimers, even held-up ones replaced (12): before, they held every one.
      for (let i = 0; i < 16; i += 1) {
        const created = await t.request('POST', '/v1/webhooks', { key: slowOrg.adminKey, body: { url: stalling.url(`/stall/${i}`), events: '*' } });
        assert.equal(created.status, 200, JSON.stringify(created.body));
        slowIds.push(created.body.webhook_id);
        made.push([slowOrg.adminKey, created.body.webhook_id]);
      }
      const other = await t.createOrganization('Answering receiver');
      const fine = await t.request('POST', '/v1/webhooks', { key: other.adminKey, body: { url: stalling.url('/fine'), events: '*' } });
      assert.equal(fine.status, 200, JSON.stringify(fine.body));
      made.push([other.adminKey, fine.body.webhook_id]);
      await newPolicyEvent(slowOrg.adminKey, 'for the stalling receivers');
      await newPolicyEvent(other.adminKey, 'for the answering one');
      // When the answering receiver is reached, the stalling ones are still holding their requests:
      // none of their attempts has ended, so none is recorded yet.
      let recordedStalls: Promise<number> | null = null;
      const answer = stalling.reply;
      stalling.reply = (request) => {
        if (request.path === '/fine' && recordedStalls === null) {
          recordedStalls = t.service.ctx.db.query<{ n: number }>(
            'SELECT count(*)::int AS n FROM webhook_deliveries WHERE webhook_id = ANY ($1)', [slowIds]).then(([row]) => row!.n);
        }
        return answer(request);
      };
      await dispatchWebhooks(t.service.ctx as AppContext);
      assert.equal(stalling.received.filter((r) => r.path === '/fine').length, 1, 'the other organisation\'s event was delivered');
      assert.equal(await recordedStalls, 0, 'while the stalling receivers still held their requests');
      const stalled = await t.service.ctx.db.query<{ status: string; attempts: number }>(
        'SELECT status, attempts FROM webhook_deliveries WHERE webhook_id = ANY ($1)', [slowIds]);
      assert.ok(stalled.length > 0 && stalled.every((d) => d.status === 'pending' && d.attempts === 1),
        `each stalled attempt made failed, its retry due: ${JSON.stringify(stalled)}`);
    } finally {
      for (const [key, id] of made) await t.request('DELETE', `/v1/webhooks/${id}`, { key });
      await stalling.close();
    }
  });

  test('a run held up by slow receivers still ends on time, and serves a slow webhook\'s retries while it lasts', async () => {
    // Eight webhooks answering in 1.3 s hold claimers a second and more at every step; a ninth,
    // another tenant's, fails slowly (marked slow). Events keep coming for as long as the run lasts.
    const slowish = await startReceiver();
    slowish.reply = (request) => (request.path === '/failing' ? { status: 500, delayMs: 1_500 } : { status: 200, delayMs: 1_300 });
    const busy = await t.createOrganization('Busy, slow to answer');
    const made: Array<[string, string]> = []; // deleted at the end, so that later tests' streams come first
    for (let i = 0; i < 8; i += 1) {
      const created = await t.request('POST', '/v1/webhooks', { key: busy.adminKey, body: { url: slowish.url(`/slow/${i}`), events: '*' } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      made.push([busy.adminKey, created.body.webhook_id]);
    }
    const other = await t.createOrganization('Failing slowly');
    const failing = await t.request('POST', '/v1/webhooks', { key: other.adminKey, body: { url: slowish.url('/failing'), events: '*' } });
    made.push([other.adminKey, failing.body.webhook_id]);
    const ctx = t.service.ctx as AppContext;
    // Work for every webhook before the run starts (committed: on PostgreSQL a stream reads only
    // what every earlier transaction has ended by), then more for as long as it lasts.
    await recordEvent(ctx.db, ctx.clock.nowMs(), { orgId: busy.orgId, type: 'policy.created', summary: 'busy', payload: {} });
    await recordEvent(ctx.db, ctx.clock.nowMs(), { orgId: other.orgId, type: 'policy.created', summary: 'other', payload: {} });
    await t.othersWritesEnded();
    let running = true;
    const events = (async () => {
      for (let n = 0; running; n += 1) {
        await recordEvent(ctx.db, ctx.clock.nowMs(), { orgId: busy.orgId, type: 'policy.created', summary: 'busy', payload: {} });
        if (n % 10 === 0) await recordEvent(ctx.db, ctx.clock.nowMs(), { orgId: other.orgId, type: 'policy.created', summary: 'other', payload: {} });
        await new Promise((resolve) => setTimeout(resolve, 150));
      }
    })();
    try {
      const run = dispatchWebhooks(ctx).then(() => 'ended' as const);
      // Without a bound the run went on for as long as the events did: they stop here after 60 s.
      const ended = await Promise.race([run, new Promise<'still running'>((resolve) => setTimeout(() => resolve('still running'), 60_000))]);
      running = false;
      await run;
      assert.equal(ended, 'ended', 'the run ended while events were still coming');
      const [left] = await ctx.db.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM webhook_deliveries WHERE webhook_id = $1 AND status = 'pending' AND next_attempt_at <= $2`,
        [failing.body.webhook_id, new Date(ctx.clock.nowMs() - 2_000)]);
      assert.equal(left!.n, 0, 'the slow webhook\'s due attempts were made during the run, not left behind the others');
      assert.ok(slowish.received.some((r) => r.path === '/failing'), 'the slow webhook was reached');
    } finally {
      running = false;
      await events;
      for (const [key, id] of made) await t.request('DELETE', `/v1/webhooks/${id}`, { key });
      await slowish.close();
    }
  });

  test('a worker that dies mid-batch loses no event: its lease lapses and the second attempt delivers it', async () => {
    const { key, webhookId } = await setUp('/crash', ['policy.created']);
    const event = await newPolicyEvent(key, 'Crash');
    // A worker takes the webhook's new events and dies before sending or recording anything.
    const stream = await claimStream(t.service.ctx.db, t.service.ctx.clock.nowMs(), 100);
    assert.ok(stream, 'the stream was claimed');
    assert.equal(stream.webhookId, webhookId);
    const mine = stream.attempts.find((attempt) => attempt.eventId === event);
    assert.ok(mine, 'the event is in the claimed batch');
    assert.equal(mine.attempt, 1);

    // While the lease holds, no other worker makes the attempt; the log shows attempts with their outcome.
    await t.service.jobs.runOnce();
    assert.equal(arrivals('/crash').length, 0, 'the claimed attempt is not made twice');
    assert.deepEqual(await deliveries(key, webhookId), [], 'nothing recorded while the lease holds');

    // The lease lasts until the second attempt's time; then the first counts as lost and the second delivers.
    await advance(Math.ceil((stream.lease.expiresAt.getTime() - await serviceNowMs()) / 1000) + 1);
    await t.service.jobs.runOnce();
    const hits = arrivals('/crash');
    assert.equal(hits.length, 1);
    assert.equal(hits[0]!.body.id, event);
    assert.equal(hits[0]!.headers['service-delivery-attempt'], '2');
    assert.equal(hits[0]!.headers['service-delivery-id'], mine.deliveryId, 'the delivery keeps the id the lost attempt had');
    const [delivered] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.equal(delivered!.status, 'delivered');
    assert.deepEqual(delivered!.attempts.map((a) => a.outcome), ['lost', 'succeeded']);
    assert.match(delivered!.attempts[0]!.error!, /stopped/);
    assert.equal(Date.parse(delivered!.attempts[0]!.next_attempt_at!) - Date.parse(delivered!.attempts[0]!.attempted_at), RETRY_DELAYS_MS[0]);
    assert.equal(delivered!.attempts[1]!.next_attempt_at, null, 'the attempt that succeeded has nothing after it');
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  // The guarantee: a worker stalled past its lease (a long pause, a slow disk) and coming back
  // records nothing. Recording, it would end the lease of the worker that took the stream over
  // and move the stream past that worker's batch: were that worker to die, its batch would be
  // neither recorded nor retried.
  test('a worker stalled past its lease records nothing when it comes back: the next worker\'s batch, its worker dead, is still delivered', async () => {
    const { key, webhookId } = await setUp('/stalled', ['policy.created']);
    const first = await newPolicyEvent(key, 'Stalled 1');
    const { db } = t.service.ctx;
    const stalled = await claimStream(db, t.service.ctx.clock.nowMs(), 100);
    assert.ok(stalled && stalled.attempts.some((attempt) => attempt.eventId === first), 'the stalled worker took the first event');
    const pastLease = async (lease: { expiresAt: Date }) => advance(Math.ceil((lease.expiresAt.getTime() - await serviceNowMs()) / 1000) + 1);
    await pastLease(stalled.lease);
    // The lapsed batch is written off as lost (retried a minute on), and the stream goes on.
    assert.equal(await recoverLapsedStreams(db, t.service.ctx.clock.nowMs()), 1);
    const second = await newPolicyEvent(key, 'Stalled 2');
    const next = await claimStream(db, t.service.ctx.clock.nowMs(), 100);
    assert.ok(next && next.webhookId === webhookId && next.attempts.some((attempt) => attempt.eventId === second),
      'the next worker took the second event');
    await sendStream(t.service.ctx, stalled); // sent again (at least once), recorded nowhere: its lease is gone
    // The next worker dies before sending. Its lease lapses, and the second event goes out as a retry.
    await pastLease(next.lease);
    await t.service.jobs.runOnce();
    await advance(RETRY_DELAYS_MS[0] / 1000);
    await t.service.jobs.runOnce();
    assert.ok(arrivals('/stalled').some((hit) => hit.body.id === second), 'the second event reached the receiver');
    const log = new Map((await deliveries(key, webhookId)).map((d) => [d.event_id, d]));
    assert.deepEqual([log.get(first)?.status, log.get(second)?.status], ['delivered', 'delivered']);
    assert.deepEqual(log.get(second)?.attempts.map((a) => a.outcome), ['lost', 'succeeded']);
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  test('a dead worker\'s batch is still delivered when the webhook is disabled and re-enabled before its lease lapses', async () => {
    const { key, webhookId } = await setUp('/crash-toggle', ['policy.created']);
    const event = await newPolicyEvent(key, 'Crash toggle');
    const stream = await claimStream(t.service.ctx.db, t.service.ctx.clock.nowMs(), 100);
    assert.ok(stream?.attempts.some((attempt) => attempt.eventId === event), 'the event is in the claimed batch');
    // The worker dies; the operator turns the webhook off and on again (its stream restarts after the batch).
    for (const status of ['disabled', 'active']) {
      assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status } })).status, 200);
    }
    await advance(Math.ceil((stream!.lease.expiresAt.getTime() - await serviceNowMs()) / 1000) + 1);
    await t.service.jobs.runOnce();
    const hits = arrivals('/crash-toggle');
    assert.deepEqual(hits.map((hit) => hit.body.id), [event], 'the batch\'s event arrives, once');
    const [delivered] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.deepEqual(delivered!.attempts.map((a) => a.outcome), ['lost', 'succeeded']);
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  /**
   * A new event whose first four attempts fail (the receiver must be failing), and the clock
   * past the fifth's due time. Returns the event's id.
   */
  async function failFourAttemptsOfAnEvent(key: string, path: string): Promise<string> {
    const event = await newPolicyEvent(key, `Four failures ${path}`);
    await t.service.jobs.runOnce();
    for (let k = 1; k <= 3; k += 1) {
      await advance(RETRY_DELAYS_MS[k - 1]! / 1000 + 1);
      await t.service.jobs.runOnce();
    }
    assert.equal(arrivals(path).length, 4, 'four attempts were made');
    await advance(RETRY_DELAYS_MS[3] / 1000 + 1);
    return event;
  }

  test('a lost last attempt counts as failed: the webhook degrades once its claim lapses', async () => {
    const { key, webhookId } = await setUp('/lost-last', ['policy.created']);
    receiver.reply = () => ({ status: 500 });
    try {
      const event = await failFourAttemptsOfAnEvent(key, '/lost-last');
      const claims = await claimDueAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs(), 100);
      assert.equal(claims.find((claim) => claim.eventId === event)?.attempt, 5, 'the fifth attempt is claimed, then its worker dies');
      await t.service.jobs.runOnce();
      assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'active', 'not before the claim lapses');
      await advance(61);
      await t.service.jobs.runOnce();
      assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'degraded');
      const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
      assert.equal(delivery!.status, 'paused');
      assert.equal(delivery!.attempts.at(-1)!.outcome, 'lost');
      assert.equal(arrivals('/lost-last').length, 4);
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('a fifth attempt of the run before a re-enabling, failing after it, does not degrade the webhook again', async () => {
    const { key, webhookId } = await setUp('/old-run', ['policy.created']);
    receiver.reply = () => ({ status: 500 });
    try {
      const first = await newPolicyEvent(key, 'Old run one');
      const second = await newPolicyEvent(key, 'Old run two');
      await t.service.jobs.runOnce();
      for (let k = 1; k <= 4; k += 1) {
        await advance(RETRY_DELAYS_MS[k - 1]! / 1000 + 1);
        if (k < 4) await t.service.jobs.runOnce();
      }
      const claims = (await claimDueAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs(), 50)).filter((c) => c.webhookId === webhookId);
      assert.deepEqual(claims.map((c) => [c.eventId, c.attempt, c.final]).sort(), [[first, 5, true], [second, 5, true]].sort());
      const failed = { succeeded: false, statusCode: 500, latencyMs: 3, error: 'The endpoint answered 500: a 2xx is required.', responseExcerpt: null };
      await recordAttempt(t.service.ctx.db, t.service.ctx.clock.nowMs(), claims[0]!, failed);
      assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'degraded');
      assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } })).body.status, 'active');
      // The other fifth attempt, made before the re-enabling, fails after it: its run is over.
      await recordAttempt(t.service.ctx.db, t.service.ctx.clock.nowMs(), claims[1]!, failed);
      assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'active', 'still active: a new run has begun');
      const logged = await deliveries(key, webhookId);
      assert.deepEqual(logged.map((d) => d.status), ['pending', 'pending'], 'both on their new run');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('an answer whose body is over 256 KiB fails the attempt, logged with the status that came', async () => {
    const { key, webhookId } = await setUp('/chatty', ['policy.created']);
    receiver.reply = () => ({ status: 200, body: 'x'.repeat(300 * 1024) });
    try {
      const ping = await t.request('POST', `/v1/webhooks/${webhookId}/test`, { key });
      assert.equal(ping.status, 200, JSON.stringify(ping.body));
      assert.deepEqual([ping.body.success, ping.body.status_code], [false, 200], JSON.stringify(ping.body));
      assert.match(ping.body.error, /larger than 262144 bytes/);
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('deleting a webhook deletes its whole delivery log: deliveries and attempts, delivered, pending and pings', async () => {
    const { key, webhookId } = await setUp('/deleted', ['policy.created']);
    try {
      await newPolicyEvent(key, 'Deleted, delivered');
      await t.service.jobs.runOnce();
      receiver.reply = () => ({ status: 500 });
      await newPolicyEvent(key, 'Deleted, failing');
      await t.service.jobs.runOnce();
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      assert.equal((await t.request('POST', `/v1/webhooks/${webhookId}/test`, { key })).status, 200);
      const logged = await deliveries(key, webhookId);
      assert.deepEqual(logged.map((d) => d.status).sort(), ['delivered', 'delivered', 'pending'], 'a delivered event, a ping, a pending retry');
      const ids = logged.map((d) => d.delivery_id);
      const count = async (sql: string) => (await t.service.ctx.db.query<{ n: number }>(sql, [webhookId, ids]))[0]!.n;
      assert.equal(await count('SELECT count(*)::int AS n FROM webhook_attempts WHERE delivery_id = ANY($2::text[]) AND $1::text IS NOT NULL'), 3);

      assert.equal((await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key })).status, 200);
      assert.equal(await count('SELECT count(*)::int AS n FROM webhook_deliveries WHERE webhook_id = $1 OR id = ANY($2::text[])'), 0,
        'no delivery left');
      assert.equal(await count('SELECT count(*)::int AS n FROM webhook_attempts WHERE delivery_id = ANY($2::text[]) AND $1::text IS NOT NULL'), 0,
        'no attempt left');
      assert.equal((await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key })).status, 404, 'gone');
      assert.equal((await t.request('POST', `/v1/webhooks/${webhookId}/test`, { key })).status, 404, 'no ping to a deleted webhook');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
  });

  /** Runs `body` with the service's sending thread replaced by one that dies on its first batch. */
  async function withSenderCrashingOnce(body: () => Promise<void>): Promise<void> {
    const dir = mkdtempSync(join(tmpdir(), 'av-crash-'));
    const marker = join(dir, 'crash-once');
    writeFileSync(marker, '');
    const ctx = t.service.ctx;
    const real = ctx.webhookSender;
    process.env.AV_TEST_SENDER_CRASH_ONCE = marker;
    ctx.webhookSender = new AttemptSender(ctx.clock, { module: new URL('./testing-sender-worker.ts', import.meta.url) });
    try {
      await body();
      assert.equal(existsSync(marker), false, 'the sending thread did crash');
    } finally {
      await ctx.webhookSender.close();
      ctx.webhookSender = real;
      delete process.env.AV_TEST_SENDER_CRASH_ONCE;
      rmSync(dir, { recursive: true, force: true });
    }
  }

  test('a sending thread that dies with a fifth attempt in its batch: the batch goes again on a new thread, and the webhook stays active', async () => {
    const { key, webhookId } = await setUp('/sender-crash', ['policy.created']);
    receiver.reply = () => ({ status: 500 });
    try {
      const event = await failFourAttemptsOfAnEvent(key, '/sender-crash');
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await withSenderCrashingOnce(() => t.service.jobs.runOnce());

      const hits = arrivals('/sender-crash');
      assert.equal(hits.length, 5, 'the fifth attempt reached the receiver');
      assert.equal(hits[4]!.headers['service-delivery-attempt'], '5');
      const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
      assert.equal(delivery!.status, 'delivered', 'delivered, not lost');
      assert.deepEqual(delivery!.attempts.map((a) => a.outcome), ['failed', 'failed', 'failed', 'failed', 'succeeded']);
      await advance(FINAL_ATTEMPT_LEASE_MS / 1000 + 1);
      await t.service.jobs.runOnce();
      assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'active', 'the webhook is not degraded');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('a sending thread that dies with first attempts in its batch: they are delivered at once, not a minute later', async () => {
    const { key, webhookId } = await setUp('/sender-crash-first', ['policy.created']);
    const event = await newPolicyEvent(key, 'Sender crash first');
    await withSenderCrashingOnce(() => t.service.jobs.runOnce());
    assert.deepEqual(arrivals('/sender-crash-first').map((r) => r.body.id), [event], 'delivered by the first run');
    const [delivery] = await deliveries(key, webhookId, `&eventId=${event}`);
    assert.equal(delivery!.status, 'delivered');
    assert.deepEqual(delivery!.attempts.map((a) => a.outcome), ['succeeded'], 'one attempt, recorded');
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  test('a test ping whose process stopped before recording it is failed a minute on, not left pending', async () => {
    const { key, webhookId } = await setUp('/ping-cut-off', ['policy.created']);
    const ctx = t.service.ctx;
    const real = ctx.webhookSender;
    // The sending never answers, as for a process that stopped with the ping in flight.
    let answer!: (results: Awaited<ReturnType<typeof real.send>>) => void;
    const sender = new AttemptSender(ctx.clock);
    sender.send = () => new Promise((resolve) => { answer = resolve; });
    ctx.webhookSender = sender;
    try {
      const ping = t.request('POST', `/v1/webhooks/${webhookId}/test`, { key });
      while ((await deliveries(key, webhookId)).length === 0) await new Promise((resolve) => setTimeout(resolve, 10));
      await t.service.jobs.runOnce();
      assert.equal((await deliveries(key, webhookId))[0]!.status, 'pending', 'within its minute: still in flight');
      await advance(61);
      await t.service.jobs.runOnce();
      const [delivery] = await deliveries(key, webhookId);
      assert.deepEqual([delivery!.status, delivery!.failure_reason, delivery!.attempts.map((a) => a.outcome)], ['failed', 'ping_failed', ['lost']]);
      answer([]);
      await ping.catch(() => {});
    } finally {
      ctx.webhookSender = real;
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('a test ping whose sending thread cannot be used is answered and recorded as failed', async () => {
    const { key, webhookId } = await setUp('/ping-no-sender', ['policy.created']);
    const ctx = t.service.ctx;
    const real = ctx.webhookSender;
    ctx.webhookSender = new AttemptSender(ctx.clock);
    await ctx.webhookSender.close();
    try {
      const ping = await t.request('POST', `/v1/webhooks/${webhookId}/test`, { key });
      assert.equal(ping.status, 200, JSON.stringify(ping.body));
      assert.equal(ping.body.success, false);
      assert.equal(ping.body.status_code, null);
      assert.equal(ping.body.error, 'The request could not be made.');
      const [delivery] = await deliveries(key, webhookId);
      assert.equal(delivery!.event_type, 'ping');
      assert.equal(delivery!.status, 'failed', 'recorded as failed, not left pending');
      assert.equal(delivery!.failure_reason, 'ping_failed');
      assert.equal(arrivals('/ping-no-sender').length, 0, 'nothing reached the receiver');
    } finally {
      ctx.webhookSender = real;
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('after a rotation deliveries carry both signatures for 24 hours, then only the new one', async () => {
    const { key, webhookId, secret: oldSecret } = await setUp('/rotation', ['policy.created']);
    const rotated = await t.request('POST', `/v1/webhooks/${webhookId}/rotate-secret`, { key });
    const newSecret = rotated.body.signing_secret as string;
    receiver.secret = newSecret;
    await newPolicyEvent(key, 'During overlap');
    await t.service.jobs.runOnce();
    const [during] = arrivals('/rotation');
    assert.ok(during, 'delivered during the overlap');
    assert.equal(during.headers['service-signature'], hmac(newSecret, during.rawBody));
    assert.equal(during.headers['service-signature-previous'], hmac(oldSecret, during.rawBody));

    await advance(24 * 3600 + 1);
    await newPolicyEvent(key, 'After overlap');
    await t.service.jobs.runOnce();
    const afterOverlap = arrivals('/rotation')[1]!;
    assert.equal(afterOverlap.headers['service-signature'], hmac(newSecret, afterOverlap.rawBody));
    assert.equal(afterOverlap.headers['service-signature-previous'], undefined);
    await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
  });

  test('an event whose transaction commits late is delivered: later events wait for it, none is skipped', async (context) => {
    const databaseUrl = process.env.DATABASE_URL;
    if (!databaseUrl) {
      context.skip('needs DATABASE_URL (PGlite has a single connection: no transaction can stay open beside another)');
      return;
    }
    const { key, webhookId } = await setUp('/late', ['policy.created']);
    const [{ schema }] = await t.service.ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
    const other = await openDatabase({ databaseUrl, dataDir: null, schema });
    const orgId = (await t.service.ctx.db.query<{ org_id: string }>('SELECT org_id FROM webhooks WHERE id = $1', [webhookId]))[0]!.org_id;
    let release = () => {};
    const released = new Promise<void>((resolve) => { release = resolve; });
    try {
      let written!: () => void;
      const wasWritten = new Promise<void>((resolve) => { written = resolve; });
      const lateId = newId('evt', t.service.ctx.clock.nowMs());
      // A transaction writes its event first, and commits only after a later event has committed.
      const late = other.transaction(async (tx) => {
        await tx.query(
          `INSERT INTO events (id, org_id, type, severity, summary, payload, created_at)
           VALUES ($1, $2, 'policy.created', 'info', 'late', '{}', $3)`, [lateId, orgId, new Date(t.service.ctx.clock.nowMs())]);
        written();
        await released;
      });
      await wasWritten;
      const early = await newPolicyEvent(key, 'Committed first');
      await t.service.jobs.runOnce();
      assert.deepEqual(arrivals('/late').map((r) => r.body.id), [], 'nothing passes an open transaction that wrote an event');
      release();
      await late;
      await t.service.jobs.runOnce();
      assert.deepEqual(arrivals('/late').map((r) => r.body.id).sort(), [early, lateId].sort(), 'both, once each');
      await t.service.jobs.runOnce();
      assert.equal(arrivals('/late').length, 2);
    } finally {
      release();
      await other.close();
      await t.request('DELETE', `/v1/webhooks/${webhookId}`, { key });
    }
  });

  test('several dispatchers on one PostgreSQL never make the same attempt twice', async (context) => {
    const databaseUrl = process.env.DATABASE_URL;
    if (!databaseUrl) {
      context.skip('needs DATABASE_URL (PGlite has a single connection)');
      return;
    }
    const [{ schema }] = await t.service.ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
    // A second worker process, as far as the database can tell: its own connection pool.
    const secondDb = await openDatabase({ databaseUrl, dataDir: null, schema });
    const second: AppContext = { ...t.service.ctx, db: secondDb };
    const org = await t.createOrganization('Concurrent dispatchers');
    const paths = ['/c1', '/c2', '/c3'];
    for (const path of paths) {
      const created = await t.request('POST', '/v1/webhooks', { key: org.adminKey, body: { url: receiver.url(path), events: ['policy.created'] } });
      assert.equal(created.status, 200);
    }
    // Slow, jittered answers keep the claims and sends of the dispatchers interleaved.
    receiver.reply = () => ({ status: 200, delayMs: Math.floor(Math.random() * 30) });
    try {
      for (let i = 0; i < 30; i += 1) {
        assert.equal((await t.request('POST', '/v1/policies', { key: org.adminKey, body: { name: `concurrent ${i}` } })).status, 200);
      }
      // Streams claimed alone, many at once over both pools: a webhook's events are held by one claim at a time.
      const claimRounds = await Promise.all(Array.from({ length: 8 }, (_, i) =>
        claimStream(i % 2 ? secondDb : t.service.ctx.db, t.service.ctx.clock.nowMs(), 7)));
      const streams = claimRounds.filter((stream) => stream !== null);
      assert.equal(new Set(streams.map((stream) => stream.webhookId)).size, streams.length, 'no stream claimed twice');
      const claimedIds = streams.flatMap((stream) => stream.attempts.map((attempt) => attempt.deliveryId));
      assert.equal(new Set(claimedIds).size, claimedIds.length, 'no delivery claimed twice');
      assert.ok(claimedIds.length > 0, 'claims were made');
      // Those claims are abandoned (their workers "died"); the rest is sent by four dispatchers at once.
      await Promise.all([dispatchWebhooks(t.service.ctx), dispatchWebhooks(second), dispatchWebhooks(t.service.ctx), dispatchWebhooks(second)]);
      await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } });
      await Promise.all([dispatchWebhooks(t.service.ctx), dispatchWebhooks(second), dispatchWebhooks(t.service.ctx), dispatchWebhooks(second)]);

      const hits = receiver.received.filter((r) => paths.includes(r.path));
      const seen = hits.map((r) => `${r.headers['service-delivery-id']}#${r.headers['service-delivery-attempt']}`);
      assert.equal(new Set(seen).size, seen.length, 'no (delivery, attempt) received twice');
      const perDelivery = new Map<string, number>();
      for (const hit of hits) perDelivery.set(String(hit.headers['service-delivery-id']), (perDelivery.get(String(hit.headers['service-delivery-id'])) ?? 0) + 1);
      const expected = await t.service.ctx.db.query<{ id: string }>('SELECT id FROM webhook_deliveries WHERE org_id = $1', [org.orgId]);
      assert.equal(expected.length, 90, '30 events for each of 3 webhooks');
      assert.deepEqual([...perDelivery.keys()].sort(), expected.map((row) => row.id).sort(), 'every delivery arrived');
      assert.ok([...perDelivery.values()].every((count) => count === 1), 'each exactly once (a healthy receiver needs no retry)');
      const states = await t.service.ctx.db.query<{ status: string; n: number }>(
        'SELECT status, count(*)::int AS n FROM webhook_deliveries WHERE org_id = $1 GROUP BY status', [org.orgId]);
      assert.deepEqual(states, [{ status: 'delivered', n: 90 }]);
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await secondDb.close();
    }
  });


  /**
   * A webhook deleted while its retries' successes are being recorded: both lock the deliveries
   * first, in id order, so neither can hold what the other waits for. A third transaction holds
   * the deliveries until both are queued behind it, the deletion first; once it lets go, the
   * deletion runs, and the recording finds nothing left to record. Had the recording locked the
   * attempts first (as its single statement once did), the two would deadlock here.
   */
  test('a webhook deleted while its attempts are recorded: neither deadlocks, and it goes with every delivery and attempt', async (context) => {
    if (!process.env.DATABASE_URL) {
      context.skip('needs DATABASE_URL (PGlite has a single connection: no lock can be held beside another)');
      return;
    }
    const [{ schema }] = await t.service.ctx.db.query<{ schema: string }>('SELECT current_schema() AS schema') as [{ schema: string }];
    const deleting = await openDatabase({ databaseUrl: process.env.DATABASE_URL!, dataDir: null, schema });
    const holding = await openDatabase({ databaseUrl: process.env.DATABASE_URL!, dataDir: null, schema });
    let release = () => {};
    const released = new Promise<void>((resolve) => { release = resolve; });
    try {
      const org = await t.createOrganization('Deleted while recorded');
      const created = await t.request('POST', '/v1/webhooks', {
        key: org.adminKey, body: { url: receiver.url('/deleted-while-recorded'), events: ['policy.created'] } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      const webhookId = created.body.webhook_id as string;
      receiver.reply = () => ({ status: 500 });
      for (let i = 0; i < 3; i += 1) {
        assert.equal((await t.request('POST', '/v1/policies', { key: org.adminKey, body: { name: `retried ${i}` } })).status, 200);
      }
      await t.service.jobs.runOnce();
      assert.equal(receiver.received.filter((r) => r.path === '/deleted-while-recorded').length, 3, 'three first attempts failed');
      assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } })).status, 200);
      const claims = (await claimDueAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs(), 50)).filter((c) => c.webhookId === webhookId);
      assert.equal(claims.length, 3, 'the three second attempts are claimed');

      let held!: (pid: number) => void;
      const isHeld = new Promise<number>((resolve) => { held = resolve; });
      const holder = holding.transaction(async (tx) => {
        await tx.query('SELECT id FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY id FOR UPDATE', [webhookId]);
        held((await tx.query<{ pid: number }>('SELECT pg_backend_pid() AS pid'))[0]!.pid);
        await released;
      });
      const holderPid = await isHeld;
      const deleted = deleteWebhook(deleting, org.orgId, webhookId);
      await queuedBehind(holding, holderPid, 1);
      const recorded = recordSuccesses(t.service.ctx.db, claims.map((claim) => ({
        claim, result: { succeeded: true, statusCode: 200, latencyMs: 5, error: null, responseExcerpt: null },
        finishedAt: new Date(t.service.ctx.clock.nowMs()),
      })));
      await queuedBehind(holding, holderPid, 2);
      release();
      const outcomes = await Promise.allSettled([holder, deleted, recorded]);
      assert.deepEqual(outcomes.map((outcome) => (outcome.status === 'rejected' ? String(outcome.reason) : 'ok')), ['ok', 'ok', 'ok']);

      const left = await t.service.ctx.db.query<{ webhooks: number; deliveries: number; attempts: number }>(
        `SELECT (SELECT count(*)::int FROM webhooks WHERE id = $1) AS webhooks,
                (SELECT count(*)::int FROM webhook_deliveries WHERE webhook_id = $1) AS deliveries,
                (SELECT count(*)::int FROM webhook_attempts WHERE delivery_id = ANY($2::text[])) AS attempts`,
        [webhookId, claims.map((c) => c.deliveryId)]);
      assert.deepEqual(left, [{ webhooks: 0, deliveries: 0, attempts: 0 }]);
    } finally {
      release();
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
      await deleting.close();
      await holding.close();
    }
  });

  /**
   * Statements that change many deliveries at once, racing the recording of successes of the
   * same deliveries on a second connection (PGlite has one: these skip). Each locks them in id
   * order (docs/webhooks.md "Lock order"), so neither deadlocks. And an event whose transaction
   * is open across its webhook's re-enabling.
   */
  describe('races on PostgreSQL', () => {
    before(() => {
      receiver.reply = (request) => (request.path.startsWith('/failing') ? { status: 500 } : { status: 200 });
    });
    after(() => {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    });

    async function raceWebhook(path: string) {
      const org = await t.createOrganization(`Races ${path}`);
      const created = await t.request('POST', '/v1/webhooks', { key: org.adminKey, body: { url: receiver.url(path), events: ['policy.created'] } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      return { key: org.adminKey, orgId: org.orgId, webhookId: created.body.webhook_id as string };
    }
    async function statuses(webhookId: string): Promise<Record<string, string>> {
      const rows = await t.service.ctx.db.query<{ id: string; status: string }>(
        'SELECT id, status FROM webhook_deliveries WHERE webhook_id = $1', [webhookId]);
      return Object.fromEntries(rows.map((row) => [row.id, row.status]));
    }
    /**
     * Two deliveries whose first attempt failed, pending, returned older (lower id) first. The
     * older event's transaction was slow to commit: its delivery is written and attempted after
     * the newer one's, so that any plan of a statement changing both meets the newer one first (in
     * table order, in the order they are due, and newest first as the index listing a webhook's
     * deliveries does) unless it sorts them by id.
     */
    async function twoPendingDeliveries(key: string, orgId: string, webhookId: string): Promise<[string, string]> {
      const before = Object.keys(await statuses(webhookId));
      const olderAtMs = t.service.ctx.clock.nowMs();
      await advance(1);
      await newPolicyEvent(key, 'Race');
      await t.service.jobs.runOnce();
      await recordEvent(t.service.ctx.db, olderAtMs, { orgId, type: 'policy.created', summary: 'slow to commit', payload: {} });
      await t.service.jobs.runOnce();
      const [older, newer] = Object.keys(await statuses(webhookId)).filter((id) => !before.includes(id)).sort();
      assert.ok(older && newer, 'two new deliveries');
      return [older, newer];
    }
    /** What recordSuccesses does with two deliveries, split at its first lock: the older one taken and held. */
    const lockOlder = (older: string) => (tx: Queryable) => tx.query('SELECT id FROM webhook_deliveries WHERE id = $1 FOR UPDATE', [older]);
    /** …then the newer one, and both delivered. */
    const deliverBoth = (older: string, newer: string) => async (tx: Queryable) => {
      await tx.query('SELECT id FROM webhook_deliveries WHERE id = $1 FOR UPDATE', [newer]);
      await tx.query(
        `UPDATE webhook_deliveries SET status = 'delivered', delivered_at = $2, next_attempt_at = NULL, updated_at = $2 WHERE id = ANY($1::text[])`,
        [[older, newer], new Date(t.service.ctx.clock.nowMs())]);
    };

    /**
     * Disabling a webhook pauses its pending deliveries, locking them in id order, as the
     * recording of successes does: it waits for the older one the recording holds without holding
     * the newer one the recording needs next. Taken newest first (the order of the index that
     * lists a webhook's deliveries), the two deadlocked and PostgreSQL aborted one: a 500 to the
     * PATCH, or acknowledged deliveries left to be sent again.
     */
    test('PATCH disabled while successes of its deliveries are being recorded: both finish, no deadlock', async (context) => {
      await withSecondConnection(t, context, async (other) => {
        const { key, orgId, webhookId } = await raceWebhook('/failing-disabled');
        const [older, newer] = await twoPendingDeliveries(key, orgId, webhookId);

        const held = await holdLocks(other, lockOlder(older), deliverBoth(older, newer));
        const answer = await queuedRequest(other, held, () => t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } }));
        assert.equal(answer.status, 200, JSON.stringify(answer.body));
        assert.equal(answer.body.status, 'disabled');
        assert.deepEqual(await statuses(webhookId), { [older]: 'delivered', [newer]: 'delivered' }, 'acknowledged deliveries stay delivered');
      });
    });

    /** The same for re-enabling, which resumes the paused deliveries: a success delivers a paused delivery too. */
    test('PATCH active while successes of its paused deliveries are being recorded: both finish, no deadlock', async (context) => {
      await withSecondConnection(t, context, async (other) => {
        const { key, orgId, webhookId } = await raceWebhook('/failing-enabled');
        const [older, newer] = await twoPendingDeliveries(key, orgId, webhookId);
        assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } })).status, 200);

        const held = await holdLocks(other, lockOlder(older), deliverBoth(older, newer));
        const answer = await queuedRequest(other, held, () => t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } }));
        assert.equal(answer.status, 200, JSON.stringify(answer.body));
        assert.deepEqual(await statuses(webhookId), { [older]: 'delivered', [newer]: 'delivered' });
      });
    });

    /** A new event whose first four attempts to the (failing) webhook fail, on schedule: its delivery's id. */
    const fourFailedAttempts = async (key: string, webhookId: string): Promise<string> => {
      await newPolicyEvent(key, 'Race');
      await t.service.jobs.runOnce();
      const [delivery] = Object.keys(await statuses(webhookId));
      for (const seconds of [60, 300, 1_800]) {
        await advance(seconds);
        await t.service.jobs.runOnce();
      }
      return delivery!;
    };

    /** The same for the fifth failure of a run, which degrades the webhook and pauses its other pending deliveries. */
    test('a last attempt failing while successes of the webhook\'s other deliveries are being recorded: it degrades, no deadlock', async (context) => {
      await withSecondConnection(t, context, async (other) => {
        const { key, orgId, webhookId } = await raceWebhook('/failing-degraded');
        const exhausted = await fourFailedAttempts(key, webhookId);
        // Then two later events' first attempts fail.
        const [older, newer] = await twoPendingDeliveries(key, orgId, webhookId);
        assert.ok(exhausted && exhausted < older, 'the exhausted delivery is the oldest');
        await advance(7_200);
        const claims = (await claimDueAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs(), 50)).filter((c) => c.webhookId === webhookId);
        const last = claims.find((claim) => claim.deliveryId === exhausted);
        assert.ok(last?.final && claims.length === 3, 'attempt 5 of the first and attempt 2 of the others are claimed');

        const held = await holdLocks(other, lockOlder(older), deliverBoth(older, newer));
        await queuedRequest(other, held, () => recordAttempt(t.service.ctx.db, t.service.ctx.clock.nowMs(), last, FAILED));
        const webhook = await t.request('GET', `/v1/webhooks/${webhookId}`, { key });
        assert.equal(webhook.body.status, 'degraded');
        assert.deepEqual(await statuses(webhookId), { [exhausted]: 'paused', [older]: 'delivered', [newer]: 'delivered' });
      });
    });

    /**
     * A late success of the delivery whose fifth attempt failed or was lost (an earlier attempt of
     * it overlapping: docs/webhooks.md "Sending"), recorded with an older delivery's. The failure
     * that may degrade the webhook locks its delivery with the pending ones the degrading pauses,
     * in one pass in id order; locking its own first, it held what the recording needed next
     * while waiting for the older one the recording held.
     */
    for (const ending of ['failed', 'lost'] as const) {
      test(`a last attempt ${ending} while a late success of it is recorded with an older delivery's: no deadlock, both delivered`, async (context) => {
        await withSecondConnection(t, context, async (other) => {
          const { key, orgId, webhookId } = await raceWebhook(`/failing-late-success-${ending}`);
          const olderAtMs = t.service.ctx.clock.nowMs();
          await advance(1);
          const exhausted = await fourFailedAttempts(key, webhookId);
          // An older event, whose transaction was slow to commit: its first attempt fails now.
          await recordEvent(t.service.ctx.db, olderAtMs, { orgId, type: 'policy.created', summary: 'slow to commit', payload: {} });
          await t.service.jobs.runOnce();
          const [older] = Object.keys(await statuses(webhookId)).filter((id) => id !== exhausted);
          assert.ok(exhausted && older && older < exhausted, 'the other delivery is the older one');
          await advance(7_200);
          const claims = (await claimDueAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs(), 50)).filter((c) => c.webhookId === webhookId);
          const last = claims.find((claim) => claim.deliveryId === exhausted);
          assert.ok(last?.final && claims.length === 2, 'attempt 5 of the one and attempt 2 of the older are claimed');
          // A lost one counts as failed once its lease has run out.
          if (ending === 'lost') await advance(FINAL_ATTEMPT_LEASE_MS / 1000 + 1);

          const held = await holdLocks(other, lockOlder(older), deliverBoth(older, exhausted));
          await queuedRequest<unknown>(other, held, () => (ending === 'failed'
            ? recordAttempt(t.service.ctx.db, t.service.ctx.clock.nowMs(), last, FAILED)
            : settleLostFinalAttempts(t.service.ctx.db, t.service.ctx.clock.nowMs())));
          assert.equal((await t.request('GET', `/v1/webhooks/${webhookId}`, { key })).body.status, 'active', 'a delivered delivery degrades nothing');
          assert.deepEqual(await statuses(webhookId), { [older]: 'delivered', [exhausted]: 'delivered' });
        });
      });
    }

    /**
     * Re-enabling a disabled webhook restarts its stream at the oldest transaction still running,
     * not at the PATCH's own: an event whose transaction began before the PATCH and commits after
     * it is delivered. Started at the PATCH's transaction, the stream skipped it (below its
     * position), and the disabling had not kept it either (not committed yet).
     */
    test('an event written by a transaction open while the webhook is re-enabled, committed after, is delivered', async (context) => {
      await withSecondConnection(t, context, async (other) => {
        const { key, orgId, webhookId } = await raceWebhook('/reenabled-across');
        assert.equal((await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'disabled' } })).status, 200);
        let eventId = '';
        const writing = await holdLocks(other, async (tx) => {
          eventId = (await recordEvent(tx, t.service.ctx.clock.nowMs(), {
            orgId, type: 'policy.created', summary: 'written across the re-enabling', payload: { policy_id: 'pol_race' },
          })).id;
        });
        const enabled = await t.request('PATCH', `/v1/webhooks/${webhookId}`, { key, body: { status: 'active' } });
        assert.equal(enabled.status, 200, JSON.stringify(enabled.body));
        writing.release();
        await writing.done;

        await t.service.jobs.runOnce();
        assert.deepEqual(arrivals('/reenabled-across').map((r) => r.body.id), [eventId]);
        const log = await t.request('GET', `/v1/webhooks/${webhookId}/deliveries`, { key });
        assert.deepEqual(log.body.data.map((d: { event_id: string; status: string }) => [d.event_id, d.status]), [[eventId, 'delivered']]);
      });
    });

    /** Likewise the retention job, which gives up deliveries still undelivered after 30 days. */
    test('deliveries expiring while their successes are being recorded: both finish, no deadlock', async (context) => {
      await withSecondConnection(t, context, async (other) => {
        const { key, orgId, webhookId } = await raceWebhook('/failing-expiring');
        const [older, newer] = await twoPendingDeliveries(key, orgId, webhookId);
        await advance(DELIVERY_LOG_RETENTION_MS / 1000 + 1);

        const held = await holdLocks(other, lockOlder(older), deliverBoth(older, newer));
        await queuedRequest(other, held, () => expireDeliveryLog(t.service.ctx.db, t.service.ctx.clock.nowMs()));
        assert.deepEqual(await statuses(webhookId), { [older]: 'delivered', [newer]: 'delivered' });
      });
    });
  });
});
