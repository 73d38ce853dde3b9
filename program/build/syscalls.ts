/**
 * Syscalls as SBPF v3 calls them: `call` with source register 0 and, as immediate,
 * the murmur3 (x86, 32-bit, seed 0) hash of the syscall's name. The loader keeps a
 * table from hash to syscall; an unknown hash only fails when the call executes, so
 * the linker checks names against the list below instead of letting a typo deploy.
 */

/**
 * Every syscall agave's `create_program_runtime_environment_v1` registers
 * (programs/bpf_loader/src/syscalls/mod.rs). Some are feature-gated on a cluster.
 */
export const KNOWN_SYSCALLS: readonly string[] = [
  'abort',
  'sol_panic_',
  'sol_log_',
  'sol_log_64_',
  'sol_log_pubkey',
  'sol_log_compute_units_',
  'sol_log_data',
  'sol_create_program_address',
  'sol_try_find_program_address',
  'sol_sha256',
  'sol_keccak256',
  'sol_secp256k1_recover',
  'sol_blake3',
  'sol_curve_validate_point',
  'sol_curve_group_op',
  'sol_curve_multiscalar_mul',
  'sol_curve_decompress',
  'sol_curve_pairing_map',
  'sol_get_clock_sysvar',
  'sol_get_epoch_schedule_sysvar',
  'sol_get_fees_sysvar',
  'sol_get_rent_sysvar',
  'sol_get_last_restart_slot',
  'sol_get_epoch_rewards_sysvar',
  'sol_memcpy_',
  'sol_memmove_',
  'sol_memset_',
  'sol_memcmp_',
  'sol_get_processed_sibling_instruction',
  'sol_get_stack_height',
  'sol_set_return_data',
  'sol_get_return_data',
  'sol_invoke_signed_c',
  'sol_invoke_signed_rust',
  'sol_alloc_free_',
  'sol_alt_bn128_group_op',
  'sol_big_mod_exp',
  'sol_poseidon',
  'sol_remaining_compute_units',
  'sol_alt_bn128_compression',
  'sol_get_sysvar',
  'sol_get_epoch_stake',
];

const knownSyscalls = new Set(KNOWN_SYSCALLS);
const knownSyscallHashes = new Set(KNOWN_SYSCALLS.map((name) => syscallHash(name)));

export function isKnownSyscall(name: string): boolean {
  return knownSyscalls.has(name);
}

export function isKnownSyscallHash(hash: number): boolean {
  return knownSyscallHashes.has(hash);
}

/** The hash the loader uses to name a syscall. */
export function syscallHash(name: string): number {
  return murmur3_32(new TextEncoder().encode(name), 0);
}

/** MurmurHash3, x86 32-bit variant. Returns an unsigned 32-bit integer. */
export function murmur3_32(bytes: Uint8Array, seed: number): number {
  const c1 = 0xcc9e2d51;
  const c2 = 0x1b873593;
  let hash = seed >>> 0;
  const blockCount = bytes.length >>> 2;
  for (let block = 0; block < blockCount; block += 1) {
    const at = block * 4;
    let k = bytes[at]! | (bytes[at + 1]! << 8) | (bytes[at + 2]! << 16) | (bytes[at + 3]! << 24);
    k = Math.imul(k, c1);
    k = (k << 15) | (k >>> 17);
    k = Math.imul(k, c2);
    hash ^= k;
    hash = (hash << 13) | (hash >>> 19);
    hash = (Math.imul(hash, 5) + 0xe6546b64) | 0;
  }
  const tail = blockCount * 4;
  let k = 0;
  switch (bytes.length & 3) {
    case 3:
      k ^= bytes[tail + 2]! << 16;
    // falls through
    case 2:
      k ^= bytes[tail + 1]! << 8;
    // falls through
    case 1:
      k ^= bytes[tail]!;
      k = Math.imul(k, c1);
      k = (k << 15) | (k >>> 17);
      k = Math.imul(k, c2);
      hash ^= k;
  }
  hash ^= bytes.length;
  hash ^= hash >>> 16;
  hash = Math.imul(hash, 0x85ebca6b);
  hash ^= hash >>> 13;
  hash = Math.imul(hash, 0xc2b2ae35);
  hash ^= hash >>> 16;
  return hash >>> 0;
}
