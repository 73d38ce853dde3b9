/**
 * Agent-to-agent escrow (SPEC.md "Escrow"): the requester's vault locks USDC in an escrow
 * account of our program; a verified completion proof releases it to the receiver, a timeout
 * refunds it, a dispute hands it to an arbiter who releases, refunds or splits it.
 *
 * Every step that moves the escrow on is a chain transaction, made like every money move of
 * the service (DESIGN §5): signed first, then — under the escrow's row lock — the state is
 * checked and the move recorded with its signature (`closing` names the move in flight, so no
 * other can start), then sent and settled from the chain's outcome: by the request, by the
 * transaction reconciler (moves with transaction rows) or by the `escrows.tick` job (disputes).
 *
 * Transaction rows (docs/escrow.md): creation writes `a2a_send` (the requester's vault pays,
 * checked against its policy like a payment) and `escrow_lock` (the escrow account receives);
 * a release writes `escrow_release` (the escrow pays out) and, when the receiver is a vault of
 * this service, `a2a_receive` on it; a refund writes `escrow_refund`; a split writes the legs it has.
 */
import { randomBytes } from 'node:crypto';
import { address, type Address, type Instruction, type Signature } from '@solana/kit';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import { largeTransactionAlerts } from '../automation/automation.ts';
import { referenceMemoIx, type PreparedTransaction } from '../chain/client.ts';
import type { Database, Queryable } from '../db/database.ts';
import { ServiceError, retryShortly } from '../errors/errors.ts';
import { recordEvent, recordEvents, type EventType } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import type { RecordMarker } from '../http/idempotency.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';
import { assertBelowCount, lockOrganization } from '../organizations/limits.ts';
import {
  attestationHashOf, commitSpend, insufficientBalance, recordBlocked, rulesFor, vaultRefusal,
} from '../payments/payments.ts';
import { evaluate, type Violation } from '../payments/policy-engine.ts';
import { spendStateOf, spendWindowsFrom, withdrawSpend } from '../payments/spend-state.ts';
import {
  EXPIRED, EXPIRY_MARGIN_BLOCKS, awaitSettlement, insertTransaction, recordTransactionFailed, registerSettlementRule, type TransactionRow,
} from '../transactions/settlement.ts';
import { addressCategories, assertChainPayable, serviceAccountSql } from '../recipients/recipients.ts';
import { assertVerifierUsable } from '../verifiers/verifiers.ts';
import { backoffMs } from '../workers/backoff.ts';
import {
  assertNotArchived, lockWallet, sessionExpiredError, sessionTokenInvalid, walletNotFound, type WalletRow,
} from '../wallets/wallets.ts';
import { recheckProofLocked, sha256Of, verifyProof, type ProofInput } from './proofs.ts';

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log' | 'config'>;

export const ESCROW_STATUSES = ['locked', 'completed', 'released', 'refunded', 'disputed', 'resolved', 'failed'] as const;
export type EscrowStatus = (typeof ESCROW_STATUSES)[number];
type Closing = 'create' | 'release' | 'refund' | 'dispute' | 'resolve' | 'decline';

export const TIMEOUT_SECONDS_DEFAULT = 3600;
export const TIMEOUT_SECONDS_MIN = 60;
export const TIMEOUT_SECONDS_MAX = 30 * 24 * 3600;
export const TASK_DESCRIPTION_MAX = 10_000;
/** How long a request waits for the chain before answering with the escrow as it stands. */
export const ESCROW_WAIT_MS = 20_000;

export interface EscrowRow {
  id: string;
  org_id: string;
  from_wallet_id: string;
  to_wallet: string;
  receiver_address: string;
  to_wallet_id: string | null;
  receiver_org_id: string | null;
  amount: bigint;
  status: EscrowStatus;
  closing: Closing | null;
  closing_signature: string | null;
  closing_valid_height: bigint | null;
  chain_address: string;
  token_address: string;
  task_description: string;
  task_hash: string;
  expected_output_hash: string | null;
  verifier_id: string | null;
  proof_type: string | null;
  output_url: string | null;
  completed_at: Date | null;
  dispute: { raised_by_org: string; raised_by_key: string; reason: string; evidence: string | null; raised_at: string } | null;
  resolution: { to_receiver: string; to_sender: string; decided_by: string; decided_at: string } | null;
  lock_signature: string | null;
  settle_signature: string | null;
  expires_at: Date;
  created_at: Date;
  updated_at: Date;
  settled_at: Date | null;
  /** timeout refunds of it the chain refused, and when the next may be sent (refundRetryDelayMs) */
  refund_failures: number;
  refund_retry_at: Date | null;
}

export function escrowNotFound(escrowId: string): ServiceError {
  return new ServiceError('escrow_not_found', `No escrow ${escrowId} involving your organisation.`, { param: 'escrow_id' });
}

/**
 * An escrow the organisation takes part in, as requester or as receiver; others answer 404. The
 * service's arbiters (`serviceArbiter`) see every disputed escrow too, and keep seeing it once
 * decided (`dispute` stays set), so that a decision sent again is told it is settled, not 404.
 */
export async function getEscrow(q: Queryable, orgId: string, escrowId: string, options: { serviceArbiter?: boolean } = {}): Promise<EscrowRow> {
  const [row] = await q.query<EscrowRow>(
    `SELECT * FROM escrows WHERE id = $1 AND (org_id = $2 OR receiver_org_id = $2${options.serviceArbiter ? ' OR dispute IS NOT NULL' : ''})`,
    [escrowId, orgId]);
  if (!row) throw escrowNotFound(escrowId);
  return row;
}

/**
 * Prepares one attempt at an escrow's move. Its memo names the escrow and the move, and is new to
 * each attempt: another process retrying a move the chain refused (a timeout refund the chain's
 * clock was behind for), holding the same blockhash, would otherwise build the refused
 * transaction byte for byte, which the chain answers with the old refusal without running it.
 * (`chain.prepare` guards against that within one process only: its memory.)
 */
export async function prepareEscrowMove(
  chain: Pick<AppContext['chain'], 'prepare'>, escrowId: string, move: Closing,
  instructions: readonly Instruction[],
): Promise<PreparedTransaction> {
  return chain.prepare([referenceMemoIx(`${escrowId}:${move}:${randomBytes(6).toString('base64url')}`), ...instructions]);
}

/** An arbiter key of an organisation taking part, not of the service's: it cannot decide. */
export function notServiceArbiter(): ServiceError {
  return new ServiceError('insufficient_permissions',
    'Disputes are decided by the service: arbiter keys of its default organisation resolve them, not the organisations taking part.');
}

/**
 * Disputes are decided by the service (SPEC: "beta: the service is arbiter"; DESIGN §7: the
 * arbiter role is platform-level): by arbiter keys of its default organisation, the one that runs
 * it, never by an organisation taking part, which would judge its own dispute.
 */
export async function isServiceArbiter(q: Queryable, principal: { orgId: string; role: string }): Promise<boolean> {
  if (principal.role !== 'arbiter') return false;
  const [org] = await q.query<{ is_default: boolean }>('SELECT is_default FROM organizations WHERE id = $1', [principal.orgId]);
  return org?.is_default === true;
}

