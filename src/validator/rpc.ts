/**
 * The Solana JSON-RPC subset the service uses, answered from the local validator, plus our
 * `agentVault_*` cheatcodes. Shapes follow a real node's (context {slot}, base64 data, u64 as
 * integers, error objects), so @solana/kit's client cannot tell the difference.
 *
 * `handlePayload` takes and returns objects (the in-process transport; u64 values are bigint),
 * `handle` takes and returns JSON text (the HTTP server).
 */
import { isAddress, type Address, type Signature } from '@solana/kit';
import { decodeBase58, encodeBase58 } from '../chain/base58.ts';
import { stringifyJson } from './json.ts';
import type { TransactionErrorJson } from './transaction-error.ts';
import type { TokenBalance } from './transaction-store.ts';
import {
  LocalValidator,
  MalformedTransactionError,
  PreflightFailureError,
  SignatureVerificationError,
  ValidatorBusyError,
  ValidatorHaltedError,
  ValidatorClosedError,
  TOKEN_PROGRAM,
  type SimulationResult,
} from './validator.ts';
import { parseTokenProgramAccount, tokenAmount } from './parsed-accounts.ts';
import { parseWireTransaction } from './wire.ts';

/**
 * The local validator's own methods (not on real clusters), for @solana/kit typing:
 * `rpc as Rpc<SolanaRpcApi & AgentVaultRpcApi>`. Integers come back as bigint through kit.
 */
export type AgentVaultRpcApi = {
  agentVault_getInfo(): { programId: Address; usdcMint: Address; slotMs: bigint; authority: Address; programDeployed: boolean };
  /** Mints micro-USDC to the owner's associated token account (created when missing). */
  agentVault_mintUsdc(owner: Address, amount: string): Signature;
  /** Moves the validator's clock forward to at least `unixMs` (standalone mode). */
  agentVault_setTime(unixMs: number | bigint): { unixTimestamp: bigint };
};

export const RPC_API_VERSION = '2.2.0';
/** Requests in one batch. */
export const MAX_BATCH_REQUESTS = 1_000;
/** Signatures per getSignatureStatuses, as on a real node. */
export const MAX_SIGNATURE_STATUSES = 256;
/** Accounts per getMultipleAccounts, as on a real node. */
export const MAX_MULTIPLE_ACCOUNTS = 100;
/** A transaction's 1,232 bytes at most, in base58 (sendTransaction's default encoding). */
const MAX_TRANSACTION_BASE58_LENGTH = 1_683;
/** Account data one getMultipleAccounts answers at most (before encoding); more is refused. */
export const MAX_MULTIPLE_ACCOUNTS_DATA_BYTES = 32 * 1024 * 1024;
/** The text of one answer, a batch's included, at most: past it, what is left is refused. */
export const MAX_RESPONSE_BYTES = 64 * 1024 * 1024;
/** Signatures per getSignaturesForAddress, as on a real node (also its default). */
export const MAX_SIGNATURES_FOR_ADDRESS = 1_000;
/** Real nodes refuse base58 account data beyond this. */
const MAX_BASE58_DATA_BYTES = 128;
/** A mint's decimals: the byte after its authority (36) and supply (8). */
const MINT_DECIMALS_OFFSET = 44;
const U64_MAX = (1n << 64n) - 1n;

export const JSON_RPC_ERRORS = {
  parseError: -32700,
  invalidRequest: -32600,
  methodNotFound: -32601,
  invalidParams: -32602,
  internalError: -32603,
  preflightFailure: -32002,
  signatureVerification: -32003,
  nodeUnhealthy: -32005,
  minContextSlotNotReached: -32016,
  unsupportedTransactionVersion: -32015,
} as const;

export interface JsonRpcError {
  code: number;
  message: string;
  data?: unknown;
}

type JsonRpcId = string | number | null;

export interface JsonRpcResponse {
  jsonrpc: '2.0';
  id: JsonRpcId;
  result?: unknown;
  error?: JsonRpcError;
}

class RpcError extends Error {
  constructor(readonly code: number, message: string, readonly data?: unknown) {
    super(message);
  }
}

function invalidParams(message: string): RpcError {
  return new RpcError(JSON_RPC_ERRORS.invalidParams, message);
}

// -----------------------------------------------------------------------------------------------
// Parameter readers

type Params = readonly unknown[];

