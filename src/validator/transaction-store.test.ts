import assert from 'node:assert/strict';
import fs, { appendFileSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { syncBuiltinESMExports } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import {
  AccountRole,
  appendTransactionMessageInstruction,
  createTransactionMessage,
  generateKeyPairSigner,
  getAddressEncoder,
  getSignatureFromTransaction,
  getTransactionEncoder,
  pipe,
  setTransactionMessageFeePayerSigner,
  setTransactionMessageLifetimeUsingBlockhash,
  signTransactionMessageWithSigners,
  type Address,
  type Blockhash,
} from '@solana/kit';
import { addressKey, TransactionStore, type ExecutedTransaction } from './transaction-store.ts';
import { SYSTEM_PROGRAM } from './validator.ts';

function executed(seq: number): ExecutedTransaction {
  return {
    record: { seq, signature: `sig${seq}`, slot: 100 + seq, blockTime: 1_700_000_000, err: seq % 2 ? null : { InstructionError: [0, { Custom: 1 }] }, computeUnits: 150, fee: 5000 },
    detail: {
      wire: new Uint8Array([seq & 0xff]), logs: [`log ${seq}`], preBalances: [10n ** 18n], postBalances: [10n ** 18n - 5000n],
      preTokenBalances: [], postTokenBalances: [],
    },
    accountKeys: [],
  };
}

describe('TransactionStore', () => {
  // Guarantee: the store is bounded, and a status is never resurrected past the snapshot it belongs to.
  it('keeps the newest signatures, reloads them and cuts lines newer than the snapshot', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'agent-vault-store-'));
    try {
      const store = new TransactionStore(dir, { capacity: 300, detailCapacity: 50 });
      const all = Array.from({ length: 700 }, (_, i) => executed(i + 1));
      for (let i = 0; i < all.length; i += 70) {
        const batch = all.slice(i, i + 70);
        await store.append(batch);
        store.publish(batch);
      }
      assert.equal(store.size, 300);
      assert.equal(store.get('sig400'), undefined);
      assert.equal(store.get('sig401')?.slot, 501);
      assert.equal(store.detail('sig650'), undefined);
      assert.deepEqual(store.detail('sig700')?.preBalances, [10n ** 18n]);
      await store.close();
      // Old segments were deleted: at most capacity + one segment stays on disk, and details of
      // at most detailCapacity + one segment (the details load reads).
      assert.equal(store.segmentEntries, 100);
      assert.equal(readdirSync(dir).filter((n) => /^\d+\.jsonl$/.test(n)).length, 4, 'statuses: 300 + the segment being written');
      assert.equal(readdirSync(dir).filter((n) => n.endsWith('.detail.jsonl')).length, 2, 'details: 50 + the segment being written');

      // A crash after appending seq 701..702 but before the snapshot that contains them, with a torn line.
      appendFileSync(join(dir, readdirSync(dir).filter((n) => /^\d+\.jsonl$/.test(n)).sort().at(-1)!),
        `${JSON.stringify({ q: 701, s: 'sig701', sl: 801, t: 0, e: null, cu: 1, f: 5000 })}\n{"q":702,"s":"sig7`);
      const reloaded = new TransactionStore(dir, { capacity: 300, detailCapacity: 50 });
      reloaded.load(700);
      assert.equal(reloaded.size, 300);
      assert.equal(reloaded.get('sig701'), undefined);
      assert.deepEqual(reloaded.get('sig700'), all[699]!.record);
      assert.deepEqual(reloaded.detail('sig700')?.logs, ['log 700']);
      await reloaded.close();

      // The cut lines are gone for good: a later snapshot with a higher seq does not bring them back.
      const again = new TransactionStore(dir, { capacity: 300, detailCapacity: 50 });
      again.load(10_000);
      assert.equal(again.get('sig701'), undefined);
      await again.close();
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

/** A transaction loading `payer` always, `even` on even seqs and `early` up to seq 100. */
function executedWithKeys(seq: number): ExecutedTransaction {
  const keys = ['payer'];
  if (seq % 2 === 0) keys.push('even');
  if (seq <= 100) keys.push('early');
  return { ...executed(seq), accountKeys: keys };
}

const signaturesOf = (records: readonly { signature: string }[]): string[] => records.map((r) => r.signature);

describe('TransactionStore address index', () => {
  // Guarantee: getSignaturesForAddress sees exactly the stored transactions of an address, newest
  // first, within the store's bound, and the same after a reload.
  it('answers by address newest first, with before, until and limit, bounded and rebuilt at load', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'agent-vault-store-'));
    try {
      const store = new TransactionStore(dir, { capacity: 300, detailCapacity: 50 });
      const all = Array.from({ length: 700 }, (_, i) => executedWithKeys(i + 1));
      for (let i = 0; i < all.length; i += 70) {
        const batch = all.slice(i, i + 70);
        await store.append(batch);
        store.publish(batch);
      }
      const check = (s: TransactionStore): void => {
        assert.deepEqual(signaturesOf(s.forAddress('payer', { limit: 3 })), ['sig700', 'sig699', 'sig698']);
        assert.deepEqual(signaturesOf(s.forAddress('even', { limit: 3, before: 'sig700' })), ['sig698', 'sig696', 'sig694']);
        // `before` and `until` need not load the address themselves.
        assert.deepEqual(signaturesOf(s.forAddress('even', { limit: 10, before: 'sig699', until: 'sig693' })),
          ['sig698', 'sig696', 'sig694']);
        assert.deepEqual(signaturesOf(s.forAddress('payer', { limit: 10, until: 'sig698' })), ['sig700', 'sig699']);
        assert.deepEqual(s.forAddress('payer', { limit: 10, before: 'sig401' }), [], 'nothing is older than the bound');
        assert.deepEqual(s.forAddress('payer', { limit: 10, before: 'sig1' }), [], 'an unknown before gives nothing');
        assert.equal(s.forAddress('payer', { limit: 1000, until: 'sig1' }).length, 300, 'an unknown until bounds nothing');
        assert.equal(s.forAddress('payer', { limit: 1000 }).at(-1)?.signature, 'sig401');
        assert.deepEqual(s.forAddress('early', { limit: 10 }), [], 'evicted transactions leave the index');
        assert.equal(s.addressCount, 2, 'an address with no transaction left is forgotten');
        assert.deepEqual(s.forAddress('nobody', { limit: 10 }), []);
      };
      check(store);
      await store.close();
      const reloaded = new TransactionStore(dir, { capacity: 300, detailCapacity: 50 });
      reloaded.load(700);
      check(reloaded);
      await reloaded.close();
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  // Guarantee: status lines written before they carried account keys are indexed from the wire bytes.
  it('indexes older status lines without keys from their wire bytes', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'agent-vault-store-'));
    try {
      const payer = await generateKeyPairSigner();
      const recipient = (await generateKeyPairSigner()).address;
      const message = pipe(
        createTransactionMessage({ version: 0 }),
        (m) => setTransactionMessageFeePayerSigner(payer, m),
        (m) => setTransactionMessageLifetimeUsingBlockhash({ blockhash: payer.address as unknown as Blockhash, lastValidBlockHeight: 1n }, m),
        (m) => appendTransactionMessageInstruction({
          programAddress: SYSTEM_PROGRAM, accounts: [{ address: recipient, role: AccountRole.WRITABLE }], data: new Uint8Array([2, 0, 0, 0]),
        }, m),
      );
      const signed = await signTransactionMessageWithSigners(message);
      const wire = new Uint8Array(getTransactionEncoder().encode(signed));
      const signature = getSignatureFromTransaction(signed);
      mkdirSync(dir, { recursive: true });
      writeFileSync(join(dir, '00000001.jsonl'),
        `${JSON.stringify({ q: 1, s: signature, sl: 5, t: 0, e: null, cu: 150, f: 5000 })}\n`);
      writeFileSync(join(dir, '00000001.detail.jsonl'),
        `${JSON.stringify({ s: signature, q: 1, tx: Buffer.from(wire).toString('base64'), l: [], pre: ['1'], post: ['1'] })}\n`);
      const store = new TransactionStore(dir, { capacity: 1000, detailCapacity: 50 });
      store.load(1);
      const keyOf = (a: string) => addressKey(new Uint8Array(getAddressEncoder().encode(a as Address)));
      assert.deepEqual(signaturesOf(store.forAddress(keyOf(recipient), { limit: 10 })), [signature]);
      assert.deepEqual(signaturesOf(store.forAddress(keyOf(payer.address), { limit: 10 })), [signature]);
      assert.deepEqual(store.detail(signature)?.preTokenBalances, []);
      // Newer segments push it past the details kept: its detail file stays all the same (its
      // keys are there), the other old ones go, and a reload still indexes it by address.
      for (let seq = 2; seq <= 501; seq += 100) {
        const batch = Array.from({ length: 100 }, (_, i) => ({ ...executed(seq + i), accountKeys: ['other'] }));
        await store.append(batch);
        store.publish(batch);
      }
      await store.close();
      assert.deepEqual(readdirSync(dir).filter((n) => n.endsWith('.detail.jsonl')).sort(),
        ['00000001.detail.jsonl', '00000005.detail.jsonl', '00000006.detail.jsonl']);
      const reloaded = new TransactionStore(dir, { capacity: 1000, detailCapacity: 50 });
      reloaded.load(501);
      assert.deepEqual(signaturesOf(reloaded.forAddress(keyOf(recipient), { limit: 10 })), [signature]);
      await reloaded.close();
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('TransactionStore when the disk fails', () => {
  const withKeys = (seq: number): ExecutedTransaction => ({ ...executed(seq), accountKeys: ['operator'] });
  type HandleMethod = (this: unknown, ...args: unknown[]) => Promise<unknown>;
  const diskFull = () => Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });
  /**
   * Runs `body` in a fresh directory with FileHandle's `name` (through which the store writes)
   * replaced by what `replace` makes of the real one; restored and the directory removed after.
   */
  const withHandleMethod = async (
    name: 'appendFile' | 'datasync', replace: (real: HandleMethod) => HandleMethod, body: (dir: string) => Promise<void>,
  ): Promise<void> => {
    const dir = mkdtempSync(join(tmpdir(), 'agent-vault-store-'));
    const probe = await open(join(dir, 'probe'), 'w');
    await probe.close();
    const methods = Object.getPrototypeOf(probe) as Record<string, HandleMethod>;
    const real = methods[name]!;
    methods[name] = replace(real);
    try {
      await body(dir);
    } finally {
      methods[name] = real;
      rmSync(dir, { recursive: true, force: true });
    }
  };

  // Guarantee: a status made visible survives a restart, whatever failed write came before it.
  it('a write cut short (a full disk) and its retry: the batch reads back whole, once', async () => {
    let failNext = true;
    await withHandleMethod('appendFile', (appendFile) => async function (this: unknown, data: unknown, ...rest: unknown[]) {
      if (!failNext || typeof data !== 'string' || !data.startsWith('{"q":')) return appendFile.call(this, data, ...rest);
      failNext = false;
      await appendFile.call(this, data.slice(0, 15));
      throw diskFull();
    }, async (dir) => {
      const store = new TransactionStore(join(dir, 'tx'));
      const batch = [withKeys(1), withKeys(2)];
      await assert.rejects(store.append(batch), /ENOSPC/);
      await store.append(batch);
      store.publish(batch);
      await store.close();
      const reloaded = new TransactionStore(join(dir, 'tx'));
      reloaded.load(2);
      assert.ok(reloaded.get('sig1') && reloaded.get('sig2'), 'both statuses are back');
      assert.deepEqual(reloaded.forAddress('operator', { limit: 10 }).map((r) => r.signature), ['sig2', 'sig1']);
    });
  });

  it('one file\'s write failing while the other\'s is still under way: the cut waits for both', async () => {
    let failNext = true;
    /** Settles once the failing details write has written all it will. */
    let detailsWritten: Promise<unknown> = Promise.resolve();
    await withHandleMethod('appendFile', (appendFile) => async function (this: unknown, data: unknown, ...rest: unknown[]) {
      if (!failNext || typeof data !== 'string') return appendFile.call(this, data, ...rest);
      if (data.startsWith('{"q":')) throw diskFull();
      // The details: half now, the rest a moment later, then the disk is full.
      failNext = false;
      const written = (async () => {
        await appendFile.call(this, data.slice(0, data.length >> 1));
        await new Promise((resolve) => setTimeout(resolve, 30));
        await appendFile.call(this, data.slice(data.length >> 1, -5));
      })();
      detailsWritten = written;
      await written;
      throw diskFull();
    }, async (dir) => {
      const store = new TransactionStore(join(dir, 'tx'));
      const batch = [withKeys(1)];
      await assert.rejects(store.append(batch), /ENOSPC/);
      // A cut made before the late half landed would leave it past the cut: the retry then
      // follows a torn line. Waited for here, so that such a cut is seen whatever the timing.
      await detailsWritten;
      await store.append(batch);
      store.publish(batch);
      await store.close();
      const reloaded = new TransactionStore(join(dir, 'tx'));
      reloaded.load(1);
      assert.ok(reloaded.get('sig1'), 'the status is back');
      assert.ok(reloaded.detail('sig1'), 'and its detail');
    });
  });

  it('a flush that fails and its retry: no line twice, and eviction past the capacity still works', async () => {
    let failNext = true;
    await withHandleMethod('datasync', (datasync) => async function (this: unknown) {
      if (!failNext) return datasync.call(this);
      failNext = false;
      throw Object.assign(new Error('EIO: i/o error, fdatasync'), { code: 'EIO' });
    }, async (dir) => {
      const store = new TransactionStore(join(dir, 'tx'), { capacity: 100 });
      const first = Array.from({ length: 10 }, (_, i) => withKeys(i + 1));
      await assert.rejects(store.append(first), /EIO/);
      await store.append(first);
      store.publish(first);
      await store.close();
      const reloaded = new TransactionStore(join(dir, 'tx'), { capacity: 100 });
      reloaded.load(10);
      assert.equal(reloaded.forAddress('operator', { limit: 1_000 }).length, 10);
      assert.doesNotThrow(() => reloaded.publish(Array.from({ length: 95 }, (_, i) => withKeys(i + 11))));
      assert.equal(reloaded.forAddress('operator', { limit: 1_000 }).length, 100);
    });
  });

  it('a crash while a load cuts lines newer than the snapshot loses none of the older ones', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'agent-vault-store-'));
    try {
      const store = new TransactionStore(join(dir, 'tx'));
      const all = Array.from({ length: 50 }, (_, i) => withKeys(i + 1));
      await store.append(all);
      store.publish(all.slice(0, 40)); // the snapshot holds 1..40; 41..50 were written ahead
      await store.close();
      const { writeSync } = fs;
      // The process dies a third of the way through rewriting the file.
      (fs as { writeSync: unknown }).writeSync = (fd: number, data: string) => {
        writeSync(fd, data.slice(0, Math.floor(data.length / 3)));
        throw new Error('killed');
      };
      syncBuiltinESMExports();
      try {
        assert.throws(() => new TransactionStore(join(dir, 'tx')).load(40), /killed/);
      } finally {
        (fs as { writeSync: unknown }).writeSync = writeSync;
        syncBuiltinESMExports();
      }
      const restarted = new TransactionStore(join(dir, 'tx'));
      restarted.load(40);
      assert.equal(all.slice(0, 40).filter((entry) => !restarted.get(entry.record.signature)).length, 0);
      assert.equal(restarted.get('sig41'), undefined, 'newer than the snapshot: cut');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