async function lockEscrow(tx: Queryable, orgId: string, escrowId: string): Promise<EscrowRow> {
  const [row] = await tx.query<EscrowRow>(
    'SELECT * FROM escrows WHERE id = $1 AND (org_id = $2 OR receiver_org_id = $2) FOR UPDATE', [escrowId, orgId]);
  if (!row) throw escrowNotFound(escrowId);
  return row;
}

const SETTLED: ReadonlySet<EscrowStatus> = new Set(['completed', 'released', 'refunded', 'disputed', 'resolved', 'failed']);

function alreadySettled(row: EscrowRow): ServiceError {
  return new ServiceError('escrow_already_settled', `Escrow ${row.id} is ${row.status}: it can no longer change that way.`,
    { escrow_id: row.id, status: row.status });
}

function expired(row: EscrowRow): ServiceError {
  return new ServiceError('escrow_expired', `Escrow ${row.id} expired at ${row.expires_at.toISOString()}: it is refunded to the requester.`,
    { escrow_id: row.id, expires_at: row.expires_at.toISOString() });
}

/** A move in flight: one at a time. */
const IN_FLIGHT: Record<Closing, string> = {
  create: 'created', release: 'released', refund: 'refunded', dispute: 'disputed', resolve: 'resolved', decline: 'refunded',
};

/**
 * How long a client is told to wait for an escrow still being created: its lock lands within a
 * slot or two, and the request that sent it (or the reconciler) settles it as soon as it does.
 */
export const CREATING_RETRY_AFTER_S = 1;

/**
 * A move asked while another is in flight. An escrow whose creation is in flight is not settled:
 * it is about to be locked, and then completes or disputes like any other, so the client is told
 * to retry (escrow_already_settled would tell it to give up). Every other move in flight ends the
 * escrow's chance to change that way: a release, a refund (it is past its expiry), a dispute, or
 * an arbiter's decision.
 */
function busy(row: EscrowRow): ServiceError {
  if (row.closing === 'create') {
    return retryShortly(`Escrow ${row.id} is still being created on chain: retry shortly.`, CREATING_RETRY_AFTER_S,
      { escrow_id: row.id, status: row.status, in_flight: row.closing });
  }
  return new ServiceError('escrow_already_settled', `Escrow ${row.id} is being ${IN_FLIGHT[row.closing!]} on chain.`,
    { escrow_id: row.id, status: row.status });
}

/** Where an escrow pays: a chain address, and the vault of the service it belongs to, if any. */
interface Receiver {
  address: string;
  walletId: string | null;
  orgId: string | null;
  /** the category the payer's recipient directory gives its address, recorded and hashed (an entry with one first, the oldest) */
  category: string | null;
  /** every category that directory gives its address: blockedCategories judges them all, as for a payment */
  categories: string[];
}

/**
 * `toWallet` as a chain address; refused when it is neither that nor a vault id (`wal_…`). The
 * route asks before the idempotency key is taken, so a corrected `toWallet` may use the same key.
 */
export function receiverAddress(toWallet: string): Address | null {
  if (toWallet.startsWith('wal_')) return null;
  try {
    return address(toWallet);
  } catch {
    throw new ServiceError('invalid_recipient', 'toWallet is a wallet id of your organisation or a chain address.', { param: 'to_wallet' });
  }
}

/** The receiver as the request names it: a vault id of the organisation, or any chain address. */
async function resolveReceiver(q: Queryable, orgId: string, toWallet: string): Promise<Receiver> {
  const receiver = receiverAddress(toWallet);
  if (receiver === null) {
    const [wallet] = await q.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = $2', [orgId, toWallet]);
    if (!wallet) throw walletNotFound(toWallet, 'to_wallet');
    assertNotArchived(wallet);
    return {
      address: wallet.chain_address, walletId: wallet.id, orgId: wallet.org_id,
      ...await addressCategories(q, orgId, wallet.chain_address),
    };
  }
  // A vault of this service, of any organisation, is credited as a vault; any other account of
  // the service is refused (a release there would sit where nothing moves it on); anything else
  // is paid as an address.
  const [found] = await q.query<{ id: string | null; org_id: string | null; status: string | null; service_account: boolean }>(
    `SELECT v.id, v.org_id, v.status, ${serviceAccountSql('k.address')} AS service_account
     FROM (SELECT $1::text AS address) k LEFT JOIN wallets v ON v.chain_address = k.address`, [receiver]);
  if (found?.id === null && found.service_account) {
    throw new ServiceError('invalid_recipient',
      `${receiver} is an account of this service that is not a vault (a reserve, a policy or an escrow, or a token account): `
        + 'an escrow pays a vault or an address outside the service.', { param: 'to_wallet' });
  }
  if (found?.status === 'archived') throw receiverArchived(receiver);
  return { address: receiver, walletId: found?.id ?? null, orgId: found?.org_id ?? null, ...await addressCategories(q, orgId, receiver) };
}

/** A receiving vault archived, named by its address (it may be another organisation's). */
function receiverArchived(receiverAddress: string): ServiceError {
  return new ServiceError('wallet_archived', `The receiving vault ${receiverAddress} is archived.`, { param: 'to_wallet' });
}

/**
 * The receiving vault, when it is one of the service's, locked against archiving (its row's key
 * share, which its foreign key would take anyway) and checked again under that lock: archived
 * since `resolveReceiver` read it, it could not take a release.
 */
async function assertReceiverOpen(tx: Queryable, receiver: Receiver): Promise<void> {
  if (receiver.walletId === null) return;
  const [vault] = await tx.query<{ status: string }>('SELECT status FROM wallets WHERE id = $1 FOR KEY SHARE', [receiver.walletId]);
  if (vault?.status === 'archived') throw receiverArchived(receiver.address);
}

// ---------------------------------------------------------------------------------------------
// Create

export interface CreateEscrowInput {
  fromWallet: string;
  toWallet: string;
  amount: bigint;
  taskDescription: string;
  timeoutSeconds: number;
  expectedOutputHash: string | null;
  verifierId: string | null;
}

export interface EscrowOutcome {
  /** null when refused */
  escrow: EscrowRow | null;
  /** when the requester's policy refused it (nothing was locked) */
  violation: Violation | null;
  /** the `a2a_send` record (blocked, or the lock) */
  sendTxId: string;
}

const SIGN_ATTEMPTS_MAX = 5;

/**
 * Locks USDC of the requester's vault in a new escrow, after its policy allowed it (SPEC
 * payment rule 8): debited at once, on chain within a slot.
 */
