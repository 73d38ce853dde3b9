/*
 * Account checks and program-derived addresses shared by every instruction.
 */
#include "program.h"

uint64_t load_state(const Context *ctx, AccountHeader *a, uint8_t discriminator, uint64_t size,
                    uint8_t **out) {
    REQUIRE(key_eq(&a->owner, ctx->program_id), ERR_INVALID_ACCOUNT_OWNER);
    REQUIRE(a->data_len == size, ERR_INVALID_ACCOUNT_DATA);
    const StateHeader *header = (const StateHeader *)account_data(a);
    REQUIRE(header->discriminator == discriminator && header->version == STATE_VERSION,
            ERR_INVALID_ACCOUNT_DATA);
    *out = account_data(a);
    return SUCCESS;
}

NOINLINE uint64_t load_reserve(const Context *ctx, AccountHeader *a, Reserve **out) {
    uint8_t *data;
    TRY(load_state(ctx, a, DISCRIMINATOR_RESERVE, sizeof(Reserve), &data));
    Reserve *reserve = (Reserve *)data;
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_RESERVE, reserve->org, NULL, reserve->header.bump);
    TRY(pda_verify(&seeds, ctx->program_id, &a->key));
    *out = reserve;
    return SUCCESS;
}

NOINLINE uint64_t load_vault(const Context *ctx, AccountHeader *a, Vault **out) {
    uint8_t *data;
    TRY(load_state(ctx, a, DISCRIMINATOR_VAULT, sizeof(Vault), &data));
    Vault *vault = (Vault *)data;
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_VAULT, vault->org, vault->agent, vault->header.bump);
    TRY(pda_verify(&seeds, ctx->program_id, &a->key));
    *out = vault;
    return SUCCESS;
}

NOINLINE uint64_t load_policy(const Context *ctx, AccountHeader *a, Policy **out) {
    uint8_t *data;
    TRY(load_state(ctx, a, DISCRIMINATOR_POLICY, sizeof(Policy), &data));
    Policy *policy = (Policy *)data;
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_POLICY, policy->policy_key, NULL, policy->header.bump);
    TRY(pda_verify(&seeds, ctx->program_id, &a->key));
    *out = policy;
    return SUCCESS;
}

NOINLINE uint64_t load_escrow(const Context *ctx, AccountHeader *a, Escrow **out) {
    uint8_t *data;
    TRY(load_state(ctx, a, DISCRIMINATOR_ESCROW, sizeof(Escrow), &data));
    Escrow *escrow = (Escrow *)data;
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_ESCROW, escrow->escrow_key, NULL, escrow->header.bump);
    TRY(pda_verify(&seeds, ctx->program_id, &a->key));
    *out = escrow;
    return SUCCESS;
}

/* The data is zeroed so that an account given lamports again later in the same transaction is no
 * state of this program (every loader refuses discriminator 0); the runtime removes an account
 * left with no lamports at the end of the transaction. */
NOINLINE void close_program_account(AccountHeader *account, AccountHeader *destination) {
    sol_memset_(account_data(account), 0, account->data_len);
    destination->lamports += account->lamports;
    account->lamports = 0;
}

uint64_t require_uninitialized(const Context *ctx, const AccountHeader *a) {
    REQUIRE(!key_eq(&a->owner, ctx->program_id), ERR_ALREADY_INITIALIZED);
    REQUIRE(is_system_program(&a->owner), ERR_INVALID_ACCOUNT_OWNER);
    REQUIRE(a->data_len == 0, ERR_INVALID_ACCOUNT_DATA);
    return SUCCESS;
}

uint64_t require_mint(const AccountHeader *a) {
    REQUIRE(is_token_program(&a->owner), ERR_INVALID_MINT);
    REQUIRE(a->data_len == MINT_LEN, ERR_INVALID_MINT);
    REQUIRE(account_data((AccountHeader *)a)[MINT_IS_INITIALIZED_OFFSET] == 1, ERR_INVALID_MINT);
    return SUCCESS;
}

uint64_t token_balance(const AccountHeader *a, uint64_t *amount) {
    REQUIRE(is_token_program(&a->owner), ERR_INVALID_TOKEN_ACCOUNT);
    REQUIRE(a->data_len == TOKEN_ACCOUNT_LEN, ERR_INVALID_TOKEN_ACCOUNT);
    *amount = *(const uint64_t *)(account_data((AccountHeader *)a) + TOKEN_ACCOUNT_AMOUNT_OFFSET);
    return SUCCESS;
}

uint64_t clock_now(int64_t *now) {
    SolClock clock;
    REQUIRE(sol_get_clock_sysvar(&clock) == 0, ERR_INVALID_INSTRUCTION);
    *now = clock.unix_timestamp;
    return SUCCESS;
}

uint64_t pda_verify(const PdaSeeds *s, const Pubkey *program_id, const Pubkey *expected) {
    Pubkey derived;
    REQUIRE(sol_create_program_address(s->seeds, s->count + 1, program_id, &derived) == 0,
            ERR_INVALID_PDA);
    REQUIRE(key_eq(&derived, expected), ERR_INVALID_PDA);
    return SUCCESS;
}

uint64_t pda_find(PdaSeeds *s, const Pubkey *program_id, const Pubkey *expected) {
    Pubkey derived;
    uint8_t bump = 0;
    REQUIRE(sol_try_find_program_address(s->seeds, s->count, program_id, &derived, &bump) == 0,
            ERR_INVALID_PDA);
    REQUIRE(key_eq(&derived, expected), ERR_INVALID_PDA);
    s->bump = bump;
    return SUCCESS;
}

NOINLINE uint64_t require_associated_token_address(const AssociatedTokenAccount *a) {
    // The program ids come from the (already checked) instruction accounts, which keeps
    // constants out of .rodata.
    SolSignerSeed seeds[3] = {
        {(const uint8_t *)&a->owner->key, 32},
        {(const uint8_t *)&a->token_program->key, 32},
        {(const uint8_t *)&a->mint->key, 32},
    };
    Pubkey derived;
    uint8_t bump = 0;
    REQUIRE(sol_try_find_program_address(seeds, 3, &a->ata_program->key, &derived, &bump) == 0,
            ERR_INVALID_TOKEN_ACCOUNT);
    REQUIRE(key_eq(&derived, &a->token_account->key), ERR_INVALID_TOKEN_ACCOUNT);
    return SUCCESS;
}
