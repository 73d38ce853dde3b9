/*
 * What the instruction handlers share: the parsed input, account checks, program-derived
 * addresses, and the cross-program invocations (System, SPL Token, Associated Token).
 */
#ifndef AGENT_VAULT_PROGRAM_H
#define AGENT_VAULT_PROGRAM_H

#include "errors.h"
#include "sol.h"
#include "state.h"

/* The longest instruction (EscrowResolve) takes 11 accounts; more than this is refused. */
#define MAX_ACCOUNTS 16

typedef struct {
    AccountHeader *accounts[MAX_ACCOUNTS];
    uint64_t account_count;
    const uint8_t *data;
    uint64_t data_len;
    const Pubkey *program_id;
} Context;

enum {
    TAG_INIT_RESERVE = 0,
    TAG_SET_POLICY = 1,
    TAG_CREATE_VAULT = 2,
    TAG_UPDATE_VAULT = 3,
    TAG_FUND = 4,
    TAG_WITHDRAW = 5,
    TAG_PAY = 6,
    TAG_ESCROW_CREATE = 7,
    TAG_ESCROW_RELEASE = 8,
    TAG_ESCROW_REFUND = 9,
    TAG_ESCROW_DISPUTE = 10,
    TAG_ESCROW_RESOLVE = 11,
    TAG_ESCROW_CLOSE = 12,
    TAG_POLICY_CLOSE = 13,
};

/* Instruction handlers: each one validates everything it touches and returns SUCCESS or an error. */
uint64_t process_init_reserve(const Context *ctx);
uint64_t process_set_policy(const Context *ctx);
uint64_t process_create_vault(const Context *ctx);
uint64_t process_update_vault(const Context *ctx);
uint64_t process_fund(const Context *ctx);
uint64_t process_withdraw(const Context *ctx);
uint64_t process_pay(const Context *ctx);
uint64_t process_escrow_create(const Context *ctx);
uint64_t process_escrow_release(const Context *ctx);
uint64_t process_escrow_refund(const Context *ctx);
uint64_t process_escrow_dispute(const Context *ctx);
uint64_t process_escrow_resolve(const Context *ctx);
uint64_t process_escrow_close(const Context *ctx);
uint64_t process_policy_close(const Context *ctx);

/* ---------------------------------------------------------------------------------------------
 * Account checks */

INLINE uint64_t require_signer(const AccountHeader *a) {
    return a->is_signer ? SUCCESS : ERR_MISSING_SIGNER;
}

INLINE uint64_t require_writable(const AccountHeader *a) {
    return a->is_writable ? SUCCESS : ERR_NOT_WRITABLE;
}

INLINE uint64_t require_system_program(const AccountHeader *a) {
    return is_system_program(&a->key) ? SUCCESS : ERR_INVALID_PROGRAM_ID;
}

INLINE uint64_t require_token_program(const AccountHeader *a) {
    return is_token_program(&a->key) ? SUCCESS : ERR_INVALID_PROGRAM_ID;
}

INLINE uint64_t require_ata_program(const AccountHeader *a) {
    return is_ata_program(&a->key) ? SUCCESS : ERR_INVALID_PROGRAM_ID;
}

/* The instruction's fixed data length and minimum account count. */
INLINE uint64_t require_shape(const Context *ctx, uint64_t data_len, uint64_t accounts) {
    if (ctx->data_len != data_len || ctx->account_count < accounts) return ERR_INVALID_INSTRUCTION;
    return SUCCESS;
}

/* Program-owned state: owner, exact size, discriminator and version. Returns its data. */
uint64_t load_state(const Context *ctx, AccountHeader *a, uint8_t discriminator, uint64_t size,
                    uint8_t **out);

/* Each loader checks the state and re-derives the account's address from the seeds stored in
 * it and its stored bump. */
uint64_t load_reserve(const Context *ctx, AccountHeader *a, Reserve **out);
uint64_t load_vault(const Context *ctx, AccountHeader *a, Vault **out);
uint64_t load_policy(const Context *ctx, AccountHeader *a, Policy **out);
uint64_t load_escrow(const Context *ctx, AccountHeader *a, Escrow **out);

/* Closes an account this program owns (EscrowClose, PolicyClose): its data zeroed and every
 * lamport to `destination`. */
void close_program_account(AccountHeader *account, AccountHeader *destination);

/* A state account about to be created: not yet ours (AlreadyInitialized), owned by System. */
uint64_t require_uninitialized(const Context *ctx, const AccountHeader *a);

/* An SPL Token mint (for InitReserve). */
uint64_t require_mint(const AccountHeader *a);

/* The token amount of an account the Token program owns. */
uint64_t token_balance(const AccountHeader *a, uint64_t *amount);

/* The Clock sysvar's unix_timestamp. */
uint64_t clock_now(int64_t *now);

/* Midnight UTC of the day containing `now` (floor division, also for times before 1970). */
INLINE int64_t utc_day_start(int64_t now) {
    if (now >= 0) return now - (int64_t)((uint64_t)now % SECONDS_PER_DAY);
    uint64_t back = (uint64_t)(-(now + 1)) / SECONDS_PER_DAY + 1; /* days to step back */
    return -(int64_t)(back * SECONDS_PER_DAY);
}

