/**
 * The webhook endpoints through the real HTTP stack and database: create (secret once), read,
 * list, change, delete, rotate, the test ping and the delivery log; roles, isolation between
 * organisations, validation and limits; the URL guard with AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS
 * off, at creation and at delivery. Deliveries themselves: delivery.test.ts.
 */
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { Resolver } from 'node:dns/promises';
import { after, before, describe, mock, test } from 'node:test';
import { ManualClock } from '../clock/clock.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { EVENT_TYPES } from '../events/events.ts';
import { deliveryHeaders, sendAttempts, signatureOf } from './attempt.ts';
import { startReceiver, type Receiver } from './testing.ts';

const PRIVATE_ON = { AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'on' };

describe('webhooks API', () => {
  let t: TestService;
  let receiver: Receiver;
  let operatorKey: string;
  let viewerKey: string;
  let arbiterKey: string;
  let agentKey: string;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService({ env: PRIVATE_ON });
    receiver = await startReceiver();
    operatorKey = await t.createKey('operator');
    viewerKey = await t.createKey('viewer');
    arbiterKey = await t.createKey('arbiter');
    agentKey = await t.createKey('agent');
    other = await t.createOrganization();
  });
  after(async () => {
    await receiver.close();
    await t.close();
  });

  const create = (body: Record<string, unknown>, key?: string) => t.request('POST', '/v1/webhooks', { body, key });

  test('create, read, list, change, delete; the secret appears in the creation response only', async () => {
    const created = await create({ url: receiver.url(), events: ['wallet.created', 'transaction.completed'] });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    const { webhook_id: id, signing_secret: secret } = created.body;
    assert.match(id, /^whk_/);
    assert.match(secret, /^whsec_[A-Za-z0-9_-]{43}$/);
    assert.equal(created.body.url, receiver.url());
    assert.deepEqual(created.body.events, ['wallet.created', 'transaction.completed']);
    assert.equal(created.body.status, 'active');
    assert.equal(created.body.degraded_at, null);
    assert.equal(created.body.secret_rotated_at, null);
    assert.equal(created.body.previous_secret_expires_at, null);
    assert.equal(typeof created.body.created_at, 'string');

    const { signing_secret: _shownOnce, ...withoutSecret } = created.body;
    const read = await t.request('GET', `/v1/webhooks/${id}`, { key: viewerKey });
    assert.equal(read.status, 200);
    assert.deepEqual(read.body, withoutSecret);
    const listed = await t.request('GET', '/v1/webhooks?limit=100', { key: viewerKey });
    assert.deepEqual(listed.body.data.find((w: { webhook_id: string }) => w.webhook_id === id), withoutSecret);
    for (const response of [read, listed]) {
      assert.ok(!JSON.stringify(response.body).includes(secret), 'a read never shows the secret');
    }

    // "*" as a string or alone in an array: every event; names are deduplicated.
    const changed = await t.request('PATCH', `/v1/webhooks/${id}`, { body: { events: '*', url: receiver.url('/other') }, key: operatorKey });
    assert.equal(changed.status, 200, JSON.stringify(changed.body));
    assert.deepEqual(changed.body.events, ['*']);
    assert.equal(changed.body.url, receiver.url('/other'));
    assert.ok(!JSON.stringify(changed.body).includes(secret), 'an update never shows the secret');
    const again = await t.request('PATCH', `/v1/webhooks/${id}`, { body: { events: ['escrow.created', 'escrow.created', 'export.ready'] } });
    assert.deepEqual(again.body.events, ['escrow.created', 'export.ready']);
    assert.deepEqual((await t.request('PATCH', `/v1/webhooks/${id}`, { body: { events: ['*'] } })).body.events, ['*']);

    const disabled = await t.request('PATCH', `/v1/webhooks/${id}`, { body: { status: 'disabled' } });
    assert.equal(disabled.body.status, 'disabled');
    assert.equal((await t.request('PATCH', `/v1/webhooks/${id}`, { body: { status: 'active' } })).body.status, 'active');

    const deleted = await t.request('DELETE', `/v1/webhooks/${id}`, { key: operatorKey });
    assert.equal(deleted.status, 200);
    assert.deepEqual(deleted.body, { webhook_id: id, deleted: true });
    for (const [method, url] of [['GET', `/v1/webhooks/${id}`], ['DELETE', `/v1/webhooks/${id}`], ['GET', `/v1/webhooks/${id}/deliveries`]]) {
      const response = await t.request(method!, url!);
      assert.equal(response.status, 404, `${method} ${url}`);
      assert.equal(response.body.error.code, 'webhook_not_found');
    }
  });

  test('rotating the secret answers a new one once and records the 24-hour overlap', async () => {
    const created = await create({ url: receiver.url(), events: '*' });
    const id = created.body.webhook_id;
    const clockNow = Date.parse((await t.request('GET', '/v1/test_helpers/clock')).body.now);
    const withField = await t.request('POST', `/v1/webhooks/${id}/rotate-secret`, { key: operatorKey, body: { overlapHours: 1 } });
    assert.equal(withField.status, 400, 'a field rotate-secret does not take is refused, not ignored');
    assert.equal(withField.body.error.param, 'overlap_hours');
    const rotated = await t.request('POST', `/v1/webhooks/${id}/rotate-secret`, { key: operatorKey });
    assert.equal(rotated.status, 200, JSON.stringify(rotated.body));
    assert.match(rotated.body.signing_secret, /^whsec_/);
    assert.notEqual(rotated.body.signing_secret, created.body.signing_secret);
    const rotatedAt = Date.parse(rotated.body.secret_rotated_at);
    assert.ok(rotatedAt >= clockNow, 'rotation time is the service clock');
    assert.equal(Date.parse(rotated.body.previous_secret_expires_at) - rotatedAt, 24 * 3600 * 1000);
    const read = await t.request('GET', `/v1/webhooks/${id}`);
    assert.equal(read.body.secret_rotated_at, rotated.body.secret_rotated_at);
    assert.ok(!JSON.stringify(read.body).includes(rotated.body.signing_secret), 'the new secret is not shown again');
    await t.request('DELETE', `/v1/webhooks/${id}`);
  });

  test('the test endpoint sends a signed ping at once and answers the endpoint\'s response; the log records it', async () => {
    const created = await create({ url: receiver.url('/ping'), events: ['wallet.created'] });
    const id = created.body.webhook_id;
    receiver.secret = created.body.signing_secret;
    const before = receiver.received.length;
    const ping = await t.request('POST', `/v1/webhooks/${id}/test`, { key: operatorKey });
    assert.equal(ping.status, 200, JSON.stringify(ping.body));
    assert.equal(ping.body.success, true);
    assert.equal(ping.body.status_code, 200);
    assert.equal(ping.body.error, null);
    assert.equal(typeof ping.body.latency_ms, 'number');
    assert.equal(receiver.received.length, before + 1);
    const got = receiver.received.at(-1)!;
    assert.equal(got.path, '/ping');
    assert.ok(got.signatureValid, 'the ping is signed with the webhook\'s secret');
    assert.equal(got.body.event, 'ping');
    assert.equal(got.body.id, ping.body.event_id);
    assert.equal(got.body.webhook_id, id);
    assert.equal(got.headers['service-event-id'], ping.body.event_id);
    assert.equal(got.headers['service-delivery-attempt'], '1');
    assert.equal(got.headers['content-type'], 'application/json');

    // A failing endpoint is reported in the body, not as an HTTP error, and nothing is retried.
    receiver.reply = () => ({ status: 503, body: 'down for maintenance' });
    try {
      const failed = await t.request('POST', `/v1/webhooks/${id}/test`);
      assert.equal(failed.status, 200);
      assert.equal(failed.body.success, false);
      assert.equal(failed.body.status_code, 503);
      assert.match(failed.body.error, /503/);
      const log = await t.request('GET', `/v1/webhooks/${id}/deliveries`, { key: viewerKey });
      assert.equal(log.status, 200);
      assert.equal(log.body.data.length, 2);
      const [latest, first] = log.body.data;
      assert.equal(latest.delivery_id, failed.body.delivery_id);
      assert.equal(latest.event_type, 'ping');
      assert.equal(latest.status, 'failed');
      assert.equal(latest.failure_reason, 'ping_failed');
      assert.equal(latest.attempts[0].outcome, 'failed');
      assert.equal(latest.attempts[0].status_code, 503);
      assert.equal(latest.attempts[0].response_excerpt, 'down for maintenance');
      assert.equal(first.delivery_id, ping.body.delivery_id);
      assert.equal(first.status, 'delivered');
      assert.equal(first.attempt_count, 1);
      assert.deepEqual(first.attempts.map((a: { outcome: string }) => a.outcome), ['succeeded']);
      const onlyFailed = await t.request('GET', `/v1/webhooks/${id}/deliveries?status=failed`);
      assert.deepEqual(onlyFailed.body.data.map((d: { delivery_id: string }) => d.delivery_id), [failed.body.delivery_id]);
      const byEvent = await t.request('GET', `/v1/webhooks/${id}/deliveries?eventId=${ping.body.event_id}`);
      assert.deepEqual(byEvent.body.data.map((d: { delivery_id: string }) => d.delivery_id), [ping.body.delivery_id]);
      // event_id, the field's name in the views and SPEC's spelling, filters alike, as wallet_id does on the lists.
      const bySnakeCase = await t.request('GET', `/v1/webhooks/${id}/deliveries?event_id=${ping.body.event_id}`);
      assert.equal(bySnakeCase.status, 200, JSON.stringify(bySnakeCase.body));
      assert.deepEqual(bySnakeCase.body.data.map((d: { delivery_id: string }) => d.delivery_id), [ping.body.delivery_id]);
      const both = await t.request('GET', `/v1/webhooks/${id}/deliveries?eventId=${ping.body.event_id}&event_id=${ping.body.event_id}`);
      assert.equal(both.status, 400);
      assert.equal(both.body.error.code, 'invalid_request');
      assert.equal(both.body.error.param, 'event_id');
      // The excerpt keeps whole characters: the 500th, outside the BMP, is not cut in half.
      const long = `${'a'.repeat(498)}é😀 and more`;
      receiver.reply = () => ({ status: 500, body: long });
      const cut = await t.request('POST', `/v1/webhooks/${id}/test`);
      assert.equal(cut.body.success, false);
      const cutLog = await t.request('GET', `/v1/webhooks/${id}/deliveries?limit=1`);
      assert.equal(cutLog.body.data[0].attempts[0].response_excerpt, `${'a'.repeat(498)}é😀`);
      // A failed ping never degrades the webhook.
      assert.equal((await t.request('GET', `/v1/webhooks/${id}`)).body.status, 'active');
    } finally {
      receiver.reply = (request) => (request.signatureValid ? { status: 200 } : { status: 401 });
    }
    await t.request('DELETE', `/v1/webhooks/${id}`);
  });

  test('bad url, events or status are invalid_request naming the field; nothing is stored', async () => {
    const before = (await t.request('GET', '/v1/webhooks?limit=100')).body.data.length;
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ url: 'ftp://files.example.com/', events: '*' }, 'url'],
      [{ url: 'https://user:pw@example.com/', events: '*' }, 'url'],
      [{ url: 'not a url', events: '*' }, 'url'],
      [{ url: `https://example.com/${'a'.repeat(2100)}`, events: '*' }, 'url'],
      // Short as sent, too long as stored (percent-encoded): was the column's CHECK, a 500.
      [{ url: `https://example.com/${'é'.repeat(400)}`, events: '*' }, 'url'],
      [{ events: '*' }, 'url'],
      [{ url: 'https://example.com/' }, 'events'],
      [{ url: 'https://example.com/', events: [] }, 'events'],
      [{ url: 'https://example.com/', events: 'wallet.created' }, 'events'],
      [{ url: 'https://example.com/', events: ['wallet.created', 'wallet.exploded'] }, 'events'],
      [{ url: 'https://example.com/', events: ['*', 'wallet.created'] }, 'events'],
      [{ url: 'https://example.com/', events: ['ping'] }, 'events'],
      [{ url: 'https://example.com/', events: Array.from({ length: 100 }, () => 'wallet.created') }, 'events'],
      [{ url: 'https://example.com/', events: '*', secret: 'mine' }, 'secret'],
    ];
    for (const [body, param] of cases) {
      const response = await create(body);
      assert.equal(response.status, 400, JSON.stringify(body).slice(0, 200));
      assert.equal(response.body.error.code, 'invalid_request', JSON.stringify(body).slice(0, 200));
      assert.equal(response.body.error.param, param, JSON.stringify(body).slice(0, 200));
    }
    assert.equal((await t.request('GET', '/v1/webhooks?limit=100')).body.data.length, before);

    const id = (await create({ url: 'https://hooks.example.com/in', events: ['wallet.created'] })).body.webhook_id;
    const patches: Array<[Record<string, unknown>, string]> = [
      [{}, 'body'],
      [{ status: 'degraded' }, 'status'],
      [{ status: 'paused' }, 'status'],
      [{ url: 'gopher://example.com/' }, 'url'],
      [{ url: `https://example.com/${'é'.repeat(400)}` }, 'url'],
      [{ events: ['nope'] }, 'events'],
      [{ signing_secret: 'whsec_x' }, 'signing_secret'],
    ];
    for (const [body, param] of patches) {
      const response = await t.request('PATCH', `/v1/webhooks/${id}`, { body });
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    const unchanged = await t.request('GET', `/v1/webhooks/${id}`);
    assert.equal(unchanged.body.url, 'https://hooks.example.com/in');
    assert.deepEqual(unchanged.body.events, ['wallet.created']);
    for (const query of ['status=gone', 'limit=0', 'limit=101', 'colour=red']) {
      const response = await t.request('GET', `/v1/webhooks/${id}/deliveries?${query}`);
      assert.equal(response.status, 400, query);
      assert.equal(response.body.error.code, 'invalid_request', query);
    }
    await t.request('DELETE', `/v1/webhooks/${id}`);
  });

  test('every event name of the catalogue can be subscribed to', async () => {
    const response = await create({ url: 'https://hooks.example.com/all-named', events: [...EVENT_TYPES] });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    assert.deepEqual(response.body.events, [...EVENT_TYPES]);
    await t.request('DELETE', `/v1/webhooks/${response.body.webhook_id}`);
  });

  test('an organisation has at most 20 webhooks', async () => {
    const org = await t.createOrganization('Many webhooks');
    const made = await Promise.all(Array.from({ length: 22 }, (_, i) =>
      create({ url: `https://hooks.example.com/${i}`, events: '*' }, org.adminKey)));
    assert.equal(made.filter((r) => r.status === 200).length, 20, 'concurrent creations stop at the limit');
    const refused = made.find((r) => r.status !== 200)!;
    assert.equal(refused.status, 400);
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.match(refused.body.error.message, /limit of 20 webhooks/);
    const one = made.find((r) => r.status === 200)!.body.webhook_id;
    await t.request('DELETE', `/v1/webhooks/${one}`, { key: org.adminKey });
    assert.equal((await create({ url: 'https://hooks.example.com/again', events: '*' }, org.adminKey)).status, 200, 'a deletion frees a place');
  });

  test('admin and operator write; viewer and arbiter only read; agent neither', async () => {
    const byOperator = await create({ url: 'https://hooks.example.com/roles', events: '*' }, operatorKey);
    assert.equal(byOperator.status, 200);
    const id = byOperator.body.webhook_id;
    const writes: Array<[string, string, unknown]> = [
      ['POST', '/v1/webhooks', { url: 'https://hooks.example.com/x', events: '*' }],
      ['PATCH', `/v1/webhooks/${id}`, { status: 'disabled' }],
      ['POST', `/v1/webhooks/${id}/rotate-secret`, undefined],
      ['POST', `/v1/webhooks/${id}/test`, undefined],
      ['DELETE', `/v1/webhooks/${id}`, undefined],
    ];
    for (const key of [viewerKey, arbiterKey, agentKey]) {
      for (const [method, url, body] of writes) {
        const response = await t.request(method, url, { key, body });
        assert.equal(response.status, 403, `${method} ${url}`);
        assert.equal(response.body.error.code, 'insufficient_permissions');
      }
    }
    const reads = [`/v1/webhooks/${id}`, '/v1/webhooks', `/v1/webhooks/${id}/deliveries`];
    for (const key of [viewerKey, arbiterKey]) {
      for (const url of reads) assert.equal((await t.request('GET', url, { key })).status, 200, url);
    }
    for (const url of reads) {
      assert.equal((await t.request('GET', url, { key: agentKey })).status, 403, url);
      assert.equal((await t.request('GET', url, { key: null })).status, 401, url);
    }
    assert.equal((await t.request('GET', `/v1/webhooks/${id}`)).body.status, 'active', 'refused writes changed nothing');
    await t.request('DELETE', `/v1/webhooks/${id}`);
  });

  test('another organisation\'s webhook answers like a missing one: 404 webhook_not_found', async () => {
    const mine = await create({ url: 'https://hooks.example.com/mine', events: '*' });
    const id = mine.body.webhook_id;
    const calls: Array<[string, string, unknown]> = [
      ['GET', `/v1/webhooks/${id}`, undefined],
      ['PATCH', `/v1/webhooks/${id}`, { status: 'disabled' }],
      ['DELETE', `/v1/webhooks/${id}`, undefined],
      ['POST', `/v1/webhooks/${id}/rotate-secret`, undefined],
      ['POST', `/v1/webhooks/${id}/test`, undefined],
      ['GET', `/v1/webhooks/${id}/deliveries`, undefined],
    ];
    for (const [method, url, body] of calls) {
      for (const [key, target] of [[other.adminKey, url], [undefined, url.replace(id, 'whk_doesnotexist')]] as const) {
        const response = await t.request(method, target, { key, body });
        assert.equal(response.status, 404, `${method} ${target}`);
        assert.equal(response.body.error.code, 'webhook_not_found');
        assert.equal(response.body.error.param, 'webhook_id');
      }
    }
    const theirs = await t.request('GET', '/v1/webhooks?limit=100', { key: other.adminKey });
    assert.ok(!theirs.body.data.some((w: { webhook_id: string }) => w.webhook_id === id), 'not in the other organisation\'s list');
    const still = await t.request('GET', `/v1/webhooks/${id}`);
    assert.equal(still.body.status, 'active', 'the other organisation changed nothing');
    assert.equal(still.body.secret_rotated_at, null, 'nor rotated the secret');
    await t.request('DELETE', `/v1/webhooks/${id}`);
  });

  test('the list pages newest first with a stable cursor; limit is bounded', async () => {
    const fresh = await t.createOrganization('Paging');
    const ids: string[] = [];
    for (let i = 0; i < 5; i += 1) ids.push((await create({ url: `https://hooks.example.com/p${i}`, events: '*' }, fresh.adminKey)).body.webhook_id);
    const first = await t.request('GET', '/v1/webhooks?limit=2', { key: fresh.adminKey });
    assert.equal(first.body.has_more, true);
    const seen = first.body.data.map((w: { webhook_id: string }) => w.webhook_id);
    const late = (await create({ url: 'https://hooks.example.com/late', events: '*' }, fresh.adminKey)).body.webhook_id;
    let cursor = first.body.next_cursor;
    while (cursor) {
      const page = await t.request('GET', `/v1/webhooks?limit=2&cursor=${cursor}`, { key: fresh.adminKey });
      seen.push(...page.body.data.map((w: { webhook_id: string }) => w.webhook_id));
      cursor = page.body.next_cursor;
    }
    const whole = (await t.request('GET', '/v1/webhooks?limit=100', { key: fresh.adminKey })).body.data
      .map((w: { webhook_id: string }) => w.webhook_id);
    assert.deepEqual(whole.filter((id: string) => id !== late), seen);
    assert.deepEqual([...seen].sort(), [...ids].sort());
    for (const limit of ['0', '101', 'ten']) {
      const response = await t.request('GET', `/v1/webhooks?limit=${limit}`, { key: fresh.adminKey });
      assert.equal(response.status, 400, limit);
      assert.equal(response.body.error.param, 'limit');
    }
  });
});

