/*
 * The entrypoint: parses the loader's serialized input and dispatches on the instruction tag.
 */
#include "program.h"

uint64_t entrypoint(uint8_t *input) {
    Context ctx;
    uint64_t count = *(uint64_t *)input;
    uint8_t *cursor = input + sizeof(uint64_t);
    bool duplicate = false;

    for (uint64_t i = 0; i < count; i++) {
        AccountHeader *account = (AccountHeader *)cursor;
        if (account->duplicate != ACCOUNT_NOT_DUPLICATE) {
            // The same account twice in one instruction is never legitimate here: it is how a
            // vault would pay itself or a token account would be both source and destination.
            duplicate = true;
            cursor += sizeof(uint64_t);
            continue;
        }
        if (i < MAX_ACCOUNTS) ctx.accounts[i] = account;
        uint64_t span = sizeof(AccountHeader) + account->data_len + MAX_PERMITTED_DATA_INCREASE;
        span = (span + 7) & ~(uint64_t)7;
        cursor += span + sizeof(uint64_t); /* rent_epoch */
    }
    ctx.data_len = *(uint64_t *)cursor;
    ctx.data = cursor + sizeof(uint64_t);
    ctx.program_id = (const Pubkey *)(ctx.data + ctx.data_len);
    ctx.account_count = count;

    if (duplicate) return ERR_DUPLICATE_ACCOUNT;
    if (count > MAX_ACCOUNTS || ctx.data_len == 0) return ERR_INVALID_INSTRUCTION;

    switch (ctx.data[0]) {
    case TAG_INIT_RESERVE: return process_init_reserve(&ctx);
    case TAG_SET_POLICY: return process_set_policy(&ctx);
    case TAG_CREATE_VAULT: return process_create_vault(&ctx);
    case TAG_UPDATE_VAULT: return process_update_vault(&ctx);
    case TAG_FUND: return process_fund(&ctx);
    case TAG_WITHDRAW: return process_withdraw(&ctx);
    case TAG_PAY: return process_pay(&ctx);
    case TAG_ESCROW_CREATE: return process_escrow_create(&ctx);
    case TAG_ESCROW_RELEASE: return process_escrow_release(&ctx);
    case TAG_ESCROW_REFUND: return process_escrow_refund(&ctx);
    case TAG_ESCROW_DISPUTE: return process_escrow_dispute(&ctx);
    case TAG_ESCROW_RESOLVE: return process_escrow_resolve(&ctx);
    case TAG_ESCROW_CLOSE: return process_escrow_close(&ctx);
    case TAG_POLICY_CLOSE: return process_policy_close(&ctx);
    default: return ERR_INVALID_INSTRUCTION;
    }
}
