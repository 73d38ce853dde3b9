/*
 * Escrow: money locked out of a vault for a task, then released to the receiver, refunded to the
 * vault, or — once disputed — split by the arbiter. A settled escrow is then closed, its two
 * accounts' rent back to the operator that paid it.
 *
 *   locked ──release (operator, before expiry)──────────────▶ released
 *   locked ──refund (arbiter any time; operator after expiry)▶ refunded
 *   locked ──dispute (operator, before expiry)──▶ disputed ──refund (arbiter)──▶ refunded
 *                                                 disputed ──resolve (arbiter)─▶ resolved
 *   released, refunded, resolved ──close (operator)──▶ (no account)
 */
#include "program.h"

/* tag, escrow_key [32], amount u64, task_hash [32], expires_at i64 */
#define ESCROW_CREATE_LEN (1 + 32 + 8 + 32 + 8)
/* tag, to_receiver u64, to_sender u64 */
#define ESCROW_RESOLVE_LEN (1 + 8 + 8)

typedef struct {
    const Context *ctx;
    const Vault *vault;
    const uint8_t *escrow_key;
    const uint8_t *task_hash;
    uint64_t amount;
    int64_t now;
    int64_t expires_at;
} EscrowOpening;

/* The escrow state (a new PDA at its canonical bump) and its token account. The accounts are
 * those of EscrowCreate. */
static NOINLINE uint64_t open_escrow(const EscrowOpening *o) {
    const Context *ctx = o->ctx;
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *mint = ctx->accounts[4];
    AccountHeader *escrow_account = ctx->accounts[5];
    AccountHeader *escrow_token = ctx->accounts[6];
    TRY(require_uninitialized(ctx, escrow_account));
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_ESCROW, o->escrow_key, NULL, 0);
    TRY(pda_find(&seeds, ctx->program_id, &escrow_account->key));
    AssociatedTokenAccount ata = {
        .payer = operator,
        .token_account = escrow_token,
        .owner = escrow_account,
        .mint = mint,
        .system_program = ctx->accounts[9],
        .token_program = ctx->accounts[10],
        .ata_program = ctx->accounts[11],
    };
    TRY(require_associated_token_address(&ata));
    CreateStateAccount create = {
        .ctx = ctx,
        .payer = operator,
        .target = escrow_account,
        .system_program = ctx->accounts[9],
        .seeds = &seeds,
        .space = sizeof(Escrow),
    };
    TRY(create_state_account(&create));
    Escrow *escrow = (Escrow *)account_data(escrow_account);
    escrow->header.discriminator = DISCRIMINATOR_ESCROW;
    escrow->header.version = STATE_VERSION;
    escrow->header.bump = seeds.bump;
    escrow->header.flags = ESCROW_LOCKED;
    escrow->authority = o->vault->authority;
    sol_memcpy_(escrow->escrow_key, o->escrow_key, 32);
    escrow->from_vault = ctx->accounts[1]->key;
    escrow->receiver = ctx->accounts[7]->key;
    escrow->arbiter = ctx->accounts[8]->key;
    escrow->mint = o->vault->mint;
    escrow->token_account = escrow_token->key;
    sol_memcpy_(escrow->task_hash, o->task_hash, 32);
    escrow->amount = o->amount;
    escrow->created_at = o->now;
    escrow->expires_at = o->expires_at;

    return create_associated_token_account(&ata);
}

/* Accounts: operator (s,w), vault (w), vault_token (w), policy, mint, escrow (w),
 * escrow_token (w), receiver, arbiter, system, token, ata.
 * Data: escrow_key [32], amount u64, task_hash [32], expires_at i64. */
NOINLINE uint64_t process_escrow_create(const Context *ctx) {
    TRY(require_shape(ctx, ESCROW_CREATE_LEN, 12));
    uint64_t amount = load_u64(ctx->data + 33);
    int64_t expires_at = (int64_t)load_u64(ctx->data + 73);
    REQUIRE(amount > 0, ERR_INVALID_AMOUNT);

    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *vault_account = ctx->accounts[1];
    AccountHeader *vault_token = ctx->accounts[2];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(vault_account));
    TRY(require_writable(vault_token));
    TRY(require_writable(ctx->accounts[5]));
    TRY(require_writable(ctx->accounts[6]));
    TRY(require_system_program(ctx->accounts[9]));
    TRY(require_token_program(ctx->accounts[10]));
    TRY(require_ata_program(ctx->accounts[11]));

    int64_t now;
    TRY(clock_now(&now));
    REQUIRE(expires_at > now, ERR_INVALID_EXPIRY);
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

    EscrowOpening opening = {
        .ctx = ctx,
        .vault = vault,
        .escrow_key = ctx->data + 1,
        .task_hash = ctx->data + 41,
        .amount = amount,
        .now = now,
        .expires_at = expires_at,
    };
    TRY(open_escrow(&opening));

    PdaSeeds vault_seeds;
    pda_seeds(&vault_seeds, SEED_VAULT, vault->org, vault->agent, vault->header.bump);
    TokenTransfer transfer = {
        .token_program = ctx->accounts[10],
        .source = vault_token,
        .destination = ctx->accounts[6],
        .authority = vault_account,
        .authority_seeds = &vault_seeds,
        .amount = amount,
    };
    return token_transfer(&transfer);
}

