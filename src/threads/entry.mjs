// Entry of the service's worker threads (the embedded validator's, the webhook sender's): the code
// base is TypeScript run through tsx, whose loader a worker does not inherit when the parent
// registered it in code (bin/agent-vault.js). The thread's own module comes in workerData.module.
import { workerData } from 'node:worker_threads';
import { register } from 'tsx/esm/api';

register();
await import(workerData.module);
