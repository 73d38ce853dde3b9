/**
 * Signing on the payment hot path, byte-identical to @solana/kit (signing.test.ts compares
 * every byte and signature). Kit is slow for a service that signs a transaction per payment:
 * its compiler builds an `Intl.Collator` on every call to order the accounts, its encoder turns
 * every address from base58 with BigInt arithmetic (~33 µs each, ~0.4 ms for a pay
 * transaction's eleven keys), and its signer goes through WebCrypto's thread pool. This compiles
 * our messages (static accounts only, legacy or version 0) with one collator kept for good,
 * writes the bytes with each address decoded once and remembered, and signs with node:crypto's
 * Ed25519 at once. Ed25519 is deterministic, so the signatures are kit's too. Any message
 * outside that shape (address lookup tables, a signer not ours, limits kit enforces, a newer
 * version) is left to kit.
 */
import { KeyObject, sign } from 'node:crypto';
import {
  AccountRole,
  compileTransactionMessage,
  type Address,
  type Base64EncodedWireTransaction,
  type KeyPairSigner,
  type Signature,
} from '@solana/kit';
import { decodeBase58, encodeBase58 } from './base58.ts';

type CompilableMessage = Parameters<typeof compileTransactionMessage>[0];

/** A message compiled to static accounts (legacy, or version 0 without lookup tables). */
interface CompiledMessage {
  version: 0 | 'legacy';
  header: { numSignerAccounts: number; numReadonlySignerAccounts: number; numReadonlyNonSignerAccounts: number };
  staticAccounts: string[];
  lifetimeToken: string;
  instructions: Array<{ programAddressIndex: number; accountIndices: number[]; data: ArrayLike<number> }>;
}

/** Kit's order among accounts of the same kind: this collation of their base58 text. */
const compareAddresses = new Intl.Collator('en', {
  caseFirst: 'lower', ignorePunctuation: false, localeMatcher: 'best fit', numeric: false, sensitivity: 'variant', usage: 'sort',
}).compare;
/** Kit's limits on a message; beyond them kit refuses it, with its own error. */
const ACCOUNTS_MAX = 64;
const SIGNERS_MAX = 12;

const isSigner = (role: number): boolean => (role & 2) !== 0;
const isWritable = (role: number): boolean => (role & 1) !== 0;

/**
 * Solana's account order, as kit makes it: the fee payer, then signers before non-signers,
 * writable before read-only, each group in address order; an account's role is the union of
 * its roles in every instruction; an invoked program is a read-only account. Null for a message
 * kit compiles differently or refuses: lookup-table accounts, a writable program, too many
 * accounts or signers, a version other than legacy and 0, no lifetime.
 */
function compileStatic(message: CompilableMessage): CompiledMessage | null {
  const { version } = message;
  if (version !== 0 && version !== 'legacy') return null;
  const lifetime = ('lifetimeConstraint' in message ? message.lifetimeConstraint : undefined) as { blockhash?: string; nonce?: string } | undefined;
  const lifetimeToken = lifetime?.nonce ?? lifetime?.blockhash;
  if (lifetimeToken === undefined) return null;
  const feePayer = message.feePayer.address as string;
  const roles = new Map<string, number>([[feePayer, AccountRole.WRITABLE_SIGNER]]);
  const programs = new Set<string>();
  for (const instruction of message.instructions) {
    const program = instruction.programAddress as string;
    const existing = roles.get(program);
    if (existing !== undefined && isWritable(existing)) return null;
    if (existing === undefined) roles.set(program, AccountRole.READONLY);
    programs.add(program);
    for (const account of instruction.accounts ?? []) {
      if ('lookupTableAddress' in account) return null;
      const address = account.address as string;
      if (address === feePayer) continue;
      if (programs.has(address) && isWritable(account.role)) return null;
      roles.set(address, (roles.get(address) ?? AccountRole.READONLY) | account.role);
    }
  }
  if (roles.size > ACCOUNTS_MAX) return null;
  const ordered = [...roles.keys()].sort((left, right) => {
    if (left === feePayer || right === feePayer) return left === feePayer ? -1 : 1;
    const l = roles.get(left)!;
    const r = roles.get(right)!;
    if (isSigner(l) !== isSigner(r)) return isSigner(l) ? -1 : 1;
    if (isWritable(l) !== isWritable(r)) return isWritable(l) ? -1 : 1;
    return compareAddresses(left, right);
  });
  const signers = ordered.filter((address) => isSigner(roles.get(address)!));
  if (signers.length > SIGNERS_MAX) return null;
  const index = new Map(ordered.map((address, i) => [address, i]));
  return {
    version,
    header: {
      numSignerAccounts: signers.length,
      numReadonlySignerAccounts: signers.filter((address) => !isWritable(roles.get(address)!)).length,
      numReadonlyNonSignerAccounts: ordered.filter((address) => !isSigner(roles.get(address)!) && !isWritable(roles.get(address)!)).length,
    },
    staticAccounts: ordered,
    lifetimeToken,
    instructions: message.instructions.map((instruction) => ({
      programAddressIndex: index.get(instruction.programAddress)!,
      accountIndices: (instruction.accounts ?? []).map((account) => index.get(account.address)!),
      data: instruction.data ?? [],
    })),
  };
}

