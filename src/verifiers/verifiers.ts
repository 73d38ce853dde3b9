/**
 * Verifiers (docs/verifiers.md): trusted third parties an organisation registers so that an
 * escrow may require its `webhook_callback` completion proof to come from one of them. Each
 * verifier holds a signing secret, shown once at creation and at each rotation; a proof is an
 * HMAC-SHA256 with it over the escrow id and a timestamp, checked here in constant time.
 *
 * The secret is stored as is: checking a proof means computing the HMAC, which needs the
 * secret itself (a hash of it could not). It never leaves the service again after the response
 * that created it, and revoking a verifier erases it.
 */
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { Type } from 'typebox';
import type { Queryable } from '../db/database.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { NAME_PATTERN } from '../http/fields.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { newId } from '../ids/ids.ts';
import { assertPublicUrl } from '../net/outbound.ts';

export const VERIFIER_NAME_MAX = 200;
/** At least one visible character and no control characters (names are printed in tables and logs). */
const VERIFIER_NAME = new RegExp(NAME_PATTERN, 'u');
/** After a rotation the previous secret keeps verifying this long, so the verifier can switch without a gap. */
export const SECRET_ROTATION_OVERLAP_MS = 24 * 3600 * 1000;
/** A proof's time may differ from the service clock by at most this much, either way. */
export const PROOF_TOLERANCE_SECONDS = 300;
/** The one verdict a completion proof signs; naming it keeps a future verdict's signature from passing for this one. */
export const PROOF_VERDICT = 'completed';
/** The longest proof string looked at: the format is ~80 characters, anything much longer is not one. */
const PROOF_LENGTH_MAX = 256;
const PROOF_FORMAT = /^t=(0|[1-9]\d{0,11}),v1=([0-9a-f]{64})$/;
const SECRET_PREFIX = 'vsec_';

/** A new signing secret: `vsec_` and 256 random bits in base64url. */
export function generateVerifierSecret(): string {
  return `${SECRET_PREFIX}${randomBytes(32).toString('base64url')}`;
}

/** The hex signature of a proof (docs/verifiers.md): HMAC-SHA256 keyed with the secret's UTF-8 bytes. */
export function proofSignature(secret: string, timestampSeconds: number, escrowId: string): string {
  return createHmac('sha256', secret).update(`${timestampSeconds}.${escrowId}.${PROOF_VERDICT}`, 'utf8').digest('hex');
}

/** A complete proof string, as a verifier builds it (used by tests and documentation examples). */
export function signCallbackProof(secret: string, timestampSeconds: number, escrowId: string): string {
  return `t=${timestampSeconds},v1=${proofSignature(secret, timestampSeconds, escrowId)}`;
}

/** Refused input is echoed in messages, but never at a length that would flood a log line. */
function quoted(text: string): string {
  return JSON.stringify(text.length > 80 ? `${text.slice(0, 80)}…` : text);
}

// ---------------------------------------------------------------------------------------------
// Rows and views

export interface VerifierRow {
  org_id: string;
  id: string;
  name: string;
  url: string | null;
  signing_secret: string | null;
  previous_signing_secret: string | null;
  previous_secret_expires_at: Date | null;
  secret_rotated_at: Date | null;
  created_at: Date;
  revoked_at: Date | null;
}

const TIME_OR_NULL = Type.Union([Type.String(), Type.Null()]);

/** A verifier as reads show it: never a secret. */
export const VerifierView = Type.Object({
  verifier_id: Type.String(),
  name: Type.String(),
  url: Type.Union([Type.String(), Type.Null()], { description: 'where the verifier can be reached, for your records; the service does not call it' }),
  status: Type.Union([Type.Literal('active'), Type.Literal('revoked')]),
  secret_rotated_at: Type.Union([Type.String(), Type.Null()], { description: 'the last rotation; null if never rotated' }),
  previous_secret_expires_at: Type.Union([Type.String(), Type.Null()], {
    description: 'until when the secret before the last rotation still verifies (in the past once it no longer does); null if none',
  }),
  created_at: Type.String(),
  revoked_at: TIME_OR_NULL,
});

/** A verifier with its new secret: the creation and rotation responses, and only those. */
export const VerifierWithSecretView = Type.Object({
  ...VerifierView.properties,
  signing_secret: Type.String({ description: 'the signing secret: shown this once, store it now' }),
});

