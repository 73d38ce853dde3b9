/**
 * Reads the parts of a wire transaction the validator needs (signatures, header, static account
 * keys, blockhash, instructions) without building @solana/kit objects: this runs once per
 * submitted transaction, on the hot path.
 */
import { decodeBase58, encodeBase58 } from '../chain/base58.ts';

/** Solana's packet limit: a wire transaction is at most 1232 bytes. */
export const MAX_TRANSACTION_BYTES = 1232;

export interface WireInstruction {
  programIdIndex: number;
  accounts: Uint8Array;
  data: Uint8Array;
}

export interface WireTransaction {
  bytes: Uint8Array;
  /** base58 of the first signature: the transaction's id. */
  signature: string;
  signatureCount: number;
  version: 'legacy' | 0;
  numRequiredSignatures: number;
  numReadonlySignedAccounts: number;
  numReadonlyUnsignedAccounts: number;
  /** The static account keys, 32 bytes each (address-table lookups are not resolved here). */
  accountKeys: Uint8Array[];
  recentBlockhash: Uint8Array;
  instructions: WireInstruction[];
  /** Present for version 0 messages. */
  addressTableLookups: { accountKey: Uint8Array; writableIndexes: Uint8Array; readonlyIndexes: Uint8Array }[];
}

export class MalformedTransactionError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'MalformedTransactionError';
  }
}

class Reader {
  offset = 0;
  constructor(readonly bytes: Uint8Array) {}

  u8(): number {
    if (this.offset >= this.bytes.length) throw new MalformedTransactionError('transaction is truncated');
    return this.bytes[this.offset++]!;
  }

  /** Solana's compact-u16 length prefix. */
  shortVec(): number {
    let value = 0;
    for (let shift = 0; shift < 21; shift += 7) {
      const byte = this.u8();
      value |= (byte & 0x7f) << shift;
      if ((byte & 0x80) === 0) return value;
    }
    throw new MalformedTransactionError('invalid compact-u16 length');
  }

  take(length: number): Uint8Array {
    const end = this.offset + length;
    if (end > this.bytes.length) throw new MalformedTransactionError('transaction is truncated');
    const slice = this.bytes.subarray(this.offset, end);
    this.offset = end;
    return slice;
  }
}

export function parseWireTransaction(bytes: Uint8Array): WireTransaction {
  if (bytes.length > MAX_TRANSACTION_BYTES) {
    throw new MalformedTransactionError(`transaction is ${bytes.length} bytes, the limit is ${MAX_TRANSACTION_BYTES}`);
  }
  const reader = new Reader(bytes);
  const signatureCount = reader.shortVec();
  if (signatureCount === 0) throw new MalformedTransactionError('transaction has no signature');
  const firstSignature = reader.take(64);
  reader.take(64 * (signatureCount - 1));
  if (firstSignature.every((b) => b === 0)) throw new MalformedTransactionError('transaction is not signed');

  let version: 'legacy' | 0 = 'legacy';
  const prefix = bytes[reader.offset];
  if (prefix !== undefined && (prefix & 0x80) !== 0) {
    if ((prefix & 0x7f) !== 0) throw new MalformedTransactionError(`unsupported transaction version ${prefix & 0x7f}`);
    version = 0;
    reader.offset++;
  }
  const numRequiredSignatures = reader.u8();
  const numReadonlySignedAccounts = reader.u8();
  const numReadonlyUnsignedAccounts = reader.u8();
  if (numRequiredSignatures !== signatureCount) {
    throw new MalformedTransactionError(`transaction needs ${numRequiredSignatures} signatures and carries ${signatureCount}`);
  }
  const keyCount = reader.shortVec();
  if (keyCount < numRequiredSignatures || keyCount === 0) throw new MalformedTransactionError('too few account keys');
  const accountKeys: Uint8Array[] = [];
  for (let i = 0; i < keyCount; i++) accountKeys.push(reader.take(32));
  const recentBlockhash = reader.take(32);
  const instructionCount = reader.shortVec();
  const instructions: WireInstruction[] = [];
  for (let i = 0; i < instructionCount; i++) {
    const programIdIndex = reader.u8();
    const accounts = reader.take(reader.shortVec());
    const data = reader.take(reader.shortVec());
    instructions.push({ programIdIndex, accounts, data });
  }
  const addressTableLookups: WireTransaction['addressTableLookups'] = [];
  if (version === 0) {
    const lookupCount = reader.shortVec();
    for (let i = 0; i < lookupCount; i++) {
      const accountKey = reader.take(32);
      const writableIndexes = reader.take(reader.shortVec());
      const readonlyIndexes = reader.take(reader.shortVec());
      addressTableLookups.push({ accountKey, writableIndexes, readonlyIndexes });
    }
  }
  if (reader.offset !== bytes.length) throw new MalformedTransactionError('trailing bytes after the message');
  return {
    bytes,
    signature: encodeBase58(firstSignature),
    signatureCount,
    version,
    numRequiredSignatures,
    numReadonlySignedAccounts,
    numReadonlyUnsignedAccounts,
    accountKeys,
    recentBlockhash,
    instructions,
    addressTableLookups,
  };
}

/** All signatures of a transaction, base58. */
export function signaturesOf(tx: WireTransaction): string[] {
  const out: string[] = [];
  // The signatures follow the compact-u16 count, which is one byte for fewer than 128.
  const start = tx.signatureCount < 128 ? 1 : 2;
  for (let i = 0; i < tx.signatureCount; i++) out.push(encodeBase58(tx.bytes.subarray(start + 64 * i, start + 64 * (i + 1))));
  return out;
}

const COMPUTE_BUDGET_PROGRAM = decodeBase58('ComputeBudget111111111111111111111111111111')!;

export function bytesEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}
const LAMPORTS_PER_SIGNATURE = 5000n;
const DEFAULT_INSTRUCTION_COMPUTE_UNITS = 200_000n;
const MAX_COMPUTE_UNITS = 1_400_000n;

/**
 * The fee the runtime charges: 5,000 lamports per signature plus the prioritisation fee
 * (compute-unit price × limit, rounded up), read from the Compute Budget instructions.
 */
export function feeOf(tx: WireTransaction): bigint {
  let price = 0n;
  let limit: bigint | null = null;
  let otherInstructions = 0n;
  for (const ix of tx.instructions) {
    const key = tx.accountKeys[ix.programIdIndex];
    if (key && bytesEqual(key, COMPUTE_BUDGET_PROGRAM)) {
      const view = new DataView(ix.data.buffer, ix.data.byteOffset, ix.data.byteLength);
      if (ix.data[0] === 2 && ix.data.length >= 5) limit = BigInt(view.getUint32(1, true));
      else if (ix.data[0] === 3 && ix.data.length >= 9) price = view.getBigUint64(1, true);
    } else {
      otherInstructions++;
    }
  }
  const signatureFee = LAMPORTS_PER_SIGNATURE * BigInt(tx.signatureCount);
  if (price === 0n) return signatureFee;
  const units = limit ?? (otherInstructions * DEFAULT_INSTRUCTION_COMPUTE_UNITS < MAX_COMPUTE_UNITS
    ? otherInstructions * DEFAULT_INSTRUCTION_COMPUTE_UNITS : MAX_COMPUTE_UNITS);
  return signatureFee + (price * units + 999_999n) / 1_000_000n;
}
