/**
 * The webhook sender's thread (started by sender.ts): makes each batch of attempts it is given
 * and answers with their outcomes.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { OffsetClock } from '../clock/clock.ts';
import { sendAttempts } from './attempt.ts';
import type { SenderReply, SenderRequest, SenderThreadData } from './sender.ts';

const port = parentPort!;
const clock = new OffsetClock((workerData as SenderThreadData).offsetCell);

port.on('message', (request: SenderRequest) => {
  sendAttempts(request.requests, request.options, clock).then(
    (sent) => port.postMessage({ id: request.id, sent } satisfies SenderReply),
    (error: unknown) => port.postMessage({ id: request.id, error: error instanceof Error ? error.message : String(error) } satisfies SenderReply));
});
