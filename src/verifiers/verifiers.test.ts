/**
 * Verifiers through the real HTTP stack and database, and the proof check escrows call
 * (verifyCallbackProof) against the same database. Proofs are signed here with node:crypto
 * straight from the scheme docs/verifiers.md describes, not with the module's own signer, so a
 * drift between the documentation and the check fails these tests.
 */
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { ServiceError } from '../errors/errors.ts';
import { newId } from '../ids/ids.ts';
import { assertVerifierUsable, signCallbackProof, verifyCallbackProof } from './verifiers.ts';

/** What a verifier computes, per docs/verifiers.md. */
function sign(secret: string, t: number, escrowId: string, verdict = 'completed'): string {
  return `t=${t},v1=${createHmac('sha256', secret).update(`${t}.${escrowId}.${verdict}`).digest('hex')}`;
}

/** The ServiceError a use-case refused with (and a failure when it did not refuse). */
async function refusal(promise: Promise<unknown>): Promise<ServiceError> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof ServiceError) return error;
    throw error;
  }
  assert.fail('expected a refusal');
}

test('the worked example of docs/verifiers.md is what the scheme computes', () => {
  const example = 't=1767225600,v1=9a6d3dc8a70c6f3682b9aaeb72698e3c225e5c61b5e8a28499bab74cb07d7a90';
  const args = ['vsec_Qm9uZ2F0ZS1leGFtcGxlLXNlY3JldC1ub3QtcmVhbDA', 1767225600, 'esc_01kdwq7s00x3v9p2m8r4t6y1zb'] as const;
  assert.equal(sign(...args), example);
  assert.equal(signCallbackProof(...args), example);
});

