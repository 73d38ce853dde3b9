/**
 * Base58 (Bitcoin alphabet) for the hot path: the chain client's signer decodes each address once
 * and encodes each signature; the validator encodes every transaction's signature when it is
 * queued and decodes it once per status lookup. @solana/kit's codec is correct but about five
 * times slower on 64-byte signatures, which matters at thousands of transactions per second.
 */
import type { Address } from '@solana/kit';

const ALPHABET = '123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz';
const DIGIT_OF = new Int8Array(128).fill(-1);
for (let i = 0; i < ALPHABET.length; i++) DIGIT_OF[ALPHABET.charCodeAt(i)] = i;

/** Longest input accepted by `decodeBase58`: enough for any key, signature or blockhash. */
const MAX_TEXT_LENGTH = 128;
const LIMB = 58 ** 5;

export function encodeBase58(bytes: Uint8Array): string {
  let zeros = 0;
  while (zeros < bytes.length && bytes[zeros] === 0) zeros++;
  // The number in limbs of base 58^5 (< 2^30), least significant first; a limb times 2^16 plus a
  // carry stays below 2^53, so plain numbers are exact.
  const limbs: number[] = [];
  for (let i = zeros; i < bytes.length; i += 2) {
    const twoBytes = i + 1 < bytes.length;
    const factor = twoBytes ? 65536 : 256;
    let carry = twoBytes ? bytes[i]! * 256 + bytes[i + 1]! : bytes[i]!;
    for (let j = 0; j < limbs.length; j++) {
      carry += limbs[j]! * factor;
      limbs[j] = carry % LIMB;
      carry = Math.floor(carry / LIMB);
    }
    while (carry > 0) {
      limbs.push(carry % LIMB);
      carry = Math.floor(carry / LIMB);
    }
  }
  let digits = '';
  for (let j = 0; j < limbs.length; j++) {
    let limb = limbs[j]!;
    const last = j === limbs.length - 1;
    for (let k = 0; k < 5 && (!last || limb > 0); k++) {
      digits = ALPHABET[limb % 58]! + digits;
      limb = Math.floor(limb / 58);
    }
  }
  return '1'.repeat(zeros) + digits;
}

/**
 * Decodes base58 text; returns null when it is not base58, or longer than `maxLength` (an
 * address or signature by default; the work grows with the square of the length).
 */
export function decodeBase58(text: string, maxLength = MAX_TEXT_LENGTH): Uint8Array | null {
  if (text.length > maxLength) return null;
  let zeros = 0;
  while (zeros < text.length && text.charCodeAt(zeros) === 49 /* '1' */) zeros++;
  const bytes = new Uint8Array(Math.ceil(((text.length - zeros) * 733) / 1000) + 1);
  let length = 0;
  for (let i = zeros; i < text.length; i++) {
    const code = text.charCodeAt(i);
    const digit = code < 128 ? DIGIT_OF[code]! : -1;
    if (digit < 0) return null;
    let carry = digit;
    let j = 0;
    for (; j < length || carry !== 0; j++) {
      carry += 58 * (bytes[j] ?? 0);
      bytes[j] = carry & 0xff;
      carry >>= 8;
    }
    length = j;
  }
  const out = new Uint8Array(zeros + length);
  for (let k = 0; k < length; k++) out[zeros + k] = bytes[length - 1 - k]!;
  return out;
}

/**
 * Whether `text` is a chain address, base58 of 32 bytes: the answer of @solana/kit's `isAddress`
 * (checked against it in base58.test.ts) at a seventh of its cost, for the payment path.
 */
export function isAddressText(text: string): text is Address {
  return text.length >= 32 && text.length <= 44 && decodeBase58(text)?.length === 32;
}

/** `text` as an Address, or a TypeError when it is not one. */
export function toAddress(text: string): Address {
  if (!isAddressText(text)) throw new TypeError(`${JSON.stringify(text.slice(0, 64))} is not a chain address`);
  return text;
}