/* The escrow's own token account, holding at least the escrowed amount. */
static uint64_t require_escrow_funds(const Escrow *escrow, const AccountHeader *escrow_token) {
    REQUIRE(key_eq(&escrow_token->key, &escrow->token_account), ERR_INVALID_TOKEN_ACCOUNT);
    uint64_t balance;
    TRY(token_balance(escrow_token, &balance));
    REQUIRE(balance >= escrow->amount, ERR_INSUFFICIENT_FUNDS);
    return SUCCESS;
}

typedef struct {
    AccountHeader *escrow_account;
    const Escrow *escrow;
    AccountHeader *escrow_token;
    AccountHeader *destination;
    AccountHeader *token_program;
    uint64_t amount;
} EscrowPayout;

/* A transfer out of the escrow's token account, signed by the escrow PDA. */
static NOINLINE uint64_t escrow_pay_out(const EscrowPayout *p) {
    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_ESCROW, p->escrow->escrow_key, NULL, p->escrow->header.bump);
    TokenTransfer transfer = {
        .token_program = p->token_program,
        .source = p->escrow_token,
        .destination = p->destination,
        .authority = p->escrow_account,
        .authority_seeds = &seeds,
        .amount = p->amount,
    };
    return token_transfer(&transfer);
}

/* The vault the escrow was funded from and its token account. */
static NOINLINE uint64_t load_escrow_vault(const Context *ctx, const Escrow *escrow,
                                           AccountHeader *vault_account,
                                           const AccountHeader *vault_token, Vault **out) {
    // The key was derived and checked at EscrowCreate; equality pins the PDA.
    REQUIRE(key_eq(&vault_account->key, &escrow->from_vault), ERR_INVALID_ACCOUNT_DATA);
    uint8_t *data;
    TRY(load_state(ctx, vault_account, DISCRIMINATOR_VAULT, sizeof(Vault), &data));
    Vault *vault = (Vault *)data;
    REQUIRE(key_eq(&vault_token->key, &vault->token_account), ERR_INVALID_TOKEN_ACCOUNT);
    *out = vault;
    return SUCCESS;
}

/* Accounts: operator (s,w), escrow (w), escrow_token (w), mint, receiver, receiver_token (w),
 * system, token, ata. */
NOINLINE uint64_t process_escrow_release(const Context *ctx) {
    TRY(require_shape(ctx, 1, 9));
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *escrow_account = ctx->accounts[1];
    AccountHeader *escrow_token = ctx->accounts[2];
    AccountHeader *mint = ctx->accounts[3];
    AccountHeader *receiver = ctx->accounts[4];
    AccountHeader *receiver_token = ctx->accounts[5];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(escrow_account));
    TRY(require_writable(escrow_token));
    TRY(require_writable(receiver_token));
    TRY(require_system_program(ctx->accounts[6]));
    TRY(require_token_program(ctx->accounts[7]));
    TRY(require_ata_program(ctx->accounts[8]));

    Escrow *escrow;
    TRY(load_escrow(ctx, escrow_account, &escrow));
    REQUIRE(key_eq(&escrow->authority, &operator->key), ERR_UNAUTHORIZED);
    REQUIRE(escrow->header.flags == ESCROW_LOCKED, ERR_INVALID_ESCROW_STATE);
    int64_t now;
    TRY(clock_now(&now));
    REQUIRE(now < escrow->expires_at, ERR_ESCROW_EXPIRED);
    REQUIRE(key_eq(&mint->key, &escrow->mint), ERR_INVALID_MINT);
    REQUIRE(key_eq(&receiver->key, &escrow->receiver), ERR_INVALID_ACCOUNT_DATA);
    TRY(require_escrow_funds(escrow, escrow_token));

    AssociatedTokenAccount payee = {
        .payer = operator,
        .token_account = receiver_token,
        .owner = receiver,
        .mint = mint,
        .system_program = ctx->accounts[6],
        .token_program = ctx->accounts[7],
        .ata_program = ctx->accounts[8],
    };
    TRY(require_payee_token_account(&payee, ctx->program_id));

    escrow->header.flags = ESCROW_RELEASED;
    escrow->released_amount = escrow->amount;
    EscrowPayout payout = {
        .escrow_account = escrow_account,
        .escrow = escrow,
        .escrow_token = escrow_token,
        .destination = receiver_token,
        .token_program = ctx->accounts[7],
        .amount = escrow->amount,
    };
    return escrow_pay_out(&payout);
}