describe('verifiers API', () => {
  let t: TestService;
  let operatorKey: string;
  let viewerKey: string;
  let arbiterKey: string;
  let agentKey: string;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService();
    operatorKey = await t.createKey('operator');
    viewerKey = await t.createKey('viewer');
    arbiterKey = await t.createKey('arbiter');
    agentKey = await t.createKey('agent');
    other = await t.createOrganization();
  });
  after(async () => { await t.close(); });

  const create = (body: Record<string, unknown>, key?: string) => t.request('POST', '/v1/verifiers', { body, key });

  test('create, read, list, revoke; the secret appears in the creation response only', async () => {
    const created = await create({ name: 'Acme QA', url: 'https://qa.acme.example/hooks' });
    assert.equal(created.status, 200);
    const { verifier_id: id, signing_secret: secret } = created.body;
    assert.match(id, /^ver_/);
    assert.match(secret, /^vsec_[A-Za-z0-9_-]{43}$/);
    assert.equal(created.body.name, 'Acme QA');
    assert.equal(created.body.url, 'https://qa.acme.example/hooks');
    assert.equal(created.body.status, 'active');
    assert.equal(created.body.secret_rotated_at, null);
    assert.equal(created.body.previous_secret_expires_at, null);
    assert.equal(created.body.revoked_at, null);

    const read = await t.request('GET', `/v1/verifiers/${id}`, { key: viewerKey });
    assert.equal(read.status, 200);
    const { signing_secret: _shownOnce, ...withoutSecret } = created.body;
    assert.deepEqual(read.body, withoutSecret);
    const listed = await t.request('GET', '/v1/verifiers?limit=100', { key: viewerKey });
    assert.deepEqual(listed.body.data.find((v: { verifier_id: string }) => v.verifier_id === id), withoutSecret);
    for (const response of [read, listed]) {
      assert.ok(!JSON.stringify(response.body).includes(secret), 'a read never shows the secret');
    }

    const revoked = await t.request('DELETE', `/v1/verifiers/${id}`, { key: operatorKey });
    assert.equal(revoked.status, 200);
    assert.equal(revoked.body.status, 'revoked');
    assert.equal(typeof revoked.body.revoked_at, 'string');
    // Revoked verifiers stay readable (escrows name them); revoking again changes nothing.
    assert.deepEqual((await t.request('GET', `/v1/verifiers/${id}`)).body, revoked.body);
    const again = await t.request('DELETE', `/v1/verifiers/${id}`);
    assert.equal(again.status, 200);
    assert.deepEqual(again.body, revoked.body);
    // A revoked verifier's secret cannot rotate.
    const unknownField = await t.request('POST', `/v1/verifiers/${id}/rotate-secret`, { body: { ttl: 5 } });
    assert.equal(unknownField.status, 400);
    assert.equal(unknownField.body.error.param, 'ttl');
    const rotate = await t.request('POST', `/v1/verifiers/${id}/rotate-secret`);
    assert.equal(rotate.status, 400);
    assert.equal(rotate.body.error.code, 'invalid_request');
    assert.equal(rotate.body.error.param, 'verifier_id');
  });

  test('url is optional; a bad or non-public url and a bad name are invalid_request naming the field, nothing stored', async () => {
    const bare = await create({ name: 'No URL' });
    assert.equal(bare.status, 200);
    assert.equal(bare.body.url, null);
    // Characters, not UTF-16 units: 200 emoji are 200 characters.
    const emoji = await create({ name: '😀'.repeat(200) });
    assert.equal(emoji.status, 200, JSON.stringify(emoji.body));
    const before = (await t.request('GET', '/v1/verifiers?limit=100')).body.data.length;
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ name: 'x', url: 'http://127.0.0.1:8080/' }, 'url'],
      [{ name: 'x', url: 'http://localhost/' }, 'url'],
      [{ name: 'x', url: 'http://169.254.169.254/' }, 'url'],
      [{ name: 'x', url: 'http://[::ffff:10.0.0.1]/' }, 'url'],
      [{ name: 'x', url: 'ftp://files.example.com/' }, 'url'],
      [{ name: 'x', url: 'https://user:pw@example.com/' }, 'url'],
      [{ name: 'x', url: 'not a url' }, 'url'],
      [{ name: 'x', url: `https://example.com/${'a'.repeat(2100)}` }, 'url'],
      [{ name: '' }, 'name'],
      [{ name: '   ' }, 'name'],
      [{ name: 'tab\there' }, 'name'],
      [{ name: 'x'.repeat(201) }, 'name'],
      [{ name: '😀'.repeat(201) }, 'name'],
      [{ url: 'https://example.com/' }, 'name'],
      [{ name: 'x', colour: 'red' }, 'colour'],
    ];
    for (const [body, param] of cases) {
      const response = await create(body);
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, 'invalid_request', JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    assert.equal((await t.request('GET', '/v1/verifiers?limit=100')).body.data.length, before);
  });

  test('admin and operator write; viewer and arbiter only read; agent neither', async () => {
    const byOperator = await create({ name: 'By operator' }, operatorKey);
    assert.equal(byOperator.status, 200);
    const id = byOperator.body.verifier_id;
    for (const key of [viewerKey, arbiterKey, agentKey]) {
      for (const [method, url] of [['POST', '/v1/verifiers'], ['POST', `/v1/verifiers/${id}/rotate-secret`], ['DELETE', `/v1/verifiers/${id}`]]) {
        const response = await t.request(method!, url!, { key, body: method === 'POST' && !url!.includes('rotate') ? { name: 'x' } : undefined });
        assert.equal(response.status, 403, `${method} ${url}`);
        assert.equal(response.body.error.code, 'insufficient_permissions');
      }
    }
    for (const key of [viewerKey, arbiterKey]) {
      assert.equal((await t.request('GET', `/v1/verifiers/${id}`, { key })).status, 200);
      assert.equal((await t.request('GET', '/v1/verifiers', { key })).status, 200);
    }
    for (const url of [`/v1/verifiers/${id}`, '/v1/verifiers']) {
      assert.equal((await t.request('GET', url, { key: agentKey })).status, 403, url);
      assert.equal((await t.request('GET', url, { key: null })).status, 401, url);
    }
    assert.equal((await t.request('GET', `/v1/verifiers/${id}`)).body.status, 'active', 'refused writes changed nothing');
  });

  test('another organisation\'s verifier answers like a missing one: 404 not_found', async () => {
    const mine = await create({ name: 'Mine' });
    const id = mine.body.verifier_id;
    for (const [method, url] of [['GET', `/v1/verifiers/${id}`], ['DELETE', `/v1/verifiers/${id}`], ['POST', `/v1/verifiers/${id}/rotate-secret`],
      ['GET', '/v1/verifiers/ver_doesnotexist'], ['DELETE', '/v1/verifiers/ver_doesnotexist'], ['POST', '/v1/verifiers/ver_doesnotexist/rotate-secret']]) {
      const key = url!.includes(id) ? other.adminKey : undefined;
      const response = await t.request(method!, url!, { key });
      assert.equal(response.status, 404, `${method} ${url}`);
      assert.equal(response.body.error.code, 'not_found');
      assert.equal(response.body.error.param, 'verifier_id');
    }
    const theirs = await t.request('GET', '/v1/verifiers?limit=100', { key: other.adminKey });
    assert.ok(!theirs.body.data.some((v: { verifier_id: string }) => v.verifier_id === id), 'not in the other organisation\'s list');
    assert.equal((await t.request('GET', `/v1/verifiers/${id}`)).body.status, 'active', 'the other organisation changed nothing');
  });

  test('the list pages newest first with a stable cursor; limit is bounded', async () => {
    const fresh = await t.createOrganization('Paging');
    const ids: string[] = [];
    for (let i = 0; i < 5; i += 1) ids.push((await create({ name: `v${i}` }, fresh.adminKey)).body.verifier_id);
    const first = await t.request('GET', '/v1/verifiers?limit=2', { key: fresh.adminKey });
    assert.equal(first.status, 200);
    assert.equal(first.body.has_more, true);
    const seen = first.body.data.map((v: { verifier_id: string }) => v.verifier_id);
    // One created between pages must not shift the pages that follow.
    const late = (await create({ name: 'late' }, fresh.adminKey)).body.verifier_id;
    let cursor = first.body.next_cursor;
    while (cursor) {
      const page = await t.request('GET', `/v1/verifiers?limit=2&cursor=${cursor}`, { key: fresh.adminKey });
      seen.push(...page.body.data.map((v: { verifier_id: string }) => v.verifier_id));
      cursor = page.body.next_cursor;
    }
    // Two creations in one millisecond order by id, so the reference order is the full list's.
    const whole = (await t.request('GET', '/v1/verifiers?limit=100', { key: fresh.adminKey })).body.data
      .map((v: { verifier_id: string }) => v.verifier_id);
    assert.deepEqual(whole.filter((id: string) => id !== late), seen);
    assert.deepEqual([...seen].sort(), [...ids].sort());
    for (const limit of ['0', '101', 'ten']) {
      const response = await t.request('GET', `/v1/verifiers?limit=${limit}`, { key: fresh.adminKey });
      assert.equal(response.status, 400, limit);
      assert.equal(response.body.error.param, 'limit');
    }
  });
});

