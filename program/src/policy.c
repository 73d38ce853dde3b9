/*
 * SetPolicy: creates a policy, or overwrites the limits of an existing one. Vaults read their
 * policy account at every spend, so an update governs every attached vault at once.
 * PolicyClose: a policy no vault uses any more is closed, its rent back to the operator that
 * created it.
 */
#include "program.h"

/* tag, policy_key [32], max_per_tx u64, max_per_day u64, expiry i64 */
#define SET_POLICY_LEN (1 + 32 + 8 + 8 + 8)

/* Accounts: operator (s,w), policy (w), system. */
NOINLINE uint64_t process_set_policy(const Context *ctx) {
    TRY(require_shape(ctx, SET_POLICY_LEN, 3));
    const uint8_t *policy_key = ctx->data + 1;
    uint64_t max_per_tx = load_u64(ctx->data + 33);
    uint64_t max_per_day = load_u64(ctx->data + 41);
    int64_t expiry = (int64_t)load_u64(ctx->data + 49);
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *policy_account = ctx->accounts[1];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(policy_account));
    TRY(require_system_program(ctx->accounts[2]));

    Policy *policy;
    if (key_eq(&policy_account->owner, ctx->program_id)) {
        TRY(load_policy(ctx, policy_account, &policy));
        // The stored key derived this address; a different key in the data names another policy.
        REQUIRE(bytes32_eq(policy->policy_key, policy_key), ERR_INVALID_PDA);
        REQUIRE(key_eq(&policy->authority, &operator->key), ERR_UNAUTHORIZED);
        uint64_t revision;
        REQUIRE(!__builtin_add_overflow(policy->revision, 1, &revision), ERR_ARITHMETIC_OVERFLOW);
        policy->revision = revision;
    } else {
        TRY(require_uninitialized(ctx, policy_account));
        PdaSeeds seeds;
        pda_seeds(&seeds, SEED_POLICY, policy_key, NULL, 0);
        TRY(pda_find(&seeds, ctx->program_id, &policy_account->key));
        CreateStateAccount create = {
            .ctx = ctx,
            .payer = operator,
            .target = policy_account,
            .system_program = ctx->accounts[2],
            .seeds = &seeds,
            .space = sizeof(Policy),
        };
        TRY(create_state_account(&create));
        policy = (Policy *)account_data(policy_account);
        policy->header.discriminator = DISCRIMINATOR_POLICY;
        policy->header.version = STATE_VERSION;
        policy->header.bump = seeds.bump;
        policy->authority = operator->key;
        sol_memcpy_(policy->policy_key, policy_key, 32);
        policy->revision = 1;
    }
    policy->max_per_tx = max_per_tx;
    policy->max_per_day = max_per_day;
    policy->expiry = expiry;
    return SUCCESS;
}

/* Accounts: operator (s,w), policy (w). The policy's account closed, every lamport it holds (the
 * rent the operator paid at SetPolicy) to the operator. The program cannot see which vaults still
 * name the policy: the service closes only a policy none can spend under any more (its
 * `policies.close` job); a vault that still names it is refused at its next spend
 * (InvalidAccountOwner), nothing moved. */
NOINLINE uint64_t process_policy_close(const Context *ctx) {
    TRY(require_shape(ctx, 1, 2));
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *policy_account = ctx->accounts[1];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(policy_account));

    Policy *policy;
    TRY(load_policy(ctx, policy_account, &policy));
    REQUIRE(key_eq(&policy->authority, &operator->key), ERR_UNAUTHORIZED);

    close_program_account(policy_account, operator);
    return SUCCESS;
}
