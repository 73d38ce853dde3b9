import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { describe, it } from 'node:test';
import { getBase58Decoder } from '@solana/kit';
import { decodeBase58, encodeBase58 } from '../chain/base58.ts';
import { stringifyJson } from './json.ts';
import { MalformedTransactionError, parseWireTransaction } from './wire.ts';

describe('base58', () => {
  it('matches @solana/kit on random bytes, leading zeros included', () => {
    const kit = getBase58Decoder();
    for (let i = 0; i < 500; i++) {
      const bytes = new Uint8Array(randomBytes(i % 70));
      if (i % 3 === 0 && bytes.length > 0) bytes[0] = 0;
      if (i % 5 === 0 && bytes.length > 1) bytes[1] = 0;
      const text = encodeBase58(bytes);
      assert.equal(text, kit.decode(bytes));
      assert.deepEqual(decodeBase58(text), bytes);
    }
  });

  it('rejects text outside the alphabet', () => {
    assert.equal(decodeBase58('0OIl'), null);
    assert.equal(decodeBase58('abc!'), null);
    assert.equal(decodeBase58('1'.repeat(200)), null);
  });
});

describe('stringifyJson', () => {
  it('writes bigint exactly and otherwise agrees with JSON.stringify', () => {
    const value = { a: 18446744073709551615n, b: [1, 'x"y', null, undefined, true], c: undefined, d: { e: -5n } };
    assert.equal(stringifyJson(value), '{"a":18446744073709551615,"b":[1,"x\\"y",null,null,true],"d":{"e":-5}}');
    const plain = { s: 'line\nbreak \u0000', n: 1.5, arr: [{}, []] };
    assert.equal(stringifyJson(plain), JSON.stringify(plain));
  });
});

describe('parseWireTransaction', () => {
  it('refuses unsigned, truncated and oversized transactions', () => {
    const unsigned = new Uint8Array(1 + 64 + 3 + 1 + 32 + 32 + 1);
    unsigned[0] = 1;
    assert.throws(() => parseWireTransaction(unsigned), MalformedTransactionError);
    assert.throws(() => parseWireTransaction(new Uint8Array([1, 2, 3])), /truncated/);
    assert.throws(() => parseWireTransaction(new Uint8Array(2000)), /limit is 1232/);
    assert.throws(() => parseWireTransaction(new Uint8Array([0])), /no signature/);
  });
});
