/*
 * Cross-program invocations: System (create a PDA), SPL Token (transfer, close), Associated Token
 * Account (create idempotently). Account infos point into the loader's input, as the runtime
 * requires, so it can write the callee's changes back where this program reads them.
 */
#include "program.h"

enum {
    SYSTEM_CREATE_ACCOUNT = 0,
    SYSTEM_ASSIGN = 1,
    SYSTEM_TRANSFER = 2,
    SYSTEM_ALLOCATE = 8,
};

#define TOKEN_TRANSFER 3
#define TOKEN_CLOSE_ACCOUNT 9
#define ATA_CREATE_IDEMPOTENT 1

/* The metas and infos of one invocation live at the start of the heap (32 KiB at 0x300000000,
 * otherwise unused by this program), not on the 512-byte stack frame clang allows. Invocations
 * are sequential and the callee runs in its own memory, so one scratch area serves them all. */
#define CPI_ACCOUNTS_MAX 8
typedef struct {
    SolAccountMeta metas[CPI_ACCOUNTS_MAX];
    SolAccountInfo infos[CPI_ACCOUNTS_MAX];
} CpiScratch;
#define HEAP_START 0x300000000ULL
#define CPI_SCRATCH ((CpiScratch *)HEAP_START)

/* rent_epoch is left 0: the runtime does not read it from a C account info. */
static void account_info(SolAccountInfo *info, AccountHeader *a) {
    info->key = &a->key;
    info->lamports = &a->lamports;
    info->data_len = a->data_len;
    info->data = account_data(a);
    info->owner = &a->owner;
    info->rent_epoch = 0;
    info->is_signer = a->is_signer;
    info->is_writable = a->is_writable;
    info->executable = a->executable;
}

static void account_meta(SolAccountMeta *meta, const AccountHeader *a, bool writable, bool signer) {
    meta->pubkey = &a->key;
    meta->is_writable = writable;
    meta->is_signer = signer;
}

static uint64_t invoke(const SolInstruction *instruction, const SolAccountInfo *infos,
                       uint64_t info_count, const PdaSeeds *signer) {
    SolSignerSeeds seeds = {NULL, 0};
    if (signer != NULL) {
        seeds.addr = signer->seeds;
        seeds.len = signer->count + 1;
    }
    return sol_invoke_signed_c(instruction, infos, info_count, &seeds, signer != NULL ? 1 : 0);
}

/* The rent-exempt minimum: (128 + space) bytes × lamports_per_byte_year × exemption_threshold.
 * The threshold is an f64; its integer value is recovered from the bits without floating point
 * (it is 2.0 on every cluster, or 1.0 once SIMD-0194 lands). */
static uint64_t rent_exempt_minimum(uint64_t space, uint64_t *lamports) {
    SolRent rent;
    REQUIRE(sol_get_rent_sysvar(&rent) == 0, ERR_INVALID_INSTRUCTION);
    uint64_t bits = rent.exemption_threshold_bits;
    int64_t exponent = (int64_t)((bits >> 52) & 0x7FF) - 1075;
    uint64_t mantissa = (bits & 0xFFFFFFFFFFFFFULL) | (1ULL << 52);
    while (exponent < 0 && (mantissa & 1) == 0) {
        mantissa >>= 1;
        exponent++;
    }
    // Bounds instead of overflow builtins (BPF has no 128-bit multiply to lower them with):
    // base < 2^52 and mantissa < 2^11, so the product fits. Real thresholds have mantissa 1.
    REQUIRE(space < (1ULL << 20) && rent.lamports_per_byte_year < (1ULL << 31) &&
                mantissa < (1ULL << 11),
            ERR_ARITHMETIC_OVERFLOW);
    uint64_t total = (128 + space) * rent.lamports_per_byte_year * mantissa;
    while (exponent > 0) {
        REQUIRE(total <= (U64_MAX >> 1), ERR_ARITHMETIC_OVERFLOW);
        total <<= 1;
        exponent--;
    }
    if (exponent < 0) total = exponent <= -64 ? 0 : total >> (uint64_t)(-exponent);
    *lamports = total;
    return SUCCESS;
}

static uint64_t system_transfer(const CreateStateAccount *c, uint64_t lamports) {
    uint8_t data[12];
    store_u32(data, SYSTEM_TRANSFER);
    store_u64(data + 4, lamports);
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], c->payer, true, true);
    account_meta(&metas[1], c->target, true, false);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], c->payer);
    account_info(&infos[1], c->target);
    account_info(&infos[2], c->system_program);
    SolInstruction instruction = {&c->system_program->key, metas, 2, data, sizeof(data)};
    return invoke(&instruction, infos, 3, NULL);
}

static uint64_t system_allocate(const CreateStateAccount *c) {
    uint8_t data[12];
    store_u32(data, SYSTEM_ALLOCATE);
    store_u64(data + 4, c->space);
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], c->target, true, true);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], c->target);
    account_info(&infos[1], c->system_program);
    SolInstruction instruction = {&c->system_program->key, metas, 1, data, sizeof(data)};
    return invoke(&instruction, infos, 2, c->seeds);
}