function configAt(params: Params, index: number): Record<string, unknown> {
  const value = params[index];
  if (value === undefined || value === null) return {};
  if (typeof value !== 'object' || Array.isArray(value)) throw invalidParams(`Invalid params: parameter ${index} must be an object`);
  checkCommitment(value as Record<string, unknown>);
  return value as Record<string, unknown>;
}

function checkCommitment(config: Record<string, unknown>): void {
  for (const key of ['commitment', 'preflightCommitment']) {
    const commitment = config[key];
    if (commitment !== undefined && commitment !== 'processed' && commitment !== 'confirmed' && commitment !== 'finalized') {
      throw invalidParams(`Invalid params: ${key} must be processed, confirmed or finalized`);
    }
  }
}

function stringAt(params: Params, index: number, what: string): string {
  const value = params[index];
  if (typeof value !== 'string') throw invalidParams(`Invalid params: ${what} must be a string`);
  return value;
}

function addressAt(params: Params, index: number): string {
  const value = stringAt(params, index, 'address');
  if (!isAddress(value)) throw invalidParams(`Invalid param: Invalid`);
  return value;
}

/** A transaction signature: base58 of 64 bytes (what a node answers otherwise: -32602). */
function isSignatureText(value: string): boolean {
  return value.length >= 64 && value.length <= 88 && decodeBase58(value)?.length === 64;
}

function integerOf(value: unknown, what: string): bigint {
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' && Number.isInteger(value)) return BigInt(value);
  throw invalidParams(`Invalid params: ${what} must be an integer`);
}

/** An optional signature parameter (`before`, `until`): base58 of 64 bytes. */
function signatureOf(value: unknown, what: string): string | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'string') throw invalidParams(`Invalid params: ${what} must be a string`);
  const bytes = decodeBase58(value);
  if (!bytes || bytes.length !== 64) throw invalidParams(`Invalid param: ${what} is not a signature`);
  return value;
}

function booleanOf(value: unknown, what: string, fallback: boolean): boolean {
  if (value === undefined || value === null) return fallback;
  if (typeof value !== 'boolean') throw invalidParams(`Invalid params: ${what} must be a boolean`);
  return value;
}

function decodeTransaction(text: string, encoding: unknown): Uint8Array {
  let bytes: Uint8Array | null;
  if (encoding === undefined || encoding === null || encoding === 'base58') {
    bytes = decodeBase58(text, MAX_TRANSACTION_BASE58_LENGTH);
    if (!bytes) throw invalidParams('invalid base58 encoding: InvalidCharacter');
  } else if (encoding === 'base64') {
    if (!/^[A-Za-z0-9+/]*={0,2}$/.test(text)) throw invalidParams('invalid base64 encoding');
    bytes = new Uint8Array(Buffer.from(text, 'base64'));
  } else {
    throw invalidParams(`unsupported encoding: ${String(encoding)}. Supported encodings: base58, base64`);
  }
  return bytes;
}

// -----------------------------------------------------------------------------------------------
// Response pieces

function base64(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('base64');
}

function simulationValue(result: SimulationResult): Record<string, unknown> {
  return {
    err: result.err,
    logs: result.logs,
    accounts: null,
    unitsConsumed: result.unitsConsumed,
    returnData: result.returnData ? { programId: result.returnData.programId, data: [base64(result.returnData.data), 'base64'] } : null,
    innerInstructions: null,
    replacementBlockhash: null,
  };
}

function statusOf(err: TransactionErrorJson | null): Record<string, unknown> {
  return err === null ? { Ok: null } : { Err: err };
}

/** What one answer may weigh (tests set them low). */
export interface RpcLimits {
  responseBytes: number;
  multipleAccountsDataBytes: number;
}

export interface RpcHandlerOptions {
  log?: (entry: Record<string, unknown>) => void;
  limits?: Partial<RpcLimits>;
}

export class RpcHandler {
  readonly #validator: LocalValidator;
  readonly #methods: Record<string, (params: Params) => unknown>;

  readonly #log: (entry: Record<string, unknown>) => void;
  readonly #limits: RpcLimits;

