import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
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
  // Each answer waits long enough for the next two of its round to arrive, however slowly they come.
  receiver.reply = () => {
    inFlight += 1;
    mostInFlight = Math.max(mostInFlight, inFlight);
    setTimeout(() => { inFlight -= 1; }, 300);
    return { status: 204, delayMs: 300 };
  };
  const sender = new AttemptSender(new OffsetClock());
  try {
    const sent = await sender.send(Array.from({ length: 9 }, (_, n) => request(n)), { allowPrivate: true, concurrency: 3 });
    assert.ok(sent.every((s) => s.result.succeeded), 'every attempt succeeded');
    assert.equal(mostInFlight, 3, 'three at a time, never more');

    const guarded = await sender.send([request(10)], { allowPrivate: false, concurrency: 1 });
    assert.equal(guarded[0]!.result.succeeded, false, 'a private address is refused when private addresses are not allowed');
    assert.equal(guarded[0]!.result.error,
      '127.0.0.1 is a loopback, private, link-local, CGNAT or reserved address, which this service does not call'
      + ' (a service run for local development can allow them: AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS=on).', 'with the guard\'s reason');
    assert.equal(receiver.received.length, 9, 'the refused attempt never reached the receiver');
  } finally {
    await sender.close();
  }
});

test('a batch to a name that resolves to a refused address fails every attempt with the guard\'s reason, sending nothing', async () => {
  receiver.received.length = 0;
  const sender = new AttemptSender(new OffsetClock());
  try {
    const byName = (n: number): AttemptRequest => ({ ...request(n), url: receiver.url(`/hook/${n}`).replace('127.0.0.1', 'localhost') });
    const sent = await sender.send([byName(1), byName(2), byName(3)], { allowPrivate: false, concurrency: 2 });
    assert.deepEqual(sent.map((s) => s.result.error), Array(3).fill(
      'localhost does not resolve to a public address (a loopback, private, link-local, CGNAT or reserved address, or none, is not called)'
      + ' (a service run for local development can allow them: AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS=on).'),
    'each attempt fails with the guard\'s reason');
    assert.equal(receiver.received.length, 0, 'nothing reached the receiver');
    const allowed = await sender.send([byName(4), byName(5)], { allowPrivate: true, concurrency: 2 });
    assert.ok(allowed.every((s) => s.result.succeeded), 'allowed, the name is reached');
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

/** A sender whose thread fails on the batches the test thread module is told to fail. */
function failingSender(stuckAfterMs = 10_000): AttemptSender {
  return new AttemptSender(new OffsetClock(), {
    module: new URL('./testing-sender-worker.ts', import.meta.url),
    stuckAfter: { roundMs: 0, marginMs: stuckAfterMs },
  });
}

function failure(kind: 'crash' | 'exit' | 'silent'): AttemptRequest {
  return { ...request(0), deliveryId: `dlv_${kind}` };
}

for (const kind of ['crash', 'exit'] as const) {
  test(`a thread that ${kind === 'crash' ? 'dies of an error' : 'exits'} fails every batch it held; the next batch gets a new thread`, async () => {
    receiver.reply = () => ({ status: 200 });
    const sender = failingSender();
    try {
      assert.equal((await sender.send([request(1)], { allowPrivate: true, concurrency: 1 }))[0]!.result.succeeded, true,
        'the first thread works');
      const held = sender.send([request(2)], { allowPrivate: true, concurrency: 1 });
      const failed = sender.send([failure(kind)], { allowPrivate: true, concurrency: 1 });
      await assert.rejects(failed, AttemptSenderError, 'the batch that killed the thread rejects');
      // The batch sent just before may have been answered before the thread died, or not.
      const earlier = await held.then(() => 'answered', (error: unknown) => (error instanceof AttemptSenderError ? 'rejected' : 'other'));
      assert.ok(earlier === 'answered' || earlier === 'rejected', 'a batch held by the failed thread is answered or rejects with the sender\'s error');
      const after = await sender.send([request(3)], { allowPrivate: true, concurrency: 1 });
      assert.equal(after[0]!.result.succeeded, true, 'the next batch is sent by a new thread');
    } finally {
      await sender.close();
    }
  });
}

test('a thread that never answers counts as stuck after its batch\'s time, and is replaced', async () => {
  receiver.reply = () => ({ status: 200 });
  // Long enough for the replacing thread to start and answer on a loaded machine (its start
  // counts against its own batch's time).
  const sender = failingSender(3_000);
  try {
    const startedMs = performance.now();
    await assert.rejects(sender.send([failure('silent')], { allowPrivate: true, concurrency: 1 }),
      (error: unknown) => error instanceof AttemptSenderError && /did not answer within 3000 ms/.test(error.message), 'the silent batch rejects');
    assert.ok(performance.now() - startedMs >= 2_990, 'not before its time');
    const after = await sender.send([request(4)], { allowPrivate: true, concurrency: 1 });
    assert.equal(after[0]!.result.succeeded, true, 'the next batch is sent by a new thread');
  } finally {
    await sender.close();
  }
});

test('a thread with a batch in flight keeps the process alive; an idle one lets it end', async () => {
  receiver.received.length = 0;
  receiver.reply = () => ({ status: 200, delayMs: 300 });
  // A process that sends one batch and awaits nothing: only the thread can keep it alive until
  // the answer comes, and only an idle thread let go lets it end without close().
  const script = `
    import { OffsetClock } from ${JSON.stringify(new URL('../clock/clock.ts', import.meta.url).href)};
    import { AttemptSender } from ${JSON.stringify(new URL('./sender.ts', import.meta.url).href)};
    const request = ${JSON.stringify(request(5))};
    new AttemptSender(new OffsetClock()).send([request], { allowPrivate: true, concurrency: 1 })
      .then(([sent]) => console.log('answered', sent.result.statusCode));`;
  const dir = mkdtempSync(join(tmpdir(), 'av-sender-'));
  writeFileSync(join(dir, 'send-one.mjs'), script);
  const child = spawn(process.execPath, ['--import', 'tsx', join(dir, 'send-one.mjs')], { stdio: ['ignore', 'pipe', 'inherit'] });
  let output = '';
  child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString(); });
  const killer = setTimeout(() => child.kill('SIGKILL'), 20_000);
  const [code] = await once(child, 'exit') as [number | null];
  clearTimeout(killer);
  rmSync(dir, { recursive: true, force: true });
  assert.equal(output.trim(), 'answered 200', 'the process lived until the answer came');
  assert.equal(code, 0, 'then it ended by itself, its thread idle');
  assert.equal(receiver.received.length, 1, 'the request was made');
});

test('a batch that cannot be handed to the thread rejects, and leaves nothing pending', async () => {
  receiver.reply = () => ({ status: 200 });
  const sender = new AttemptSender(new OffsetClock());
  try {
    const unclonable = { ...request(6), signing: { secret: SECRET, previousSecret: (() => null) as unknown as null } };
    await assert.rejects(sender.send([unclonable], { allowPrivate: true, concurrency: 1 }), AttemptSenderError, 'it rejects');
    const after = await sender.send([request(7)], { allowPrivate: true, concurrency: 1 });
    assert.equal(after[0]!.result.succeeded, true, 'the same thread goes on sending');
  } finally {
    await sender.close();
  }
});
