// Entry of the embedded validator's worker thread: the code base is TypeScript run through tsx,
// whose loader a worker does not inherit when the parent registered it in code (bin/agent-vault.js).
import { register } from 'tsx/esm/api';

register();
await import('./thread-worker.ts');
