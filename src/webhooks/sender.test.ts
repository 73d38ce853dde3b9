import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { OffsetClock } from '../clock/clock.ts';
import type { AttemptRequest } from './attempt.ts';
import { AttemptSender, AttemptSenderError } from './sender.ts';
import { startReceiver, type Receiver } from './testing.ts';

const SECRET = 'whsec_sender_test_secret';
const DAY_MS = 24 * 3600 * 1000;

let receiver: Receiver;
before(async () => {
  receiver = await startReceiver();
  receiver.secret = SECRET;
});
after(() => receiver.close());

function request(n: number, body: string | null = JSON.stringify({ event: 'ping', id: `evt_${n}` })): AttemptRequest {
  return { deliveryId: `dlv_${n}`, eventId: `evt_${n}`, attempt: 1, url: receiver.url(`/hook/${n}`), signing: { secret: SECRET, previousSecret: null }, body };
}

test('a batch is sent from the sender thread: signed, judged, in order, timed on the service clock', async () => {
  receiver.received.length = 0;
  receiver.reply = (received) => (received.path === '/hook/2' ? { status: 500, body: 'down' } : { status: 200, body: 'ok' });
  // The service clock ten days ahead of the wall: the thread shares its offset.
  const clock = new OffsetClock(10 * DAY_MS);
  const sender = new AttemptSender(clock);
  try {
    const startedMs = clock.nowMs();
    const sent = await sender.send([request(1), request(2), request(3, null), request(4)], { allowPrivate: true, concurrency: 2 });
    const endedMs = clock.nowMs();

    assert.deepEqual(sent.map((s) => [s.result.succeeded, s.result.statusCode]), [[true, 200], [false, 500], [false, null], [true, 200]],
      'each outcome is its own request\'s, in the order given');
    assert.equal(sent[1]!.result.error, 'The endpoint answered 500: a 2xx is required.', 'a non-2xx is a failure with its reason');
    assert.equal(sent[1]!.result.responseExcerpt, 'down', 'the answer is kept as an excerpt');
    assert.match(sent[2]!.result.error ?? '', /no longer stored/, 'an attempt without its event is a failure, with no request made');
    for (const { attemptedAt, finishedAt } of sent) {
      assert.ok(attemptedAt.getTime() >= startedMs && finishedAt.getTime() <= endedMs, 'times are on the service clock, not the wall');
      assert.ok(attemptedAt <= finishedAt, 'an attempt finishes after it began');
    }
    assert.deepEqual(receiver.received.map((r) => r.path).sort(), ['/hook/1', '/hook/2', '/hook/4'], 'three requests reached the receiver');
    assert.ok(receiver.received.every((r) => r.signatureValid), 'every request carries a valid Service-Signature');
    assert.ok(receiver.received.every((r) => r.headers['service-delivery-attempt'] === '1'), 'the attempt number is sent');
  } finally {
    await sender.close();
  }
});

test('the sender keeps at most `concurrency` attempts in flight and applies the SSRF guard it is told to', async () => {
  receiver.received.length = 0;
  let inFlight = 0;
  let mostInFlight = 0;
  receiver.reply = () => {
    inFlight += 1;
    mostInFlight = Math.max(mostInFlight, inFlight);
    setTimeout(() => { inFlight -= 1; }, 40);
    return { status: 204, delayMs: 40 };
  };
  const sender = new AttemptSender(new OffsetClock());
  try {
    const sent = await sender.send(Array.from({ length: 9 }, (_, n) => request(n)), { allowPrivate: true, concurrency: 3 });
    assert.ok(sent.every((s) => s.result.succeeded), 'every attempt succeeded');
    assert.equal(mostInFlight, 3, 'three at a time, never more');

    const guarded = await sender.send([request(10)], { allowPrivate: false, concurrency: 1 });
    assert.equal(guarded[0]!.result.succeeded, false, 'a private address is refused when private addresses are not allowed');
    assert.equal(guarded[0]!.result.error,
      '127.0.0.1 is a loopback, private, link-local, CGNAT or reserved address, which this service does not call.', 'with the guard\'s reason');
    assert.equal(receiver.received.length, 9, 'the refused attempt never reached the receiver');
  } finally {
    await sender.close();
  }
});

test('a closed sender refuses new batches', async () => {
  const sender = new AttemptSender(new OffsetClock());
  await sender.send([request(1)], { allowPrivate: true, concurrency: 1 });
  await sender.close();
  await assert.rejects(sender.send([request(2)], { allowPrivate: true, concurrency: 1 }), AttemptSenderError, 'closed: nothing is sent');
});
