/**
 * Opaque, prefixed, time-sortable identifiers: `<prefix>_` + 10 characters of millisecond time
 * and 16 of randomness in Crockford base32 (a ULID), so ids sort by creation time.
 */
import { randomBytes } from 'node:crypto';

const ALPHABET = '0123456789abcdefghjkmnpqrstvwxyz';

export type IdPrefix = 'org' | 'wal' | 'pol' | 'tx' | 'esc' | 'whk' | 'evt' | 'exp' | 'key' | 'req' | 'rcp' | 'ver' | 'dep' | 'aud' | 'dlv';

export function newId(prefix: IdPrefix, nowMs: number): string {
  let time = '';
  let t = nowMs;
  for (let i = 0; i < 10; i += 1) {
    time = ALPHABET[t % 32] + time;
    t = Math.floor(t / 32);
  }
  const random = randomBytes(10);
  let bits = 0n;
  for (const byte of random) bits = (bits << 8n) | BigInt(byte);
  let tail = '';
  for (let i = 0; i < 16; i += 1) {
    tail = ALPHABET[Number(bits & 31n)] + tail;
    bits >>= 5n;
  }
  return `${prefix}_${time}${tail}`;
}