export function verifierView(row: VerifierRow) {
  return {
    verifier_id: row.id,
    name: row.name,
    url: row.url,
    status: row.revoked_at ? 'revoked' as const : 'active' as const,
    secret_rotated_at: row.secret_rotated_at?.toISOString() ?? null,
    previous_secret_expires_at: row.previous_secret_expires_at?.toISOString() ?? null,
    created_at: row.created_at.toISOString(),
    revoked_at: row.revoked_at?.toISOString() ?? null,
  };
}

export function verifierWithSecretView(row: VerifierRow) {
  if (row.signing_secret === null) throw new Error('a verifier shown with its secret must be active');
  return { ...verifierView(row), signing_secret: row.signing_secret };
}

function verifierNotFound(verifierId: string): ServiceError {
  // The closed error list has no verifier_not_found; not_found with the param says which id.
  return new ServiceError('not_found', `No verifier ${quoted(verifierId)} in your organisation.`, { param: 'verifier_id' });
}

// ---------------------------------------------------------------------------------------------
// Use-cases

export interface NewVerifier {
  name: string;
  url?: string;
}

export async function createVerifier(
  q: Queryable, nowMs: number, orgId: string, input: NewVerifier, options: { allowPrivateUrls: boolean },
): Promise<VerifierRow> {
  // Characters as the schema counts them (code points: an emoji is one).
  const chars = Array.from(input.name).length;
  if (chars < 1 || chars > VERIFIER_NAME_MAX || !VERIFIER_NAME.test(input.name)) {
    throw invalidRequest('name', `name must be 1–${VERIFIER_NAME_MAX} characters, not all blank, without control characters.`);
  }
  const url = input.url === undefined ? null : assertPublicUrl(input.url, { allowPrivate: options.allowPrivateUrls, param: 'url' }).href;
  const rows = await q.query<VerifierRow>(
    `INSERT INTO verifiers (org_id, id, name, url, signing_secret, created_at)
     VALUES ($1, $2, $3, $4, $5, $6) RETURNING *`,
    [orgId, newId('ver', nowMs), input.name, url, generateVerifierSecret(), new Date(nowMs)]);
  return rows[0]!;
}

/** A verifier of the organisation, revoked ones included (escrows keep naming them). */
export async function getVerifier(q: Queryable, orgId: string, verifierId: string): Promise<VerifierRow> {
  const rows = await q.query<VerifierRow>('SELECT * FROM verifiers WHERE org_id = $1 AND id = $2', [orgId, verifierId]);
  if (!rows[0]) throw verifierNotFound(verifierId);
  return rows[0];
}

/** One page of the organisation's verifiers, newest first, revoked ones included. */
export async function listVerifiers(q: Queryable, orgId: string, page: PageRequest) {
  const { sql, params } = new PageFilter().where((p) => `org_id = ${p}`, orgId).page(page);
  const rows = await q.query<VerifierRow>(`SELECT * FROM verifiers ${sql}`, params);
  return toPage(rows, page, verifierView);
}

/**
 * Revokes at once: the next proof signed by it fails, and escrow creation refuses it. Its
 * secrets are erased, since nothing may verify with them again. Revoking a revoked verifier
 * changes nothing and returns it.
 */
export async function revokeVerifier(q: Queryable, nowMs: number, orgId: string, verifierId: string): Promise<VerifierRow> {
  const rows = await q.query<VerifierRow>(
    `UPDATE verifiers SET revoked_at = $3, signing_secret = NULL, previous_signing_secret = NULL, previous_secret_expires_at = NULL
     WHERE org_id = $1 AND id = $2 AND revoked_at IS NULL RETURNING *`,
    [orgId, verifierId, new Date(nowMs)]);
  return rows[0] ?? getVerifier(q, orgId, verifierId);
}

/**
 * A new secret, returned once; the one it replaces keeps verifying for 24 hours. Only one
 * previous secret is kept: rotating again within the overlap ends the older secret at once.
 * One statement, so two concurrent rotations cannot lose a secret between them.
 */
export async function rotateVerifierSecret(q: Queryable, nowMs: number, orgId: string, verifierId: string): Promise<VerifierRow> {
  const rows = await q.query<VerifierRow>(
    `UPDATE verifiers
     SET previous_signing_secret = signing_secret, previous_secret_expires_at = $3, signing_secret = $4, secret_rotated_at = $5
     WHERE org_id = $1 AND id = $2 AND revoked_at IS NULL RETURNING *`,
    [orgId, verifierId, new Date(nowMs + SECRET_ROTATION_OVERLAP_MS), generateVerifierSecret(), new Date(nowMs)]);
  if (rows[0]) return rows[0];
  await getVerifier(q, orgId, verifierId);
  throw invalidRequest('verifier_id', `Verifier ${quoted(verifierId)} is revoked: its secret cannot rotate. Create a new verifier.`);
}

