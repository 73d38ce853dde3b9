/**
 * The embedded validator in its own worker thread, as `serve` runs it by default: payments
 * settle through it, the business clock is one clock for both threads, it refuses to open a
 * state another validator holds, and closing it persists what it executed.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { closeSync, constants, mkdirSync, mkdtempSync, openSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { Worker } from 'node:worker_threads';
import { address, signature as toSignature, type Rpc, type SolanaRpcApi } from '@solana/kit';
import { startTestService, type TestService } from '../../test/harness.ts';
import { balanceOf, fundedWallet, newRecipient } from '../../test/fixtures.ts';
import { OffsetClock } from '../clock/clock.ts';
import { createInProcessRpc } from './in-process.ts';
import { eventually } from './testing.ts';
import { ValidatorThread } from './thread.ts';
import { LOCK_FILE, SNAPSHOT_FILES } from './state-file.ts';
import { LocalValidator, type PublishedStatus } from './validator.ts';

const DAY_S = 24 * 60 * 60;

describe('OffsetClock shared with another thread', () => {
  test('an advance in either thread moves both clocks; the offset never goes back', async () => {
    const clock = new OffsetClock(5_000);
    const worker = new Worker(`
      const { parentPort, workerData } = require('node:worker_threads');
      const cell = new BigInt64Array(workerData, 0, 1);
      parentPort.once('message', () => { Atomics.add(cell, 0, 60000n); parentPort.postMessage(String(Atomics.load(cell, 0))); });
    `, { eval: true, workerData: clock.offsetCell });
    const seen = new Promise<string>((resolve) => worker.once('message', resolve));
    clock.advance(1);
    worker.postMessage('go');
    assert.equal(await seen, '66000', 'the worker saw the advance made here');
    assert.equal(clock.offsetMs, 66_000, 'this thread sees the worker\'s advance');
    await worker.terminate();
    const twin = new OffsetClock(clock.offsetCell);
    twin.setAtLeast(Date.now() + 1_000);
    assert.equal(clock.offsetMs, 66_000, 'setAtLeast to an earlier time leaves the offset');
    const target = Date.now() + 120_000;
    twin.setAtLeast(target);
    assert.ok(clock.nowMs() >= target, `the twin moved the shared offset (${clock.offsetMs})`);
  });
});

describe('the embedded validator in its own thread', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ env: { AGENT_VAULT_VALIDATOR_THREAD: 'on', AGENT_VAULT_SLOT_MS: '100' } }); });
  after(async () => { await t.close(); });

  test('a payment is sent, confirmed at a slot boundary of the thread and lands on chain', async () => {
    assert.equal(t.service.ctx.validator, null, 'the validator is not on the test\'s thread');
    const wallet = await fundedWallet(t, '10');
    const to = await newRecipient();
    const paid = await t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to, amount: '2.5', currency: 'USDC' } });
    assert.equal(paid.status, 200, JSON.stringify(paid.body));
    assert.equal(paid.body.status, 'confirmed');
    assert.equal(typeof paid.body.on_chain_slot, 'number');
    assert.equal(await t.service.ctx.chain.getUsdcBalance(address(to)), 2_500_000n);
    assert.equal(await balanceOf(t, wallet.wallet_id), '7.50');
  });

  test('the test clock moves the chain\'s clock, and the chain\'s setTime moves the service clock', async () => {
    const advanced = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: DAY_S } });
    assert.equal(advanced.status, 200, JSON.stringify(advanced.body));
    const wallet = await fundedWallet(t, '1');
    const paid = await t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' } });
    assert.equal(paid.body.status, 'confirmed', JSON.stringify(paid.body));
    const rpc = t.service.ctx.cheatcodes as unknown as Rpc<SolanaRpcApi>;
    const landed = await rpc.getTransaction(toSignature(paid.body.tx_signature), {
      encoding: 'json', maxSupportedTransactionVersion: 0,
    }).send();
    const blockTimeMs = Number(landed!.blockTime) * 1000;
    assert.ok(blockTimeMs >= Date.now() + (DAY_S - 60) * 1000, `block time ${new Date(blockTimeMs).toISOString()} is a day ahead`);

    const target = t.service.ctx.clock.nowMs() + 3_600_000;
    await t.service.ctx.cheatcodes!.agentVault_setTime(target).send();
    assert.ok(t.service.ctx.clock.nowMs() >= target, 'the service clock moved with the chain\'s');
  });
});

describe('short slots', () => {
  let t: TestService;
  before(async () => { t = await startTestService({ env: { AGENT_VAULT_VALIDATOR_THREAD: 'on', AGENT_VAULT_SLOT_MS: '10' } }); });
  after(async () => { await t.close(); });

  test('a payment made after 150 slots (1.5 s) signs with a blockhash that is still valid', async () => {
    const wallet = await fundedWallet(t, '2');
    const first = await t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' } });
    assert.equal(first.body.status, 'confirmed', JSON.stringify(first.body));
    // Until the chain is past what the first payment's blockhash allowed: 151 blocks on.
    const { chain } = t.service.ctx;
    const past = (await chain.getBlockHeight()) + 151n;
    await eventually(async () => ((await chain.getBlockHeight()) > past ? true : null), '151 more blocks');
    const second = await t.request('POST', '/v1/payments', { body: { walletId: wallet.wallet_id, to: await newRecipient(), amount: '1', currency: 'USDC' } });
    assert.equal(second.body.status, 'confirmed', JSON.stringify(second.body));
  });
});

describe('ValidatorThread', () => {
  test('refuses a state another validator holds, with that validator\'s reason', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    const holder = await LocalValidator.open({ dataDir, slotMs: 0, clock: new OffsetClock(), programSoPath: null });
    try {
      // By name too: the CLI says such a refusal in one line, as the operator's to fix.
      await assert.rejects(ValidatorThread.start({ dataDir, slotMs: 0, programSoPath: null, offsetCell: new OffsetClock().offsetCell }),
        { name: 'ValidatorLockedError', message: /in use by pid/ });
    } finally {
      await holder.close();
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('a validator that has not opened in time is ended, and start says so', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    try {
      // A lock of another container, touched (by its clock) an hour ahead: opening waits to see
      // whether its holder lives until LOCK_STALE_MS after that, as a large state read at start
      // would take its time. The bound leaves the thread time to load its code (~1 s; 2.7 s
      // with both cores busy).
      const lock = join(dataDir, LOCK_FILE);
      writeFileSync(lock, '1\nanother-boot:4026531999\n');
      const ahead = new Date(Date.now() + 3_600_000);
      utimesSync(lock, ahead, ahead);
      const started = Date.now();
      await assert.rejects(ValidatorThread.start({ dataDir, slotMs: 10, programSoPath: null, offsetCell: new OffsetClock().offsetCell, openTimeoutMs: 8_000 }),
        { name: 'ValidatorThreadError',
          message: 'the embedded validator did not open within 8000 ms (its thread had loaded and was opening the state); its thread was ended' });
      assert.ok(Date.now() - started < 20_000, 'start did not wait for the open');
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('a call whose signal aborts rejects with its reason, whatever the thread answers', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    const thread = await ValidatorThread.start({ dataDir, slotMs: 10, programSoPath: null, offsetCell: new OffsetClock().offsetCell });
    try {
      const transport = thread.transport();
      const abort = new AbortController();
      // Posted to the thread, then aborted in the same turn: its answer can only arrive after.
      const call = transport({ payload: { jsonrpc: '2.0', id: 1, method: 'getSlot', params: [] }, signal: abort.signal });
      abort.abort(new Error('given up'));
      await assert.rejects(call, /given up/);
      const slot = await transport<{ result: number }>({ payload: { jsonrpc: '2.0', id: 2, method: 'getSlot', params: [] } });
      assert.equal(typeof slot.result, 'number', 'the next call is answered');
    } finally {
      await thread.close();
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('a close held up by its disk rejects in time, saying so', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    const fifos = SNAPSHOT_FILES.map((file) => join(dataDir, `${file}.tmp`));
    try {
      const thread = await ValidatorThread.start({ dataDir, slotMs: 10, programSoPath: null, offsetCell: new OffsetClock().offsetCell });
      // The next snapshot is written to a new file through its temporary name, here a named pipe
      // nobody reads: its open waits, as a write to a disk that stopped answering would.
      for (const file of SNAPSHOT_FILES) rmSync(join(dataDir, file), { force: true });
      for (const fifo of fifos) execFileSync('mkfifo', [fifo]);
      await thread.transport()({ payload: { jsonrpc: '2.0', id: 1, method: 'agentVault_mintUsdc', params: [await newRecipient(), '1'] } });
      const started = Date.now();
      await assert.rejects(thread.close(500), { message: 'closing the embedded validator: it did not close within 500 ms' });
      assert.ok(Date.now() - started < 5_000, 'close did not wait for the disk');
    } finally {
      // The disk answers again (a reader at each pipe), so that the thread can end and the process exit.
      for (const fifo of fifos) closeSync(openSync(fifo, constants.O_RDONLY | constants.O_NONBLOCK));
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('tells the service each time executed statuses become visible, and only then are they', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    const thread = await ValidatorThread.start({ dataDir, slotMs: 50, programSoPath: null, offsetCell: new OffsetClock().offsetCell });
    try {
      const transport = thread.transport();
      const statusOf = async (signature: string) => (await transport<{ result: { value: unknown[] } }>({
        payload: { jsonrpc: '2.0', id: 2, method: 'getSignatureStatuses', params: [[signature]] },
      })).result.value[0];
      let published = 0;
      thread.onPublished(() => { published += 1; });
      const signal = new Promise<readonly PublishedStatus[]>((resolve) => thread.onPublished(resolve));
      const minted = await transport<{ result: string }>({ payload: { jsonrpc: '2.0', id: 1, method: 'agentVault_mintUsdc', params: [await newRecipient(), '1000'] } });
      // The signal leaves the thread before any answer given after the publish, so an answer that
      // arrives with no signal yet must come from before it.
      const early = await statusOf(minted.result);
      if (published === 0) assert.equal(early, null, 'not visible before the signal');
      const pushed = await signal;
      assert.ok(await statusOf(minted.result), 'visible once signalled');
      assert.deepEqual(pushed.map((status) => [status.signature, status.err]), [[minted.result, null]], 'the signal carries the statuses');
      assert.equal(typeof pushed[0]!.slot, 'number');
    } finally {
      await thread.close();
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('closing persists what it executed; answering after close is refused', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    try {
      const thread = await ValidatorThread.start({ dataDir, slotMs: 10, programSoPath: null, offsetCell: new OffsetClock().offsetCell });
      const transport = thread.transport();
      const owner = await newRecipient();
      const minted = await transport<{ result: string }>({ payload: { jsonrpc: '2.0', id: 1, method: 'agentVault_mintUsdc', params: [owner, '4200000'] } });
      assert.match(minted.result, /^[1-9A-HJ-NP-Za-km-z]{64,88}$/, JSON.stringify(minted));
      await thread.close();
      await assert.rejects(transport({ payload: { jsonrpc: '2.0', id: 2, method: 'getSlot', params: [] } }), /stopped/);

      const reopened = await LocalValidator.open({ dataDir, slotMs: 0, clock: new OffsetClock(), programSoPath: null });
      try {
        assert.equal(reopened.usdcMint, thread.info.usdcMint, 'the same chain');
        const account = await reopened.associatedTokenAddress(address(owner));
        const { value } = await createInProcessRpc(reopened).getTokenAccountBalance(account).send();
        assert.equal(value.amount, '4200000', 'the mint queued before close executed and was persisted');
      } finally {
        await reopened.close();
      }
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  test('a close whose last snapshot fails says so and still ends the thread', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'av-thread-'));
    try {
      const thread = await ValidatorThread.start({ dataDir, slotMs: 10, programSoPath: null, offsetCell: new OffsetClock().offsetCell });
      const transport = thread.transport();
      await transport({ payload: { jsonrpc: '2.0', id: 1, method: 'agentVault_mintUsdc', params: [await newRecipient(), '1'] } });
      // Every snapshot file a directory: the final snapshot cannot be written (a failing disk).
      for (const file of SNAPSHOT_FILES) {
        rmSync(join(dataDir, file), { force: true });
        mkdirSync(join(dataDir, file));
      }
      await assert.rejects(thread.close(), /closing the embedded validator/);
      await assert.rejects(transport({ payload: { jsonrpc: '2.0', id: 2, method: 'getSlot', params: [] } }), /stopped/,
        'the thread ended: nothing is left to keep the process alive');
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });
});
