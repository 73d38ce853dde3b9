/**
 * A sending thread for tests of sender.ts's failure handling: it answers like
 * sender-worker.ts, except for a batch whose first delivery id names a failure:
 * `dlv_crash` throws (the thread dies of an uncaught error), `dlv_exit` ends the thread,
 * `dlv_silent` is never answered. And a thread started while the file named by
 * AV_TEST_SENDER_CRASH_ONCE exists deletes it and dies on its first batch: the next thread works.
 */
import { rmSync } from 'node:fs';
import { parentPort, workerData } from 'node:worker_threads';
import { OffsetClock } from '../clock/clock.ts';
import { sendAttempts } from './attempt.ts';
import type { SenderReply, SenderRequest, SenderThreadData } from './sender.ts';

const port = parentPort!;
const clock = new OffsetClock((workerData as SenderThreadData).offsetCell);

const crashMarker = process.env.AV_TEST_SENDER_CRASH_ONCE;

port.on('message', (request: SenderRequest) => {
  if (crashMarker) {
    let crash = true;
    try {
      rmSync(crashMarker);
    } catch {
      crash = false;
    }
    if (crash) throw new Error('the test thread crashed, once');
  }
  const failure = request.requests[0]?.deliveryId;
  if (failure === 'dlv_crash') throw new Error('the test thread crashed');
  if (failure === 'dlv_exit') process.exit(7);
  if (failure === 'dlv_silent') return;
  void sendAttempts(request.requests, request.options, clock)
    .then((sent) => port.postMessage({ id: request.id, sent } satisfies SenderReply));
});
