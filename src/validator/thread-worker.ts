/**
 * The embedded validator's thread (started by thread.ts): opens the validator, answers the
 * service's JSON-RPC payloads, closes on request. Executing transactions at each slot boundary
 * happens here, off the service's event loop.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { OffsetClock } from '../clock/clock.ts';
import { createRpcHandler } from './rpc.ts';
import type { ThreadReply, ThreadRequest, ValidatorThreadOptions } from './thread.ts';
import { LocalValidator } from './validator.ts';

const port = parentPort!;
const options = workerData as ValidatorThreadOptions;
const reply = (message: ThreadReply): void => port.postMessage(message);
reply({ kind: 'loaded' });

try {
  const validator = await LocalValidator.open({
    dataDir: options.dataDir, slotMs: options.slotMs, clock: new OffsetClock(options.offsetCell),
    programSoPath: options.programSoPath, log: (entry) => reply({ kind: 'log', entry }),
  });
  const handler = createRpcHandler(validator);
  validator.onPublished((statuses) => reply({ kind: 'published', statuses }));
  port.on('message', (request: ThreadRequest) => {
    if (request.kind === 'close') {
      void validator.close().then(() => {
        reply({ kind: 'closed' });
        port.close();
      }, (error: unknown) => reply({ kind: 'closed', error: String(error) }));
      return;
    }
    handler.handlePayload(request.payload).then(
      (response) => reply({ kind: 'response', id: request.id, response }),
      (error: unknown) => reply({ kind: 'response', id: request.id, error: error instanceof Error ? error.message : String(error) }));
  });
  reply({ kind: 'ready', info: validator.info() });
} catch (error) {
  reply({ kind: 'failed', error: error instanceof Error ? error.message : String(error), name: error instanceof Error ? error.name : 'Error' });
  port.close();
}
