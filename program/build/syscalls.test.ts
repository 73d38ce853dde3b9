import assert from 'node:assert/strict';
import { test } from 'node:test';
import { KNOWN_SYSCALLS, murmur3_32, syscallHash } from './syscalls.ts';

// The guarantee: our hashes are the ones the loader registers, or every syscall fails at run time.
test('syscallHash matches the hashes the Solana SDK publishes', () => {
  // From the SBPFv3 branch of the generated C headers, platform-tools-sdk/sbf/c/inc/sol/log.h
  // in the agave tree (read in jito-foundation/jito-solana), which call syscalls by hash.
  const published: Record<string, number> = {
    sol_log_: 544561597,
    sol_log_64_: 1546269048,
    sol_log_compute_units_: 1387942038,
    sol_log_data: 1930933300,
  };
  for (const [name, hash] of Object.entries(published)) assert.equal(syscallHash(name), hash, name);
  // Firedancer's loader fuzzer lists these two (abort, sol_panic_) first.
  assert.equal(syscallHash('abort'), 0xb6fc1a11);
  assert.equal(syscallHash('sol_panic_'), 0x686093bb);
});

test('murmur3_32 matches the reference vectors for every tail length', () => {
  // SMHasher's MurmurHash3_x86_32 verification vectors.
  assert.equal(murmur3_32(new Uint8Array(0), 0), 0);
  assert.equal(murmur3_32(new Uint8Array(0), 1), 0x514e28b7);
  assert.equal(murmur3_32(new Uint8Array(0), 0xffffffff), 0x81f16f39);
  assert.equal(murmur3_32(new Uint8Array([0x21, 0x43, 0x65, 0x87]), 0), 0xf55b516b);
  assert.equal(murmur3_32(new Uint8Array([0x21, 0x43, 0x65]), 0), 0x7e4a8634);
  assert.equal(murmur3_32(new Uint8Array([0x21, 0x43]), 0), 0xa0f7b07a);
  assert.equal(murmur3_32(new Uint8Array([0x21]), 0), 0x72661cf4);
  assert.equal(murmur3_32(new TextEncoder().encode('Hello, world!'), 1234), 0xfaf6cdb3);
});

test('no two known syscalls share a hash', () => {
  const hashes = new Set(KNOWN_SYSCALLS.map(syscallHash));
  assert.equal(hashes.size, KNOWN_SYSCALLS.length);
});
