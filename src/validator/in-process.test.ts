import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { generateKeyPairSigner, lamports } from '@solana/kit';
import { ManualClock } from '../clock/clock.ts';
import { createInProcessRpc } from './in-process.ts';
import { describeRpcSuite } from './rpc-suite.ts';
import { confirmed, signedTransaction, transferSol, type TestRpc } from './testing.ts';
import { LocalValidator } from './validator.ts';

describeRpcSuite('local validator in-process (createSolanaRpcFromTransport)', async () => {
  const clock = new ManualClock(1_750_000_000_000);
  const validator = await LocalValidator.open({ slotMs: 20, clock, programSoPath: null });
  return { rpc: createInProcessRpc(validator) as TestRpc, validator, clock, close: () => validator.close() };
});

describe('local validator with slotMs 0', () => {
  // Guarantee: with slotMs 0 a transaction has executed (and, in memory, is visible) when sendTransaction returns.
  it('executes each transaction at once', async () => {
    const clock = new ManualClock(1_750_000_000_000);
    const validator = await LocalValidator.open({ slotMs: 0, clock, programSoPath: null });
    try {
      const rpc = createInProcessRpc(validator) as TestRpc;
      const payer = await generateKeyPairSigner();
      const airdrop = await rpc.requestAirdrop(payer.address, lamports(1_000_000_000n)).send();
      assert.ok((await rpc.getSignatureStatuses([airdrop]).send()).value[0]);
      const recipient = (await generateKeyPairSigner()).address;
      const { wire, signature } = await signedTransaction(rpc, payer, [transferSol(payer, recipient, 5_000_000n)]);
      await rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send();
      assert.equal((await rpc.getSignatureStatuses([signature]).send()).value[0]?.err, null);
      assert.equal((await rpc.getBalance(recipient).send()).value, 5_000_000n);
      await confirmed(rpc, signature);
    } finally {
      await validator.close();
    }
  });
});