export async function createEscrow(
  ctx: Ctx, orgId: string, input: CreateEscrowInput,
  options: {
    wait: boolean; mark?: RecordMarker;
    /** an `agent` key's escrow: the session public key its token matched, checked again under the vault's lock */
    sessionKey?: string | null;
    /** the API key asking: read again under the vault's lock (revoked meanwhile: 401, nothing locked) */
    keyId?: string;
  },
): Promise<EscrowOutcome> {
  const receiver = await resolveReceiver(ctx.db, orgId, input.toWallet);
  assertChainPayable(ctx.chain, receiver.address, 'to_wallet');
  if (input.verifierId !== null) await assertVerifierUsable(ctx.db, orgId, input.verifierId);
  const taskHash = sha256Of(input.taskDescription);
  for (let attempt = 0; attempt < SIGN_ATTEMPTS_MAX; attempt += 1) {
    const [unlocked] = await ctx.db.query<WalletRow>('SELECT * FROM wallets WHERE org_id = $1 AND id = $2', [orgId, input.fromWallet]);
    if (!unlocked) throw walletNotFound(input.fromWallet, 'from_wallet');
    assertNotArchived(unlocked);
    if (unlocked.chain_address === receiver.address) {
      throw new ServiceError('invalid_recipient', 'An escrow pays another vault than the one it locks.', { param: 'to_wallet' });
    }
    const nowMs = ctx.clock.nowMs();
    const escrowId = newId('esc', nowMs);
    const sendTxId = newId('tx', nowMs);
    // Rounded up to the chain's whole seconds: an escrow never expires before its full timeout.
    const expiresAtSeconds = BigInt(Math.ceil(nowMs / 1000) + input.timeoutSeconds);
    const { escrow: escrowAddress, escrowToken } = await ctx.chain.escrowAddresses(escrowId);
    const prepared = await ctx.chain.prepare([
      referenceMemoIx(escrowId),
      await ctx.chain.escrowCreateIx({
        orgId, agentId: unlocked.agent_id, policyId: unlocked.policy_id, escrowId, receiver: address(receiver.address),
        amount: input.amount, taskHash: Buffer.from(taskHash.slice('sha256:'.length), 'hex'), expiresAtSeconds,
      }),
    ]);
    const attestation = attestationHashOf({
      walletId: unlocked.id, recipient: input.toWallet, amount: input.amount, currency: 'USDC', memo: null, category: receiver.category, atMs: nowMs,
    });

    const decided = await ctx.db.transaction(async (tx) => {
      // The organisation first, as a funding or a wallet's creation locks it before its vaults.
      await lockOrganization(tx, orgId);
      // Vaults in id order (lockEscrowVaults): a receiving vault ahead of the payer is locked
      // first, as the escrow's foreign key would lock it after.
      const receiverFirst = receiver.walletId !== null && receiver.walletId < input.fromWallet;
      if (receiverFirst) await assertReceiverOpen(tx, receiver);
      const wallet = await lockWallet(tx, orgId, input.fromWallet);
      await assertActingKeyLive(tx, orgId, options.keyId);
      // Read once the vault is locked, and no earlier than its latest spend (spendWindowsFrom).
      const { atMs: recordedMs, windows: read } = await spendWindowsFrom(tx, [wallet.id], ctx.clock.nowMs());
      if (!receiverFirst) await assertReceiverOpen(tx, receiver);
      const refusal = vaultRefusal(wallet, options.sessionKey ?? null, recordedMs);
      if (refusal) throw refusal;
      if (wallet.policy_id !== unlocked.policy_id) return null;
      // Again under a share lock: a revocation committed while the escrow was signed is seen, and
      // one arriving now waits for this escrow (which it then finds among those naming it).
      if (input.verifierId !== null) await assertVerifierUsable(tx, orgId, input.verifierId, { lock: true });
      const windows = read.get(wallet.id)!;
      const rules = await rulesFor(tx, wallet);
      const decision = evaluate(rules, spendStateOf(windows), {
        amount: input.amount, recipient: input.toWallet, recipientAddress: receiver.address, category: receiver.category,
        categories: receiver.categories, atMs: recordedMs,
      });
      const asPayment = { walletId: wallet.id, to: input.toWallet, amount: input.amount, memo: null, category: receiver.category };
      const asRecipient = { address: receiver.address, category: receiver.category, categories: receiver.categories, domain: null, recipientId: null };
      if (!decision.allowed) {
        await recordBlocked(tx, recordedMs, wallet, asPayment, asRecipient, attestation,
          decision.violation, sendTxId, 'a2a_send', nowMs);
        await options.mark?.(tx, sendTxId);
        return { escrowId: null, violation: decision.violation };
      }
      // An escrow is not held for a co-signature: above requireCoSign it is refused like any other rule.
      if (decision.requiresApproval) {
        const violation: Violation = { rule: 'require_co_sign', limit: formatUsdc(rules.requireCoSign!), attempted: formatUsdc(input.amount) };
        await recordBlocked(tx, recordedMs, wallet, asPayment, asRecipient, attestation,
          violation, sendTxId, 'a2a_send', nowMs);
        await options.mark?.(tx, sendTxId);
        return { escrowId: null, violation };
      }
      if (wallet.balance < input.amount) throw insufficientBalance(wallet, input.amount);
      await assertBelowCount(tx, orgId, {
        noun: 'escrows open on chain',
        countSql: `SELECT count(*)::int AS n FROM escrows WHERE org_id = $1 AND chain_closed_at IS NULL AND status <> 'failed'`,
        max: ctx.config.openEscrowsPerOrgMax,
        advice: 'an escrow counts until it is settled and the escrows.close job has closed its accounts on chain (docs/escrow.md); '
          + 'or ask the operator (AGENT_VAULT_OPEN_ESCROWS_PER_ORG_MAX).',
      });
      const now = new Date(recordedMs);
      await tx.query(
        `INSERT INTO escrows (id, org_id, from_wallet_id, to_wallet, receiver_address, to_wallet_id, receiver_org_id, amount,
           status, closing, closing_signature, closing_valid_height, chain_address, token_address, task_description, task_hash,
           expected_output_hash, verifier_id, lock_signature, expires_at, created_at, updated_at, closing_wire)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'locked', 'create', $9, $10, $11, $12, $13, $14, $15, $16, $9, $17, $18, $18, $19)`,
        [escrowId, orgId, wallet.id, input.toWallet, receiver.address, receiver.walletId, receiver.orgId, input.amount,
          prepared.signature, prepared.lastValidBlockHeight, escrowAddress, escrowToken, input.taskDescription, taskHash,
          input.expectedOutputHash, input.verifierId, new Date(Number(expiresAtSeconds) * 1000), now, prepared.wire]);
      const send = await insertTransaction(tx, recordedMs, {
        id: sendTxId, orgId, walletId: wallet.id, type: 'a2a_send', amount: input.amount, recipient: input.toWallet,
        policyId: wallet.policy_id, attestationHash: attestation, signature: prepared.signature,
        lastValidBlockHeight: prepared.lastValidBlockHeight, escrowId, recipientAddress: receiver.address, spendAtMs: recordedMs,
        attestedAtMs: nowMs, category: receiver.category,
      });
      await insertTransaction(tx, recordedMs, {
        orgId, walletId: wallet.id, type: 'escrow_lock', amount: input.amount, recipient: escrowAddress,
        signature: prepared.signature, lastValidBlockHeight: prepared.lastValidBlockHeight, escrowId,
      });
      await commitSpend(tx, recordedMs, wallet, send.amount, windows);
      await options.mark?.(tx, escrowId);
      return { escrowId, violation: null };
    });
    if (decided === null) continue;
    if (decided.violation) return { escrow: null, violation: decided.violation, sendTxId };
    await submit(ctx, prepared, options.wait);
    return { escrow: await getEscrow(ctx.db, orgId, decided.escrowId), violation: null, sendTxId };
  }
  throw new ServiceError('service_unavailable', 'The wallet\'s policy kept changing while the escrow was signed; retry.');
}