describe('verifyCallbackProof and assertVerifierUsable', () => {
  let t: TestService;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService();
    other = await t.createOrganization();
  });
  after(async () => { await t.close(); });

  const db = () => t.service.ctx.db;
  const nowMs = () => t.service.ctx.clock.nowMs();
  const nowSeconds = () => Math.floor(nowMs() / 1000);
  const escrowId = () => newId('esc', nowMs());
  const verify = (verifierId: string, escrow: string, proof: string, orgId = t.orgId) =>
    verifyCallbackProof(db(), nowMs(), orgId, verifierId, escrow, proof);
  async function newVerifier(): Promise<{ id: string; secret: string }> {
    const created = await t.request('POST', '/v1/verifiers', { body: { name: 'QA' } });
    assert.equal(created.status, 200);
    return { id: created.body.verifier_id, secret: created.body.signing_secret };
  }
  async function proofRefusal(promise: Promise<unknown>, reason: RegExp): Promise<void> {
    const error = await refusal(promise);
    assert.equal(error.code, 'invalid_proof');
    assert.equal(error.status, 400);
    assert.deepEqual(error.details, { param: 'proof' });
    assert.match(error.message, reason);
  }
  const advance = async (seconds: number) => {
    const response = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } });
    assert.equal(response.status, 200);
  };

  test('a proof signed with the secret for this escrow, within 300 s either way, verifies', async () => {
    const { id, secret } = await newVerifier();
    const escrow = escrowId();
    await verify(id, escrow, sign(secret, nowSeconds(), escrow));
    // Clocks of verifier and service may differ: 200 s behind or ahead is inside the tolerance.
    await verify(id, escrow, sign(secret, nowSeconds() - 200, escrow));
    await verify(id, escrow, sign(secret, nowSeconds() + 200, escrow));
  });

  test('a proof for another escrow, another verdict, another secret or altered does not verify', async () => {
    const { id, secret } = await newVerifier();
    const other = await newVerifier();
    const escrow = escrowId();
    const now = nowSeconds();
    await proofRefusal(verify(id, escrow, sign(secret, now, escrowId())), /does not verify/);
    await proofRefusal(verify(id, escrow, sign(secret, now, escrow, 'failed')), /does not verify/);
    await proofRefusal(verify(id, escrow, sign(other.secret, now, escrow)), /does not verify/);
    // The same signature with another time: t is signed too.
    const genuine = sign(secret, now, escrow);
    await proofRefusal(verify(id, escrow, genuine.replace(`t=${now}`, `t=${now - 1}`)), /does not verify/);
    const flipped = genuine.slice(0, -1) + (genuine.endsWith('0') ? '1' : '0');
    await proofRefusal(verify(id, escrow, flipped), /does not verify/);
  });

  test('a proof more than 300 s from the service clock is stale, even with a good signature', async () => {
    const { id, secret } = await newVerifier();
    const escrow = escrowId();
    await proofRefusal(verify(id, escrow, sign(secret, nowSeconds() - 400, escrow)), /more than 300 seconds/);
    await proofRefusal(verify(id, escrow, sign(secret, nowSeconds() + 400, escrow)), /more than 300 seconds/);
    // Signed at the current time, then the service clock moves on by ten minutes.
    const proof = sign(secret, nowSeconds(), escrow);
    await verify(id, escrow, proof);
    await advance(600);
    await proofRefusal(verify(id, escrow, proof), /more than 300 seconds/);
  });

  test('300 s either way is the tolerance in whole seconds, whatever the clock\'s milliseconds', async () => {
    const { id, secret } = await newVerifier();
    const escrow = escrowId();
    const second = nowSeconds();
    const at = (ms: number, time: number) => verifyCallbackProof(db(), second * 1000 + ms, t.orgId, id, escrow, sign(secret, time, escrow));
    for (const ms of [0, 984]) {
      await at(ms, second - 300);
      await at(ms, second + 300);
      await proofRefusal(at(ms, second - 301), new RegExp(`t=${second - 301} is more than 300 seconds away from the service clock \\(now ${second}\\)`));
      await proofRefusal(at(ms, second + 301), /more than 300 seconds/);
    }
  });

  test('malformed proofs are refused with the expected format', async () => {
    const { id, secret } = await newVerifier();
    const escrow = escrowId();
    const now = nowSeconds();
    const good = sign(secret, now, escrow);
    const hex = good.slice(good.indexOf('v1=') + 3);
    for (const proof of ['', 'garbage', `v1=${hex},t=${now}`, `t=${now}`, `v1=${hex}`, `t=${now},v1=${hex.toUpperCase()}`,
      `t=${now},v1=${hex.slice(2)}`, `t=${now},v1=${hex}00`, `t=-${now},v1=${hex}`, `t=${now}.5,v1=${hex}`, ` ${good}`, `${good} `,
      `${good},v1=${hex}`, `t=${now}, v1=${hex}`, `t=${now},v0=${hex}`, `t=1e9,v1=${hex}`, `t=${'9'.repeat(13)},v1=${hex}`, 'x'.repeat(10_000),
      // Leading zeros: not the documented form, although the same time.
      `t=0${now},v1=${hex}`, `t=00${now},v1=${hex}`]) {
      await proofRefusal(verify(id, escrow, proof), /t=<unix seconds>,v1=/);
    }
  });

  test('a revoked verifier, an unknown one and another organisation\'s never verify', async () => {
    const { id, secret } = await newVerifier();
    const escrow = escrowId();
    const proof = sign(secret, nowSeconds(), escrow);
    await verify(id, escrow, proof);
    assert.equal((await t.request('DELETE', `/v1/verifiers/${id}`)).status, 200);
    await proofRefusal(verify(id, escrow, proof), /revoked/);
    await proofRefusal(verify('ver_unknown', escrow, proof), /does not exist/);
    const theirs = await t.request('POST', '/v1/verifiers', { body: { name: 'theirs' }, key: other.adminKey });
    const theirProof = sign(theirs.body.signing_secret, nowSeconds(), escrow);
    await verifyCallbackProof(db(), nowMs(), other.orgId, theirs.body.verifier_id, escrow, theirProof);
    await proofRefusal(verify(theirs.body.verifier_id, escrow, theirProof), /does not exist/);
  });

  test('after a rotation the new secret verifies at once and the previous one for 24 hours, then no more', async () => {
    const { id, secret: first } = await newVerifier();
    const escrow = escrowId();
    const rotated = await t.request('POST', `/v1/verifiers/${id}/rotate-secret`);
    assert.equal(rotated.status, 200);
    const second = rotated.body.signing_secret;
    assert.match(second, /^vsec_/);
    assert.notEqual(second, first);
    assert.equal(rotated.body.status, 'active');
    assert.equal(Date.parse(rotated.body.previous_secret_expires_at) - Date.parse(rotated.body.secret_rotated_at), 24 * 3600 * 1000);
    assert.ok(!JSON.stringify((await t.request('GET', `/v1/verifiers/${id}`)).body).includes(second), 'the new secret is shown once');

    await verify(id, escrow, sign(second, nowSeconds(), escrow));
    await verify(id, escrow, sign(first, nowSeconds(), escrow));
    await advance(23 * 3600);
    await verify(id, escrow, sign(first, nowSeconds(), escrow));
    await advance(3600 + 1);
    await proofRefusal(verify(id, escrow, sign(first, nowSeconds(), escrow)), /does not verify/);
    await verify(id, escrow, sign(second, nowSeconds(), escrow));
  });

  test('rotating again within the overlap keeps only the secret just replaced', async () => {
    const { id, secret: first } = await newVerifier();
    const escrow = escrowId();
    const second = (await t.request('POST', `/v1/verifiers/${id}/rotate-secret`)).body.signing_secret;
    const third = (await t.request('POST', `/v1/verifiers/${id}/rotate-secret`)).body.signing_secret;
    await verify(id, escrow, sign(third, nowSeconds(), escrow));
    await verify(id, escrow, sign(second, nowSeconds(), escrow));
    await proofRefusal(verify(id, escrow, sign(first, nowSeconds(), escrow)), /does not verify/);
  });

  test('assertVerifierUsable: an active verifier of the organisation passes; unknown, revoked or foreign is invalid_request verifierId', async () => {
    const { id } = await newVerifier();
    await assertVerifierUsable(db(), t.orgId, id);
    for (const [orgId, verifierId] of [[other.orgId, id], [t.orgId, 'ver_unknown']] as const) {
      const error = await refusal(assertVerifierUsable(db(), orgId, verifierId));
      assert.equal(error.code, 'invalid_request');
      assert.deepEqual(error.details, { param: 'verifier_id' });
    }
    await t.request('DELETE', `/v1/verifiers/${id}`);
    const error = await refusal(assertVerifierUsable(db(), t.orgId, id));
    assert.equal(error.code, 'invalid_request');
    assert.match(error.message, /revoked/);
  });
});
