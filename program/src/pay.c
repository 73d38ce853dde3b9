/*
 * Pay, the hot path, and the spending rules it shares with EscrowCreate.
 *
 * Cost matters here: the policy is pinned by the key the vault stores (derived and checked when
 * it was attached), so it is not re-derived; the recipient's token account is only created (and
 * its address derived) when it does not exist yet; nothing is logged on success.
 */
#include "program.h"

#define MEMO_MAX_LEN 128
/* tag, amount u64, attestation [32], memo_len u8 */
#define PAY_FIXED_LEN (1 + 8 + 32 + 1)

NOINLINE uint64_t spend_from_vault(const Spend *s, Vault **vault_out) {
    const Context *ctx = s->ctx;
    Vault *vault;
    TRY(load_vault(ctx, s->vault, &vault));
    REQUIRE(key_eq(&vault->authority, &s->operator->key), ERR_UNAUTHORIZED);
    REQUIRE((vault->header.flags & VAULT_FLAG_FROZEN) == 0, ERR_VAULT_FROZEN);
    REQUIRE(key_eq(&s->policy->key, &vault->policy), ERR_POLICY_MISMATCH);
    uint8_t *policy_data;
    TRY(load_state(ctx, s->policy, DISCRIMINATOR_POLICY, sizeof(Policy), &policy_data));
    const Policy *policy = (const Policy *)policy_data;
    // The address alone is not enough: a policy closed (PolicyClose) can be created again at it by
    // any key, with limits of its choosing. CreateVault and UpdateVault attach only a policy of
    // the vault's authority, and so does this.
    REQUIRE(key_eq(&policy->authority, &vault->authority), ERR_POLICY_MISMATCH);
    REQUIRE(key_eq(&s->mint->key, &vault->mint), ERR_INVALID_MINT);
    REQUIRE(key_eq(&s->vault_token->key, &vault->token_account), ERR_INVALID_TOKEN_ACCOUNT);

    REQUIRE(policy->expiry == 0 || s->now < policy->expiry, ERR_POLICY_EXPIRED);
    REQUIRE(s->amount <= policy->max_per_tx, ERR_OVER_MAX_PER_TX);
    int64_t day = utc_day_start(s->now);
    // A clock that went back (validators' timestamps may) stays in the later day: its spending
    // must not become available again.
    if (day < vault->day_start) day = vault->day_start;
    uint64_t spent = vault->day_start == day ? vault->day_spent : 0;
    uint64_t day_total;
    REQUIRE(!__builtin_add_overflow(spent, s->amount, &day_total), ERR_ARITHMETIC_OVERFLOW);
    REQUIRE(day_total <= policy->max_per_day, ERR_OVER_DAILY_CAP);

    uint64_t balance;
    TRY(token_balance(s->vault_token, &balance));
    REQUIRE(balance >= s->amount, ERR_INSUFFICIENT_FUNDS);
    uint64_t payment_count;
    REQUIRE(!__builtin_add_overflow(vault->payment_count, 1, &payment_count),
            ERR_ARITHMETIC_OVERFLOW);

    vault->day_start = day;
    vault->day_spent = day_total;
    vault->payment_count = payment_count;
    *vault_out = vault;
    return SUCCESS;
}

/* Accounts: operator (s,w), vault (w), vault_token (w), policy, mint, recipient,
 * recipient_token (w), system, token, ata.
 * Data: amount u64, attestation [32], memo_len u8, memo [memo_len]. */
NOINLINE uint64_t process_pay(const Context *ctx) {
    REQUIRE(ctx->data_len >= PAY_FIXED_LEN, ERR_INVALID_INSTRUCTION);
    uint64_t memo_len = ctx->data[PAY_FIXED_LEN - 1];
    REQUIRE(memo_len <= MEMO_MAX_LEN, ERR_MEMO_TOO_LONG);
    TRY(require_shape(ctx, PAY_FIXED_LEN + memo_len, 10));
    uint64_t amount = load_u64(ctx->data + 1);
    REQUIRE(amount > 0, ERR_INVALID_AMOUNT);

    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *vault_account = ctx->accounts[1];
    AccountHeader *vault_token = ctx->accounts[2];
    AccountHeader *recipient_token = ctx->accounts[6];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(vault_account));
    TRY(require_writable(vault_token));
    TRY(require_writable(recipient_token));
    TRY(require_system_program(ctx->accounts[7]));
    TRY(require_token_program(ctx->accounts[8]));
    TRY(require_ata_program(ctx->accounts[9]));

    int64_t now;
    TRY(clock_now(&now));
    Spend spend = {
        .ctx = ctx,
        .operator = operator,
        .vault = vault_account,
        .vault_token = vault_token,
        .policy = ctx->accounts[3],
        .mint = ctx->accounts[4],
        .amount = amount,
        .now = now,
    };
    Vault *vault;
    TRY(spend_from_vault(&spend, &vault));

    AssociatedTokenAccount payee = {
        .payer = operator,
        .token_account = recipient_token,
        .owner = ctx->accounts[5],
        .mint = ctx->accounts[4],
        .system_program = ctx->accounts[7],
        .token_program = ctx->accounts[8],
        .ata_program = ctx->accounts[9],
    };
    TRY(require_payee_token_account(&payee, ctx->program_id));

    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_VAULT, vault->org, vault->agent, vault->header.bump);
    TokenTransfer transfer = {
        .token_program = ctx->accounts[8],
        .source = vault_token,
        .destination = recipient_token,
        .authority = vault_account,
        .authority_seeds = &seeds,
        .amount = amount,
    };
    return token_transfer(&transfer);
}