export interface SignedTransaction {
  signature: Signature;
  wire: Base64EncodedWireTransaction;
}

/** Decoded addresses kept; a pay transaction's keys are mostly the same few (bounded like the PDA caches). */
const ADDRESS_CACHE_MAX = 100_000;

/** Solana's compact-u16 length prefix. */
function shortVec(value: number): number[] {
  const out: number[] = [];
  let rest = value;
  for (;;) {
    const low = rest & 0x7f;
    rest >>= 7;
    if (rest === 0) {
      out.push(low);
      return out;
    }
    out.push(low | 0x80);
  }
}

class ByteWriter {
  #buffer = new Uint8Array(1280);
  length = 0;

  #room(extra: number): void {
    if (this.length + extra <= this.#buffer.length) return;
    const grown = new Uint8Array(Math.max(this.#buffer.length * 2, this.length + extra));
    grown.set(this.#buffer.subarray(0, this.length));
    this.#buffer = grown;
  }

  byte(value: number): void {
    this.#room(1);
    this.#buffer[this.length++] = value;
  }

  bytes(values: ArrayLike<number>): void {
    this.#room(values.length);
    this.#buffer.set(values, this.length);
    this.length += values.length;
  }

  /** A compact-u16 count, then the bytes. */
  prefixed(values: ArrayLike<number>): void {
    this.bytes(shortVec(values.length));
    this.bytes(values);
  }

  done(): Uint8Array {
    return this.#buffer.slice(0, this.length);
  }
}

/** Signs with the given key pairs; a transaction needing any other signer is kit's to sign. */
export class FastSigner {
  readonly #keys = new Map<string, KeyObject>();
  readonly #addresses = new Map<string, Uint8Array>();

  constructor(signers: readonly KeyPairSigner[]) {
    for (const signer of signers) this.#keys.set(signer.address, KeyObject.from(signer.keyPair.privateKey));
  }

  /** Null when a signer of this message is not one of ours, or its version is newer than 0 (the caller signs it with kit). */
  sign(message: CompilableMessage): SignedTransaction | null {
    const compiled = compileStatic(message);
    if (!compiled) return null;
    const signers = compiled.staticAccounts.slice(0, compiled.header.numSignerAccounts);
    const keys = signers.map((signer) => this.#keys.get(signer));
    if (keys.some((key) => key === undefined)) return null;
    const messageBytes = this.#encodeMessage(compiled);
    const wire = new ByteWriter();
    wire.bytes(shortVec(keys.length));
    let first: Buffer | null = null;
    for (const key of keys) {
      const signature = sign(null, messageBytes, key!);
      first ??= signature;
      wire.bytes(signature);
    }
    wire.bytes(messageBytes);
    return {
      signature: encodeBase58(first!) as Signature,
      wire: Buffer.from(wire.done()).toString('base64') as Base64EncodedWireTransaction,
    };
  }

  #addressBytes(value: Address | string): Uint8Array {
    let bytes = this.#addresses.get(value);
    if (!bytes) {
      const decoded = decodeBase58(value);
      if (!decoded || decoded.length !== 32) throw new Error(`${value} is not a 32-byte base58 address`);
      if (this.#addresses.size >= ADDRESS_CACHE_MAX) this.#addresses.clear();
      this.#addresses.set(value, decoded);
      bytes = decoded;
    }
    return bytes;
  }

  /** The message as Solana's wire format has it (legacy, or version 0 with no lookup tables). */
  #encodeMessage(compiled: CompiledMessage): Uint8Array {
    const out = new ByteWriter();
    if (compiled.version !== 'legacy') out.byte(0x80 | compiled.version);
    const { header } = compiled;
    out.bytes([header.numSignerAccounts, header.numReadonlySignerAccounts, header.numReadonlyNonSignerAccounts]);
    out.bytes(shortVec(compiled.staticAccounts.length));
    for (const account of compiled.staticAccounts) out.bytes(this.#addressBytes(account));
    out.bytes(this.#addressBytes(compiled.lifetimeToken));
    out.bytes(shortVec(compiled.instructions.length));
    for (const instruction of compiled.instructions) {
      out.byte(instruction.programAddressIndex);
      out.prefixed(instruction.accountIndices);
      out.prefixed(instruction.data);
    }
    if (compiled.version !== 'legacy') out.bytes(shortVec(0)); // no address table lookups
    return out.done();
  }
}