async function submit(ctx: Ctx, prepared: PreparedTransaction, wait: boolean): Promise<void> {
  try {
    await ctx.chain.submit(prepared);
  } catch (error) {
    ctx.log.warn({ err: error, signature: prepared.signature }, 'submitting an escrow transaction failed; the reconciler settles it');
  }
  const settle = awaitSettlement(ctx, prepared.signature, ESCROW_WAIT_MS);
  if (wait) await settle;
  else void settle.catch((error) => ctx.log.warn({ err: error, signature: prepared.signature }, 'background settlement failed'));
}

// ---------------------------------------------------------------------------------------------
// Complete → release

/**
 * An `agent` key's move on an escrow: the vault taking part whose session token the request
 * showed, and the session public key that token matched when the request was authorised.
 */
export interface PartySession {
  walletId: string;
  sessionKey: string;
}

/**
 * Checks again, in the transaction that records an agent's move, that the vault's session is the
 * one its token matched and has not expired (DESIGN §7: a rotation revokes at once). The vault's
 * row is read FOR SHARE, after the escrow's row (and, for a completion, in id order with the
 * other vault): a rotation either committed first and refuses the move, as a payment's would,
 * or waits for the move to commit. Without it, a completion fetching its output for seconds
 * would release on a token rotated meanwhile.
 */
async function assertSessionCurrent(tx: Queryable, session: PartySession, nowMs: number): Promise<void> {
  const [vault] = await tx.query<Pick<WalletRow, 'session_public_key' | 'session_expires_at'>>(
    'SELECT session_public_key, session_expires_at FROM wallets WHERE id = $1 FOR SHARE', [session.walletId]);
  if (!vault || vault.session_public_key !== session.sessionKey) throw sessionTokenInvalid();
  const expiredSession = sessionExpiredError(vault, nowMs);
  if (expiredSession) throw expiredSession;
}

/** The receiver (or the requester) shows a completion proof; verified, the escrow is released to the receiver. */
export async function completeEscrow(
  ctx: Ctx, orgId: string, escrowId: string, proof: ProofInput,
  options: {
    wait: boolean;
    /** an `agent` key's completion: checked again under the vault's lock */
    session?: PartySession | null;
    /** the API key asking: read again under the escrow's lock (revoked during the output's fetch: 401, nothing released) */
    keyId?: string;
  },
): Promise<EscrowRow> {
  const before = await getEscrow(ctx.db, orgId, escrowId);
  assertCompletable(before, ctx.clock.nowMs());
  await verifyProof(ctx.db, ctx.clock.nowMs(), before, proof, { callerOrgId: orgId, allowPrivate: ctx.config.allowPrivateWebhooks });
  const prepared = await prepareEscrowMove(ctx.chain, escrowId, 'release',
    [await ctx.chain.escrowReleaseIx(escrowId, address(before.receiver_address))]);
  await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const escrow = await lockEscrow(tx, orgId, escrowId);
    assertCompletable(escrow, nowMs);
    await assertActingKeyLive(tx, orgId, options.keyId);
    // A vault whose own columns are read under the lock — an attestation's receiving vault, the
    // vault whose session token an agent showed — is locked FOR SHARE, both vaults in id order,
    // before those reads; otherwise recordPayout locks them.
    const read = [proof.proofType === 'signed_attestation' ? escrow.to_wallet_id : null, options.session?.walletId ?? null]
      .filter((id): id is string => id !== null);
    if (read.length > 0) {
      await lockEscrowVaults(tx, [escrow.from_wallet_id, escrow.to_wallet_id].map((id): VaultLock => ({
        id, strength: id !== null && read.includes(id) ? 'SHARE' : 'KEY SHARE',
      })));
    }
    if (options.session) await assertSessionCurrent(tx, options.session, nowMs);
    await recheckProofLocked(tx, nowMs, escrow, proof);
    await tx.query(
      `UPDATE escrows SET status = 'completed', closing = 'release', closing_signature = $2, closing_valid_height = $3,
         proof_type = $4, output_url = $5, completed_at = $6, updated_at = $6, closing_wire = $7 WHERE id = $1`,
      [escrowId, prepared.signature, prepared.lastValidBlockHeight, proof.proofType, proof.outputUrl, new Date(nowMs), prepared.wire]);
    await recordPayout(tx, nowMs, escrow, prepared, escrow.amount, 0n);
    await recordEscrowEvent(tx, nowMs, escrow, 'escrow.completed',
      `Escrow ${escrow.id}: completion proof (${proof.proofType}) verified; releasing ${formatUsdc(escrow.amount)} USDC`, {
        escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
        proof_type: proof.proofType,
      });
  });
  await submit(ctx, prepared, options.wait);
  return getEscrow(ctx.db, orgId, escrowId);
}

function assertCompletable(escrow: EscrowRow, nowMs: number): void {
  if (escrow.closing !== null && escrow.status === 'locked') throw busy(escrow);
  if (SETTLED.has(escrow.status)) throw alreadySettled(escrow);
  if (nowMs >= escrow.expires_at.getTime()) throw expired(escrow);
}

/** A vault an escrow's transaction writes rows for (or reads under the lock), and how strongly it is locked. */
interface VaultLock { id: string | null; strength: 'SHARE' | 'KEY SHARE' }

/**
 * Locks the escrow vaults a transaction touches (the sender's; the receiver's when it is a vault
 * of this service and gets a row) in id order, as payment batches and fundings lock vaults. The
 * foreign keys of the rows an escrow writes lock them too (FOR KEY SHARE), but in the order the
 * rows are written, which could close a cycle with a batch holding both vaults FOR UPDATE.
 * `SHARE` where a vault's own columns are read under the lock.
 */
async function lockEscrowVaults(tx: Queryable, locks: readonly VaultLock[]): Promise<void> {
  const present = locks.filter((lock): lock is VaultLock & { id: string } => lock.id !== null);
  for (const { id, strength } of present.sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0))) {
    await tx.query(`SELECT id FROM wallets WHERE id = $1 FOR ${strength}`, [id]);
  }
}

/**
 * The transaction rows of a payout from the escrow: `escrow_release` (and `a2a_receive` on a
 * receiving vault of this service) for the receiver's leg, `escrow_refund` for the sender's.
 */
