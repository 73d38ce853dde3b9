/**
 * Opaque, prefixed, time-sortable identifiers: `<prefix>_` + 10 characters of millisecond time
 * and 16 of randomness in Crockford base32 (a ULID), so ids sort by creation time.
 */
import { createHash, randomFillSync } from 'node:crypto';

const ALPHABET = '0123456789abcdefghjkmnpqrstvwxyz';

export type IdPrefix = 'org' | 'wal' | 'pol' | 'tx' | 'esc' | 'whk' | 'evt' | 'exp' | 'key' | 'req' | 'rcp' | 'ver' | 'dep' | 'aud' | 'dlv';

/**
 * Random bytes are drawn from the CSPRNG 4 KiB at a time and handed out 10 per id: one call
 * into OpenSSL per ~400 ids instead of one per id (a payment makes several ids). Each byte is
 * used once.
 */
const POOL_BYTES = 4096;
/** The bytes behind the 16 characters after the time: random for newId, a digest for derivedId. */
const TAIL_BYTES = 10;
const pool = Buffer.alloc(POOL_BYTES);
let poolOffset = POOL_BYTES;

function takeRandom(): number {
  if (poolOffset + TAIL_BYTES > POOL_BYTES) {
    randomFillSync(pool);
    poolOffset = 0;
  }
  const start = poolOffset;
  poolOffset += TAIL_BYTES;
  return start;
}

export function newId(prefix: IdPrefix, nowMs: number): string {
  return encodeId(prefix, nowMs, pool, takeRandom());
}

/**
 * An id made from `seed` instead of randomness: the same time and seed give the same id. For
 * things named by what they are about (a webhook's delivery of one event), so that whoever
 * records them, at whatever moment, names them alike.
 */
export function derivedId(prefix: IdPrefix, nowMs: number, seed: string): string {
  return encodeId(prefix, nowMs, createHash('sha256').update(seed, 'utf8').digest(), 0);
}

/** `<prefix>_` + 10 characters of `ms` + 16 characters of the 10 bytes of `bytes` at `start`. */
function encodeId(prefix: IdPrefix, ms: number, bytes: Buffer, start: number): string {
  let time = '';
  let t = ms;
  for (let i = 0; i < 10; i += 1) {
    time = ALPHABET[t % 32] + time;
    t = Math.floor(t / 32);
  }
  // 80 bits as 16 characters of 5 bits, from the last character back.
  let tail = '';
  let bits = 0;
  let bitCount = 0;
  for (let i = start + TAIL_BYTES - 1; i >= start; i -= 1) {
    bits |= bytes[i]! << bitCount;
    bitCount += 8;
    while (bitCount >= 5) {
      tail = ALPHABET[bits & 31] + tail;
      bits >>>= 5;
      bitCount -= 5;
    }
  }
  return `${prefix}_${time}${tail}`;
}
