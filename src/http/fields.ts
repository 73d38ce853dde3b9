/**
 * Request fields whose malformed value has a code of its own in the closed list (SPEC.md's
 * payment rules): a JSON number, an empty string or an over-long value for `amount`, `currency`
 * or a payment's `to` fails the schema, yet answers `invalid_amount`, `invalid_currency` or
 * `invalid_recipient`, as a badly written value does, rather than `invalid_request`. The schema
 * names the code (`x-error-code`, an OpenAPI extension); app.ts reads it from the failing schema.
 * Likewise a string with a pattern carries what the pattern asks for in words
 * (`x-pattern-text`), which a refusal says instead of the expression. And one parser serves
 * every amount field (`amountOf`).
 */
import { Type, type TString } from 'typebox';
import { ServiceError, type ErrorCode } from '../errors/errors.ts';
import { AMOUNT_TEXT_MAX, MAX_MICRO_USDC, formatUsdc, parseUsdc } from '../money/money.ts';

/** Currency codes are short (only `USDC` is taken); a longer value is refused by the schema. */
const CURRENCY_TEXT_MAX = 16;

export const ERROR_CODE_KEYWORD = 'x-error-code';
/** What a string's `pattern` asks for, in words: a refusal says it instead of the regular expression. */
export const PATTERN_TEXT_KEYWORD = 'x-pattern-text';

/** A string that must match `pattern`; refused, it is told `text` ("must …"). */
export function patternString(
  pattern: string, text: string, options: { description?: string; minLength?: number; maxLength?: number } = {},
): TString {
  return Type.String({ ...options, pattern, [PATTERN_TEXT_KEYWORD]: text });
}

/** Text people write (a reason): at least one character that is not a space. */
export const NOT_BLANK_PATTERN = '\\S';
/** A name people give (an API key's, a verifier's, an organisation's): not blank, no control characters. */
export const NAME_PATTERN = '^(?=.*\\S)[^\\u0000-\\u001f\\u007f]+$';
export const NAME_TEXT = 'must not be blank nor hold control characters';

function codedString(code: ErrorCode, options: { description?: string; minLength?: number; maxLength?: number }): TString {
  return Type.String({ ...options, [ERROR_CODE_KEYWORD]: code });
}

/** Decimal USDC as a string (never a JSON number: docs/decisions.md). */
export const amountField = (description = 'decimal USDC, at most 6 decimals'): TString =>
  codedString('invalid_amount', { maxLength: AMOUNT_TEXT_MAX, description });

/**
 * A USDC amount field's value in micro-USDC, or `invalid_amount` naming the field and what it
 * may be (`alternative`: another value it takes, said after the amount).
 */
export function amountOf(text: string, param: string, { allowZero = false, alternative = '' } = {}): bigint {
  const amount = parseUsdc(text, { allowZero });
  if (amount === null) {
    throw new ServiceError('invalid_amount', `${param} must be a ${allowZero ? '' : 'positive '}decimal string of USDC${alternative}: `
      + `at most 6 decimals and ${formatUsdc(MAX_MICRO_USDC)}, no sign, exponent or spaces.`, { param });
  }
  return amount;
}

export const currencyField = (description = 'USDC'): TString => codedString('invalid_currency', { maxLength: CURRENCY_TEXT_MAX, description });

/** A payment's recipient: a chain address or a domain of the recipient directory (an escrow's: a vault id or an address). */
export const recipientField = (description: string, maxLength = 253): TString =>
  codedString('invalid_recipient', { minLength: 1, maxLength, description });

/** The body of an endpoint that takes no field: none, or `{}`; a field sent is refused, not ignored. */
export const NoFields = Type.Object({}, { additionalProperties: false });