async function recordPayout(
  tx: Queryable, nowMs: number, escrow: EscrowRow, prepared: { signature: string; lastValidBlockHeight: bigint },
  toReceiver: bigint, toSender: bigint,
): Promise<void> {
  await lockEscrowVaults(tx, [
    { id: escrow.from_wallet_id, strength: 'KEY SHARE' },
    ...(toReceiver > 0n ? [{ id: escrow.to_wallet_id, strength: 'KEY SHARE' as const }] : []),
  ]);
  const common = { signature: prepared.signature, lastValidBlockHeight: prepared.lastValidBlockHeight, escrowId: escrow.id };
  if (toReceiver > 0n) {
    await insertTransaction(tx, nowMs, {
      ...common, orgId: escrow.org_id, walletId: escrow.from_wallet_id, type: 'escrow_release', amount: toReceiver,
      recipient: escrow.to_wallet,
    });
    if (escrow.to_wallet_id !== null) {
      await insertTransaction(tx, nowMs, {
        ...common, orgId: escrow.receiver_org_id!, walletId: escrow.to_wallet_id, type: 'a2a_receive', amount: toReceiver,
        recipient: escrow.receiver_address,
      });
    }
  }
  if (toSender > 0n) {
    const [sender] = await tx.query<{ chain_address: string }>('SELECT chain_address FROM wallets WHERE id = $1', [escrow.from_wallet_id]);
    await insertTransaction(tx, nowMs, {
      ...common, orgId: escrow.org_id, walletId: escrow.from_wallet_id, type: 'escrow_refund', amount: toSender,
      recipient: sender!.chain_address,
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Timeout → refund

const TICK_BATCH_MAX = 100;

/**
 * The `escrows.tick` job: refunds every locked escrow past its expiry (following the service
 * clock), and settles disputes whose chain transaction the request did not see through.
 */
export async function tickEscrows(ctx: Ctx): Promise<{ refunding: number; disputesSettled: number }> {
  const nowMs = ctx.clock.nowMs();
  const due = await ctx.db.query<{ id: string; org_id: string; refund_failures: number }>(
    `SELECT id, org_id, refund_failures FROM escrows WHERE status = 'locked' AND closing IS NULL AND expires_at <= $1
       AND (refund_retry_at IS NULL OR refund_retry_at <= $1)
     ORDER BY expires_at LIMIT ${TICK_BATCH_MAX}`, [new Date(nowMs)]);
  const sent: PreparedTransaction[] = [];
  for (const { id, org_id: orgId, refund_failures: failures } of due) {
    if (failures >= REFUND_FAILURES_WARNED) {
      ctx.log.warn({ escrowId: id, failures }, 'the chain keeps refusing an expired escrow\'s refund; sending it again');
    }
    try {
      const prepared = await refundExpired(ctx, orgId, id);
      if (prepared) sent.push(prepared);
    } catch (error) {
      ctx.log.warn({ err: error, escrowId: id }, 'refunding an expired escrow failed; retried at the next tick');
    }
  }
  // Sent one after the other, settled together: a slot confirms them all. Moves in flight are
  // sent again by a job of their own (escrows.resend), which this wait never holds up.
  await Promise.all(sent.map((prepared) => submit(ctx, prepared, true)));
  return { refunding: sent.length, disputesSettled: await settleDisputes(ctx) };
}

/** A move in flight for this long (service clock) is sent again at each tick while it can land. */
const RESEND_AFTER_MS = 2_000;

/**
 * The `escrows.resend` job: sends again, as signed, every escrow move in flight for
 * `RESEND_AFTER_MS` whose blockhash still lets it land: the chain may not have kept it, or never
 * got it (a process that died before its embedded validator saved the slot, a cluster node that
 * dropped it, a chain that did not answer the first send). The same bytes, so the chain runs a
 * move at most once; one it ran already answers as before. Without this a lost release waited
 * out its blockhash and failed, and an escrow past its expiry by then was refunded although its
 * completion had been accepted. A job of its own: escrows.tick waits up to ESCROW_WAIT_MS for
 * its refunds to settle, and a release recorded meanwhile must not wait behind them (a chain
 * that came back within a second would otherwise see it only after the escrow's expiry).
 */
export async function resendEscrowMoves(ctx: Ctx): Promise<void> {
  const before = new Date(ctx.clock.nowMs() - RESEND_AFTER_MS);
  // The chain is asked only when a move has been in flight that long (an idle process asks nothing).
  const [any] = await ctx.db.query('SELECT 1 FROM escrows WHERE closing IS NOT NULL AND closing_wire IS NOT NULL AND updated_at <= $1 LIMIT 1', [before]);
  if (!any) return;
  const height = await ctx.chain.getBlockHeight();
  const inFlight = await ctx.db.query<{ id: string; closing_signature: string; closing_wire: string; closing_valid_height: bigint }>(
    `SELECT id, closing_signature, closing_wire, closing_valid_height FROM escrows
     WHERE closing IS NOT NULL AND closing_wire IS NOT NULL AND updated_at <= $1 AND closing_valid_height >= $2
     ORDER BY updated_at LIMIT ${TICK_BATCH_MAX}`, [before, height]);
  await Promise.all(inFlight.map((row) => ctx.chain.submit({
    signature: row.closing_signature as Signature, wire: row.closing_wire as PreparedTransaction['wire'],
    lastValidBlockHeight: row.closing_valid_height,
  }).catch((error: unknown) => ctx.log.warn({ err: error, escrowId: row.id }, 'sending an escrow move again failed; tried at the next tick'))));
}

/** Records the refund of an expired escrow; returns its chain transaction to send, or null when it is not due. */
async function refundExpired(ctx: Ctx, orgId: string, escrowId: string): Promise<PreparedTransaction | null> {
  const escrow = await getEscrow(ctx.db, orgId, escrowId);
  const [sender] = await ctx.db.query<{ chain_address: string }>('SELECT chain_address FROM wallets WHERE id = $1', [escrow.from_wallet_id]);
  const prepared = await prepareEscrowMove(ctx.chain, escrowId, 'refund',
    [await ctx.chain.escrowRefundIx(escrowId, address(sender!.chain_address))]);
  return ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const locked = await lockEscrow(tx, orgId, escrowId);
    if (locked.status !== 'locked' || locked.closing !== null || nowMs < locked.expires_at.getTime()) return null;
    if (locked.refund_retry_at !== null && nowMs < locked.refund_retry_at.getTime()) return null;
    await tx.query(
      `UPDATE escrows SET closing = 'refund', closing_signature = $2, closing_valid_height = $3, updated_at = $4, closing_wire = $5
       WHERE id = $1`,
      [escrowId, prepared.signature, prepared.lastValidBlockHeight, new Date(nowMs), prepared.wire]);
    await recordPayout(tx, nowMs, locked, prepared, 0n, locked.amount);
    return prepared;
  });
}

// ---------------------------------------------------------------------------------------------
// Decline

/**
 * The receiving side turns a locked escrow down: the requester has its money back at once, as at
 * its timeout, instead of when it expires; a vault that never asked for the work need not wait
 * up to 30 days to be archived. Signed by the service's arbiter key, the one key the program lets
 * refund before the expiry. Only the receiving organisation (an agent: with the receiving vault's
 * token), only a locked escrow with no move in flight, only before its expiry (the timeout
 * refunds it then).
 */
export async function declineEscrow(
  ctx: Ctx, orgId: string, escrowId: string, options: { wait: boolean; session: PartySession | null; keyId: string },
): Promise<EscrowRow> {
  const before = await getEscrow(ctx.db, orgId, escrowId);
  assertDeclinable(before, orgId, options.session, ctx.clock.nowMs());
  const [sender] = await ctx.db.query<{ chain_address: string }>('SELECT chain_address FROM wallets WHERE id = $1', [before.from_wallet_id]);
  const prepared = await prepareEscrowMove(ctx.chain, escrowId, 'decline',
    [await ctx.chain.escrowRefundIx(escrowId, address(sender!.chain_address), true)]);
  await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const escrow = await lockEscrow(tx, orgId, escrowId);
    assertDeclinable(escrow, orgId, options.session, nowMs);
    await assertActingKeyLive(tx, orgId, options.keyId);
    if (options.session) {
      await lockEscrowVaults(tx, [escrow.from_wallet_id, escrow.to_wallet_id].map((id): VaultLock => ({
        id, strength: id === options.session!.walletId ? 'SHARE' : 'KEY SHARE',
      })));
      await assertSessionCurrent(tx, options.session, nowMs);
    }
    await tx.query(
      `UPDATE escrows SET closing = 'decline', closing_signature = $2, closing_valid_height = $3, updated_at = $4, closing_wire = $5
       WHERE id = $1`,
      [escrowId, prepared.signature, prepared.lastValidBlockHeight, new Date(nowMs), prepared.wire]);
    await recordPayout(tx, nowMs, escrow, prepared, 0n, escrow.amount);
  });
  await submit(ctx, prepared, options.wait);
  return getEscrow(ctx.db, orgId, escrowId);
}