static uint64_t system_assign(const CreateStateAccount *c) {
    uint8_t data[36];
    store_u32(data, SYSTEM_ASSIGN);
    sol_memcpy_(data + 4, c->ctx->program_id, 32);
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], c->target, true, true);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], c->target);
    account_info(&infos[1], c->system_program);
    SolInstruction instruction = {&c->system_program->key, metas, 1, data, sizeof(data)};
    return invoke(&instruction, infos, 2, c->seeds);
}

static uint64_t system_create_account(const CreateStateAccount *c, uint64_t lamports) {
    uint8_t data[52];
    store_u32(data, SYSTEM_CREATE_ACCOUNT);
    store_u64(data + 4, lamports);
    store_u64(data + 12, c->space);
    sol_memcpy_(data + 20, c->ctx->program_id, 32);
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], c->payer, true, true);
    account_meta(&metas[1], c->target, true, true);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], c->payer);
    account_info(&infos[1], c->target);
    account_info(&infos[2], c->system_program);
    SolInstruction instruction = {&c->system_program->key, metas, 2, data, sizeof(data)};
    return invoke(&instruction, infos, 3, c->seeds);
}

NOINLINE uint64_t create_state_account(const CreateStateAccount *c) {
    uint64_t minimum;
    TRY(rent_exempt_minimum(c->space, &minimum));
    uint64_t held = c->target->lamports;
    if (held == 0) return system_create_account(c, minimum);
    if (held < minimum) TRY(system_transfer(c, minimum - held));
    TRY(system_allocate(c));
    return system_assign(c);
}

NOINLINE uint64_t token_transfer(const TokenTransfer *t) {
    uint8_t data[9];
    data[0] = TOKEN_TRANSFER;
    store_u64(data + 1, t->amount);
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], t->source, true, false);
    account_meta(&metas[1], t->destination, true, false);
    account_meta(&metas[2], t->authority, false, true);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], t->source);
    account_info(&infos[1], t->destination);
    account_info(&infos[2], t->authority);
    account_info(&infos[3], t->token_program);
    SolInstruction instruction = {&t->token_program->key, metas, 3, data, sizeof(data)};
    return invoke(&instruction, infos, 4, t->authority_seeds);
}

NOINLINE uint64_t token_close_account(const TokenCloseAccount *c) {
    uint8_t data[1] = {TOKEN_CLOSE_ACCOUNT};
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], c->account, true, false);
    account_meta(&metas[1], c->destination, true, false);
    account_meta(&metas[2], c->authority, false, true);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], c->account);
    account_info(&infos[1], c->destination);
    account_info(&infos[2], c->authority);
    account_info(&infos[3], c->token_program);
    SolInstruction instruction = {&c->token_program->key, metas, 3, data, sizeof(data)};
    return invoke(&instruction, infos, 4, c->authority_seeds);
}

NOINLINE uint64_t create_associated_token_account(const AssociatedTokenAccount *a) {
    uint8_t data[1] = {ATA_CREATE_IDEMPOTENT};
    SolAccountMeta *metas = CPI_SCRATCH->metas;
    account_meta(&metas[0], a->payer, true, true);
    account_meta(&metas[1], a->token_account, true, false);
    account_meta(&metas[2], a->owner, false, false);
    account_meta(&metas[3], a->mint, false, false);
    account_meta(&metas[4], a->system_program, false, false);
    account_meta(&metas[5], a->token_program, false, false);
    SolAccountInfo *infos = CPI_SCRATCH->infos;
    account_info(&infos[0], a->payer);
    account_info(&infos[1], a->token_account);
    account_info(&infos[2], a->owner);
    account_info(&infos[3], a->mint);
    account_info(&infos[4], a->system_program);
    account_info(&infos[5], a->token_program);
    account_info(&infos[6], a->ata_program);
    SolInstruction instruction = {&a->ata_program->key, metas, 6, data, sizeof(data)};
    return invoke(&instruction, infos, 7, NULL);
}

NOINLINE uint64_t require_payee_token_account(const AssociatedTokenAccount *a, const Pubkey *program_id) {
    const AccountHeader *token = a->token_account;
    if (is_system_program(&token->owner)) {
        // Missing, or only pre-funded by someone: the ATA program creates it either way.
        TRY(require_associated_token_address(a));
        return create_associated_token_account(a);
    }
    REQUIRE(is_token_program(&token->owner), ERR_INVALID_TOKEN_ACCOUNT);
    REQUIRE(token->data_len == TOKEN_ACCOUNT_LEN, ERR_INVALID_TOKEN_ACCOUNT);
    const uint8_t *data = account_data((AccountHeader *)token);
    REQUIRE(key_eq((const Pubkey *)(data + TOKEN_ACCOUNT_MINT_OFFSET), &a->mint->key),
            ERR_INVALID_TOKEN_ACCOUNT);
    REQUIRE(key_eq((const Pubkey *)(data + TOKEN_ACCOUNT_OWNER_OFFSET), &a->owner->key),
            ERR_INVALID_TOKEN_ACCOUNT);
    // Any token account may name one of this program's accounts as its owner, but the program
    // moves money out of their ATA alone: paid anywhere else, the money would stay there for
    // good. Derived only then, so a payment to anyone else costs no derivation.
    if (key_eq(&a->owner->owner, program_id)) return require_associated_token_address(a);
    return SUCCESS;
}
