/**
 * Completion proofs of an escrow (SPEC.md "Proof formats"), each really verified:
 *
 * - `output_hash`: `sha256:<64 hex>`, with `outputUrl`. It must equal the escrow's
 *   `expectedOutputHash` when one was given at creation, and the SHA-256 of the bytes at
 *   `outputUrl` (fetched through the outbound guard, a few at a time per process).
 * - `signed_attestation`: `<base64url payload>.<base64url ed25519 signature>`; the payload is
 *   JSON naming the escrow and its task hash, signed by the receiving vault's current session
 *   authority (DESIGN §7).
 * - `webhook_callback`: a proof string from the verifier named at creation (docs/verifiers.md).
 *
 * Any failure is 400 `invalid_proof` with the reason, and changes nothing.
 */
import { createHash } from 'node:crypto';
import type { Queryable } from '../db/database.ts';
import { ServiceError, retryShortly } from '../errors/errors.ts';
import { fetchGuarded, OutboundError } from '../net/outbound.ts';
import { verifyCallbackProof } from '../verifiers/verifiers.ts';
import { verifySessionSignature } from '../wallets/session-token.ts';

export const PROOF_TYPES = ['output_hash', 'signed_attestation', 'webhook_callback'] as const;
export type ProofType = (typeof PROOF_TYPES)[number];

export const SHA256_PATTERN = '^sha256:[0-9a-f]{64}$';
export const SHA256_TEXT = 'must be "sha256:" and 64 lowercase hex digits';
const SHA256 = new RegExp(SHA256_PATTERN);
/** An output fetched to check its hash: at most this long and this large. */
export const OUTPUT_FETCH_TIMEOUT_MS = 5_000;
export const OUTPUT_MAX_BYTES = 10 * 1024 * 1024;
export const PROOF_MAX_CHARS = 8_192;
/**
 * Outputs fetched at once by one process (each up to OUTPUT_MAX_BYTES in memory), and for one
 * completing organisation (the caller's, which chose the outputUrl: the receiving party of a
 * cross-organisation escrow cannot use up the requester's share), so that one tenant cannot take
 * them all; a completion beyond either is answered 503 at once, to retry, rather than queued.
 */
export const OUTPUT_FETCHES_MAX = 8;
export const OUTPUT_FETCHES_PER_ORG_MAX = 4;
let outputFetches = 0;
const outputFetchesByOrg = new Map<string, number>();

/** A fetch takes at most OUTPUT_FETCH_TIMEOUT_MS: a place frees within that. */
const FETCH_RETRY_AFTER_S = OUTPUT_FETCH_TIMEOUT_MS / 1000;

function takeOutputFetch(orgId: string): void {
  const ofOrg = outputFetchesByOrg.get(orgId) ?? 0;
  if (ofOrg >= OUTPUT_FETCHES_PER_ORG_MAX) {
    throw retryShortly(
      `${OUTPUT_FETCHES_PER_ORG_MAX} outputs of this organisation's escrows are being fetched already; retry in a few seconds.`, FETCH_RETRY_AFTER_S);
  }
  if (outputFetches >= OUTPUT_FETCHES_MAX) {
    throw retryShortly(`${OUTPUT_FETCHES_MAX} escrow outputs are being fetched already; retry in a few seconds.`, FETCH_RETRY_AFTER_S);
  }
  outputFetches += 1;
  outputFetchesByOrg.set(orgId, ofOrg + 1);
}

function giveOutputFetch(orgId: string): void {
  outputFetches -= 1;
  const left = (outputFetchesByOrg.get(orgId) ?? 1) - 1;
  if (left > 0) outputFetchesByOrg.set(orgId, left);
  else outputFetchesByOrg.delete(orgId);
}

export interface EscrowForProof {
  id: string;
  org_id: string;
  task_hash: string;
  expected_output_hash: string | null;
  verifier_id: string | null;
  to_wallet_id: string | null;
}

export interface ProofInput {
  proofType: ProofType;
  proof: string;
  outputUrl: string | null;
}

