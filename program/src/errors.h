/*
 * The program's custom error codes, returned as Custom(n). docs/program.md is the list of record;
 * src/chain/program.ts mirrors it for the service.
 */
#ifndef AGENT_VAULT_ERRORS_H
#define AGENT_VAULT_ERRORS_H

#define SUCCESS 0

enum {
    ERR_INVALID_INSTRUCTION = 6000,
    ERR_MISSING_SIGNER = 6001,
    ERR_UNAUTHORIZED = 6002,
    ERR_INVALID_ACCOUNT_OWNER = 6003,
    ERR_INVALID_ACCOUNT_DATA = 6004,
    ERR_INVALID_PDA = 6005,
    ERR_DUPLICATE_ACCOUNT = 6006,
    ERR_INVALID_PROGRAM_ID = 6007,
    ERR_INVALID_MINT = 6008,
    ERR_INVALID_TOKEN_ACCOUNT = 6009,
    ERR_ALREADY_INITIALIZED = 6010,
    ERR_VAULT_FROZEN = 6011,
    ERR_POLICY_EXPIRED = 6012,
    ERR_OVER_MAX_PER_TX = 6013,
    ERR_OVER_DAILY_CAP = 6014,
    ERR_INSUFFICIENT_FUNDS = 6015,
    ERR_INVALID_AMOUNT = 6016,
    ERR_ARITHMETIC_OVERFLOW = 6017,
    ERR_INVALID_ESCROW_STATE = 6018,
    ERR_ESCROW_EXPIRED = 6019,
    ERR_ESCROW_NOT_EXPIRED = 6020,
    ERR_INVALID_SPLIT = 6021,
    ERR_INVALID_EXPIRY = 6022,
    ERR_MEMO_TOO_LONG = 6023,
    ERR_POLICY_MISMATCH = 6024,
    ERR_NOT_WRITABLE = 6025,
    ERR_TOKEN_ACCOUNT_NOT_EMPTY = 6026,
};

/* Evaluates a check and returns its error from the calling function when it fails. */
#define TRY(expr)                    \
    do {                             \
        uint64_t try_err_ = (expr);  \
        if (try_err_ != SUCCESS)     \
            return try_err_;         \
    } while (0)

#define REQUIRE(cond, err)  \
    do {                    \
        if (!(cond))        \
            return (err);   \
    } while (0)

#endif
