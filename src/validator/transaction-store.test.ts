import assert from 'node:assert/strict';
import { appendFileSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { TransactionStore, type ExecutedTransaction } from './transaction-store.ts';

function executed(seq: number): ExecutedTransaction {
  return {
    record: { seq, signature: `sig${seq}`, slot: 100 + seq, blockTime: 1_700_000_000, err: seq % 2 ? null : { InstructionError: [0, { Custom: 1 }] }, computeUnits: 150, fee: 5000 },
    detail: { wire: new Uint8Array([seq & 0xff]), logs: [`log ${seq}`], preBalances: [10n ** 18n], postBalances: [10n ** 18n - 5000n] },
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
      // Old segments were deleted: at most capacity + one segment stays on disk.
      assert.ok(readdirSync(dir).filter((n) => n.endsWith('.detail.jsonl')).length <= 300 / store.segmentEntries + 1);

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