export function invalidProof(message: string, param = 'proof'): ServiceError {
  return new ServiceError('invalid_proof', message, { param });
}

export function sha256Of(bytes: Uint8Array | string): string {
  return `sha256:${createHash('sha256').update(bytes).digest('hex')}`;
}

/** The message an agent signs for `signed_attestation`: what the payload's JSON must hold. */
export interface AttestationPayload {
  escrow_id: string;
  task_hash: string;
  /** optional: the hash of what was delivered */
  output_hash?: string;
}

/** Builds a `signed_attestation` proof with a signing function (SDKs and tests). */
export function encodeAttestation(payload: AttestationPayload, sign: (message: Uint8Array) => Uint8Array): string {
  const bytes = Buffer.from(JSON.stringify(payload));
  return `${bytes.toString('base64url')}.${Buffer.from(sign(bytes)).toString('base64url')}`;
}

async function verifyOutputHash(escrow: EscrowForProof, input: ProofInput, fetcherOrgId: string, allowPrivate: boolean): Promise<void> {
  if (!SHA256.test(input.proof)) throw invalidProof('An output_hash proof is "sha256:" followed by 64 lowercase hex digits.');
  if (escrow.expected_output_hash !== null && input.proof !== escrow.expected_output_hash) {
    throw invalidProof('The output hash differs from the expectedOutputHash the escrow was created with.');
  }
  // A hash alone proves nothing: both parties can read the escrow's expected_output_hash. The
  // bytes it is the hash of are the proof that the output was delivered.
  if (input.outputUrl === null) {
    throw invalidProof('An output_hash proof needs outputUrl, where the service reads the output and hashes it: the hash alone proves no delivery.',
      'output_url');
  }
  let body: Buffer;
  takeOutputFetch(fetcherOrgId);
  try {
    const response = await fetchGuarded(input.outputUrl, { timeoutMs: OUTPUT_FETCH_TIMEOUT_MS, maxBytes: OUTPUT_MAX_BYTES, allowPrivate });
    if (response.status < 200 || response.status > 299) throw invalidProof(`Fetching outputUrl answered HTTP ${response.status}.`, 'output_url');
    body = response.body;
  } catch (error) {
    if (error instanceof OutboundError) throw invalidProof(`outputUrl could not be fetched: ${error.message}.`, 'output_url');
    throw error;
  } finally {
    giveOutputFetch(fetcherOrgId);
  }
  if (sha256Of(body) !== input.proof) throw invalidProof('The SHA-256 of the bytes at outputUrl differs from the proof.');
}

async function verifyAttestation(q: Queryable, nowMs: number, escrow: EscrowForProof, proof: string, lock: boolean): Promise<void> {
  if (escrow.to_wallet_id === null) {
    throw invalidProof('A signed_attestation needs a receiving vault of this service (its session authority signs it).');
  }
  const [payloadText, signatureText, extra] = proof.split('.');
  if (!payloadText || !signatureText || extra !== undefined) throw invalidProof('A signed_attestation is "<base64url payload>.<base64url signature>".');
  const payloadBytes = Buffer.from(payloadText, 'base64url');
  let payload: Partial<AttestationPayload>;
  try {
    payload = JSON.parse(payloadBytes.toString('utf8')) as Partial<AttestationPayload>;
  } catch {
    throw invalidProof('The signed_attestation payload is not base64url JSON.');
  }
  if (payload?.escrow_id !== escrow.id) throw invalidProof('The attestation names another escrow.');
  if (payload.task_hash !== escrow.task_hash) throw invalidProof('The attestation names another task.');
  if (payload.output_hash !== undefined && (typeof payload.output_hash !== 'string' || !SHA256.test(payload.output_hash))) {
    throw invalidProof('The attestation\'s output_hash is not "sha256:<64 hex>".');
  }
  if (escrow.expected_output_hash !== null && payload.output_hash !== escrow.expected_output_hash) {
    throw invalidProof('The attestation\'s output_hash differs from the expectedOutputHash the escrow was created with.');
  }
  const [vault] = await q.query<{ session_public_key: string | null; session_expires_at: Date | null }>(
    `SELECT session_public_key, session_expires_at FROM wallets WHERE id = $1${lock ? ' FOR SHARE' : ''}`, [escrow.to_wallet_id]);
  if (!vault?.session_public_key || !vault.session_expires_at || vault.session_expires_at.getTime() <= nowMs) {
    throw invalidProof('The receiving vault has no current session authority to verify the attestation with.');
  }
  const signature = Buffer.from(signatureText, 'base64url');
  if (!verifySessionSignature(vault.session_public_key, payloadBytes, signature)) {
    throw invalidProof('The attestation is not signed by the receiving vault\'s current session authority.');
  }
}