/** A host name that is not localhost and not an IP literal, but resolves only to non-public addresses (e.g. from /etc/hosts). */
describe('webhook URLs with AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS off (the default)', () => {
  let strict: TestService;
  let receiver: Receiver;
  before(async () => {
    strict = await startTestService();
    receiver = await startReceiver();
  });
  after(async () => {
    await receiver.close();
    await strict.close();
  });

  test('loopback, private, link-local and localhost URLs are refused at creation and update', async () => {
    const refused = [
      'http://127.0.0.1:8080/hook', 'http://localhost/hook', 'http://api.localhost/hook', 'http://10.1.2.3/',
      'http://192.168.1.10/', 'http://172.16.0.1/', 'http://169.254.169.254/latest/meta-data', 'http://100.64.0.1/',
      'http://[::1]/', 'http://[::ffff:10.0.0.1]/', 'http://0x7f.1/', 'http://0.0.0.0/',
    ];
    for (const url of refused) {
      const response = await strict.request('POST', '/v1/webhooks', { body: { url, events: '*' } });
      assert.equal(response.status, 400, url);
      assert.equal(response.body.error.code, 'invalid_request', url);
      assert.equal(response.body.error.param, 'url', url);
    }
    const ok = await strict.request('POST', '/v1/webhooks', { body: { url: 'https://hooks.example.com/in', events: '*' } });
    assert.equal(ok.status, 200, JSON.stringify(ok.body));
    const patch = await strict.request('PATCH', `/v1/webhooks/${ok.body.webhook_id}`, { body: { url: 'http://127.0.0.1/' } });
    assert.equal(patch.status, 400);
    assert.equal(patch.body.error.param, 'url');
    assert.equal((await strict.request('GET', `/v1/webhooks/${ok.body.webhook_id}`)).body.url, 'https://hooks.example.com/in');
    await strict.request('DELETE', `/v1/webhooks/${ok.body.webhook_id}`);
  });

  test('a host name that resolves to a private address is refused when sending, and says why', async () => {
    // DNS (c-ares, wrapped: no network here) says 10.1.2.3 for this name, at sending time.
    mock.method(Resolver.prototype, 'resolve4', async (name: string) => {
      if (name === 'intranet.example') return ['10.1.2.3'];
      throw Object.assign(new Error('queryA ENOTFOUND'), { code: 'ENOTFOUND' });
    });
    mock.method(Resolver.prototype, 'resolve6', async () => {
      throw Object.assign(new Error('queryAaaa ENODATA'), { code: 'ENODATA' });
    });
    try {
      // The name passes creation (it is not an address), but DNS says private at sending time.
      const url = receiver.url('/private', 'intranet.example');
      const created = await strict.request('POST', '/v1/webhooks', { body: { url, events: ['policy.created'] } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      const id = created.body.webhook_id;

      // A delivery, as the sending thread makes it (sendAttempts), run here where DNS is wrapped
      // (the thread's own DNS is not).
      const [sent] = await sendAttempts([{
        deliveryId: 'dlv_private', eventId: 'evt_private', attempt: 1, url, signing: { secret: created.body.signing_secret, previousSecret: null }, body: '{}',
      }], { allowPrivate: false, concurrency: 1 }, new ManualClock(Date.now()));
      assert.equal(sent!.result.succeeded, false);
      assert.equal(sent!.result.statusCode, null);
      assert.match(sent!.result.error!, /loopback, private/);
      assert.ok(!sent!.result.error!.includes('10.1.2.3'), 'the message does not reveal what the name resolved to');
      assert.equal(receiver.received.length, 0, 'nothing reached the private address');
      await strict.request('DELETE', `/v1/webhooks/${id}`);
    } finally {
      mock.restoreAll();
    }
  });
});

test('the worked example of docs/webhooks.md is what the dispatcher signs', () => {
  const body = '{"event":"ping","id":"evt_01kdwq7s00x3v9p2m8r4t6y1zb","timestamp":"2026-01-01T00:00:00.000Z","webhook_id":"whk_01kdwq7s00a1b2c3d4e5f6g7h8"}';
  const secret = 'whsec_Qm9uZ2F0ZS1leGFtcGxlLXNlY3JldC1ub3QtcmVhbDA';
  const example = '402e58f41c90894b1b37ba3a710f5fcce6e3459ec36b941d190e17a7711d2317';
  assert.equal(createHmac('sha256', secret).update(body, 'utf8').digest('hex'), example);
  assert.equal(signatureOf(body, secret), example);
  const headers = deliveryHeaders(body, { secret, previousSecret: null }, { eventId: 'evt_01kdwq7s00x3v9p2m8r4t6y1zb', deliveryId: 'dlv_x', attempt: 1 });
  assert.equal(headers['service-signature'], example);
  assert.equal(headers['service-signature-previous'], undefined);
});
