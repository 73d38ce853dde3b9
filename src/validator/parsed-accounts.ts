/**
 * `encoding: "jsonParsed"` for the accounts a Solana client parses most: SPL Token accounts and
 * mints, in the shape a cluster's RPC answers (`{program: "spl-token", parsed: {type, info},
 * space}`). Any other account falls back to base64, as a cluster does for a program it has no
 * parser for.
 */
import { encodeBase58 } from '../chain/base58.ts';

const TOKEN_ACCOUNT_BYTES = 165;
const MINT_BYTES = 82;
const TOKEN_ACCOUNT_STATES = ['uninitialized', 'initialized', 'frozen'] as const;

/** A token amount as the RPC writes one: raw, decimals, and the decimal text (trailing zeros dropped). */
export function tokenAmount(amount: bigint, decimals: number): Record<string, unknown> {
  const text = amount.toString().padStart(decimals + 1, '0');
  const whole = text.slice(0, text.length - decimals);
  const fraction = decimals > 0 ? text.slice(text.length - decimals).replace(/0+$/, '') : '';
  const uiAmountString = fraction ? `${whole}.${fraction}` : whole;
  return { amount: amount.toString(), decimals, uiAmount: Number(uiAmountString), uiAmountString };
}

/**
 * The parsed form of a Token program account's data, or null when it is neither a token account
 * nor a mint. `decimalsOf(mint)` reads a mint's decimals (a token account's amounts need them).
 */
export function parseTokenProgramAccount(
  data: Uint8Array, decimalsOf: (mint: string) => number,
): Record<string, unknown> | null {
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const key = (offset: number) => encodeBase58(data.subarray(offset, offset + 32));
  // COption<Pubkey>: a u32 tag (1 = some), then the key.
  const optionalKey = (offset: number) => (view.getUint32(offset, true) === 1 ? key(offset + 4) : null);
  if (data.length === TOKEN_ACCOUNT_BYTES) {
    const state = TOKEN_ACCOUNT_STATES[data[108]!];
    if (state === undefined || state === 'uninitialized') return null;
    const mint = key(0);
    const decimals = decimalsOf(mint);
    const info: Record<string, unknown> = {
      isNative: view.getUint32(109, true) === 1,
      mint,
      owner: key(32),
      state,
      tokenAmount: tokenAmount(view.getBigUint64(64, true), decimals),
    };
    const delegate = optionalKey(72);
    if (delegate !== null) {
      info.delegate = delegate;
      info.delegatedAmount = tokenAmount(view.getBigUint64(121, true), decimals);
    }
    if (info.isNative) info.rentExemptReserve = tokenAmount(view.getBigUint64(113, true), decimals);
    const closeAuthority = optionalKey(129);
    if (closeAuthority !== null) info.closeAuthority = closeAuthority;
    return { program: 'spl-token', parsed: { type: 'account', info }, space: BigInt(data.length) };
  }
  if (data.length === MINT_BYTES && data[45] === 1) {
    return {
      program: 'spl-token',
      parsed: {
        type: 'mint',
        info: {
          decimals: data[44],
          freezeAuthority: optionalKey(46),
          isInitialized: true,
          mintAuthority: optionalKey(0),
          supply: view.getBigUint64(36, true).toString(),
        },
      },
      space: BigInt(data.length),
    };
  }
  return null;
}