function assertDeclinable(escrow: EscrowRow, orgId: string, session: PartySession | null, nowMs: number): void {
  // Within one organisation its admins and operators opened it too: only the receiving vault's
  // agent declines there, or the requester would have a way to take its money back early.
  const withinOne = escrow.org_id === escrow.receiver_org_id;
  if (escrow.receiver_org_id !== orgId || (session !== null && session.walletId !== escrow.to_wallet_id) || (withinOne && session === null)) {
    throw new ServiceError('insufficient_permissions', withinOne
      ? `Escrow ${escrow.id} is between two vaults of your organisation: only an agent with the receiving vault's Session-Token declines it.`
      : `Only the receiving side declines escrow ${escrow.id}: the organisation of its receiving vault, or an agent with that vault's token.`);
  }
  if (escrow.closing !== null && escrow.status === 'locked') throw busy(escrow);
  if (escrow.status !== 'locked') throw alreadySettled(escrow);
  if (nowMs >= escrow.expires_at.getTime()) throw expired(escrow);
}

// ---------------------------------------------------------------------------------------------
// Dispute and resolution

export interface DisputeInput {
  reason: string;
  evidence: string | null;
}

/** Either party raises a dispute before the timeout: only an arbiter settles the escrow then. */
export async function disputeEscrow(
  ctx: Ctx, orgId: string, keyId: string, escrowId: string, input: DisputeInput,
  options: {
    /** an `agent` key's dispute: checked again under the vault's lock */
    session?: PartySession | null;
  } = {},
): Promise<EscrowRow> {
  const before = await getEscrow(ctx.db, orgId, escrowId);
  assertCompletable(before, ctx.clock.nowMs());
  const prepared = await prepareEscrowMove(ctx.chain, escrowId, 'dispute', [await ctx.chain.escrowDisputeIx(escrowId)]);
  await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const escrow = await lockEscrow(tx, orgId, escrowId);
    assertCompletable(escrow, nowMs);
    await assertActingKeyLive(tx, orgId, keyId);
    if (options.session) await assertSessionCurrent(tx, options.session, nowMs);
    const dispute = {
      raised_by_org: orgId, raised_by_key: keyId, reason: input.reason, evidence: input.evidence, raised_at: new Date(nowMs).toISOString(),
    };
    await tx.query(
      `UPDATE escrows SET closing = 'dispute', closing_signature = $2, closing_valid_height = $3, dispute = $4, updated_at = $5,
         closing_wire = $6 WHERE id = $1`,
      [escrowId, prepared.signature, prepared.lastValidBlockHeight, JSON.stringify(dispute), new Date(nowMs), prepared.wire]);
  });
  try {
    await ctx.chain.submit(prepared);
  } catch (error) {
    ctx.log.warn({ err: error, signature: prepared.signature }, 'submitting a dispute failed; escrows.tick settles it');
  }
  let refusedAs: string | null = null;
  try {
    const outcome = await ctx.chain.waitForOutcome(prepared.signature, ESCROW_WAIT_MS);
    refusedAs = outcome.err?.name ?? null;
    await settleDispute(ctx.db, ctx.clock.nowMs(), escrowId, prepared.signature, refusedAs);
  } catch (error) {
    ctx.log.warn({ err: error, escrowId }, 'no outcome for the dispute yet; escrows.tick settles it');
  }
  const after = await getEscrow(ctx.db, orgId, escrowId);
  // It reached the chain after the expiry (asked at its very end): refused there, as here after it.
  if (refusedAs === 'EscrowExpired') throw expired(after);
  return after;
}

/** A dispute's chain outcome: disputed with `escrow.disputed`, or back to locked when the chain refused it. */
async function settleDispute(db: Database, nowMs: number, escrowId: string, signature: string, error: string | null): Promise<void> {
  await db.transaction(async (tx) => {
    const [escrow] = await tx.query<EscrowRow>(
      `SELECT * FROM escrows WHERE id = $1 AND closing = 'dispute' AND closing_signature = $2 FOR UPDATE`, [escrowId, signature]);
    if (!escrow) return;
    if (error !== null) {
      await tx.query(
        `UPDATE escrows SET closing = NULL, closing_signature = NULL, closing_wire = NULL, closing_valid_height = NULL, dispute = NULL, updated_at = $2
         WHERE id = $1`, [escrowId, new Date(nowMs)]);
      // Told, as a refused release is: the party that disputed learns no arbiter will decide it.
      await recordEscrowEvent(tx, nowMs, escrow, 'escrow.dispute_failed',
        `Escrow ${escrow.id}: its dispute was refused on chain (${error}); it is locked again`, {
          escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
          tx_signature: signature, reason: error, status: 'locked', expires_at: escrow.expires_at.toISOString(),
          raised_by_org: escrow.dispute!.raised_by_org,
        });
      return;
    }
    await tx.query(
      `UPDATE escrows SET status = 'disputed', closing = NULL, closing_signature = NULL, closing_wire = NULL, closing_valid_height = NULL, updated_at = $2
       WHERE id = $1`, [escrowId, new Date(nowMs)]);
    const payload = {
      escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
      reason: escrow.dispute!.reason, evidence: escrow.dispute!.evidence, raised_by_org: escrow.dispute!.raised_by_org,
    };
    await recordEscrowEvent(tx, nowMs, escrow, 'escrow.disputed',
      `Escrow ${escrow.id} of ${formatUsdc(escrow.amount)} USDC disputed: ${escrow.dispute!.reason.slice(0, 120)}`, payload);
  });
}

async function settleDisputes(ctx: Ctx): Promise<number> {
  const open = await ctx.db.query<{ id: string; closing_signature: string; closing_valid_height: bigint }>(
    `SELECT id, closing_signature, closing_valid_height FROM escrows WHERE closing = 'dispute' ORDER BY updated_at LIMIT ${TICK_BATCH_MAX}`);
  if (!open.length) return 0;
  // The height before the statuses, as reconcilePending reads them: a status read after the
  // height is at least as recent, so a dispute it does not find had not landed by that height
  // either. Read the other way round, a dispute landing between the two reads (in its last valid
  // blocks) would be unknown to the statuses and past expiry to the height: judged expired, and
  // put back to locked while the chain holds it disputed.
  const height = await ctx.chain.getBlockHeight();
  const outcomes = await ctx.chain.getOutcomes(open.map((row) => row.closing_signature as Signature));
  let settled = 0;
  for (const [index, row] of open.entries()) {
    const outcome = outcomes[index];
    if (outcome) {
      await settleDispute(ctx.db, ctx.clock.nowMs(), row.id, row.closing_signature, outcome.err?.name ?? null);
      settled += 1;
    } else if (height > row.closing_valid_height + EXPIRY_MARGIN_BLOCKS) {
      await settleDispute(ctx.db, ctx.clock.nowMs(), row.id, row.closing_signature, EXPIRED);
      settled += 1;
    }
  }
  return settled;
}

export interface Resolution {
  toReceiver: bigint;
  toSender: bigint;
}

