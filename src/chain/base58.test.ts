/**
 * The payment path's address check answers what @solana/kit's `isAddress` answers, on real
 * addresses and on text that is almost one.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { getAddressDecoder, isAddress } from '@solana/kit';
import { isAddressText, toAddress } from './base58.ts';

const ALPHABET = '123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz';
const decoder = getAddressDecoder();

function randomAddress(): string {
  const bytes = randomBytes(32);
  // Leading zero bytes are leading '1's: cover them too.
  const zeros = bytes[0]! % 4;
  bytes.fill(0, 0, zeros);
  return decoder.decode(bytes);
}

function nearMisses(text: string): string[] {
  const at = randomBytes(1)[0]! % text.length;
  const other = ALPHABET[randomBytes(1)[0]! % ALPHABET.length]!;
  return [
    text.slice(0, -1), `${text}${other}`, `1${text}`, `${text.slice(0, at)}0${text.slice(at + 1)}`,
    `${text.slice(0, at)}${other}${text.slice(at + 1)}`, `${text.slice(0, at)}l${text.slice(at + 1)}`, ` ${text}`, text.toLowerCase(),
    'z'.repeat(44), '1'.repeat(32), '1'.repeat(31), '1'.repeat(44), '',
  ];
}

test('isAddressText agrees with @solana/kit isAddress on 500 addresses and their near misses', () => {
  let valid = 0;
  let invalid = 0;
  for (let i = 0; i < 500; i += 1) {
    const text = randomAddress();
    for (const candidate of [text, ...nearMisses(text)]) {
      const expected = isAddress(candidate);
      assert.equal(isAddressText(candidate), expected, `isAddressText(${JSON.stringify(candidate)}) should be ${expected}`);
      if (expected) valid += 1;
      else invalid += 1;
    }
  }
  assert.ok(valid > 500 && invalid > 500, `both answers were exercised (${valid} valid, ${invalid} invalid)`);
});

test('toAddress answers an address as it is and refuses anything else', () => {
  const text = randomAddress();
  assert.equal(toAddress(text), text);
  assert.throws(() => toAddress(`${text}0`), TypeError);
  assert.throws(() => toAddress('alice.example.com'), TypeError);
});
