/**
 * The operator key: the service's Solana key. It signs and pays for every transaction and is
 * the `authority` the program checks. Given by AGENT_VAULT_OPERATOR_KEY, or generated into the
 * data dir on first start (mode 0600). The secret never leaves this module: callers get a
 * signer whose private key is a non-extractable CryptoKey, and nothing here logs it.
 */
import { createPrivateKey, createPublicKey, generateKeyPairSync } from 'node:crypto';
import { chmodSync, mkdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { createKeyPairSignerFromBytes, getBase58Decoder, getBase58Encoder, type KeyPairSigner } from '@solana/kit';

export const OPERATOR_KEY_FILE = 'operator-key.json';

/**
 * Parses a 64-byte Solana secret key (32-byte seed then 32-byte public key), written either as
 * the CLI's JSON array of numbers or as base58. Its errors never quote the text: it is a secret
 * (the parsers' own messages, JSON's and base58's, would show part or all of it).
 */
export function parseSecretKey(text: string): Uint8Array {
  const trimmed = text.trim();
  let bytes: Uint8Array;
  if (trimmed.startsWith('[')) {
    let numbers: unknown;
    try {
      numbers = JSON.parse(trimmed);
    } catch {
      throw new Error('a key starting with "[" must be a JSON array of 64 bytes, and this one is not valid JSON');
    }
    if (!Array.isArray(numbers) || !numbers.every((n) => Number.isInteger(n) && n >= 0 && n <= 255)) {
      throw new Error('a JSON key must be an array of bytes');
    }
    bytes = Uint8Array.from(numbers as number[]);
  } else {
    try {
      bytes = new Uint8Array(getBase58Encoder().encode(trimmed));
    } catch {
      throw new Error('a key is base58 or a JSON array of 64 bytes, and this one is neither (quotes around it, or a character base58 does not use: 0, O, I, l)');
    }
  }
  if (bytes.length !== 64) throw new Error(`a secret key has 64 bytes, this one has ${bytes.length}`);
  // Seed ‖ public key: a key altered or pasted together from two would sign as neither.
  const seed = createPrivateKey({ key: Buffer.concat([PKCS8_ED25519_SEED_PREFIX, bytes.subarray(0, 32)]), format: 'der', type: 'pkcs8' });
  const publicKey = createPublicKey(seed).export({ format: 'der', type: 'spki' }).subarray(-32);
  if (!publicKey.equals(bytes.subarray(32))) {
    throw new Error('its last 32 bytes are not the public key of its first 32 (a key altered, or put together from two)');
  }
  return bytes;
}

/** PKCS #8 DER of an Ed25519 private key, up to its 32-byte seed (RFC 8410). */
const PKCS8_ED25519_SEED_PREFIX = Buffer.from('302e020100300506032b657004220420', 'hex');

/** A new 64-byte secret key (seed ‖ public key), as the Solana CLI writes them. */
export function generateSecretKey(): Uint8Array {
  const { privateKey } = generateKeyPairSync('ed25519');
  const jwk = privateKey.export({ format: 'jwk' });
  const secret = new Uint8Array(64);
  secret.set(Buffer.from(jwk.d!, 'base64url'), 0);
  secret.set(Buffer.from(jwk.x!, 'base64url'), 32);
  return secret;
}

export function writeSecretKeyFile(path: string, secret: Uint8Array): void {
  mkdirSync(dirname(path), { recursive: true });
  writeFileSync(path, JSON.stringify([...secret]), { mode: 0o600, flag: 'wx' });
  chmodSync(path, 0o600);
}

/** Reads a key file, refusing one that other users can read. */
export function readSecretKeyFile(path: string): Uint8Array {
  const mode = statSync(path).mode & 0o777;
  if ((mode & 0o077) !== 0) {
    throw new Error(`${path} is readable by other users (mode ${mode.toString(8)}); run chmod 600 on it`);
  }
  return parseSecretKey(readFileSync(path, 'utf8'));
}

/** Loads a key file, creating it with a fresh key when it does not exist yet. */
export async function loadOrCreateKeyFile(path: string): Promise<KeyPairSigner> {
  let secret: Uint8Array;
  try {
    secret = readSecretKeyFile(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
    secret = generateSecretKey();
    try {
      writeSecretKeyFile(path, secret);
    } catch (writeError) {
      // Another process created it first: use theirs.
      if ((writeError as NodeJS.ErrnoException).code !== 'EEXIST') throw writeError;
      secret = readSecretKeyFile(path);
    }
  }
  return createKeyPairSignerFromBytes(secret);
}

export async function loadOperatorKey(options: { dataDir: string; secretKey?: string }): Promise<KeyPairSigner> {
  return loadServiceKey({ ...options, file: OPERATOR_KEY_FILE, variable: 'AGENT_VAULT_OPERATOR_KEY' });
}

/**
 * One of the service's Solana keys: `secretKey` (the environment variable `variable`) when
 * given, else `file` in the data dir, generated on first use.
 */
export async function loadServiceKey(options: { dataDir: string; secretKey?: string; file: string; variable: string }): Promise<KeyPairSigner> {
  if (options.secretKey) {
    let secret: Uint8Array;
    try {
      secret = parseSecretKey(options.secretKey);
    } catch (error) {
      throw new Error(`${options.variable} is not a valid secret key: ${(error as Error).message}`);
    }
    return createKeyPairSignerFromBytes(secret);
  }
  return loadOrCreateKeyFile(join(options.dataDir, options.file));
}

export function encodeSecretKeyBase58(secret: Uint8Array): string {
  return getBase58Decoder().decode(secret);
}
