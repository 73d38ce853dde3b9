import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { derivedId, newId } from './ids.ts';

describe('newId', () => {
  test('prefix, 10 characters of time and 16 random ones, in Crockford base32', () => {
    const id = newId('tx', Date.UTC(2026, 10, 23));
    assert.match(id, /^tx_[0-9a-hjkmnp-tv-z]{26}$/);
    assert.equal(newId('evt', 0).slice(0, 14), 'evt_0000000000', 'time 0 is ten zeros');
  });

  test('ids sort by their millisecond', () => {
    const ids = [5, 1, 1_763_900_000_000, 32, 31, 1_763_900_000_001].map((ms) => newId('evt', ms));
    const byTime = [1, 5, 31, 32, 1_763_900_000_000, 1_763_900_000_001].map((ms) => ids[[5, 1, 1_763_900_000_000, 32, 31, 1_763_900_000_001].indexOf(ms)]!);
    assert.deepEqual([...ids].sort(), byTime);
  });

  test('the random part never repeats and uses every character in every position', () => {
    const seen = new Set<string>();
    const characters = Array.from({ length: 16 }, () => new Set<string>());
    for (let i = 0; i < 20_000; i += 1) {
      const tail = newId('tx', 1_763_900_000_000).slice(13);
      seen.add(tail);
      [...tail].forEach((c, position) => characters[position]!.add(c));
    }
    assert.equal(seen.size, 20_000, 'no repeat in 20,000 ids of one millisecond');
    assert.deepEqual(characters.map((set) => set.size), Array(16).fill(32), 'all 32 characters appear in each position');
  });
});

describe('derivedId', () => {
  test('the same time and seed give the same id; another seed or time another one', () => {
    const at = Date.UTC(2026, 10, 23);
    const id = derivedId('dlv', at, 'whk_a\nevt_b');
    assert.match(id, /^dlv_[0-9a-hjkmnp-tv-z]{26}$/);
    assert.equal(derivedId('dlv', at, 'whk_a\nevt_b'), id);
    assert.equal(id.slice(0, 14), newId('dlv', at).slice(0, 14), 'the time part is newId\'s: derived ids sort among the others');
    assert.notEqual(derivedId('dlv', at, 'whk_a\nevt_c'), id);
    assert.notEqual(derivedId('dlv', at + 1, 'whk_a\nevt_b'), id);
    const tails = new Set(Array.from({ length: 2_000 }, (_, i) => derivedId('dlv', at, `seed ${i}`).slice(14)));
    assert.equal(tails.size, 2_000, 'distinct seeds, distinct ids');
  });
});