/**
 * The proofs an escrow accepts, from what its requester set at creation. A verifier or an
 * expected output hash is a check the requester chose, and a proof of another kind would step
 * around it: the receiving agent can always sign an attestation of its own, naming the expected
 * hash, without delivering anything. So a verifier admits `webhook_callback`, an expected hash
 * `output_hash` (the bytes at outputUrl), both admit either; an escrow with neither has no check
 * to keep, and admits `output_hash` and `signed_attestation` — the latter only when it pays a
 * vault of this service, whose session authority signs it.
 */
export function acceptedProofTypes(escrow: Pick<EscrowForProof, 'expected_output_hash' | 'verifier_id' | 'to_wallet_id'>): ProofType[] {
  const chosen: ProofType[] = [];
  if (escrow.verifier_id !== null) chosen.push('webhook_callback');
  if (escrow.expected_output_hash !== null) chosen.push('output_hash');
  if (chosen.length > 0) return chosen;
  return escrow.to_wallet_id === null ? ['output_hash'] : ['output_hash', 'signed_attestation'];
}

/**
 * Verifies a completion proof against its escrow; throws `invalid_proof` with the reason.
 * `callerOrgId`: the organisation completing (either party's), whose share of fetches an output takes.
 */
export async function verifyProof(
  q: Queryable, nowMs: number, escrow: EscrowForProof, input: ProofInput, options: { callerOrgId: string; allowPrivate: boolean },
): Promise<void> {
  if (input.proof.length > PROOF_MAX_CHARS) throw invalidProof(`A proof is at most ${PROOF_MAX_CHARS} characters.`);
  const accepted = acceptedProofTypes(escrow);
  if (!accepted.includes(input.proofType)) {
    throw invalidProof(`This escrow accepts ${accepted.join(' or ')} proofs (its accepted_proofs), not ${input.proofType}.`);
  }
  switch (input.proofType) {
    case 'output_hash':
      return verifyOutputHash(escrow, input, options.callerOrgId, options.allowPrivate);
    case 'signed_attestation':
      return verifyAttestation(q, nowMs, escrow, input.proof, false);
    case 'webhook_callback':
      return verifyCallback(q, nowMs, escrow, input.proof, false);
  }
}

function verifyCallback(q: Queryable, nowMs: number, escrow: EscrowForProof, proof: string, lock: boolean): Promise<void> {
  if (escrow.verifier_id === null) throw invalidProof('This escrow names no verifier: a webhook_callback proof cannot be checked.');
  return verifyCallbackProof(q, nowMs, escrow.org_id, escrow.verifier_id, escrow.id, proof, lock);
}

/**
 * In the transaction that records a release, after verifyProof passed: checks again the part of
 * the proof that rests on a credential the service stores and can take back — the verifier's
 * secret, the receiving vault's session authority — with its row locked FOR SHARE. A revocation
 * or rotation then either came first and refuses the proof, or waits for the release to commit:
 * a proof checked just before it cannot release the escrow after it. An output hash rests on
 * nothing the service can take back, and its bytes are not fetched again.
 */
export async function recheckProofLocked(tx: Queryable, nowMs: number, escrow: EscrowForProof, input: ProofInput): Promise<void> {
  if (input.proofType === 'signed_attestation') await verifyAttestation(tx, nowMs, escrow, input.proof, true);
  else if (input.proofType === 'webhook_callback') await verifyCallback(tx, nowMs, escrow, input.proof, true);
}
