/**
 * A batch of attempts resolves each URL's host name once: the resolver (c-ares queries through
 * `dns.promises.Resolver`, which the guard calls) is counted, answering 127.0.0.1 for test
 * names (no network here), and a batch of many attempts to two URLs on one receiver asks it once
 * per URL; the next batch asks again. One test name takes 3 s to resolve, so that an attempt's
 * 5 s deadline is seen to cover its name's resolution as well as its request.
 */
import assert from 'node:assert/strict';
import { Resolver } from 'node:dns/promises';
import { after, before, describe, mock, test } from 'node:test';
import { ManualClock } from '../clock/clock.ts';
import { sendAttempts, type AttemptRequest } from './attempt.ts';
import { startReceiver, type Receiver } from './testing.ts';

/** A name DNS answers for only after SLOW_NAME_RESOLUTION_MS. */
const SLOW_NAME = 'slow-dns.example';
const SLOW_NAME_RESOLUTION_MS = 3_000;

describe('sendAttempts', () => {
  let receiver: Receiver;
  const asked: string[] = [];
  before(async () => {
    receiver = await startReceiver();
    receiver.secret = null;
    receiver.reply = () => ({ status: 204 });
    mock.method(Resolver.prototype, 'resolve4', async (name: string) => {
      asked.push(name);
      if (name === SLOW_NAME) await new Promise((resolve) => setTimeout(resolve, SLOW_NAME_RESOLUTION_MS));
      return ['127.0.0.1'];
    });
    mock.method(Resolver.prototype, 'resolve6', async () => {
      throw Object.assign(new Error('queryAaaa ENODATA'), { code: 'ENODATA' });
    });
  });
  after(async () => {
    mock.restoreAll();
    await receiver.close();
  });

  const request = (url: string, n: number): AttemptRequest => ({
    deliveryId: `dlv_${n}`, eventId: `evt_${n}`, attempt: 1, url, signing: { secret: 'whsec_test', previousSecret: null }, body: '{}',
  });

  test('resolves each URL\'s host name once per batch, however many attempts go to it', async () => {
    // Two webhooks' URLs on one receiver (the second spells its name with the root's dot).
    const urls = [receiver.url('/a', 'hooks.example'), receiver.url('/b', 'hooks.example.')];
    const batch = Array.from({ length: 12 }, (_, n) => request(urls[n % 2]!, n));
    const clock = new ManualClock(Date.now());

    const sent = await sendAttempts(batch, { allowPrivate: true, concurrency: 4 }, clock);
    assert.deepEqual(sent.map((s) => s.result.statusCode), batch.map(() => 204), 'every attempt reached the receiver');
    assert.equal(receiver.received.length, 12);
    assert.deepEqual(asked, ['hooks.example', 'hooks.example'], 'one resolution per URL for the whole batch');

    await sendAttempts(batch.slice(0, 3), { allowPrivate: true, concurrency: 3 }, clock);
    assert.equal(asked.length, 4, 'the next batch resolves its two URLs again');
  });

  test('an attempt ends within 5 s of its start, its host name\'s resolution included', async () => {
    // DESIGN §8's 5 s are the attempt's: 3 s of DNS and a receiver answering 3 s later is a
    // timed-out attempt at 5 s, not a success at 6 s (resolution and request once had 5 s each).
    const replyBefore = receiver.reply;
    receiver.reply = () => ({ status: 204, delayMs: 3_000 });
    try {
      const clock = new ManualClock(Date.now());
      const [sent] = await sendAttempts([request(receiver.url('/slow', SLOW_NAME), 100)], { allowPrivate: true, concurrency: 1 }, clock);
      const { result } = sent!;
      // With 5 s for each of the resolution and the request, the answer at 6 s would be a success.
      assert.equal(result.succeeded, false, 'the answer came after the deadline');
      assert.equal(result.statusCode, null);
      assert.match(result.error ?? '', /within 5000 ms/);
      assert.equal(receiver.received.at(-1)?.path, '/slow', 'the request was sent once the name resolved');
    } finally {
      receiver.reply = replyBefore;
    }
  });
});
