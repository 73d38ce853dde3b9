/**
 * The service's log keeps secrets out (src/http/logger.ts): a key sent in a query string, and the
 * values a failed statement was given, never reach it.
 */
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { loggedUrl, serviceLogger } from './logger.ts';

describe('the service log', () => {
  const lines: string[] = [];
  let t: TestService;
  before(async () => {
    const sink = new Writable({ write(chunk, _encoding, done) { lines.push(String(chunk)); done(); } });
    t = await startTestService({ workers: false, logger: serviceLogger('info', sink) });
  });
  after(async () => { await t.close(); });

  test('a key sent in the query string is not written with the request line; the other parameters are', async () => {
    const secret = `${t.adminKey}`;
    const answer = await t.request('GET', `/v1/transactions?limit=5&api_key=${encodeURIComponent(secret)}&Session%2DToken=avst_abc`, { key: null });
    assert.equal(answer.status, 401);
    const requestLine = lines.map((line) => JSON.parse(line)).find((line) => line.msg === 'incoming request' && line.req?.url?.startsWith('/v1/transactions'));
    assert.ok(requestLine, 'the request was logged');
    assert.equal(requestLine.req.url, '/v1/transactions?limit=5&api_key=[redacted]&Session%2DToken=[redacted]');
    assert.ok(!lines.some((line) => line.includes(secret) || line.includes('avst_abc')), 'no line holds the key or the token');
  });

  test('a failed statement is logged without the values it was given', async () => {
    const secret = 'whsec_never_in_the_log';
    const error = await t.service.ctx.db.transaction(async (tx) => {
      await tx.query('CREATE TEMPORARY TABLE logged_secrets (secret text CHECK (length(secret) < 5))');
      await tx.query('INSERT INTO logged_secrets (secret) VALUES ($1)', [secret]);
    }).then(() => null, (failure: unknown) => failure);
    assert.ok(error instanceof Error, 'the statement failed');
    t.service.app.log.error({ err: error }, 'a statement failed');
    const line = lines.find((entry) => entry.includes('"a statement failed"'));
    assert.ok(line, 'the error was logged');
    assert.ok(!line.includes(secret), `the secret is not in the line: ${line}`);
    const logged = JSON.parse(line).err;
    assert.match(logged.message, /logged_secrets/, 'the error itself is there');
    assert.equal(logged.code, '23514');
    assert.equal(logged.detail, 'Failing row contains (values not logged).');
  });

  test('whatever is logged as an error is written, never failing the log call, and values are dropped at any depth', () => {
    const sink: string[] = [];
    const logger = serviceLogger('info', new Writable({ write(chunk, _encoding, done) { sink.push(String(chunk)); done(); } }));
    const plain = { reason: 'refused', params: ['whsec_x'] };
    logger.warn({ err: null }, 'null');
    logger.warn({ err: 'a string' }, 'string');
    logger.warn({ err: plain }, 'plain');
    assert.deepEqual(plain, { reason: 'refused', params: ['whsec_x'] }, 'the caller\'s object is left as it was');
    const inner = Object.assign(new Error('duplicate key value violates unique constraint "webhooks_pkey"'), {
      params: ['whsec_inner'], detail: 'Key (signing_secret)=(whsec_inner) already exists.',
    });
    logger.warn({ err: new AggregateError([inner], 'several failed') }, 'aggregate');
    logger.warn({ err: new Error('wrapped', { cause: inner }) }, 'caused');
    const lines = sink.map((line) => JSON.parse(line));
    assert.deepEqual(lines.map((line) => line.msg), ['null', 'string', 'plain', 'aggregate', 'caused']);
    assert.equal(lines[0].err, null);
    assert.equal(lines[1].err, 'a string');
    assert.deepEqual(lines[2].err, { reason: 'refused' });
    for (const line of lines.slice(3)) assert.ok(!JSON.stringify(line).includes('whsec_'), JSON.stringify(line));
    assert.equal(lines[3].err.aggregateErrors[0].detail, 'Key (signing_secret)=(values not logged) already exists.');
  });

  test('query values are judged by their names, decoded', () => {
    assert.equal(loggedUrl('/v1/events?pwd=a&pass=b&bearer=c&q=avst_d&r=av%5Fe&limit=5'), '/v1/events?pwd=[redacted]&pass=[redacted]&bearer=[redacted]&q=[redacted]&r=[redacted]&limit=5',
      'secret-looking names, and values that are a key or token of the service whatever their name');
    assert.equal(loggedUrl('/v1/events?type=payment.sent&token=x'), '/v1/events?type=payment.sent&token=[redacted]');
    assert.equal(loggedUrl('/v1/events?my%5Fsecret=x&cursor=abc'), '/v1/events?my%5Fsecret=[redacted]&cursor=abc');
    assert.equal(loggedUrl('/v1/events?to%6Ben=s&api+key=t'), '/v1/events?to%6Ben=[redacted]&api+key=[redacted]', 'a name written encoded');
    assert.equal(loggedUrl('/v1/events?%zz=1&flag'), '/v1/events?%zz=1&flag');
    assert.equal(loggedUrl('/v1/events'), '/v1/events');
  });
});