/**
 * The service's arbiter (`isServiceArbiter`) settles a disputed escrow of any organisation: all to
 * the receiver, all back, or a split; written on chain.
 */
export async function resolveEscrow(
  ctx: Ctx, arbiter: { orgId: string; role: string; keyId: string }, escrowId: string, split: Resolution, options: { wait: boolean },
): Promise<EscrowRow> {
  if (!(await isServiceArbiter(ctx.db, arbiter))) throw notServiceArbiter();
  const keyId = arbiter.keyId;
  const before = await getEscrow(ctx.db, arbiter.orgId, escrowId, { serviceArbiter: true });
  const orgId = before.org_id;
  assertResolvable(before, split);
  const [sender] = await ctx.db.query<{ chain_address: string }>('SELECT chain_address FROM wallets WHERE id = $1', [before.from_wallet_id]);
  // All back to the sender is the program's refund, signed by the arbiter: like a timeout's, it
  // gives the vault's day its allowance back on chain, as the service gives its windows back.
  // (Its resolve instruction does not, and the chain would then refuse payments the policy allows.)
  const payout = split.toReceiver === 0n
    ? await ctx.chain.escrowRefundIx(escrowId, address(sender!.chain_address), true)
    : await ctx.chain.escrowResolveIx(escrowId, address(before.receiver_address), address(sender!.chain_address), split);
  const prepared = await prepareEscrowMove(ctx.chain, escrowId, 'resolve', [payout]);
  await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const escrow = await lockEscrow(tx, orgId, escrowId);
    assertResolvable(escrow, split);
    await assertActingKeyLive(tx, arbiter.orgId, keyId);
    const resolution = {
      to_receiver: formatUsdc(split.toReceiver), to_sender: formatUsdc(split.toSender), decided_by: keyId,
      decided_at: new Date(nowMs).toISOString(),
    };
    await tx.query(
      `UPDATE escrows SET closing = 'resolve', closing_signature = $2, closing_valid_height = $3, resolution = $4, updated_at = $5,
         closing_wire = $6 WHERE id = $1`,
      [escrowId, prepared.signature, prepared.lastValidBlockHeight, JSON.stringify(resolution), new Date(nowMs), prepared.wire]);
    await recordPayout(tx, nowMs, escrow, prepared, split.toReceiver, split.toSender);
  });
  await submit(ctx, prepared, options.wait);
  return getEscrow(ctx.db, orgId, escrowId);
}

function assertResolvable(escrow: EscrowRow, split: Resolution): void {
  if (escrow.closing === 'dispute') {
    // About to be disputed: decidable in a moment.
    throw retryShortly(`Escrow ${escrow.id}'s dispute is landing on chain: retry shortly.`, CREATING_RETRY_AFTER_S,
      { escrow_id: escrow.id, status: escrow.status, in_flight: escrow.closing });
  }
  if (escrow.closing !== null && escrow.status === 'locked') throw busy(escrow);
  if (escrow.status === 'locked') {
    // Not settled (escrow_already_settled would say it is): not in a state a decision takes.
    throw new ServiceError('invalid_request',
      `Escrow ${escrow.id} is locked: only a disputed escrow is resolved (either party disputes it first).`,
      { param: 'escrow_id', escrow_id: escrow.id, status: escrow.status });
  }
  if (escrow.status !== 'disputed') {
    throw new ServiceError('escrow_already_settled', `Escrow ${escrow.id} is ${escrow.status}: only a disputed escrow is resolved.`,
      { escrow_id: escrow.id, status: escrow.status });
  }
  if (escrow.closing !== null) throw busy(escrow);
  if (split.toReceiver + split.toSender !== escrow.amount) {
    throw new ServiceError('invalid_amount', `The split must add up to the escrow's ${formatUsdc(escrow.amount)} USDC.`,
      { param: 'to_receiver' });
  }
}

// ---------------------------------------------------------------------------------------------
// Settlement: what each escrow transaction's chain outcome does

/** The escrow's final status after its payout landed. */
function statusAfterPayout(escrow: EscrowRow): EscrowStatus {
  if (escrow.closing === 'release') return 'released';
  if (escrow.closing === 'refund' || escrow.closing === 'decline') return 'refunded';
  const toReceiver = escrow.resolution?.to_receiver ?? '0.00';
  const toSender = escrow.resolution?.to_sender ?? '0.00';
  if (Number(toSender) === 0) return 'released';
  if (Number(toReceiver) === 0) return 'refunded';
  return 'resolved';
}

/**
 * Ends the escrow's move in flight once, whichever of its rows settles first (the rows of one
 * chain transaction settle in one database transaction). Returns the escrow as it was.
 */
async function finishClosing(tx: Queryable, nowMs: number, row: TransactionRow, confirmed: boolean): Promise<EscrowRow | null> {
  const [escrow] = await tx.query<EscrowRow>(
    'SELECT * FROM escrows WHERE id = $1 AND closing_signature = $2 FOR UPDATE', [row.escrow_id, row.tx_signature]);
  if (!escrow) return null;
  const now = new Date(nowMs);
  if (confirmed) {
    const status = escrow.closing === 'create' ? 'locked' : statusAfterPayout(escrow);
    const settledAt = escrow.closing === 'create' ? null : now;
    await tx.query(
      `UPDATE escrows SET status = $2, closing = NULL, closing_signature = NULL, closing_wire = NULL, closing_valid_height = NULL, updated_at = $3,
         settled_at = $4, settle_signature = CASE WHEN $4::timestamptz IS NULL THEN settle_signature ELSE $5 END WHERE id = $1`,
      [escrow.id, status, now, settledAt, row.tx_signature]);
    await writeClosingEvents(tx, nowMs, escrow, status, row.tx_signature!);
  } else {
    // The chain refused the move: a refused creation never locked anything; a refused payout
    // leaves the escrow as it was before (a release after the expiry: the timeout refunds it).
    const status = escrow.closing === 'create' ? 'failed' : escrow.closing === 'resolve' ? 'disputed' : 'locked';
    // A refused timeout refund is sent again later and later: a refusal that repeats (the
    // escrow's account no longer locked, a chain clock behind the service's) costs a row and a
    // fee each time, and would hold a place in every batch of the refunding job.
    // A refund that never landed (its blockhash expired: a congested or stopped chain) was not
    // refused: it is sent again at the next tick, without adding to the back-off.
    const refused = escrow.closing === 'refund' && row.failure_reason !== EXPIRED;
    const refundFailures = refused ? escrow.refund_failures + 1 : escrow.refund_failures;
    const refundRetryAt = refused ? new Date(nowMs + refundRetryDelayMs(refundFailures)) : escrow.refund_retry_at;
    // A refused release also takes back what its completion set: the escrow is locked again, with
    // no proof that took effect.
    await tx.query(
      `UPDATE escrows SET status = $2, closing = NULL, closing_signature = NULL, closing_wire = NULL, closing_valid_height = NULL,
         resolution = CASE WHEN closing = 'resolve' THEN NULL ELSE resolution END, updated_at = $3,
         completed_at = CASE WHEN closing = 'release' THEN NULL ELSE completed_at END,
         proof_type = CASE WHEN closing = 'release' THEN NULL ELSE proof_type END,
         output_url = CASE WHEN closing = 'release' THEN NULL ELSE output_url END,
         settled_at = CASE WHEN $2 = 'failed' THEN $3 ELSE settled_at END,
         refund_failures = $4, refund_retry_at = $5 WHERE id = $1`,
      [escrow.id, status, now, refundFailures, refundRetryAt]);
    // Told, so that a party waiting for `escrow.released` after `escrow.completed` does not wait
    // for ever: the escrow can be completed again before its expiry, or is refunded at it.
    if (escrow.closing === 'release') {
      await recordEscrowEvent(tx, nowMs, escrow, 'escrow.release_failed',
        `Escrow ${escrow.id}: its release was refused on chain (${row.failure_reason ?? 'unknown'}); it is locked again`, {
          escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
          tx_signature: row.tx_signature, reason: row.failure_reason, status: 'locked', expires_at: escrow.expires_at.toISOString(),
        });
    }
    // An arbiter's decision that did not land (refused, or lost and not sent again in time) is
    // taken back: the escrow waits for a decision again, and both parties are told rather than
    // finding it disputed with no trace of the decision. The service's arbiters see it among the
    // disputed escrows of their list again.
    if (escrow.closing === 'resolve') {
      await recordEscrowEvent(tx, nowMs, escrow, 'escrow.resolve_failed',
        `Escrow ${escrow.id}: the arbiter's decision did not take effect on chain (${row.failure_reason ?? 'unknown'}); it is disputed again`, {
          escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
          tx_signature: row.tx_signature, reason: row.failure_reason, status: 'disputed', resolution: escrow.resolution,
        });
    }
  }
  return escrow;
}

