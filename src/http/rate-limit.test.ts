/**
 * The per-key rate limit (DESIGN §3, docs/decisions.md "Rate limiting") through the real HTTP
 * stack, with a limit of 5 a minute: a request is counted against its key as soon as the key is
 * known, before the role check and before the body is parsed and validated, so over the limit
 * every request of that key is 429 with Retry-After, whatever it would otherwise have been.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestResponse, type TestService } from '../../test/harness.ts';

const LIMIT_PER_MINUTE = 5;

describe('rate limit', () => {
  let t: TestService;
  before(async () => {
    t = await startTestService({ workers: false, env: { AGENT_VAULT_RATE_LIMIT_PER_MINUTE: String(LIMIT_PER_MINUTE) } });
  });
  after(async () => { await t.close(); });

  const assertRateLimited = (response: TestResponse): void => {
    assert.equal(response.status, 429, JSON.stringify(response.body));
    assert.equal(response.body.error.code, 'rate_limited');
    assert.ok(Number(response.headers['retry-after']) > 0, 'Retry-After names the seconds to wait');
    assert.equal(response.body.error.request_id, response.headers['request-id']);
  };

  test('a read-only key looping writes it may not make gets 403 up to its limit, then 429', async () => {
    // Refused requests cost a SHA-256 and a key read each: a key cannot send them unthrottled.
    const viewer = await t.createKey('viewer');
    const write = () => t.request('POST', '/v1/wallets', { key: viewer, body: { agentId: 'not-allowed', label: 'x', policyId: 'pol_moderate' } });
    const answers: TestResponse[] = [];
    for (let i = 0; i <= LIMIT_PER_MINUTE; i += 1) answers.push(await write());
    assert.deepEqual(answers.map((a) => a.status), [...Array<number>(LIMIT_PER_MINUTE).fill(403), 429]);
    assert.equal(answers[0]!.body.error.code, 'insufficient_permissions');
    assertRateLimited(answers.at(-1)!);
    assertRateLimited(await t.request('GET', '/v1/organization', { key: viewer }));

    const other = await t.createKey('viewer');
    assert.equal((await t.request('GET', '/v1/organization', { key: other })).status, 200, 'another key is not limited');
  });

  test('a key looping malformed bodies gets 400 up to its limit, then 429', async () => {
    // Malformed JSON, a wrong content type, an unknown field, a missing one: each is refused
    // after the body is parsed or validated, and each counts all the same.
    const key = await t.createKey('admin');
    const malformed = [
      () => t.request('POST', '/v1/wallets', { key, body: '{"agentId": ', headers: { 'content-type': 'application/json' } }),
      () => t.request('POST', '/v1/wallets', { key, body: 'agentId=x', headers: { 'content-type': 'text/plain' } }),
      () => t.request('POST', '/v1/wallets', { key, body: { agentId: 'a', label: 'x', policyId: 'pol_moderate', colour: 'red' } }),
      () => t.request('POST', '/v1/wallets', { key, body: { label: 'x', policyId: 'pol_moderate' } }),
    ];
    const answers: TestResponse[] = [];
    for (let i = 0; i <= LIMIT_PER_MINUTE; i += 1) answers.push(await malformed[i % malformed.length]!());
    assert.deepEqual(answers.map((a) => a.status), [...Array<number>(LIMIT_PER_MINUTE).fill(400), 429]);
    assert.ok(answers.slice(0, LIMIT_PER_MINUTE).every((a) => a.body.error.code === 'invalid_request'));
    assertRateLimited(answers.at(-1)!);

    const other = await t.createKey('admin');
    const wallet = await t.request('POST', '/v1/wallets', { key: other, body: { agentId: `rate-${process.pid}`, label: 'x', policyId: 'pol_moderate' } });
    assert.equal(wallet.status, 200, `another key is not limited: ${JSON.stringify(wallet.body)}`);
  });

  test('requests without a valid key are answered 401, never 429: they are not counted', async () => {
    // Documented: a refused key costs one SHA-256 and one indexed read; throttling by address
    // belongs to the load balancer.
    const statuses: number[] = [];
    for (let i = 0; i <= 2 * LIMIT_PER_MINUTE; i += 1) {
      statuses.push((await t.request('GET', '/v1/organization', { key: i % 2 ? null : 'av_admin_unknownunknownunknownunknown00' })).status);
    }
    assert.deepEqual(statuses, statuses.map(() => 401));
    assert.equal((await t.request('GET', '/healthz', { key: null })).status, 200, 'health checks are never limited');
  });
});
