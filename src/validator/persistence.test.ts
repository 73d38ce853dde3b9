import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { closeSync, constants, existsSync, mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync, statSync, utimesSync, writeFileSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import {
  SOLANA_ERROR__JSON_RPC__SERVER_ERROR_NODE_UNHEALTHY, generateKeyPairSigner, isSolanaError, lamports, type KeyPairSigner,
} from '@solana/kit';
import { ManualClock } from '../clock/clock.ts';
import { createInProcessRpc } from './in-process.ts';
import { startRpcServer } from './http.ts';
import { LOCK_FILE, LOCK_STALE_MS, SNAPSHOT_FILES, acquireLock, readSnapshot } from './state-file.ts';
import {
  confirmed, createAtaIdempotent, eventually, memoInstruction, signedTransaction, transferSol, transferToken, writeMemoProgram, type TestRpc,
} from './testing.ts';
import { DEFAULT_PROGRAM_SO_PATH, LocalValidator, PROGRAM_KEY_FILE, UNPUBLISHED_SLOTS_MAX, VALIDATOR_KEY_FILE } from './validator.ts';

const START_MS = 1_750_000_000_000;

describe('local validator persistence', () => {
  let root: string;
  let memoSo: string;

  before(() => {
    root = mkdtempSync(join(tmpdir(), 'agent-vault-validator-'));
    memoSo = writeMemoProgram(root);
  });
  after(() => rmSync(root, { recursive: true, force: true }));

  // Guarantee: accounts, transaction statuses and the deployed program survive a restart.
  it('restores balances, statuses, transactions and the program after a restart', async () => {
    const dataDir = join(root, 'restart');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: memoSo });
    let rpc = createInProcessRpc(validator) as TestRpc;
    const { programId, usdcMint } = validator;
    assert.equal(validator.info().programDeployed, true);

    const payer = await generateKeyPairSigner();
    const recipient = (await generateKeyPairSigner()).address;
    const airdrop = await rpc.requestAirdrop(payer.address, lamports(2_000_000_000n)).send();
    const mint = await rpc.agentVault_mintUsdc(payer.address, '7000000').send();
    await confirmed(rpc, mint);
    const source = await validator.associatedTokenAddress(payer.address);
    const destination = await validator.associatedTokenAddress(recipient);
    const transfer = await signedTransaction(rpc, payer, [
      createAtaIdempotent(payer, destination, recipient, usdcMint),
      transferToken(source, destination, payer, 2_500_000n),
      transferSol(payer, recipient, 100_000_000n),
    ]);
    await rpc.sendTransaction(transfer.wire, { encoding: 'base64' }).send();
    const memo = await signedTransaction(rpc, payer, [memoInstruction(programId, payer, 'before restart')]);
    await rpc.sendTransaction(memo.wire, { encoding: 'base64' }).send();
    const signatures = [airdrop, mint, transfer.signature, memo.signature];
    const statusesBefore = await Promise.all(signatures.map((s) => confirmed(rpc, s)));
    const slotBefore = validator.slot;
    // A blockhash handed out before the restart must still be usable after it.
    const lifetime = (await rpc.getLatestBlockhash().send()).value;
    await validator.close();

    validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: memoSo });
    rpc = createInProcessRpc(validator) as TestRpc;
    try {
      assert.equal(validator.programId, programId);
      assert.equal(validator.usdcMint, usdcMint);
      assert.ok(validator.slot > slotBefore, 'slots continue after a restart');
      assert.deepEqual((await rpc.getSignatureStatuses(signatures).send()).value, statusesBefore);
      assert.equal((await rpc.getTokenAccountBalance(source).send()).value.amount, '4500000');
      assert.equal((await rpc.getTokenAccountBalance(destination).send()).value.amount, '2500000');
      assert.equal((await rpc.getBalance(recipient).send()).value, 100_000_000n);
      const tx = await rpc.getTransaction(memo.signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
      assert.ok(tx?.meta?.logMessages?.some((line) => line.includes('before restart')));

      const again = await signedTransaction(rpc, payer, [memoInstruction(programId, payer, 'after restart')], lifetime);
      await rpc.sendTransaction(again.wire, { encoding: 'base64' }).send();
      assert.equal((await confirmed(rpc, again.signature)).err, null);
    } finally {
      await validator.close();
    }
  });

  // Guarantee: a snapshot torn by a crash while it was written costs only what it would have
  // made visible; the one before it, and the log up to it, load.
  it('restarts from the snapshot before when the newest is torn, and cuts the log lines it did not hold', async () => {
    const dataDir = join(root, 'torn');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    let rpc = createInProcessRpc(validator) as TestRpc;
    const first = (await generateKeyPairSigner()).address;
    const second = (await generateKeyPairSigner()).address;
    const kept = await rpc.requestAirdrop(first, lamports(1_000_000n)).send();
    await confirmed(rpc, kept);
    // The snapshot that made the first airdrop visible (the next write goes to the other file).
    const before = readSnapshot(dataDir)!;
    const beforeBytes = readFileSync(join(dataDir, SNAPSHOT_FILES[before.file!]));
    const lost = await rpc.requestAirdrop(second, lamports(2_000_000n)).send();
    await confirmed(rpc, lost);
    await validator.close();
    // A crash as the snapshot after it was being written: that one torn, the one before whole.
    const newest = readSnapshot(dataDir)!;
    assert.ok(newest.meta.seq > before.meta.seq);
    assert.deepEqual(SNAPSHOT_FILES.map((name) => existsSync(join(dataDir, name))), [true, true], 'the two files written in turn');
    const torn = readFileSync(join(dataDir, SNAPSHOT_FILES[newest.file!]));
    const middle = torn.length >> 1;
    torn.writeUInt8(torn.readUInt8(middle) ^ 0xff, middle);
    writeFileSync(join(dataDir, SNAPSHOT_FILES[newest.file!]), torn);
    writeFileSync(join(dataDir, SNAPSHOT_FILES[newest.file === 0 ? 1 : 0]), beforeBytes);

    validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    rpc = createInProcessRpc(validator) as TestRpc;
    try {
      assert.equal((await rpc.getBalance(first).send()).value, 1_000_000n);
      assert.ok((await rpc.getSignatureStatuses([kept]).send()).value[0]);
      assert.equal((await rpc.getBalance(second).send()).value, 0n, 'its effects were only in the torn snapshot');
      assert.equal((await rpc.getSignatureStatuses([lost]).send()).value[0], null, 'and its status line was cut');
    } finally {
      await validator.close();
    }
  });

  it('keeps its keys private (mode 0600)', async () => {
    const dataDir = join(root, 'keys');
    const validator = await LocalValidator.open({ dataDir, slotMs: 0, clock: new ManualClock(START_MS), programSoPath: null });
    await validator.close();
    for (const file of [VALIDATOR_KEY_FILE, PROGRAM_KEY_FILE]) {
      assert.equal(statSync(join(dataDir, file)).mode & 0o777, 0o600, file);
    }
  });

  // Guarantee: one process owns a validator's state; a second one refuses with a clear message.
  it('refuses a second open of the same data dir and takes over a stale lock', async () => {
    const dataDir = join(root, 'lock');
    const clock = new ManualClock(START_MS);
    const first = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    try {
      await assert.rejects(LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null }),
        new RegExp(`validator state at ${dataDir} is in use by pid ${process.pid}`));
      const other = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', `
        import { LocalValidator } from ${JSON.stringify(new URL('./validator.ts', import.meta.url).href)};
        import { ManualClock } from ${JSON.stringify(new URL('../clock/clock.ts', import.meta.url).href)};
        try { await LocalValidator.open({ dataDir: ${JSON.stringify(dataDir)}, clock: new ManualClock(0), programSoPath: null }); }
        catch (error) { console.error(error.message); process.exit(3); }`], { encoding: 'utf8', timeout: 60_000 });
      assert.equal(other.status, 3, other.stderr);
      assert.match(other.stderr, new RegExp(`validator state at ${dataDir} is in use by pid ${process.pid}`));
    } finally {
      await first.close();
    }
    assert.equal(existsSync(join(dataDir, LOCK_FILE)), false, 'close releases the lock');

    const dead = spawnSync(process.execPath, ['-e', '']).pid;
    writeFileSync(join(dataDir, LOCK_FILE), `${dead}\n`);
    const taker = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    await taker.close();

    // A lock naming this very pid, written before this process started: an earlier run with the
    // same pid (pid 1 in a container, killed and restarted) left it, and it is taken over.
    writeFileSync(join(dataDir, LOCK_FILE), `${process.pid}\n`);
    const beforeThisProcess = new Date(Date.now() - process.uptime() * 1000 - 60_000);
    utimesSync(join(dataDir, LOCK_FILE), beforeThisProcess, beforeThisProcess);
    const samePid = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    try {
      await assert.rejects(LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null }), /in use by pid/, 'held now: refused');
    } finally {
      await samePid.close();
    }
  });

  // Guarantee: one owner, also when several processes start at once on a lock left by a crash.
  it('processes taking one stale lock over at the same instant: exactly one holds it each time', async () => {
    const dataDir = join(root, 'lock-race');
    mkdirSync(dataDir, { recursive: true });
    const lock = join(dataDir, LOCK_FILE);
    const dead = spawnSync(process.execPath, ['-e', '']).pid;
    // Each process holds what it takes until it is killed, so one that starts late finds it held.
    const script = `
      import { acquireLock } from ${JSON.stringify(new URL('./state-file.ts', import.meta.url).href)};
      const at = Number(process.argv[1]);
      while (Date.now() < at) {}
      try { acquireLock(${JSON.stringify(dataDir)}); console.log('held'); setInterval(() => {}, 1_000); }
      catch (error) { console.log(/in use by pid/.test(error.message) ? 'refused' : error.message); }`;
    for (let trial = 0; trial < 6; trial += 1) {
      // Left by a process killed while it held it (the last trial's holder, killed), or none.
      if (trial === 0) writeFileSync(lock, `${dead}\n`);
      if (trial === 3) rmSync(lock);
      const at = String(Date.now() + 1_500);
      const children = Array.from({ length: 4 }, () => spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script, at],
        { stdio: ['ignore', 'pipe', 'inherit'] }));
      const outcomes = await Promise.all(children.map((child) => new Promise<string>((resolve, reject) => {
        let out = '';
        child.stdout!.on('data', (chunk: Buffer) => {
          out += chunk.toString('utf8');
          if (out.includes('\n')) resolve(out.trim());
        });
        child.on('error', reject);
        child.on('exit', () => resolve(out.trim()));
      })));
      await Promise.all(children.map((child) => new Promise((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) resolve(null);
        else { child.on('exit', resolve); child.kill('SIGKILL'); }
      })));
      assert.deepEqual(outcomes.sort(), ['held', 'refused', 'refused', 'refused'], `trial ${trial}`);
      assert.deepEqual(readdirSync(dataDir), [LOCK_FILE], 'the holder\'s lock, and no file of a takeover left behind');
    }
  });

  it('a takeover being judged by another process is waited for; one left by a process that died judging is removed', () => {
    const dataDir = join(root, 'lock-takeover');
    mkdirSync(dataDir, { recursive: true });
    const lock = join(dataDir, LOCK_FILE);
    const takeover = `${lock}.takeover`;
    const dead = spawnSync(process.execPath, ['-e', '']).pid;
    writeFileSync(lock, `${dead}\n`);
    writeFileSync(takeover, `${dead}\n`);
    // Another process judging: its takeover ends 300 ms from now (acquireLock blocks this thread).
    spawn(process.execPath, ['-e', `setTimeout(() => require('node:fs').rmSync(${JSON.stringify(takeover)}), 300)`]);
    let release = acquireLock(dataDir);
    assert.match(readFileSync(lock, 'utf8'), new RegExp(`^${process.pid}\n`), 'taken over once the other judgement ended');
    release();
    // Died judging, long ago: its takeover lock is removed, and the stale lock taken over.
    writeFileSync(lock, `${dead}\n`);
    writeFileSync(takeover, `${dead}\n`);
    const longAgo = new Date(Date.now() - 10 * 60_000);
    utimesSync(takeover, longAgo, longAgo);
    release = acquireLock(dataDir);
    assert.match(readFileSync(lock, 'utf8'), new RegExp(`^${process.pid}\n`));
    assert.equal(existsSync(takeover), false);
    release();
  });

  // Guarantee: the same across containers or hosts sharing the data dir, where a pid means nothing.
  it('refuses a lock of another container while its holder touches it, and takes it over once it stops', async () => {
    const dataDir = join(root, 'lock-elsewhere');
    const clock = new ManualClock(START_MS);
    mkdirSync(dataDir, { recursive: true });
    const path = join(dataDir, LOCK_FILE);
    const touch = (at: Date) => utimesSync(path, at, at);
    // Held in another pid namespace by a process whose pid is unused here, then by one with this
    // process's pid: neither pid tells anything here, and both are refused while touched.
    const dead = spawnSync(process.execPath, ['-e', '']).pid;
    for (const pid of [dead, process.pid]) {
      writeFileSync(path, `${pid}\nanother-boot:4026531999\n`);
      // Its holder, touching it from a process of its own (opening the lock blocks this thread).
      const holder = spawn(process.execPath, ['-e',
        `setInterval(() => require('node:fs').utimesSync(${JSON.stringify(path)}, new Date(), new Date()), 100)`]);
      try {
        await assert.rejects(LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null }),
          new RegExp(`in use by pid ${pid} of another host or container`));
      } finally {
        holder.kill('SIGKILL');
      }
    }
    // Untouched for longer than a holder would leave it: its holder is gone.
    touch(new Date(Date.now() - LOCK_STALE_MS - 1_000));
    const taker = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    try {
      assert.match(readFileSync(path, 'utf8'), new RegExp(`^${process.pid}\n.+\n$`), 'the lock names its holder and its namespace');
      // The holder touches its own lock, so that another container can tell it lives.
      const setBack = new Date(Date.now() - 60_000);
      touch(setBack);
      // Touched again by its holder: newer than the time set back (a heartbeat, every 2 s; the
      // deadline only keeps a lock never touched from hanging the test).
      await eventually(async () => (statSync(path).mtimeMs > setBack.getTime() ? true : null), 'the holder\'s heartbeat on its lock');
    } finally {
      await taker.close();
    }
  });

  // Guarantee: with slotMs 0 and a data dir, what is visible has been persisted.
  it('persists immediate-mode transactions before they are visible', async () => {
    const dataDir = join(root, 'immediate');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: 0, clock, programSoPath: null });
    let rpc = createInProcessRpc(validator) as TestRpc;
    let payer: KeyPairSigner;
    let signature;
    try {
      payer = await generateKeyPairSigner();
      signature = await rpc.requestAirdrop(payer.address, lamports(3_000_000n)).send();
      await confirmed(rpc, signature);
    } finally {
      await validator.close();
    }
    validator = await LocalValidator.open({ dataDir, slotMs: 0, clock, programSoPath: null });
    rpc = createInProcessRpc(validator) as TestRpc;
    try {
      assert.equal((await rpc.getBalance(payer.address).send()).value, 3_000_000n);
      assert.ok((await rpc.getSignatureStatuses([signature]).send()).value[0]);
    } finally {
      await validator.close();
    }
  });

  // Guarantee: status lines are written as transactions execute, ahead of the slot's snapshot;
  // a crash before that snapshot shows nothing of them after a restart.
  it('writes the log during the slot, and a crash before the snapshot leaves no trace of it', async () => {
    const dataDir = join(root, 'crash');
    const logDir = join(dataDir, 'transactions');
    const logText = () => (existsSync(logDir) ? readdirSync(logDir) : []).filter((name) => name.endsWith('.jsonl'))
      .map((name) => readFileSync(join(logDir, name), 'utf8')).join('');
    // A slot that does not end while the child lives: its airdrop executes, is logged and never snapshotted.
    const child = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', `
      import { generateKeyPairSigner } from '@solana/kit';
      import { LocalValidator } from ${JSON.stringify(new URL('./validator.ts', import.meta.url).href)};
      import { ManualClock } from ${JSON.stringify(new URL('../clock/clock.ts', import.meta.url).href)};
      const validator = await LocalValidator.open({ dataDir: ${JSON.stringify(dataDir)}, slotMs: 60000, clock: new ManualClock(${START_MS}), programSoPath: null });
      const payer = await generateKeyPairSigner();
      const signature = await validator.requestAirdrop(payer.address, 5000000n);
      console.log(JSON.stringify({ signature, payer: payer.address }));
      setInterval(() => {}, 1000);`], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      const { signature, payer } = await new Promise<{ signature: string; payer: string }>((resolve, reject) => {
        let out = '';
        child.stdout.on('data', (chunk: Buffer) => {
          out += chunk.toString();
          if (out.includes('\n')) resolve(JSON.parse(out.split('\n')[0]!) as { signature: string; payer: string });
        });
        child.once('exit', (code) => reject(new Error(`the child exited (${code}) before its airdrop`)));
      });
      const deadline = Date.now() + 10_000;
      while (!logText().includes(signature)) {
        assert.ok(Date.now() < deadline, 'the airdrop\'s status line reached the log while its slot was still running');
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      child.kill('SIGKILL');
      await new Promise((resolve) => child.once('exit', resolve));

      const validator = await LocalValidator.open({ dataDir, slotMs: 20, clock: new ManualClock(START_MS), programSoPath: null });
      const rpc = createInProcessRpc(validator) as TestRpc;
      try {
        assert.equal(logText().includes(signature), false, 'the line newer than the snapshot was cut at load');
        assert.equal((await rpc.getSignatureStatuses([signature as never]).send()).value[0], null, 'the airdrop is not visible');
        assert.equal((await rpc.getBalance(payer as never).send()).value, 0n, 'and its effect is gone');
        const again = await rpc.requestAirdrop(payer as never, lamports(7_000_000n)).send();
        await confirmed(rpc, again);
        assert.equal((await rpc.getBalance(payer as never).send()).value, 7_000_000n);
      } finally {
        await validator.close();
      }
    } finally {
      child.kill('SIGKILL');
    }
  });

  // Guarantee: a transaction it executed never passes its last valid block height unseen.
  it('makes no slot and takes no transaction while its snapshot cannot be written, and resumes once it can', async () => {
    const dataDir = join(root, 'halt');
    const validator = await LocalValidator.open({ dataDir, slotMs: 20, clock: new ManualClock(START_MS), programSoPath: null });
    const rpc = createInProcessRpc(validator) as TestRpc;
    const pause = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
    // Served over HTTP too (`agent-vault validator`): its GET /health, which probes use.
    const server = await startRpcServer(validator, { port: 0 });
    const health = async () => (await fetch(`${server.url}/health`)).status;
    try {
      assert.equal(await health(), 200);
      const payer = await generateKeyPairSigner();
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000n)).send());
      // Each snapshot file turned into a directory: every write of it fails, as on a failing disk.
      for (const file of SNAPSHOT_FILES) {
        rmSync(join(dataDir, file), { force: true });
        mkdirSync(join(dataDir, file));
      }
      const executed = await rpc.requestAirdrop(payer.address, lamports(2_000_000n)).send();
      // Its slot ended and its snapshot failed: halted (on a loaded machine this can take more
      // than a few slots' time, so it is waited for, not assumed).
      while (await health() !== 503) await pause(10);
      const height = await rpc.getBlockHeight().send();
      await pause(300); // fifteen slots' time
      assert.equal(await rpc.getBlockHeight().send(), height, 'no slot is made while halted');
      assert.equal((await rpc.getSignatureStatuses([executed]).send()).value[0], null, 'executed, not yet visible');
      // Refused as a node that is not healthy (the JSON-RPC error clients retry on).
      await assert.rejects(rpc.requestAirdrop(payer.address, lamports(3_000_000n)).send(),
        (error: unknown) => isSolanaError(error, SOLANA_ERROR__JSON_RPC__SERVER_ERROR_NODE_UNHEALTHY));
      await assert.rejects(rpc.getHealth().send(), (error: unknown) => isSolanaError(error, SOLANA_ERROR__JSON_RPC__SERVER_ERROR_NODE_UNHEALTHY));
      assert.equal(await health(), 503);
      for (const file of SNAPSHOT_FILES) rmSync(join(dataDir, file), { recursive: true, force: true });
      await confirmed(rpc, executed);
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(3_000_000n)).send());
      assert.ok(await rpc.getBlockHeight().send() > height, 'slots resume');
      assert.equal((await rpc.getBalance(payer.address).send()).value, 6_000_000n);
      assert.equal(await health(), 200);
    } finally {
      await server.close();
      for (const file of SNAPSHOT_FILES) if (existsSync(join(dataDir, file)) && statSync(join(dataDir, file)).isDirectory()) rmSync(join(dataDir, file), { recursive: true });
      await validator.close();
    }
  });

  // Guarantee: the same while a snapshot write hangs without failing (a stalled disk).
  it('holds its slots while a snapshot write hangs, so a transaction it executed cannot expire unseen', async () => {
    const dataDir = join(root, 'hang');
    const slotMs = 50;
    const validator = await LocalValidator.open({ dataDir, slotMs, clock: new ManualClock(START_MS), programSoPath: null });
    const rpc = createInProcessRpc(validator) as TestRpc;
    const pause = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
    let resume = async () => {};
    try {
      const payer = await generateKeyPairSigner();
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000n)).send());
      // Sent just after a slot began, then every file operation of this process stalls (each of
      // libuv's threads blocked opening a pipe nobody writes), as on a disk that stopped
      // answering: the slot's snapshot starts and does not end.
      const before = await rpc.getBlockHeight().send();
      while (await rpc.getBlockHeight().send() === before) await new Promise((resolve) => setImmediate(resolve));
      const sentAt = await rpc.getBlockHeight().send();
      const executed = await rpc.requestAirdrop(payer.address, lamports(2_000_000n)).send();
      resume = stallFileOperations();
      await pause(30 * slotMs);
      const held = await rpc.getBlockHeight().send();
      assert.ok(held <= sentAt + BigInt(UNPUBLISHED_SLOTS_MAX) + 1n, `slots held at ${held}, sent at ${sentAt}`);
      await pause(5 * slotMs);
      assert.equal(await rpc.getBlockHeight().send(), held, 'no slot is made while the snapshot hangs');
      assert.equal((await rpc.getSignatureStatuses([executed]).send()).value[0], null, 'executed, not yet visible');
      await resume();
      await confirmed(rpc, executed);
      await pause(3 * slotMs);
      assert.ok(await rpc.getBlockHeight().send() > held, 'slots resume');
      assert.equal((await rpc.getBalance(payer.address).send()).value, 3_000_000n);
    } finally {
      await resume();
      await validator.close();
    }
  });

  // Guarantee: our own program, once built, is deployed through the loader and runs after a restart.
  it('deploys program/agent_vault.so and runs it after a restart', { skip: !existsSync(DEFAULT_PROGRAM_SO_PATH) }, async () => {
    const dataDir = join(root, 'agent-vault');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: 20, clock });
    assert.equal(validator.info().programDeployed, true);
    await validator.close();
    validator = await LocalValidator.open({ dataDir, slotMs: 20, clock });
    try {
      const rpc = createInProcessRpc(validator) as TestRpc;
      const account = (await rpc.getAccountInfo(validator.programId, { encoding: 'base64' }).send()).value;
      assert.equal(account?.executable, true);
      const payer = await generateKeyPairSigner();
      await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000_000n)).send());
      // An instruction tag the program does not know: the program itself must answer.
      const { wire, signature } = await signedTransaction(rpc, payer, [
        { programAddress: validator.programId, accounts: [], data: new Uint8Array([255]) },
      ]);
      await rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send();
      const status = await confirmed(rpc, signature);
      assert.ok(status.err && typeof status.err === 'object' && 'InstructionError' in status.err, JSON.stringify(status.err, (_k, v) => (typeof v === 'bigint' ? String(v) : v)));
      const tx = await rpc.getTransaction(signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
      assert.ok(tx?.meta?.logMessages?.some((line) => line.startsWith(`Program ${validator.programId} consumed`)), tx?.meta?.logMessages?.join('\n'));
    } finally {
      await validator.close();
    }
  });
});

/**
 * Blocks every thread of libuv's pool (where file operations run) in an open of a pipe that no
 * one writes; the function returned lets them go.
 */
function stallFileOperations(): () => Promise<void> {
  const dir = mkdtempSync(join(tmpdir(), 'av-stall-'));
  const pipes = Array.from({ length: Number(process.env.UV_THREADPOOL_SIZE ?? 4) }, (_, i) => join(dir, `pipe-${i}`));
  for (const pipe of pipes) assert.equal(spawnSync('mkfifo', [pipe]).status, 0, 'mkfifo');
  const stalled = pipes.map((pipe) => open(pipe, 'r'));
  let released: Promise<void> | null = null;
  return () => released ??= (async () => {
    // A writer's open completes each reader's.
    const writers = pipes.map((pipe) => openSync(pipe, constants.O_WRONLY | constants.O_NONBLOCK));
    for (const handle of await Promise.all(stalled)) await handle.close();
    for (const writer of writers) closeSync(writer);
    rmSync(dir, { recursive: true });
  })();
}
