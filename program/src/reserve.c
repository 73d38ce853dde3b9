/*
 * An organisation's reserve: InitReserve, and the two moves inside the organisation, Fund
 * (reserve → vault) and Withdraw (vault → reserve).
 */
#include "program.h"

/* Accounts: operator (s,w), reserve (w), reserve_token (w), mint, system, token, ata.
 * Data: org [32]. */
NOINLINE uint64_t process_init_reserve(const Context *ctx) {
    TRY(require_shape(ctx, 1 + 32, 7));
    const uint8_t *org = ctx->data + 1;
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *reserve_account = ctx->accounts[1];
    AccountHeader *reserve_token = ctx->accounts[2];
    AccountHeader *mint = ctx->accounts[3];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(reserve_account));
    TRY(require_writable(reserve_token));
    TRY(require_system_program(ctx->accounts[4]));
    TRY(require_token_program(ctx->accounts[5]));
    TRY(require_ata_program(ctx->accounts[6]));
    TRY(require_mint(mint));
    TRY(require_uninitialized(ctx, reserve_account));

    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_RESERVE, org, NULL, 0);
    TRY(pda_find(&seeds, ctx->program_id, &reserve_account->key));
    AssociatedTokenAccount ata = {
        .payer = operator,
        .token_account = reserve_token,
        .owner = reserve_account,
        .mint = mint,
        .system_program = ctx->accounts[4],
        .token_program = ctx->accounts[5],
        .ata_program = ctx->accounts[6],
    };
    TRY(require_associated_token_address(&ata));

    CreateStateAccount create = {
        .ctx = ctx,
        .payer = operator,
        .target = reserve_account,
        .system_program = ctx->accounts[4],
        .seeds = &seeds,
        .space = sizeof(Reserve),
    };
    TRY(create_state_account(&create));
    Reserve *reserve = (Reserve *)account_data(reserve_account);
    reserve->header.discriminator = DISCRIMINATOR_RESERVE;
    reserve->header.version = STATE_VERSION;
    reserve->header.bump = seeds.bump;
    reserve->authority = operator->key;
    sol_memcpy_(reserve->org, org, 32);
    reserve->mint = mint->key;
    reserve->token_account = reserve_token->key;

    return create_associated_token_account(&ata);
}

/* What Fund and Withdraw both check: the operator is the authority of both, the vault belongs to
 * the reserve, the token accounts are the stored ones, the source covers the amount. */
typedef struct {
    const Context *ctx;
    AccountHeader *operator;
    AccountHeader *reserve;
    AccountHeader *reserve_token;
    AccountHeader *vault;
    AccountHeader *vault_token;
    AccountHeader *token_program;
    bool to_vault;
} InternalMove;

static NOINLINE uint64_t move_inside_organisation(const InternalMove *m) {
    const Context *ctx = m->ctx;
    TRY(require_shape(ctx, 1 + 8, 6));
    uint64_t amount = load_u64(ctx->data + 1);
    REQUIRE(amount > 0, ERR_INVALID_AMOUNT);
    TRY(require_signer(m->operator));
    TRY(require_writable(m->reserve_token));
    TRY(require_writable(m->vault_token));
    TRY(require_token_program(m->token_program));

    Reserve *reserve;
    TRY(load_reserve(ctx, m->reserve, &reserve));
    REQUIRE(key_eq(&reserve->authority, &m->operator->key), ERR_UNAUTHORIZED);
    Vault *vault;
    TRY(load_vault(ctx, m->vault, &vault));
    REQUIRE(key_eq(&vault->authority, &m->operator->key), ERR_UNAUTHORIZED);
    REQUIRE(key_eq(&vault->reserve, &m->reserve->key), ERR_INVALID_ACCOUNT_DATA);
    REQUIRE(key_eq(&m->reserve_token->key, &reserve->token_account), ERR_INVALID_TOKEN_ACCOUNT);
    REQUIRE(key_eq(&m->vault_token->key, &vault->token_account), ERR_INVALID_TOKEN_ACCOUNT);

    AccountHeader *source = m->to_vault ? m->reserve_token : m->vault_token;
    uint64_t balance;
    TRY(token_balance(source, &balance));
    REQUIRE(balance >= amount, ERR_INSUFFICIENT_FUNDS);

    PdaSeeds seeds;
    if (m->to_vault)
        pda_seeds(&seeds, SEED_RESERVE, reserve->org, NULL, reserve->header.bump);
    else
        pda_seeds(&seeds, SEED_VAULT, vault->org, vault->agent, vault->header.bump);
    TokenTransfer transfer = {
        .token_program = m->token_program,
        .source = source,
        .destination = m->to_vault ? m->vault_token : m->reserve_token,
        .authority = m->to_vault ? m->reserve : m->vault,
        .authority_seeds = &seeds,
        .amount = amount,
    };
    return token_transfer(&transfer);
}

/* Accounts: operator (s), reserve, reserve_token (w), vault, vault_token (w), token.
 * Data: amount u64. */
NOINLINE uint64_t process_fund(const Context *ctx) {
    REQUIRE(ctx->account_count >= 6, ERR_INVALID_INSTRUCTION);
    InternalMove move = {
        .ctx = ctx,
        .operator = ctx->accounts[0],
        .reserve = ctx->accounts[1],
        .reserve_token = ctx->accounts[2],
        .vault = ctx->accounts[3],
        .vault_token = ctx->accounts[4],
        .token_program = ctx->accounts[5],
        .to_vault = true,
    };
    return move_inside_organisation(&move);
}

/* Accounts: operator (s), vault, vault_token (w), reserve, reserve_token (w), token.
 * Data: amount u64. */
NOINLINE uint64_t process_withdraw(const Context *ctx) {
    REQUIRE(ctx->account_count >= 6, ERR_INVALID_INSTRUCTION);
    InternalMove move = {
        .ctx = ctx,
        .operator = ctx->accounts[0],
        .vault = ctx->accounts[1],
        .vault_token = ctx->accounts[2],
        .reserve = ctx->accounts[3],
        .reserve_token = ctx->accounts[4],
        .token_program = ctx->accounts[5],
        .to_vault = false,
    };
    return move_inside_organisation(&move);
}