/* Accounts: signer (s), escrow (w), escrow_token (w), from_vault (w), vault_token (w), token.
 * The arbiter may refund a locked or disputed escrow at any time; the operator only a locked
 * one whose time is up. */
NOINLINE uint64_t process_escrow_refund(const Context *ctx) {
    TRY(require_shape(ctx, 1, 6));
    AccountHeader *signer = ctx->accounts[0];
    AccountHeader *escrow_account = ctx->accounts[1];
    AccountHeader *escrow_token = ctx->accounts[2];
    AccountHeader *vault_account = ctx->accounts[3];
    AccountHeader *vault_token = ctx->accounts[4];
    TRY(require_signer(signer));
    TRY(require_writable(escrow_account));
    TRY(require_writable(escrow_token));
    TRY(require_writable(vault_account));
    TRY(require_writable(vault_token));
    TRY(require_token_program(ctx->accounts[5]));

    Escrow *escrow;
    TRY(load_escrow(ctx, escrow_account, &escrow));
    uint8_t state = escrow->header.flags;
    if (key_eq(&signer->key, &escrow->arbiter)) {
        REQUIRE(state == ESCROW_LOCKED || state == ESCROW_DISPUTED, ERR_INVALID_ESCROW_STATE);
    } else {
        REQUIRE(key_eq(&signer->key, &escrow->authority), ERR_UNAUTHORIZED);
        REQUIRE(state == ESCROW_LOCKED, ERR_INVALID_ESCROW_STATE);
        int64_t now;
        TRY(clock_now(&now));
        REQUIRE(now >= escrow->expires_at, ERR_ESCROW_NOT_EXPIRED);
    }
    Vault *vault;
    TRY(load_escrow_vault(ctx, escrow, vault_account, vault_token, &vault));
    TRY(require_escrow_funds(escrow, escrow_token));

    // The lock counted against the day it was created in; give that day its allowance back.
    if (vault->day_start == utc_day_start(escrow->created_at)) {
        vault->day_spent = vault->day_spent > escrow->amount ? vault->day_spent - escrow->amount : 0;
    }
    escrow->header.flags = ESCROW_REFUNDED;
    escrow->refunded_amount = escrow->amount;
    EscrowPayout payout = {
        .escrow_account = escrow_account,
        .escrow = escrow,
        .escrow_token = escrow_token,
        .destination = vault_token,
        .token_program = ctx->accounts[5],
        .amount = escrow->amount,
    };
    return escrow_pay_out(&payout);
}

/* Accounts: operator (s), escrow (w). */
NOINLINE uint64_t process_escrow_dispute(const Context *ctx) {
    TRY(require_shape(ctx, 1, 2));
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *escrow_account = ctx->accounts[1];
    TRY(require_signer(operator));
    TRY(require_writable(escrow_account));
    Escrow *escrow;
    TRY(load_escrow(ctx, escrow_account, &escrow));
    REQUIRE(key_eq(&escrow->authority, &operator->key), ERR_UNAUTHORIZED);
    REQUIRE(escrow->header.flags == ESCROW_LOCKED, ERR_INVALID_ESCROW_STATE);
    int64_t now;
    TRY(clock_now(&now));
    REQUIRE(now < escrow->expires_at, ERR_ESCROW_EXPIRED);
    escrow->header.flags = ESCROW_DISPUTED;
    return SUCCESS;
}

/* Accounts: arbiter (s,w), escrow (w), escrow_token (w), mint, receiver, receiver_token (w),
 * from_vault (w), vault_token (w), system, token, ata. Data: to_receiver u64, to_sender u64. */
