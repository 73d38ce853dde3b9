/**
 * A vault's session authority (DESIGN §7): an ed25519 key pair made at rotation. The token
 * handed out once is the key's 32-byte seed; the service keeps only the public key and the
 * expiry, so a leaked database cannot act as an agent, and `signed_attestation` proofs are
 * verified against the stored public key.
 */
import { createPrivateKey, createPublicKey, generateKeyPairSync, sign, timingSafeEqual, verify, type KeyObject } from 'node:crypto';
import { getBase58Decoder, getBase58Encoder } from '@solana/kit';

const TOKEN_PREFIX = 'avst_';
const TOKEN_PATTERN = /^avst_[A-Za-z0-9_-]{43}$/;
/** DER prefix of a PKCS#8 ed25519 private key; the 32-byte seed follows it. */
const PKCS8_ED25519_PREFIX = Buffer.from('302e020100300506032b657004220420', 'hex');
/** DER prefix of an SPKI ed25519 public key; the 32-byte key follows it. */
const SPKI_ED25519_PREFIX = Buffer.from('302a300506032b6570032100', 'hex');

export const SESSION_TTL_SECONDS_DEFAULT = 24 * 3600;
export const SESSION_TTL_SECONDS_MAX = 90 * 24 * 3600;
export const SESSION_TTL_SECONDS_MIN = 60;

export interface SessionAuthority {
  /** shown once: `avst_` + base64url(seed) */
  token: string;
  /** base58, like a Solana address */
  publicKey: string;
}

export function newSessionAuthority(): SessionAuthority {
  const { privateKey, publicKey } = generateKeyPairSync('ed25519');
  const seed = privateKey.export({ format: 'der', type: 'pkcs8' }).subarray(PKCS8_ED25519_PREFIX.length);
  return { token: TOKEN_PREFIX + Buffer.from(seed).toString('base64url'), publicKey: encodePublicKey(publicKey) };
}

function encodePublicKey(key: KeyObject): string {
  const raw = key.export({ format: 'der', type: 'spki' }).subarray(SPKI_ED25519_PREFIX.length);
  return getBase58Decoder().decode(raw);
}

function privateKeyOf(token: string): KeyObject | null {
  if (!TOKEN_PATTERN.test(token)) return null;
  const seed = Buffer.from(token.slice(TOKEN_PREFIX.length), 'base64url');
  if (seed.length !== 32) return null;
  return createPrivateKey({ key: Buffer.concat([PKCS8_ED25519_PREFIX, seed]), format: 'der', type: 'pkcs8' });
}

/** The public key a token stands for; null when the text is not a session token at all. */
export function publicKeyOfToken(token: string): string | null {
  const key = privateKeyOf(token);
  return key ? encodePublicKey(createPublicKey(key)) : null;
}

/** Constant-time: does this token belong to the vault whose public key is stored? */
export function tokenMatches(token: string, storedPublicKey: string | null): boolean {
  if (!storedPublicKey) return false;
  const presented = publicKeyOfToken(token);
  if (!presented) return false;
  const a = Buffer.from(presented);
  const b = Buffer.from(storedPublicKey);
  return a.length === b.length && timingSafeEqual(a, b);
}

/** Verifies an ed25519 signature made with a vault's session key (signed attestations). */
export function verifySessionSignature(publicKey: string, message: Uint8Array, signature: Uint8Array): boolean {
  const raw = getBase58Encoder().encode(publicKey);
  if (raw.length !== 32 || signature.length !== 64) return false;
  const key = createPublicKey({ key: Buffer.concat([SPKI_ED25519_PREFIX, Buffer.from(raw)]), format: 'der', type: 'spki' });
  return verify(null, message, key, signature);
}

/** What an agent holding the token signs with (tests and SDKs). */
export function signWithSessionToken(token: string, message: Uint8Array): Uint8Array {
  const key = privateKeyOf(token);
  if (!key) throw new Error('not a session token');
  return new Uint8Array(sign(null, message, key));
}