/* ---------------------------------------------------------------------------------------------
 * Program-derived addresses. Seeds are a prefix word ("vault"...), one or two 32-byte ids and
 * the bump; seeds[count] is always the bump, so the same struct both derives and signs. */

#define SEED_WORD(a, b, c, d, e, f, g)                                                         \
    ((uint64_t)(a) | (uint64_t)(b) << 8 | (uint64_t)(c) << 16 | (uint64_t)(d) << 24 |        \
     (uint64_t)(e) << 32 | (uint64_t)(f) << 40 | (uint64_t)(g) << 48)
#define SEED_RESERVE SEED_WORD('r', 'e', 's', 'e', 'r', 'v', 'e'), 7
#define SEED_VAULT SEED_WORD('v', 'a', 'u', 'l', 't', 0, 0), 5
#define SEED_POLICY SEED_WORD('p', 'o', 'l', 'i', 'c', 'y', 0), 6
#define SEED_ESCROW SEED_WORD('e', 's', 'c', 'r', 'o', 'w', 0), 6

typedef struct {
    SolSignerSeed seeds[4];
    uint64_t count; /* seeds before the bump */
    uint64_t prefix;
    uint8_t bump;
} PdaSeeds;

/* id2 may be NULL (one-id seeds). The struct must not move after this call. */
INLINE void pda_seeds(PdaSeeds *s, uint64_t prefix, uint64_t prefix_len, const uint8_t *id1,
                      const uint8_t *id2, uint8_t bump) {
    s->prefix = prefix;
    s->bump = bump;
    s->seeds[0].addr = (const uint8_t *)&s->prefix;
    s->seeds[0].len = prefix_len;
    s->seeds[1].addr = id1;
    s->seeds[1].len = 32;
    uint64_t n = 2;
    if (id2 != NULL) {
        s->seeds[2].addr = id2;
        s->seeds[2].len = 32;
        n = 3;
    }
    s->seeds[n].addr = &s->bump;
    s->seeds[n].len = 1;
    s->count = n;
}

/* sol_create_program_address(seeds ‖ [bump]) == expected, else InvalidPda. */
uint64_t pda_verify(const PdaSeeds *s, const Pubkey *program_id, const Pubkey *expected);

/* Creation: the canonical bump (sol_try_find_program_address) must give `expected`; sets bump. */
uint64_t pda_find(PdaSeeds *s, const Pubkey *program_id, const Pubkey *expected);


/* ---------------------------------------------------------------------------------------------
 * Cross-program invocations */

typedef struct {
    const Context *ctx;
    AccountHeader *payer;
    AccountHeader *target;
    AccountHeader *system_program;
    const PdaSeeds *seeds; /* the target's, bump included */
    uint64_t space;
} CreateStateAccount;

/* Creates a rent-exempt program-owned account at a PDA; an address someone pre-funded is topped
 * up, allocated and assigned instead (CreateAccount refuses an account holding lamports). */
uint64_t create_state_account(const CreateStateAccount *c);

typedef struct {
    AccountHeader *token_program;
    AccountHeader *source;
    AccountHeader *destination;
    AccountHeader *authority;
    const PdaSeeds *authority_seeds;
    uint64_t amount;
} TokenTransfer;

/* SPL Token Transfer signed by the PDA that owns the source. */
uint64_t token_transfer(const TokenTransfer *t);

typedef struct {
    AccountHeader *token_program;
    AccountHeader *account;
    AccountHeader *destination;
    AccountHeader *authority;
    const PdaSeeds *authority_seeds;
} TokenCloseAccount;

/* SPL Token CloseAccount (the account must hold no tokens) signed by the PDA that owns it; its
 * lamports go to `destination`. */
uint64_t token_close_account(const TokenCloseAccount *c);

typedef struct {
    AccountHeader *payer;
    AccountHeader *token_account;
    AccountHeader *owner;
    AccountHeader *mint;
    AccountHeader *system_program;
    AccountHeader *token_program;
    AccountHeader *ata_program;
} AssociatedTokenAccount;

/* The token account is the owner's associated token account for the mint, else
 * InvalidTokenAccount. */
uint64_t require_associated_token_address(const AssociatedTokenAccount *a);

/* Associated Token Account CreateIdempotent (the address is checked by the caller). */
uint64_t create_associated_token_account(const AssociatedTokenAccount *a);

/* A payee's token account: when it exists, an SPL token account of `mint` owned by `owner`,
 * and the owner's ATA when `owner` is an account of this program (`program_id`: a vault, a
 * reserve or an escrow, which only ever spend from their ATA); when missing (still a System
 * account), the owner's ATA, created with `payer` paying rent. */
uint64_t require_payee_token_account(const AssociatedTokenAccount *a, const Pubkey *program_id);

/* ---------------------------------------------------------------------------------------------
 * Spending from a vault (Pay and EscrowCreate) */

typedef struct {
    const Context *ctx;
    AccountHeader *operator;
    AccountHeader *vault;
    AccountHeader *vault_token;
    AccountHeader *policy;
    AccountHeader *mint;
    uint64_t amount;
    int64_t now;
} Spend;

/* Every check of a spend (authority, frozen, policy, limits, daily cap, balance) and, when they
 * pass, the vault's counters updated. Returns the vault so the caller can sign with its seeds. */
uint64_t spend_from_vault(const Spend *s, Vault **vault_out);

#endif