  constructor(validator: LocalValidator, options: RpcHandlerOptions = {}) {
    this.#validator = validator;
    this.#log = options.log ?? (() => {});
    this.#limits = {
      responseBytes: options.limits?.responseBytes ?? MAX_RESPONSE_BYTES,
      multipleAccountsDataBytes: options.limits?.multipleAccountsDataBytes ?? MAX_MULTIPLE_ACCOUNTS_DATA_BYTES,
    };
    const v = validator;
    this.#methods = {
      getHealth: () => {
        v.assertHealthy();
        return 'ok';
      },
      getVersion: () => ({ 'solana-core': RPC_API_VERSION, 'feature-set': 0 }),
      getGenesisHash: () => v.genesisHash,
      getSlot: (p) => {
        this.#readContextConfig(p, 0);
        return v.slot;
      },
      getBlockHeight: (p) => {
        this.#readContextConfig(p, 0);
        return v.blockHeight;
      },
      getLatestBlockhash: (p) => {
        this.#readContextConfig(p, 0);
        const latest = v.latestBlockhash();
        return this.#withContext({ blockhash: latest.blockhash, lastValidBlockHeight: latest.lastValidBlockHeight }, latest.slot);
      },
      isBlockhashValid: (p) => {
        const blockhash = stringAt(p, 0, 'blockhash');
        this.#readContextConfig(p, 1);
        return this.#withContext(v.isBlockhashValid(blockhash));
      },
      getMinimumBalanceForRentExemption: (p) => {
        const length = integerOf(p[0], 'data length');
        if (length < 0n || length > 10n * 1024n * 1024n) throw invalidParams('Invalid params: data length out of range');
        configAt(p, 1);
        return v.minimumBalanceForRentExemption(Number(length));
      },
      getBalance: (p) => {
        const address = addressAt(p, 0);
        this.#readContextConfig(p, 1);
        return this.#withContext(v.getBalance(address));
      },
      getAccountInfo: (p) => {
        const address = addressAt(p, 0);
        const config = this.#readContextConfig(p, 1);
        return this.#withContext(this.#account(address, config));
      },
      getMultipleAccounts: (p) => {
        const addresses = p[0];
        if (!Array.isArray(addresses) || addresses.some((a) => typeof a !== 'string' || !isAddress(a))) {
          throw invalidParams('Invalid params: expected an array of addresses');
        }
        if (addresses.length > MAX_MULTIPLE_ACCOUNTS) {
          throw invalidParams(`Too many inputs provided; max ${MAX_MULTIPLE_ACCOUNTS}`);
        }
        const config = this.#readContextConfig(p, 1);
        // The same address a hundred times over a 10 MB account would answer 1.3 GB of text.
        const slice = config['dataSlice'] as { offset?: unknown; length?: unknown } | null | undefined;
        const sliced = (length: number) => (slice && typeof slice === 'object'
          ? Math.max(0, Math.min(Number(slice.length) || 0, length - (Number(slice.offset) || 0))) : length);
        let dataBytes = 0;
        for (const a of addresses as string[]) dataBytes += sliced(this.#validator.getAccount(a)?.data.length ?? 0);
        if (dataBytes > this.#limits.multipleAccountsDataBytes) {
          throw invalidParams(`Invalid params: the accounts hold ${dataBytes} bytes of data, more than ${this.#limits.multipleAccountsDataBytes} `
            + 'in one answer: ask for fewer, or use dataSlice');
        }
        return this.#withContext((addresses as string[]).map((a) => this.#account(a, config)));
      },
      getTokenAccountBalance: (p) => {
        const address = addressAt(p, 0);
        this.#readContextConfig(p, 1);
        if (!v.getAccount(address)) throw invalidParams('Invalid param: could not find account');
        const token = v.tokenAccount(address);
        if (!token) throw invalidParams('Invalid param: not a Token account');
        return this.#withContext(tokenAmount(token.amount, token.decimals));
      },
      getSignatureStatuses: (p) => {
        const signatures = p[0];
        if (!Array.isArray(signatures) || signatures.some((s) => typeof s !== 'string')) {
          throw invalidParams('Invalid params: expected an array of signatures');
        }
        if (signatures.length > MAX_SIGNATURE_STATUSES) throw invalidParams(`Too many inputs provided; max ${MAX_SIGNATURE_STATUSES}`);
        if (signatures.some((s) => !isSignatureText(s))) throw invalidParams('Invalid param: Invalid signature');
        const config = configAt(p, 1);
        booleanOf(config['searchTransactionHistory'], 'searchTransactionHistory', false);
        const slot = v.slot;
        return this.#withContext((signatures as string[]).map((signature) => {
          const found = v.transaction(signature);
          if (!found) return null;
          const { record } = found;
          return { slot: record.slot, confirmations: null, err: record.err, status: statusOf(record.err), confirmationStatus: 'finalized' };
        }), slot);
      },
      getTransaction: (p) => this.#getTransaction(p),
      getSignaturesForAddress: (p) => {
        const address = addressAt(p, 0);
        const config = this.#readContextConfig(p, 1);
        if (config['commitment'] === 'processed') throw invalidParams('Method does not support commitment below `confirmed`');
        const limit = config['limit'] === undefined || config['limit'] === null
          ? BigInt(MAX_SIGNATURES_FOR_ADDRESS) : integerOf(config['limit'], 'limit');
        if (limit < 1n || limit > BigInt(MAX_SIGNATURES_FOR_ADDRESS)) {
          throw invalidParams(`Invalid limit; max ${MAX_SIGNATURES_FOR_ADDRESS}`);
        }
        const before = signatureOf(config['before'], 'before');
        const until = signatureOf(config['until'], 'until');
        // Every visible transaction is final here; memos are not extracted (always null).
        return v.signaturesForAddress(address, { limit: Number(limit), before, until }).map((record) => ({
          signature: record.signature, slot: record.slot, err: record.err, memo: null, blockTime: record.blockTime,
          confirmationStatus: 'finalized',
        }));
      },
      sendTransaction: (p) => {
        const text = stringAt(p, 0, 'transaction');
        const config = configAt(p, 1);
        const bytes = decodeTransaction(text, config['encoding']);
        const skipPreflight = booleanOf(config['skipPreflight'], 'skipPreflight', false);
        this.#checkMinContextSlot(config);
        try {
          return v.sendTransaction(bytes, { skipPreflight });
        } catch (error) {
          if (error instanceof PreflightFailureError) {
            throw new RpcError(JSON_RPC_ERRORS.preflightFailure, error.message, simulationValue(error.simulation));
          }
          if (error instanceof SignatureVerificationError) throw new RpcError(JSON_RPC_ERRORS.signatureVerification, error.message);
          throw error;
        }
      },
      simulateTransaction: (p) => {
        const text = stringAt(p, 0, 'transaction');
        const config = configAt(p, 1);
        const bytes = decodeTransaction(text, config['encoding']);
        const sigVerify = booleanOf(config['sigVerify'], 'sigVerify', false);
        const replaceRecentBlockhash = booleanOf(config['replaceRecentBlockhash'], 'replaceRecentBlockhash', false);
        if (sigVerify && replaceRecentBlockhash) throw invalidParams('sigVerify may not be used with replaceRecentBlockhash');
        this.#checkMinContextSlot(config);
        const result = v.simulateTransaction(bytes, { sigVerify, replaceRecentBlockhash });
        return this.#withContext({ ...simulationValue(result), replacementBlockhash: result.replacementBlockhash });
      },
      requestAirdrop: async (p) => {
        const address = addressAt(p, 0);
        const lamports = integerOf(p[1], 'lamports');
        configAt(p, 2);
        if (lamports <= 0n || lamports > U64_MAX) throw invalidParams('Invalid params: lamports must be a positive u64');
        return v.requestAirdrop(address as Address, lamports);
      },

      agentVault_getInfo: () => {
        const info = v.info();
        return { programId: info.programId, usdcMint: info.usdcMint, slotMs: info.slotMs, authority: info.authority, programDeployed: info.programDeployed };
      },
      agentVault_mintUsdc: async (p) => {
        const owner = addressAt(p, 0);
        const amountText = stringAt(p, 1, 'amount');
        if (!/^[0-9]{1,20}$/.test(amountText)) throw invalidParams('Invalid params: amount must be an integer string of micro-USDC');
        const amount = BigInt(amountText);
        if (amount <= 0n || amount > U64_MAX) throw invalidParams('Invalid params: amount must be a positive u64');
        return v.mintUsdc(owner as Address, amount);
      },
      agentVault_setTime: (p) => {
        const unixMs = integerOf(p[0], 'unixMs');
        if (unixMs < 0n || unixMs > 8_640_000_000_000_000n) throw invalidParams('Invalid params: unixMs out of range');
        try {
          v.setTime(Number(unixMs));
        } catch (error) {
          throw invalidParams((error as Error).message);
        }
        return { unixTimestamp: v.clockUnixTimestamp };
      },
    };
  }

  #withContext(value: unknown, slot: number = this.#validator.slot): { context: { slot: number; apiVersion: string }; value: unknown } {
    return { context: { slot, apiVersion: RPC_API_VERSION }, value };
  }

  #readContextConfig(params: Params, index: number): Record<string, unknown> {
    const config = configAt(params, index);
    this.#checkMinContextSlot(config);
    return config;
  }

  #checkMinContextSlot(config: Record<string, unknown>): void {
    if (config['minContextSlot'] === undefined || config['minContextSlot'] === null) return;
    const minContextSlot = integerOf(config['minContextSlot'], 'minContextSlot');
    const slot = this.#validator.slot;
    if (minContextSlot > BigInt(slot)) {
      throw new RpcError(JSON_RPC_ERRORS.minContextSlotNotReached, 'Minimum context slot has not been reached', { contextSlot: slot });
    }
  }

  #account(address: string, config: Record<string, unknown>): Record<string, unknown> | null {
    const account = this.#validator.getAccount(address);
    if (!account) return null;
    let data = account.data;
    const slice = config['dataSlice'];
    if (slice !== undefined && slice !== null) {
      if (typeof slice !== 'object') throw invalidParams('Invalid params: dataSlice must be an object');
      const offset = Number(integerOf((slice as Record<string, unknown>)['offset'], 'dataSlice.offset'));
      const length = Number(integerOf((slice as Record<string, unknown>)['length'], 'dataSlice.length'));
      if (offset < 0 || length < 0) throw invalidParams('Invalid params: dataSlice must not be negative');
      data = data.subarray(Math.min(offset, data.length), Math.min(offset + length, data.length));
    }
    const encoding = config['encoding'];
    let encoded: unknown;
    // jsonParsed: token accounts and mints parsed (whole, not sliced); any other account falls
    // back to base64, as a real node does for accounts it cannot parse.
    const parsed = encoding === 'jsonParsed' && data === account.data && account.owner === TOKEN_PROGRAM
      ? parseTokenProgramAccount(data, (mint) => this.#validator.getAccount(mint)?.data[MINT_DECIMALS_OFFSET] ?? 0) : null;
    if (parsed) encoded = parsed;
    else if (encoding === 'base64' || encoding === 'jsonParsed') encoded = [base64(data), 'base64'];
    else if (encoding === 'base58' || encoding === undefined || encoding === null || encoding === 'binary') {
      if (data.length > MAX_BASE58_DATA_BYTES) {
        throw new RpcError(JSON_RPC_ERRORS.invalidRequest,
          `Encoded binary (base 58) data should be less than ${MAX_BASE58_DATA_BYTES} bytes, please use Base64 encoding.`);
      }
      encoded = encoding === 'base58' ? [encodeBase58(data), 'base58'] : encodeBase58(data);
    } else {
      throw invalidParams(`Invalid params: unsupported encoding ${String(encoding)}`);
    }
    return {
      data: encoded,
      executable: account.executable,
      lamports: account.lamports,
      owner: account.owner,
      rentEpoch: account.rentEpoch,
      space: BigInt(account.data.length),
    };
  }

  #getTransaction(p: Params): unknown {
    const signature = stringAt(p, 0, 'signature');
    if (!isSignatureText(signature)) throw invalidParams('Invalid param: Invalid signature');
    // The legacy form passes the encoding as a bare string.
    const config = typeof p[1] === 'string' ? { encoding: p[1] } : configAt(p, 1);
    if (config['commitment'] === 'processed') throw invalidParams('Method does not support commitment below `confirmed`');
    const encoding = config['encoding'] ?? 'json';
    if (!['json', 'jsonParsed', 'base64', 'base58'].includes(encoding as string)) {
      throw invalidParams(`Invalid params: unsupported encoding ${String(encoding)}`);
    }
    const maxVersion = config['maxSupportedTransactionVersion'];
    if (maxVersion !== undefined && maxVersion !== null && Number(integerOf(maxVersion, 'maxSupportedTransactionVersion')) !== 0) {
      throw invalidParams('Invalid params: maxSupportedTransactionVersion must be 0');
    }
    const found = this.#validator.transaction(signature);
    if (!found || !found.detail) return null;
    const { record, detail } = found;
    const tx = parseWireTransaction(detail.wire);
    if (tx.version === 0 && (maxVersion === undefined || maxVersion === null)) {
      throw new RpcError(JSON_RPC_ERRORS.unsupportedTransactionVersion,
        'Transaction version (0) is not supported by the requesting client. Please try the request again with the '
        + 'following configuration parameter: "maxSupportedTransactionVersion": 0');
    }
    const withVersion = maxVersion !== undefined && maxVersion !== null;
    let transaction: unknown;
    if (encoding === 'base64') transaction = [base64(detail.wire), 'base64'];
    else if (encoding === 'base58') transaction = [encodeBase58(detail.wire), 'base58'];
    else {
      const message: Record<string, unknown> = {
        accountKeys: tx.accountKeys.map(encodeBase58),
        header: {
          numReadonlySignedAccounts: tx.numReadonlySignedAccounts,
          numReadonlyUnsignedAccounts: tx.numReadonlyUnsignedAccounts,
          numRequiredSignatures: tx.numRequiredSignatures,
        },
        instructions: tx.instructions.map((ix) => ({
          accounts: [...ix.accounts], data: encodeBase58(ix.data), programIdIndex: ix.programIdIndex, stackHeight: null,
        })),
        recentBlockhash: encodeBase58(tx.recentBlockhash),
      };
      if (withVersion && tx.version === 0) {
        message['addressTableLookups'] = tx.addressTableLookups.map((l) => ({
          accountKey: encodeBase58(l.accountKey), readonlyIndexes: [...l.readonlyIndexes], writableIndexes: [...l.writableIndexes],
        }));
      }
      const signatures: string[] = [];
      for (let i = 0; i < tx.signatureCount; i++) signatures.push(encodeBase58(detail.wire.subarray(1 + 64 * i, 65 + 64 * i)));
      transaction = { message, signatures };
    }
    const meta: Record<string, unknown> = {
      err: record.err,
      status: statusOf(record.err),
      fee: BigInt(record.fee),
      preBalances: detail.preBalances,
      postBalances: detail.postBalances,
      innerInstructions: [],
      logMessages: detail.logs,
      preTokenBalances: detail.preTokenBalances.map(tokenBalanceJson),
      postTokenBalances: detail.postTokenBalances.map(tokenBalanceJson),
      rewards: [],
      computeUnitsConsumed: BigInt(record.computeUnits),
    };
    if (withVersion) meta['loadedAddresses'] = { readonly: [], writable: [] };
    const response: Record<string, unknown> = { blockTime: record.blockTime, meta, slot: record.slot, transaction };
    if (withVersion) response['version'] = tx.version;
    return response;
  }

  /** One request object or a batch; objects with bigint u64 values. Notifications get no answer. */
  async handlePayload(payload: unknown): Promise<JsonRpcResponse | JsonRpcResponse[] | null> {
    if (Array.isArray(payload)) {
      if (payload.length === 0) return this.#error(null, JSON_RPC_ERRORS.invalidRequest, 'Invalid request');
      if (payload.length > MAX_BATCH_REQUESTS) {
        return this.#error(null, JSON_RPC_ERRORS.invalidRequest, `Invalid request: more than ${MAX_BATCH_REQUESTS} requests in a batch`);
      }
      const responses: JsonRpcResponse[] = [];
      // In order: a batch may send a transaction and then ask for its status.
      for (const request of payload) {
        const response = await this.#handleOne(request);
        if (response) responses.push(response);
      }
      return responses.length > 0 ? responses : null;
    }
    return this.#handleOne(payload);
  }

  /** JSON text in, JSON text out ('' when there is nothing to answer). */
  async handle(requestJson: string): Promise<string> {
    let payload: unknown;
    try {
      payload = JSON.parse(requestJson);
    } catch {
      return stringifyJson(this.#error(null, JSON_RPC_ERRORS.parseError, 'Parse error'));
    }
    if (!Array.isArray(payload) || payload.length === 0 || payload.length > MAX_BATCH_REQUESTS) {
      const response = await this.handlePayload(payload);
      return response === null ? '' : this.#bounded(stringifyJson(response), Array.isArray(response) ? null : response.id);
    }
    // A batch's answers are turned into text one by one, so that what it holds stays bounded: past
    // MAX_RESPONSE_BYTES, the requests left are answered with an error instead of run.
    const texts: string[] = [];
    let bytes = 2;
    for (const request of payload) {
      const id = request && typeof request === 'object' && 'id' in request ? (request as { id: unknown }).id : null;
      const validId = typeof id === 'string' || typeof id === 'number' ? id : null;
      let text: string;
      if (bytes > this.#limits.responseBytes) {
        // A notification gets no answer, run or not.
        if (request && typeof request === 'object' && !Array.isArray(request) && !('id' in request)) continue;
        text = stringifyJson(this.#error(validId, JSON_RPC_ERRORS.internalError,
          `The batch's answers passed ${this.#limits.responseBytes} bytes: this request was not run; send fewer per batch.`));
      } else {
        const response = await this.#handleOne(request);
        if (!response) continue;
        text = this.#bounded(stringifyJson(response), validId);
      }
      texts.push(text);
      bytes += text.length + 1;
    }
    return texts.length ? `[${texts.join(',')}]` : '';
  }

  /** An answer's text, or an error in its place when it alone passes MAX_RESPONSE_BYTES. */
  #bounded(text: string, id: JsonRpcId): string {
    if (text.length <= this.#limits.responseBytes) return text;
    return stringifyJson(this.#error(id, JSON_RPC_ERRORS.internalError, `The answer passes ${this.#limits.responseBytes} bytes.`));
  }

  #error(id: JsonRpcId, code: number, message: string, data?: unknown): JsonRpcResponse {
    const error: JsonRpcError = { code, message };
    if (data !== undefined) error.data = data;
    return { jsonrpc: '2.0', id, error };
  }

  async #handleOne(request: unknown): Promise<JsonRpcResponse | null> {
    if (!request || typeof request !== 'object' || Array.isArray(request)) {
      return this.#error(null, JSON_RPC_ERRORS.invalidRequest, 'Invalid request');
    }
    const { jsonrpc, id, method, params } = request as Record<string, unknown>;
    const validId = typeof id === 'string' || typeof id === 'number' || id === null ? id : undefined;
    if (jsonrpc !== '2.0' || typeof method !== 'string' || (id !== undefined && validId === undefined)) {
      return this.#error(validId ?? null, JSON_RPC_ERRORS.invalidRequest, 'Invalid request');
    }
    const isNotification = id === undefined;
    const handler = Object.hasOwn(this.#methods, method) ? this.#methods[method] : undefined;
    if (!handler) return isNotification ? null : this.#error(validId ?? null, JSON_RPC_ERRORS.methodNotFound, 'Method not found');
    if (params !== undefined && params !== null && !Array.isArray(params)) {
      return this.#error(validId ?? null, JSON_RPC_ERRORS.invalidParams, 'Invalid params: params must be an array');
    }
    try {
      const result = await handler((params as Params | undefined) ?? []);
      return isNotification ? null : { jsonrpc: '2.0', id: validId ?? null, result };
    } catch (error) {
      const [code, message, data] = errorParts(error);
      if (code === JSON_RPC_ERRORS.internalError) this.#log({ level: 'error', msg: 'rpc method failed', method, err: String(error) });
      if (isNotification) return null;
      return this.#error(validId ?? null, code, message, data);
    }
  }
}

function errorParts(error: unknown): [number, string, unknown?] {
  if (error instanceof RpcError) return [error.code, error.message, error.data];
  if (error instanceof MalformedTransactionError) return [JSON_RPC_ERRORS.invalidParams, `invalid transaction: ${error.message}`];
  if (error instanceof RangeError) return [JSON_RPC_ERRORS.invalidParams, `Invalid params: ${error.message}`];
  if (error instanceof ValidatorBusyError || error instanceof ValidatorClosedError || error instanceof ValidatorHaltedError) {
    return [JSON_RPC_ERRORS.nodeUnhealthy, error.message];
  }
  return [JSON_RPC_ERRORS.internalError, 'Internal error'];
}

function tokenBalanceJson(balance: TokenBalance): Record<string, unknown> {
  return {
    accountIndex: balance.accountIndex, mint: encodeBase58(balance.mint), owner: encodeBase58(balance.owner), programId: balance.programId,
    uiTokenAmount: tokenAmount(balance.amount, balance.decimals),
  };
}

export function createRpcHandler(validator: LocalValidator, options: RpcHandlerOptions = {}): RpcHandler {
  return new RpcHandler(validator, options);
}
