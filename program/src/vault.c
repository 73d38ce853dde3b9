/*
 * An agent's vault: CreateVault, and UpdateVault (attach a policy, freeze, unfreeze).
 */
#include "program.h"

enum {
    VAULT_OP_ATTACH_POLICY = 0,
    VAULT_OP_FREEZE = 1,
    VAULT_OP_UNFREEZE = 2,
};

/* Accounts: operator (s,w), reserve, vault (w), vault_token (w), policy, mint, system, token, ata.
 * Data: org [32], agent [32]. */
NOINLINE uint64_t process_create_vault(const Context *ctx) {
    TRY(require_shape(ctx, 1 + 32 + 32, 9));
    const uint8_t *org = ctx->data + 1;
    const uint8_t *agent = ctx->data + 33;
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *reserve_account = ctx->accounts[1];
    AccountHeader *vault_account = ctx->accounts[2];
    AccountHeader *vault_token = ctx->accounts[3];
    AccountHeader *policy_account = ctx->accounts[4];
    AccountHeader *mint = ctx->accounts[5];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(vault_account));
    TRY(require_writable(vault_token));
    TRY(require_system_program(ctx->accounts[6]));
    TRY(require_token_program(ctx->accounts[7]));
    TRY(require_ata_program(ctx->accounts[8]));

    Reserve *reserve;
    TRY(load_reserve(ctx, reserve_account, &reserve));
    // The reserve must be the PDA of the org named in the data (its address derives from it).
    REQUIRE(bytes32_eq(reserve->org, org), ERR_INVALID_PDA);
    REQUIRE(key_eq(&reserve->authority, &operator->key), ERR_UNAUTHORIZED);
    Policy *policy;
    TRY(load_policy(ctx, policy_account, &policy));
    REQUIRE(key_eq(&policy->authority, &operator->key), ERR_UNAUTHORIZED);
    REQUIRE(key_eq(&mint->key, &reserve->mint), ERR_INVALID_MINT);

    TRY(require_uninitialized(ctx, vault_account));
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_VAULT, org, agent, 0);
    TRY(pda_find(&seeds, ctx->program_id, &vault_account->key));
    AssociatedTokenAccount ata = {
        .payer = operator,
        .token_account = vault_token,
        .owner = vault_account,
        .mint = mint,
        .system_program = ctx->accounts[6],
        .token_program = ctx->accounts[7],
        .ata_program = ctx->accounts[8],
    };
    TRY(require_associated_token_address(&ata));

    CreateStateAccount create = {
        .ctx = ctx,
        .payer = operator,
        .target = vault_account,
        .system_program = ctx->accounts[6],
        .seeds = &seeds,
        .space = sizeof(Vault),
    };
    TRY(create_state_account(&create));
    Vault *vault = (Vault *)account_data(vault_account);
    vault->header.discriminator = DISCRIMINATOR_VAULT;
    vault->header.version = STATE_VERSION;
    vault->header.bump = seeds.bump;
    vault->authority = reserve->authority;
    sol_memcpy_(vault->org, org, 32);
    sol_memcpy_(vault->agent, agent, 32);
    vault->reserve = reserve_account->key;
    vault->policy = policy_account->key;
    vault->mint = reserve->mint;
    vault->token_account = vault_token->key;

    return create_associated_token_account(&ata);
}

/* Accounts: operator (s), vault (w), policy (op 0 only). Data: op u8. */
NOINLINE uint64_t process_update_vault(const Context *ctx) {
    TRY(require_shape(ctx, 2, 2));
    uint8_t op = ctx->data[1];
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *vault_account = ctx->accounts[1];
    TRY(require_signer(operator));
    TRY(require_writable(vault_account));
    Vault *vault;
    TRY(load_vault(ctx, vault_account, &vault));
    REQUIRE(key_eq(&vault->authority, &operator->key), ERR_UNAUTHORIZED);

    switch (op) {
    case VAULT_OP_ATTACH_POLICY: {
        REQUIRE(ctx->account_count >= 3, ERR_INVALID_INSTRUCTION);
        AccountHeader *policy_account = ctx->accounts[2];
        Policy *policy;
        TRY(load_policy(ctx, policy_account, &policy));
        REQUIRE(key_eq(&policy->authority, &vault->authority), ERR_UNAUTHORIZED);
        vault->policy = policy_account->key;
        return SUCCESS;
    }
    case VAULT_OP_FREEZE:
        vault->header.flags |= VAULT_FLAG_FROZEN;
        return SUCCESS;
    case VAULT_OP_UNFREEZE:
        vault->header.flags &= (uint8_t)~VAULT_FLAG_FROZEN;
        return SUCCESS;
    default:
        return ERR_INVALID_INSTRUCTION;
    }
}
