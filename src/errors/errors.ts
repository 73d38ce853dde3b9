/**
 * The closed list of error codes (DESIGN §3), each with its HTTP status and the sentence the
 * error reference (/docs/errors) shows. Use-cases throw ServiceError with a code from here;
 * only the HTTP edge turns it into a response.
 */
export const ERROR_CODES = {
  invalid_request: { status: 400, description: 'The request is malformed: bad JSON, or a missing, unknown or badly typed field (named in `param`).' },
  invalid_amount: { status: 400, description: 'An amount must be a positive decimal string with at most 6 fractional digits and at most 9223372036854.775807, no sign, exponent or spaces.' },
  invalid_currency: { status: 400, description: 'The only currency is `USDC`.' },
  invalid_recipient: { status: 400, description: 'The recipient is neither a valid chain address nor a domain in the organisation\'s recipient directory.' },
  invalid_proof: { status: 400, description: 'The completion proof is malformed or does not verify.' },
  authentication_failed: { status: 401, description: 'The API key is missing, malformed, unknown or revoked.' },
  session_token_expired: { status: 401, description: 'The vault\'s session token has expired: an admin or operator rotates it (`POST /v1/wallets/{wallet_id}/rotate-token`).' },
  policy_violation: { status: 402, description: 'The payment breaks a rule of the vault\'s policy; `violation` names the rule, its limit and the attempted value. Nothing was submitted.' },
  insufficient_permissions: { status: 403, description: 'The API key\'s role does not allow this operation.' },
  session_token_invalid: { status: 403, description: 'The session token is missing or belongs to another vault.' },
  wallet_not_found: { status: 404, description: 'No wallet with this id in your organisation.' },
  policy_not_found: { status: 404, description: 'No policy with this id in your organisation.' },
  escrow_not_found: { status: 404, description: 'No escrow with this id in your organisation.' },
  transaction_not_found: { status: 404, description: 'No transaction with this id in your organisation.' },
  webhook_not_found: { status: 404, description: 'No webhook with this id in your organisation.' },
  export_not_found: { status: 404, description: 'No export with this id in your organisation.' },
  api_key_not_found: { status: 404, description: 'No API key with this id in your organisation.' },
  recipient_not_found: { status: 404, description: 'No recipient with this id in your organisation.' },
  not_found: { status: 404, description: 'No such route or resource.' },
  idempotency_conflict: { status: 409, description: 'This idempotency key was used with other parameters, or its first request is still running.' },
  wallet_agent_id_conflict: { status: 409, description: 'The organisation already has a wallet for this agentId (agent ids are never reused: the vault address derives from them).' },
  wallet_frozen: { status: 422, description: 'The wallet is frozen: unfreeze it first.' },
  wallet_archived: { status: 422, description: 'The wallet is archived: it only answers reads.' },
  wallet_insufficient_balance: { status: 422, description: 'The wallet\'s balance does not cover the amount.' },
  wallet_balance_not_zero: { status: 422, description: 'Only a wallet with a zero balance can be archived: withdraw first.' },
  org_insufficient_balance: { status: 422, description: 'The organisation\'s reserve does not cover the amount.' },
  withdrawal_exceeds_balance: { status: 422, description: 'The withdrawal is larger than the wallet\'s balance.' },
  policy_immutable: { status: 422, description: 'Preset policies cannot be changed or deleted: clone one first.' },
  policy_in_use: { status: 422, description: 'The policy is attached to wallets: attach them elsewhere first.' },
  escrow_expired: { status: 422, description: 'The escrow\'s timeout has passed.' },
  escrow_already_settled: { status: 422, description: 'The escrow was already released, refunded or disputed.' },
  rate_limited: { status: 429, description: 'Too many requests for this API key: wait for the number of seconds in `Retry-After`.' },
  internal_error: { status: 500, description: 'Something went wrong on our side. The request id helps us find it.' },
  service_unavailable: { status: 503, description: 'A dependency (database or chain) is not answering, what the request needs is still under way, or the service is overloaded (refused before anything was done): retry (after `Retry-After` seconds when given) with the same idempotency key.' },
} as const;

export type ErrorCode = keyof typeof ERROR_CODES;

export interface ErrorDetails {
  param?: string;
  violation?: { rule: string; limit: string | number; attempted: string | number };
  wallet_id?: string;
  policy_id?: string;
  [key: string]: unknown;
}

export class ServiceError extends Error {
  /** set when an idempotent replay repeats a stored refusal */
  replayed = false;
  /** seconds until asking again can succeed, sent as `Retry-After` (a `rate_limited` without it says 60) */
  retryAfterS: number | null = null;

  constructor(readonly code: ErrorCode, message: string, readonly details: ErrorDetails = {}) {
    super(message);
    this.name = 'ServiceError';
  }

  get status(): number {
    return ERROR_CODES[this.code].status;
  }
}

/**
 * 503 `service_unavailable` for a request that will succeed once something under way is done (not
 * a dependency down): `Retry-After` says when to ask again, and it is not logged as an outage.
 */
export function retryShortly(message: string, retryAfterS: number, details: Record<string, unknown> = {}): ServiceError {
  const error = new ServiceError('service_unavailable', message, details);
  error.retryAfterS = retryAfterS;
  return error;
}

export function invalidRequest(param: string, message: string): ServiceError {
  return new ServiceError('invalid_request', message, { param });
}
