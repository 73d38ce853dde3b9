/*
 * Account layouts of docs/program.md, as C structs. Every field sits at its natural alignment,
 * so the structs have no hidden padding; the static asserts pin each documented offset.
 */
#ifndef AGENT_VAULT_STATE_H
#define AGENT_VAULT_STATE_H

#include "sol.h"

#define STATE_VERSION 1

enum {
    DISCRIMINATOR_RESERVE = 1,
    DISCRIMINATOR_VAULT = 2,
    DISCRIMINATOR_POLICY = 3,
    DISCRIMINATOR_ESCROW = 4,
};

enum {
    ESCROW_LOCKED = 1,
    ESCROW_RELEASED = 2,
    ESCROW_REFUNDED = 3,
    ESCROW_DISPUTED = 4,
    ESCROW_RESOLVED = 5,
};

#define VAULT_FLAG_FROZEN 0x01

typedef struct {
    uint8_t discriminator;
    uint8_t version;
    uint8_t bump;
    uint8_t flags; /* vault: flags; escrow: state */
    uint32_t zero;
} StateHeader;

typedef struct {
    StateHeader header;
    Pubkey authority;
    uint8_t org[32];
    Pubkey mint;
    Pubkey token_account;
} Reserve;

typedef struct {
    StateHeader header;
    Pubkey authority;
    uint8_t org[32];
    uint8_t agent[32];
    Pubkey reserve;
    Pubkey policy;
    Pubkey mint;
    Pubkey token_account;
    int64_t day_start;
    uint64_t day_spent;
    uint64_t payment_count;
} Vault;

typedef struct {
    StateHeader header;
    Pubkey authority;
    uint8_t policy_key[32];
    uint64_t max_per_tx;
    uint64_t max_per_day;
    int64_t expiry;
    uint64_t revision;
    uint64_t reserved;
} Policy;

typedef struct {
    StateHeader header;
    Pubkey authority;
    uint8_t escrow_key[32];
    Pubkey from_vault;
    Pubkey receiver;
    Pubkey arbiter;
    Pubkey mint;
    Pubkey token_account;
    uint8_t task_hash[32];
    uint64_t amount;
    int64_t created_at;
    int64_t expires_at;
    uint64_t released_amount;
    uint64_t refunded_amount;
} Escrow;

_Static_assert(sizeof(Reserve) == 136, "Reserve is 136 bytes");
_Static_assert(OFFSET_OF(Reserve, authority) == 8, "Reserve.authority");
_Static_assert(OFFSET_OF(Reserve, org) == 40, "Reserve.org");
_Static_assert(OFFSET_OF(Reserve, mint) == 72, "Reserve.mint");
_Static_assert(OFFSET_OF(Reserve, token_account) == 104, "Reserve.token_account");

_Static_assert(sizeof(Vault) == 256, "Vault is 256 bytes");
_Static_assert(OFFSET_OF(Vault, org) == 40, "Vault.org");
_Static_assert(OFFSET_OF(Vault, agent) == 72, "Vault.agent");
_Static_assert(OFFSET_OF(Vault, reserve) == 104, "Vault.reserve");
_Static_assert(OFFSET_OF(Vault, policy) == 136, "Vault.policy");
_Static_assert(OFFSET_OF(Vault, mint) == 168, "Vault.mint");
_Static_assert(OFFSET_OF(Vault, token_account) == 200, "Vault.token_account");
_Static_assert(OFFSET_OF(Vault, day_start) == 232, "Vault.day_start");
_Static_assert(OFFSET_OF(Vault, day_spent) == 240, "Vault.day_spent");
_Static_assert(OFFSET_OF(Vault, payment_count) == 248, "Vault.payment_count");

_Static_assert(sizeof(Policy) == 112, "Policy is 112 bytes");
_Static_assert(OFFSET_OF(Policy, policy_key) == 40, "Policy.policy_key");
_Static_assert(OFFSET_OF(Policy, max_per_tx) == 72, "Policy.max_per_tx");
_Static_assert(OFFSET_OF(Policy, max_per_day) == 80, "Policy.max_per_day");
_Static_assert(OFFSET_OF(Policy, expiry) == 88, "Policy.expiry");
_Static_assert(OFFSET_OF(Policy, revision) == 96, "Policy.revision");
_Static_assert(OFFSET_OF(Policy, reserved) == 104, "Policy.reserved");

_Static_assert(sizeof(Escrow) == 304, "Escrow is 304 bytes");
_Static_assert(OFFSET_OF(Escrow, escrow_key) == 40, "Escrow.escrow_key");
_Static_assert(OFFSET_OF(Escrow, from_vault) == 72, "Escrow.from_vault");
_Static_assert(OFFSET_OF(Escrow, receiver) == 104, "Escrow.receiver");
_Static_assert(OFFSET_OF(Escrow, arbiter) == 136, "Escrow.arbiter");
_Static_assert(OFFSET_OF(Escrow, mint) == 168, "Escrow.mint");
_Static_assert(OFFSET_OF(Escrow, token_account) == 200, "Escrow.token_account");
_Static_assert(OFFSET_OF(Escrow, task_hash) == 232, "Escrow.task_hash");
_Static_assert(OFFSET_OF(Escrow, amount) == 264, "Escrow.amount");
_Static_assert(OFFSET_OF(Escrow, created_at) == 272, "Escrow.created_at");
_Static_assert(OFFSET_OF(Escrow, expires_at) == 280, "Escrow.expires_at");
_Static_assert(OFFSET_OF(Escrow, released_amount) == 288, "Escrow.released_amount");
_Static_assert(OFFSET_OF(Escrow, refunded_amount) == 296, "Escrow.refunded_amount");

/* SPL Token layouts (the accounts the Token program owns). */
#define TOKEN_ACCOUNT_LEN 165
#define TOKEN_ACCOUNT_MINT_OFFSET 0
#define TOKEN_ACCOUNT_OWNER_OFFSET 32
#define TOKEN_ACCOUNT_AMOUNT_OFFSET 64
#define MINT_LEN 82
#define MINT_IS_INITIALIZED_OFFSET 45

#define SECONDS_PER_DAY 86400

#endif
