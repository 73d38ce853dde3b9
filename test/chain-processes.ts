/**
 * Another process's view of the chain, within one test process: a chain client on the same
 * chain and operator key, with its own blockhash cache and its own memory of the signatures it
 * prepared, which is all that tells two processes apart on the chain side.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { ChainClient, referenceMemoIx } from '../src/chain/client.ts';

export function processClient(chain: ChainClient): ChainClient {
  return new ChainClient({
    rpc: chain.rpc, programId: chain.programId, usdcMint: chain.usdcMint, operator: chain.operator, arbiter: chain.arbiter,
    embedded: chain.embedded, pollIntervalMs: 10,
  });
}

/** Both clients now hold the same blockhash: the same instructions would make the same signature. */
export async function sameBlockhash(a: ChainClient, b: ChainClient): Promise<void> {
  const warm = [referenceMemoIx(`warm-${randomBytes(4).toString('hex')}`)];
  const [fromA, fromB] = await Promise.all([a.prepare(warm), b.prepare(warm)]);
  assert.equal(fromA.signature, fromB.signature, 'precondition: both processes hold one blockhash');
}
