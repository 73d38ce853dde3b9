/*
 * The Solana runtime as this program sees it, written from the runtime's documented ABI (no SDK
 * exists here): fixed-width types, the loader's serialized input, the C ABI structs of
 * sol_invoke_signed_c, and the syscalls the program calls.
 *
 * Everything is freestanding: no libc, no writable globals, no floating point.
 */
#ifndef AGENT_VAULT_SOL_H
#define AGENT_VAULT_SOL_H

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed long long int64_t;
typedef _Bool bool;
#define true 1
#define false 0
#define NULL ((void *)0)

#define U64_MAX 0xFFFFFFFFFFFFFFFFULL
#define INLINE static inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#define OFFSET_OF(type, field) __builtin_offsetof(type, field)

/* A public key, kept as four words so that comparing and copying keys (always 8-byte aligned in
 * the loader's input and in our account layouts) takes four loads instead of thirty-two. */
typedef struct {
    uint64_t w[4];
} Pubkey;
_Static_assert(sizeof(Pubkey) == 32, "Pubkey is 32 bytes");

INLINE bool key_eq(const Pubkey *a, const Pubkey *b) {
    return ((a->w[0] ^ b->w[0]) | (a->w[1] ^ b->w[1]) | (a->w[2] ^ b->w[2]) | (a->w[3] ^ b->w[3])) == 0;
}

INLINE bool key_is(const Pubkey *a, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3) {
    return ((a->w[0] ^ w0) | (a->w[1] ^ w1) | (a->w[2] ^ w2) | (a->w[3] ^ w3)) == 0;
}

/* Program ids as little-endian words, compared with immediates so no constant needs .rodata. */
#define SYSTEM_PROGRAM_WORDS 0ULL, 0ULL, 0ULL, 0ULL
/* TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA */
#define TOKEN_PROGRAM_WORDS \
    0x93a165d7e1f6dd06ULL, 0xac79ebce46e1cbd9ULL, 0x91375b5fed85b41cULL, 0xa900ff7e85f58c3aULL
/* ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL */
#define ATA_PROGRAM_WORDS \
    0xf189244e8f25978cULL, 0x830d8e1429103dbbULL, 0x8410ffda99135a0bULL, 0x59f8e9dbd87b8e04ULL

INLINE bool is_system_program(const Pubkey *k) { return key_is(k, SYSTEM_PROGRAM_WORDS); }
INLINE bool is_token_program(const Pubkey *k) { return key_is(k, TOKEN_PROGRAM_WORDS); }
INLINE bool is_ata_program(const Pubkey *k) { return key_is(k, ATA_PROGRAM_WORDS); }

INLINE bool bytes32_eq(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0;
    for (int i = 0; i < 32; i++) diff |= a[i] ^ b[i];
    return diff == 0;
}

/* Little-endian reads and writes at any alignment (instruction data is unaligned). */
INLINE uint64_t load_u64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

INLINE void store_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

INLINE void store_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---------------------------------------------------------------------------------------------
 * The loader's serialized input (aligned layout of the upgradeable loader). Per account: this
 * header, then data_len bytes of data, 10 KiB of realloc room, padding to 8, rent_epoch u64.
 * A duplicate entry is only the marker (the index of the first occurrence) and 7 bytes of pad. */
typedef struct {
    uint8_t duplicate; /* 0xFF when this is the account's first occurrence */
    uint8_t is_signer;
    uint8_t is_writable;
    uint8_t executable;
    uint32_t padding;
    Pubkey key;
    Pubkey owner;
    uint64_t lamports;
    uint64_t data_len;
    /* data follows */
} AccountHeader;
_Static_assert(sizeof(AccountHeader) == 88, "serialized account header is 88 bytes");

#define ACCOUNT_NOT_DUPLICATE 0xFF
#define MAX_PERMITTED_DATA_INCREASE 10240

INLINE uint8_t *account_data(AccountHeader *a) { return (uint8_t *)a + sizeof(AccountHeader); }

/* ---------------------------------------------------------------------------------------------
 * C ABI of sol_invoke_signed_c and the PDA syscalls. */
typedef struct {
    const Pubkey *pubkey;
    bool is_writable;
    bool is_signer;
} SolAccountMeta;

typedef struct {
    const Pubkey *program_id;
    const SolAccountMeta *accounts;
    uint64_t account_len;
    const uint8_t *data;
    uint64_t data_len;
} SolInstruction;

typedef struct {
    Pubkey *key;
    uint64_t *lamports;
    uint64_t data_len;
    uint8_t *data;
    Pubkey *owner;
    uint64_t rent_epoch;
    bool is_signer;
    bool is_writable;
    bool executable;
} SolAccountInfo;
_Static_assert(sizeof(SolAccountInfo) == 56, "SolAccountInfo matches the runtime's C ABI");

typedef struct {
    const uint8_t *addr;
    uint64_t len;
} SolSignerSeed;

typedef struct {
    const SolSignerSeed *addr;
    uint64_t len;
} SolSignerSeeds;

/* Clock sysvar: slot, epoch_start_timestamp, epoch, leader_schedule_epoch, unix_timestamp. */
typedef struct {
    uint64_t slot;
    int64_t epoch_start_timestamp;
    uint64_t epoch;
    uint64_t leader_schedule_epoch;
    int64_t unix_timestamp;
} SolClock;

/* Rent sysvar: lamports_per_byte_year u64, exemption_threshold f64 (kept as its bits; the
 * program has no floating point), burn_percent u8, padded to 24 bytes. */
typedef struct {
    uint64_t lamports_per_byte_year;
    uint64_t exemption_threshold_bits;
    uint8_t burn_percent;
    uint8_t padding[7];
} SolRent;

extern uint64_t sol_create_program_address(const SolSignerSeed *seeds, uint64_t seeds_len,
                                           const Pubkey *program_id, Pubkey *address);
extern uint64_t sol_try_find_program_address(const SolSignerSeed *seeds, uint64_t seeds_len,
                                             const Pubkey *program_id, Pubkey *address,
                                             uint8_t *bump_seed);
extern uint64_t sol_invoke_signed_c(const SolInstruction *instruction,
                                    const SolAccountInfo *account_infos, uint64_t account_infos_len,
                                    const SolSignerSeeds *signers_seeds, uint64_t signers_seeds_len);
extern uint64_t sol_get_clock_sysvar(SolClock *clock);
extern uint64_t sol_get_rent_sysvar(SolRent *rent);
extern void sol_memcpy_(void *dst, const void *src, uint64_t n);
extern void sol_memset_(void *dst, uint8_t c, uint64_t n);

#endif