NOINLINE uint64_t process_escrow_resolve(const Context *ctx) {
    TRY(require_shape(ctx, ESCROW_RESOLVE_LEN, 11));
    uint64_t to_receiver = load_u64(ctx->data + 1);
    uint64_t to_sender = load_u64(ctx->data + 9);
    AccountHeader *arbiter = ctx->accounts[0];
    AccountHeader *escrow_account = ctx->accounts[1];
    AccountHeader *escrow_token = ctx->accounts[2];
    AccountHeader *mint = ctx->accounts[3];
    AccountHeader *receiver = ctx->accounts[4];
    AccountHeader *receiver_token = ctx->accounts[5];
    AccountHeader *vault_account = ctx->accounts[6];
    AccountHeader *vault_token = ctx->accounts[7];
    TRY(require_signer(arbiter));
    TRY(require_writable(arbiter));
    TRY(require_writable(escrow_account));
    TRY(require_writable(escrow_token));
    TRY(require_writable(receiver_token));
    TRY(require_writable(vault_account));
    TRY(require_writable(vault_token));
    TRY(require_system_program(ctx->accounts[8]));
    TRY(require_token_program(ctx->accounts[9]));
    TRY(require_ata_program(ctx->accounts[10]));

    Escrow *escrow;
    TRY(load_escrow(ctx, escrow_account, &escrow));
    REQUIRE(key_eq(&arbiter->key, &escrow->arbiter), ERR_UNAUTHORIZED);
    REQUIRE(escrow->header.flags == ESCROW_DISPUTED, ERR_INVALID_ESCROW_STATE);
    uint64_t total;
    REQUIRE(!__builtin_add_overflow(to_receiver, to_sender, &total), ERR_ARITHMETIC_OVERFLOW);
    REQUIRE(total == escrow->amount, ERR_INVALID_SPLIT);
    REQUIRE(key_eq(&mint->key, &escrow->mint), ERR_INVALID_MINT);
    REQUIRE(key_eq(&receiver->key, &escrow->receiver), ERR_INVALID_ACCOUNT_DATA);
    Vault *vault;
    TRY(load_escrow_vault(ctx, escrow, vault_account, vault_token, &vault));
    TRY(require_escrow_funds(escrow, escrow_token));

    escrow->header.flags = ESCROW_RESOLVED;
    escrow->released_amount = to_receiver;
    escrow->refunded_amount = to_sender;
    EscrowPayout payout = {
        .escrow_account = escrow_account,
        .escrow = escrow,
        .escrow_token = escrow_token,
        .token_program = ctx->accounts[9],
    };
    if (to_receiver > 0) {
        AssociatedTokenAccount payee = {
            .payer = arbiter,
            .token_account = receiver_token,
            .owner = receiver,
            .mint = mint,
            .system_program = ctx->accounts[8],
            .token_program = ctx->accounts[9],
            .ata_program = ctx->accounts[10],
        };
        TRY(require_payee_token_account(&payee, ctx->program_id));
        payout.destination = receiver_token;
        payout.amount = to_receiver;
        TRY(escrow_pay_out(&payout));
    }
    if (to_sender > 0) {
        payout.destination = vault_token;
        payout.amount = to_sender;
        TRY(escrow_pay_out(&payout));
    }
    return SUCCESS;
}

/* Accounts: operator (s,w), escrow (w), escrow_token (w), token. A settled escrow whose token
 * account is empty: the token account is closed by SPL Token, the escrow account by this program,
 * and the lamports of both (their rent, which the operator paid at EscrowCreate) go to the
 * operator. */
NOINLINE uint64_t process_escrow_close(const Context *ctx) {
    TRY(require_shape(ctx, 1, 4));
    AccountHeader *operator = ctx->accounts[0];
    AccountHeader *escrow_account = ctx->accounts[1];
    AccountHeader *escrow_token = ctx->accounts[2];
    TRY(require_signer(operator));
    TRY(require_writable(operator));
    TRY(require_writable(escrow_account));
    TRY(require_writable(escrow_token));
    TRY(require_token_program(ctx->accounts[3]));

    Escrow *escrow;
    TRY(load_escrow(ctx, escrow_account, &escrow));
    REQUIRE(key_eq(&escrow->authority, &operator->key), ERR_UNAUTHORIZED);
    uint8_t state = escrow->header.flags;
    REQUIRE(state == ESCROW_RELEASED || state == ESCROW_REFUNDED || state == ESCROW_RESOLVED,
            ERR_INVALID_ESCROW_STATE);
    REQUIRE(key_eq(&escrow_token->key, &escrow->token_account), ERR_INVALID_TOKEN_ACCOUNT);
    uint64_t balance;
    TRY(token_balance(escrow_token, &balance));
    // USDC sent to the account after (or beyond) the settlement: closing is refused rather than
    // the tokens taken by anyone.
    REQUIRE(balance == 0, ERR_TOKEN_ACCOUNT_NOT_EMPTY);

    PdaSeeds seeds;
    pda_seeds(&seeds, SEED_ESCROW, escrow->escrow_key, NULL, escrow->header.bump);
    TokenCloseAccount close = {
        .token_program = ctx->accounts[3],
        .account = escrow_token,
        .destination = operator,
        .authority = escrow_account,
        .authority_seeds = &seeds,
    };
    TRY(token_close_account(&close));

    // The program owns the escrow account, so it closes it itself.
    close_program_account(escrow_account, operator);
    return SUCCESS;
}
