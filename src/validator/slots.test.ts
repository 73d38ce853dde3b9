/**
 * Transactions execute as they arrive, a slice at a time, so the validator keeps answering
 * under a burst; they show only when their slot ends, every one of them once, and closing runs
 * what is left.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { generateKeyPairSigner, lamports, type KeyPairSigner } from '@solana/kit';
import { ManualClock } from '../clock/clock.ts';
import { createInProcessRpc } from './in-process.ts';
import { MEMO_PROGRAM, confirmed, memoInstruction, signedTransaction, type TestRpc } from './testing.ts';
import { LocalValidator } from './validator.ts';

const START_MS = 1_750_000_000_000;
/** Long enough to sign, send and execute the whole set inside one slot. */
const SLOT_MS = 2_000;
/** Enough transactions that executing them all takes far longer than one slice. */
const COUNT = 300;

const turn = () => new Promise((resolve) => setImmediate(resolve));

async function memos(rpc: TestRpc, payer: KeyPairSigner, prefix: string) {
  const lifetime = (await rpc.getLatestBlockhash().send()).value;
  return Promise.all(Array.from({ length: COUNT }, (_, i) =>
    signedTransaction(rpc, payer, [memoInstruction(MEMO_PROGRAM, payer, `${prefix} ${i}`)], lifetime)));
}

/** getSignatureStatuses takes at most 256 signatures a call. */
async function statusesOf(rpc: TestRpc, sent: ReadonlyArray<{ signature: Parameters<TestRpc['getSignatureStatuses']>[0][number] }>) {
  const statuses = [];
  for (let start = 0; start < sent.length; start += 200) {
    statuses.push(...(await rpc.getSignatureStatuses(sent.slice(start, start + 200).map((s) => s.signature)).send()).value);
  }
  return statuses;
}

/** Waits for the next slot to begin, so that what is sent now lands in one slot. */
async function slotStart(validator: LocalValidator): Promise<void> {
  const slot = validator.slot;
  while (validator.slot === slot) await new Promise((resolve) => setTimeout(resolve, 1));
}

/** Sends them all at once (the validator's own call: no turn of the event loop between them). */
function sendAll(validator: LocalValidator, sent: ReadonlyArray<{ wire: string }>): void {
  for (const { wire } of sent) validator.sendTransaction(Buffer.from(wire, 'base64'), { skipPreflight: true });
}

describe('local validator slots', () => {
  let root: string;
  before(() => { root = mkdtempSync(join(tmpdir(), 'agent-vault-slots-')); });
  after(() => rmSync(root, { recursive: true, force: true }));

  it('executes a burst a slice at a time, answering in between, and shows it when the slot ends', async () => {
    const validator = await LocalValidator.open({ slotMs: SLOT_MS, clock: new ManualClock(START_MS), programSoPath: null });
    try {
      const rpc = createInProcessRpc(validator) as TestRpc;
      const payer = await generateKeyPairSigner();
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(10_000_000_000n)).send());
      const sent = await memos(rpc, payer, 'slice');
      await slotStart(validator);
      const slot = validator.slot;
      sendAll(validator, sent);
      assert.equal(validator.queuedCount, COUNT, 'all sent, none executed yet');

      // Each turn of the event loop is a chance to answer: count what is left at each one.
      const left = new Set<number>();
      while (validator.queuedCount > 0) {
        left.add(validator.queuedCount);
        await turn();
      }
      const partial = [...left].filter((n) => n > 0 && n < COUNT);
      assert.ok(partial.length >= 2, `executed in slices with turns between them (left at each turn: ${[...left].join(', ')})`);
      assert.equal(validator.slot, slot, 'all executed within the slot they were sent in');
      assert.ok((await statusesOf(rpc, sent)).every((status) => status === null), 'none shows before its slot ends');

      await slotStart(validator);
      const statuses = await statusesOf(rpc, sent);
      assert.ok(statuses.every((status) => status?.err === null && status.slot === BigInt(slot)),
        'each shows once the slot ended, executed in that slot, successfully');
    } finally {
      await validator.close();
    }
  });

  it('closing executes what is left of a burst, and persists it', async () => {
    const dataDir = join(root, 'close');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: SLOT_MS, clock, programSoPath: null });
    const payer = await generateKeyPairSigner();
    let sent: Awaited<ReturnType<typeof memos>>;
    try {
      const rpc = createInProcessRpc(validator) as TestRpc;
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(10_000_000_000n)).send());
      sent = await memos(rpc, payer, 'close');
      sendAll(validator, sent);
      await turn();
      assert.ok(validator.queuedCount > 0 && validator.queuedCount < COUNT, 'closing while the burst is half executed');
    } finally {
      await validator.close();
    }
    validator = await LocalValidator.open({ dataDir, slotMs: SLOT_MS, clock, programSoPath: null });
    try {
      const rpc = createInProcessRpc(validator) as TestRpc;
      const statuses = await statusesOf(rpc, sent);
      assert.equal(statuses.filter((status) => status?.err === null).length, COUNT, 'every one executed before closing, and was persisted');
    } finally {
      await validator.close();
    }
  });
});
