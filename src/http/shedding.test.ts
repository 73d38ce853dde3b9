/**
 * Load shedding (AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS): while the process's event loop is late all
 * the time, new requests are refused 503 with Retry-After before anything is done for them, and
 * served again once it catches up. The loop is kept busy here the way an overload keeps it busy:
 * work that never lets it wait.
 */
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { after, before, test } from 'node:test';
import pino from 'pino';
import { startTestService, type TestService } from '../../test/harness.ts';
import { OVERLOADED_RETRY_AFTER_S } from './app.ts';

let t: TestService;
const lines: Array<{ level: number; msg: string; refused?: number }> = [];
before(async () => {
  const sink = new Writable({ write(chunk, _encoding, done) { lines.push(JSON.parse(String(chunk))); done(); } });
  t = await startTestService({ workers: false, env: { AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS: '100' }, logger: pino({ level: 'warn' }, sink) });
});
after(async () => { await t.close(); });

const nextTurn = () => new Promise((resolve) => setTimeout(resolve, 20));

/** Keeps the event loop busy in 250 ms turns until the returned function is called. */
function overload(): () => void {
  let busy = true;
  const turn = () => {
    const end = Date.now() + 250;
    while (Date.now() < end) { /* the loop is taken */ }
    if (busy) setImmediate(turn);
  };
  setImmediate(turn);
  return () => { busy = false; };
}

test('an overloaded process refuses new requests 503 with Retry-After, doing nothing for them, and serves again once it catches up', async () => {
  assert.equal((await t.request('GET', '/v1/organization')).status, 200);
  const stop = overload();
  let refused;
  let refusals = 0;
  try {
    // A key that does not exist: refused for load, the answer is 503, not 401 — the key is never read.
    // (Between requests the loop's turn comes: a request answered in microtasks alone never gives it one.)
    // Forty requests take over ten seconds of the loop never free: the one-second sample acts long before.
    let asked = 0;
    do refused = await nextTurn().then(() => t.request('GET', '/v1/organization', { key: 'av_admin_doesnotexistdoesnotexist0001' }));
    while (refused.status === 401 && ++asked < 40);
    assert.equal(refused.status, 503, JSON.stringify(refused.body));
    refusals += 1;
    assert.equal(refused.body.error.code, 'service_unavailable');
    assert.match(refused.body.error.message, /^The service is overloaded \(its event loop is \d+ ms late\); retry in 2 s\. Nothing of this request was done\.$/);
    assert.equal(refused.headers['retry-after'], String(OVERLOADED_RETRY_AFTER_S));
    assert.equal(refused.headers['request-id'], refused.body.error.request_id);

    const created = await t.request('POST', '/v1/wallets', { body: { agentId: 'shed-1', label: 'x', policyId: 'pol_moderate' } });
    assert.deepEqual([created.status, created.body.error?.code], [503, 'service_unavailable'], 'a creation is refused too');
    refusals += 1;
    assert.equal((await t.request('GET', '/healthz', { key: null })).status, 200, '/healthz still answers what it checks');
  } finally {
    stop();
  }
  let served;
  do {
    served = await nextTurn().then(() => t.request('GET', '/v1/wallets?limit=100'));
    if (served.status === 503) refusals += 1;
  } while (served.status === 503);
  assert.equal(served.status, 200, JSON.stringify(served.body));
  assert.deepEqual(served.body.data.filter((w: { agent_id: string }) => w.agent_id === 'shed-1'), [], 'the refused creation made nothing');
  // Every refusal is counted in the warnings: the first says the overload began, the request
  // served after it that it is over.
  const warnings = lines.filter((line) => line.level === 40);
  assert.equal(warnings[0]?.msg, 'overloaded: refusing new requests');
  assert.equal(warnings.at(-1)?.msg, 'overload over: serving requests again');
  assert.equal(warnings.reduce((sum, line) => sum + (line.refused ?? 0), 0), refusals, JSON.stringify(warnings));
});

test('off (0), the busiest loop refuses nothing', async () => {
  const off = await startTestService({ workers: false, env: { AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS: '0' } });
  const stop = overload();
  try {
    // Two seconds of a loop never free: past the one-second sample a limit would have acted on.
    const until = Date.now() + 2_000;
    while (Date.now() < until) {
      await nextTurn();
      assert.equal((await off.request('GET', '/v1/organization')).status, 200);
    }
  } finally {
    stop();
    await off.close();
  }
});