/** The first refused refund is sent again after a second, each next one after twice as long, at most an hour. */
const REFUND_RETRY_FIRST_MS = 1_000;
const REFUND_RETRY_MAX_MS = 60 * 60 * 1000;
/** From this many refused refunds of one escrow on, each is logged as a warning. */
const REFUND_FAILURES_WARNED = 5;

export function refundRetryDelayMs(failures: number): number {
  return backoffMs(failures, REFUND_RETRY_FIRST_MS, REFUND_RETRY_MAX_MS);
}

/**
 * An escrow event, written to both organisations when the receiver is a vault of another one
 * (each with its own vault as the event's wallet); within one organisation, once, under the
 * paying vault and naming the receiving one, whose feed shows it too.
 */
async function recordEscrowEvent(
  tx: Queryable, nowMs: number, escrow: EscrowRow, type: EventType, summary: string, payload: Record<string, unknown>,
): Promise<void> {
  const receiverOrg = escrow.receiver_org_id ?? escrow.org_id;
  if (receiverOrg === escrow.org_id) {
    await recordEvent(tx, nowMs, { orgId: escrow.org_id, type, walletId: escrow.from_wallet_id, relatedWalletId: escrow.to_wallet_id, summary, payload });
    return;
  }
  await recordEvents(tx, nowMs, [
    { orgId: escrow.org_id, type, walletId: escrow.from_wallet_id, summary, payload },
    { orgId: receiverOrg, type, walletId: escrow.to_wallet_id, summary, payload },
  ]);
}

async function writeClosingEvents(tx: Queryable, nowMs: number, escrow: EscrowRow, status: EscrowStatus, signature: string): Promise<void> {
  const base = {
    escrow_id: escrow.id, from_wallet: escrow.from_wallet_id, to_wallet: escrow.to_wallet, amount: formatUsdc(escrow.amount),
    tx_signature: signature,
  };
  const both = (type: EventType, summary: string, payload: Record<string, unknown>) => recordEscrowEvent(tx, nowMs, escrow, type, summary, payload);
  if (escrow.closing === 'create') {
    await both('escrow.created', `Escrow ${escrow.id}: ${formatUsdc(escrow.amount)} USDC locked for ${escrow.to_wallet}`,
      { ...base, expires_at: escrow.expires_at.toISOString(), task_hash: escrow.task_hash });
    return;
  }
  const resolution = escrow.closing === 'resolve' ? { resolution: { to_receiver: escrow.resolution!.to_receiver, to_sender: escrow.resolution!.to_sender } } : {};
  if (status === 'released') {
    await both('escrow.released', `Escrow ${escrow.id}: ${formatUsdc(escrow.amount)} USDC released to ${escrow.to_wallet}`, { ...base, ...resolution });
  } else if (status === 'refunded') {
    const afterDispute = escrow.closing === 'resolve';
    const reason = afterDispute ? 'dispute' : escrow.closing === 'decline' ? 'declined' : 'timeout';
    await both('escrow.refunded',
      `Escrow ${escrow.id}: ${formatUsdc(escrow.amount)} USDC refunded to ${escrow.from_wallet_id} (${afterDispute ? 'after a dispute' : reason})`,
      { ...base, reason, after_dispute: afterDispute, ...resolution });
  } else {
    await both('escrow.resolved',
      `Escrow ${escrow.id} split: ${escrow.resolution!.to_receiver} USDC to ${escrow.to_wallet}, ${escrow.resolution!.to_sender} back`,
      { ...base, ...resolution });
  }
}

const nothing = async () => {};

registerSettlementRule('a2a_send', {
  async confirmed(tx, nowMs, row) {
    await finishClosing(tx, nowMs, row, true);
    // An escrow moves money out of the vault as a payment does: the large-transaction alert too.
    await recordEvents(tx, nowMs, await largeTransactionAlerts(tx, [row]));
  },
  async failed(tx, nowMs, row) {
    await tx.query('UPDATE wallets SET balance = balance + $2 WHERE id = $1', [row.wallet_id, row.amount]);
    await withdrawSpend(tx, row.wallet_id!, row.id);
    await finishClosing(tx, nowMs, row, false);
    await recordTransactionFailed(tx, nowMs, row, `Escrow ${row.escrow_id} of ${formatUsdc(row.amount)} USDC (its lock)`);
  },
});
registerSettlementRule('escrow_lock', { confirmed: nothing, failed: nothing });
registerSettlementRule('escrow_release', {
  async confirmed(tx, nowMs, row) { await finishClosing(tx, nowMs, row, true); },
  async failed(tx, nowMs, row) { await finishClosing(tx, nowMs, row, false); },
});
registerSettlementRule('a2a_receive', {
  async confirmed(tx, nowMs, row) {
    await tx.query('UPDATE wallets SET balance = balance + $2, last_transaction_at = $3 WHERE id = $1',
      [row.wallet_id, row.amount, new Date(nowMs)]);
  },
  failed: nothing,
});
registerSettlementRule('escrow_refund', {
  async confirmed(tx, nowMs, row) {
    await tx.query('UPDATE wallets SET balance = balance + $2, last_transaction_at = $3 WHERE id = $1',
      [row.wallet_id, row.amount, new Date(nowMs)]);
    const escrow = await finishClosing(tx, nowMs, row, true);
    // A refund in full gives the requester's budgets back: the money never left its control.
    if (escrow && statusAfterPayout(escrow) === 'refunded') {
      const [send] = await tx.query<{ id: string }>(
        `SELECT id FROM transactions WHERE escrow_id = $1 AND type = 'a2a_send' AND status = 'confirmed'`, [row.escrow_id]);
      if (send) await withdrawSpend(tx, row.wallet_id!, send.id);
    }
  },
  async failed(tx, nowMs, row) { await finishClosing(tx, nowMs, row, false); },
});
