/**
 * Signing on the payment hot path. @solana/kit compiles the message (account order, header,
 * instruction indices) here as everywhere; what it does next is slow for a service that signs
 * a transaction per payment: its encoder turns every address from base58 with BigInt arithmetic
 * (~33 µs each, ~0.4 ms for a pay transaction's eleven keys), and its signer goes through
 * WebCrypto's thread pool. This writes the compiled message with each address decoded once and
 * remembered, and signs with node:crypto's Ed25519 at once: ~0.15 ms instead of ~1 ms per pay
 * transaction. Ed25519 is deterministic, so the bytes are exactly kit's (signing.test.ts).
 */
import { KeyObject, sign } from 'node:crypto';
import {
  compileTransactionMessage,
  type Address,
  type Base64EncodedWireTransaction,
  type KeyPairSigner,
  type Signature,
} from '@solana/kit';
import { decodeBase58, encodeBase58 } from './base58.ts';

type CompilableMessage = Parameters<typeof compileTransactionMessage>[0];
/** Legacy and version 0 messages; anything newer is left to kit. */
type CompiledMessage = Extract<ReturnType<typeof compileTransactionMessage>, { version: 0 | 'legacy' }>;

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
    const compiled = compileTransactionMessage(message);
    if (compiled.version !== 0 && compiled.version !== 'legacy') return null;
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

  /** The message as Solana's wire format has it (legacy, or version 0 with its lookup tables). */
  #encodeMessage(compiled: CompiledMessage): Uint8Array {
    const out = new ByteWriter();
    if (compiled.version !== 'legacy') out.byte(0x80 | compiled.version);
    const { header } = compiled;
    out.bytes([header.numSignerAccounts, header.numReadonlySignerAccounts, header.numReadonlyNonSignerAccounts]);
    out.bytes(shortVec(compiled.staticAccounts.length));
    for (const account of compiled.staticAccounts) out.bytes(this.#addressBytes(account));
    const lifetime = 'lifetimeToken' in compiled ? compiled.lifetimeToken : undefined;
    if (typeof lifetime !== 'string') throw new Error('the transaction message has no lifetime');
    out.bytes(this.#addressBytes(lifetime));
    out.bytes(shortVec(compiled.instructions.length));
    for (const instruction of compiled.instructions) {
      out.byte(instruction.programAddressIndex);
      out.prefixed(instruction.accountIndices ?? []);
      out.prefixed(instruction.data ?? []);
    }
    if (compiled.version !== 'legacy') {
      const lookups = 'addressTableLookups' in compiled ? compiled.addressTableLookups ?? [] : [];
      out.bytes(shortVec(lookups.length));
      for (const lookup of lookups) {
        out.bytes(this.#addressBytes(lookup.lookupTableAddress));
        out.prefixed(lookup.writableIndexes);
        out.prefixed(lookup.readonlyIndexes);
      }
    }
    return out.done();
  }
}