// ---------------------------------------------------------------------------------------------
// For escrows

/** At escrow creation: the verifier an escrow names must be one of the organisation's, and active. */
export async function assertVerifierUsable(
  q: Queryable, orgId: string, verifierId: string, options: { lock?: boolean } = {},
): Promise<void> {
  const rows = await q.query<Pick<VerifierRow, 'revoked_at'>>(
    `SELECT revoked_at FROM verifiers WHERE org_id = $1 AND id = $2${options.lock ? ' FOR SHARE' : ''}`, [orgId, verifierId]);
  if (!rows[0]) throw invalidRequest('verifier_id', `No verifier ${quoted(verifierId)} in your organisation: register it with POST /v1/verifiers.`);
  if (rows[0].revoked_at) throw invalidRequest('verifier_id', `Verifier ${quoted(verifierId)} is revoked.`);
}

function invalidProof(reason: string): ServiceError {
  return new ServiceError('invalid_proof', reason, { param: 'proof' });
}

/** Constant-time equality of two 32-byte signatures given in hex. */
function signaturesEqual(expectedHex: string, presentedHex: string): boolean {
  return timingSafeEqual(Buffer.from(expectedHex, 'hex'), Buffer.from(presentedHex, 'hex'));
}

/**
 * Checks a `webhook_callback` proof for an escrow that names `verifierId`: the string is
 * `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<escrow id>.completed")>`, `t` within
 * 300 s of the service clock (`nowMs`), signed with the verifier's current secret or, during
 * the 24 h after a rotation, the previous one. Throws invalid_proof (param `proof`) naming
 * what is wrong; resolves when the proof holds.
 *
 * A proof is not single-use here: it is bound to one escrow, and an escrow completes once.
 * `lock`: the verifier's row is read FOR SHARE, so that a revocation or rotation waits for the
 * caller's transaction (the release it records) instead of slipping in after the check.
 */
export async function verifyCallbackProof(
  q: Queryable, nowMs: number, orgId: string, verifierId: string, escrowId: string, proof: string, lock = false,
): Promise<void> {
  const match = proof.length <= PROOF_LENGTH_MAX ? PROOF_FORMAT.exec(proof) : null;
  if (!match) {
    throw invalidProof('A webhook_callback proof is "t=<unix seconds>,v1=<64 lowercase hex characters of HMAC-SHA256>".');
  }
  const timestampSeconds = Number(match[1]);
  const signature = match[2]!;
  // In whole seconds, as `t` is written: 300 s either way is the same tolerance, and the refusal's
  // "now" is the second compared (a millisecond clock made t = now − 300 stale and now + 300 good).
  const nowSeconds = Math.floor(nowMs / 1000);
  if (Math.abs(nowSeconds - timestampSeconds) > PROOF_TOLERANCE_SECONDS) {
    throw invalidProof(`The proof's time t=${timestampSeconds} is more than ${PROOF_TOLERANCE_SECONDS} seconds away from the service clock `
      + `(now ${nowSeconds}): sign a fresh one.`);
  }
  const [verifier] = await q.query<VerifierRow>(`SELECT * FROM verifiers WHERE org_id = $1 AND id = $2${lock ? ' FOR SHARE' : ''}`, [orgId, verifierId]);
  if (!verifier) throw invalidProof(`The escrow's verifier ${quoted(verifierId)} does not exist in this organisation.`);
  if (verifier.revoked_at || verifier.signing_secret === null) {
    throw invalidProof(`The escrow's verifier ${quoted(verifierId)} was revoked: its proofs no longer verify.`);
  }
  const secrets = [verifier.signing_secret];
  if (verifier.previous_signing_secret !== null && verifier.previous_secret_expires_at !== null
    && nowMs < verifier.previous_secret_expires_at.getTime()) {
    secrets.push(verifier.previous_signing_secret);
  }
  // Every candidate is compared, even after a match, so the time taken says nothing about which secret matched.
  let verified = false;
  for (const secret of secrets) {
    if (signaturesEqual(proofSignature(secret, timestampSeconds, escrowId), signature)) verified = true;
  }
  if (!verified) {
    throw invalidProof(`The proof's signature does not verify for escrow ${quoted(escrowId)} with verifier ${quoted(verifierId)}'s secret.`);
  }
}
