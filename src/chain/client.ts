/**
 * The chain client: every operation the service performs on Solana, through JSON-RPC only,
 * so one code path serves the embedded local validator and a real cluster.
 *
 * A transaction is prepared (built and signed) before it is sent, so its signature is known
 * and can be recorded first; after a crash the signature is enough to find out what happened.
 */
import {
  address,
  appendTransactionMessageInstructions,
  createTransactionMessage,
  getBase64EncodedWireTransaction,
  getSignatureFromTransaction,
  pipe,
  setTransactionMessageFeePayerSigner,
  setTransactionMessageLifetimeUsingBlockhash,
  signTransactionMessageWithSigners,
  type Address,
  type Base64EncodedWireTransaction,
  type Blockhash,
  type Instruction,
  type KeyPairSigner,
  type Rpc,
  type Signature,
  type SolanaRpcApi,
} from '@solana/kit';
import { ServiceError } from '../errors/errors.ts';
import type { PublishedStatus } from '../validator/validator.ts';
import * as program from './program.ts';
import { FastSigner } from './signing.ts';

export type SolanaRpc = Rpc<SolanaRpcApi>;

/** SPL Memo (v3): present on every cluster and in LiteSVM. */
export const MEMO_PROGRAM = address('MemoSq4gqABAXKb96qnH8TysNcWxMyWCqXgDLGmfcHr');
const MEMO_REFERENCE_MAX_BYTES = 64;

/**
 * A memo naming the service's record of a transaction (`agent-vault:tx_…`). It links the chain
 * transaction to its record for anyone reading the chain, and makes two transactions with the
 * same instructions distinct, so they never share a signature (which the chain would run once).
 */
export function referenceMemoIx(reference: string): Instruction {
  const data = new TextEncoder().encode(`agent-vault:${reference}`);
  if (data.length > MEMO_REFERENCE_MAX_BYTES) throw new Error('memo reference too long');
  return { programAddress: MEMO_PROGRAM, accounts: [], data };
}

export interface PreparedTransaction {
  signature: Signature;
  wire: Base64EncodedWireTransaction;
  /** The transaction cannot land after this block height. */
  lastValidBlockHeight: bigint;
}

export interface ChainError {
  /** index of the failing instruction, when the error is an instruction error */
  instructionIndex: number | null;
  /** the program's custom error code, when there is one */
  code: number | null;
  /** program error name (docs/program.md) or the runtime's error text */
  name: string;
  raw: unknown;
}

export interface TransactionOutcome {
  signature: Signature;
  slot: bigint;
  err: ChainError | null;
}

/**
 * A call to the chain that did not answer within its time: the chain is a dependency that is
 * down, answered 503 `service_unavailable`, not a request held for minutes (fetch's own limit is
 * 300 s, past an idempotency key's lease).
 */
export class ChainUnavailableError extends ServiceError {
  constructor(method: string, timeoutMs: number) {
    super('service_unavailable', `The chain did not answer ${method} within ${timeoutMs} ms; retry (with the same idempotency key).`);
  }
}

/** Every RPC call of the client ends within this by default (ChainClientOptions.callTimeoutMs). */
export const RPC_CALL_TIMEOUT_MS = 10_000;

export class ConfirmationTimeoutError extends Error {
  constructor(readonly signature: Signature, timeoutMs: number) {
    super(`transaction ${signature} not confirmed within ${timeoutMs} ms`);
    this.name = 'ConfirmationTimeoutError';
  }
}

/**
 * `prepare` found no blockhash in time that makes the transaction differ from an identical one
 * it prepared before (several identical requests at once: one blockhash each, one a slot).
 */
export class NoDistinctBlockhashError extends Error {
  constructor() {
    super('no new blockhash to make this transaction distinct from an earlier identical one');
    this.name = 'NoDistinctBlockhashError';
  }
}

/** Turns a transaction error as JSON-RPC reports it into something the service can branch on. */
export function parseChainError(raw: unknown): ChainError {
  if (raw && typeof raw === 'object' && 'InstructionError' in raw) {
    const [index, inner] = (raw as { InstructionError: [number, unknown] }).InstructionError;
    if (inner && typeof inner === 'object' && 'Custom' in inner) {
      const code = Number((inner as { Custom: number | bigint }).Custom);
      return { instructionIndex: Number(index), code, name: program.programErrorName(code) ?? `Custom(${code})`, raw };
    }
    return { instructionIndex: Number(index), code: null, name: String(inner), raw };
  }
  return { instructionIndex: null, code: null, name: typeof raw === 'string' ? raw : JSON.stringify(raw, jsonBigint), raw };
}

/** A JSON value with every number made a bigint, as kit's RPC answers carry them. */
function withBigints(value: unknown): unknown {
  if (typeof value === 'number') return Number.isInteger(value) ? BigInt(value) : value;
  if (Array.isArray(value)) return value.map(withBigints);
  if (value && typeof value === 'object') return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, withBigints(v)]));
  return value;
}

function jsonBigint(_key: string, value: unknown): unknown {
  return typeof value === 'bigint' ? value.toString() : value;
}

export interface ChainClientOptions {
  rpc: SolanaRpc;
  programId: Address;
  usdcMint: Address;
  /** the service's key: it signs and pays for every transaction */
  operator: KeyPairSigner;
  /**
   * signs escrow refunds before expiry and dispute resolutions. A key of its own, not the
   * operator's: the program refuses the same account twice in one instruction, and keeping
   * the two apart means the operator key alone cannot refund an escrow early.
   */
  arbiter: KeyPairSigner;
  /** how often outstanding signatures are polled (default 100 ms) */
  pollIntervalMs?: number;
  /** how long a fetched blockhash is reused (default 5 s; clusters accept ~60 s) */
  blockhashMaxAgeMs?: number;
  /** each RPC call fails with ChainUnavailableError after this long (default RPC_CALL_TIMEOUT_MS) */
  callTimeoutMs?: number;
  /**
   * the chain runs inside this process (the embedded validator): a transaction it took but has
   * not yet persisted is lost with the process all the same, so waiting for it to be taken
   * protects nothing (default false)
   */
  embedded?: boolean;
  /**
   * subscribes to the statuses the chain makes visible (the embedded validator's publish): the
   * transactions waited for among them resolve at once, without a poll; the interval's poll
   * remains for the rest (a signature published before it was waited for, a lost message)
   */
  onPublished?: (listener: (statuses: readonly PublishedStatus[]) => void) => void;
}

interface Waiter {
  resolve(outcome: TransactionOutcome): void;
  reject(error: Error): void;
}

/** JSON-RPC caps getSignatureStatuses at 256 signatures per call. */
const STATUS_BATCH_MAX = 256;
/** And getMultipleAccounts at 100 accounts. */
const MULTIPLE_ACCOUNTS_MAX = 100;
/** Recently prepared signatures remembered to keep deliberate repeats distinct. */
const PREPARED_SIGNATURES_MAX = 200_000;
/**
 * An identical transaction waits for the next blockhash, asking every PREPARE_RETRY_MS for up to
 * PREPARE_WAIT_MS: a few slots (400 ms each on a cluster and on the notional slots of slotMs 0).
 */
const PREPARE_RETRY_MS = 20;
const PREPARE_WAIT_MS = 3_000;
/** Bounded caches: a PDA costs a few hashes to derive; thousands of vaults fit easily. */
const PDA_CACHE_MAX = 100_000;

export class ChainClient {
  readonly rpc: SolanaRpc;
  readonly programId: Address;
  readonly usdcMint: Address;
  readonly operator: KeyPairSigner;
  readonly arbiter: KeyPairSigner;
  /** ChainClientOptions.embedded */
  readonly embedded: boolean;
  readonly #pollIntervalMs: number;
  readonly #blockhashMaxAgeMs: number;
  readonly #callTimeoutMs: number;
  #blockhash: { value: { blockhash: Blockhash; lastValidBlockHeight: bigint }; fetchedAtMs: number } | null = null;
  #blockhashInFlight: Promise<{ blockhash: Blockhash; lastValidBlockHeight: bigint }> | null = null;
  readonly #pdas = new Map<string, Promise<program.Pda>>();
  readonly #atas = new Map<string, Promise<Address>>();
  readonly #waiters = new Map<Signature, Waiter[]>();
  readonly #prepared = new Set<Signature>();
  readonly #signer: FastSigner;
  readonly #reserved: ReadonlyMap<string, string>;
  #pollTimer: NodeJS.Timeout | null = null;
  #polling = false;

  constructor(options: ChainClientOptions) {
    this.rpc = options.rpc;
    this.programId = options.programId;
    this.usdcMint = options.usdcMint;
    this.operator = options.operator;
    this.arbiter = options.arbiter;
    if (this.arbiter.address === this.operator.address) throw new Error('the arbiter key must differ from the operator key');
    this.embedded = options.embedded ?? false;
    this.#pollIntervalMs = options.pollIntervalMs ?? 100;
    this.#blockhashMaxAgeMs = options.blockhashMaxAgeMs ?? 5_000;
    this.#callTimeoutMs = options.callTimeoutMs ?? RPC_CALL_TIMEOUT_MS;
    this.#signer = new FastSigner([this.operator, this.arbiter]);
    this.#reserved = new Map([
      [this.operator.address, 'the service\'s operator key'], [this.arbiter.address, 'the service\'s arbiter key'],
      [this.usdcMint, 'the USDC mint'], [this.programId, 'the Agent Vault program'],
      [program.SYSTEM_PROGRAM, 'the System Program'], [program.TOKEN_PROGRAM, 'the SPL Token program'],
      [program.ATA_PROGRAM, 'the Associated Token Account program'], [MEMO_PROGRAM, 'the SPL Memo program'],
    ]);
    options.onPublished?.((statuses) => this.#resolvePublished(statuses));
  }

  // -------------------------------------------------------------------------------------------
  // Addresses

  /**
   * What `address` is, when it is an account no payment can go to: a key of the service, the
   * USDC mint, or a program its transactions call. The operator key, the mint and the System,
   * Token and ATA programs are accounts of the payment's own instruction, which the program
   * refuses to name twice (the chain would fail the payment after it was recorded); the arbiter
   * key is the service's (credited, the money would be in no index); a program's token account
   * is one nothing could spend. Null for any other address.
   */
  reservedAccount(address: string): string | null {
    return this.#reserved.get(address) ?? null;
  }

  #cachedPda(key: string, derive: () => Promise<program.Pda>): Promise<program.Pda> {
    let pda = this.#pdas.get(key);
    if (!pda) {
      if (this.#pdas.size >= PDA_CACHE_MAX) this.#pdas.clear();
      pda = derive();
      this.#pdas.set(key, pda);
    }
    return pda;
  }

  ata(owner: Address): Promise<Address> {
    let ata = this.#atas.get(owner);
    if (!ata) {
      if (this.#atas.size >= PDA_CACHE_MAX) this.#atas.clear();
      ata = program.findAssociatedTokenAddress(owner, this.usdcMint);
      this.#atas.set(owner, ata);
    }
    return ata;
  }

  async reserveAddresses(orgId: string): Promise<{ reserve: Address; reserveToken: Address }> {
    const { address: reserve } = await this.#cachedPda(`r:${orgId}`, () =>
      program.findReservePda(this.programId, program.seedOf(orgId)));
    return { reserve, reserveToken: await this.ata(reserve) };
  }

  /** A vault's address is deterministic from (organisation, agent). */
  async vaultAddresses(orgId: string, agentId: string): Promise<{ vault: Address; vaultToken: Address }> {
    const { address: vault } = await this.#cachedPda(`v:${orgId}:${agentId}`, () =>
      program.findVaultPda(this.programId, program.seedOf(orgId), program.seedOf(agentId)));
    return { vault, vaultToken: await this.ata(vault) };
  }

  async policyAddress(orgId: string, policyId: string): Promise<Address> {
    const { address } = await this.#cachedPda(`p:${orgId}:${policyId}`, () =>
      program.findPolicyPda(this.programId, program.policyKeyOf(orgId, policyId)));
    return address;
  }

  async escrowAddresses(escrowId: string): Promise<{ escrow: Address; escrowToken: Address }> {
    const { address: escrow } = await this.#cachedPda(`e:${escrowId}`, () =>
      program.findEscrowPda(this.programId, program.seedOf(escrowId)));
    return { escrow, escrowToken: await this.ata(escrow) };
  }

  // -------------------------------------------------------------------------------------------
  // Instructions, by service identifiers

  async initReserveIx(orgId: string): Promise<Instruction> {
    const { reserve, reserveToken } = await this.reserveAddresses(orgId);
    return program.initReserve(this.programId,
      { operator: this.operator, reserve, reserveToken, mint: this.usdcMint }, program.seedOf(orgId));
  }

  async setPolicyIx(orgId: string, policyId: string, limits: program.PolicyLimits): Promise<Instruction> {
    const policy = await this.policyAddress(orgId, policyId);
    return program.setPolicy(this.programId, { operator: this.operator, policy },
      program.policyKeyOf(orgId, policyId), limits);
  }

  async createVaultIx(orgId: string, agentId: string, policyId: string): Promise<Instruction> {
    const [{ reserve }, { vault, vaultToken }, policy] = await Promise.all([
      this.reserveAddresses(orgId), this.vaultAddresses(orgId, agentId), this.policyAddress(orgId, policyId)]);
    return program.createVault(this.programId,
      { operator: this.operator, reserve, vault, vaultToken, policy, mint: this.usdcMint },
      program.seedOf(orgId), program.seedOf(agentId));
  }

  async attachPolicyIx(orgId: string, agentId: string, policyId: string): Promise<Instruction> {
    const [{ vault }, policy] = await Promise.all([this.vaultAddresses(orgId, agentId), this.policyAddress(orgId, policyId)]);
    return program.updateVault(this.programId, { operator: this.operator, vault }, { op: 'attach_policy', policy });
  }

  async setFrozenIx(orgId: string, agentId: string, frozen: boolean): Promise<Instruction> {
    const { vault } = await this.vaultAddresses(orgId, agentId);
    return program.updateVault(this.programId, { operator: this.operator, vault }, { op: frozen ? 'freeze' : 'unfreeze' });
  }

  async #transferAccounts(orgId: string, agentId: string): Promise<program.TransferAccounts> {
    const [r, v] = await Promise.all([this.reserveAddresses(orgId), this.vaultAddresses(orgId, agentId)]);
    return { operator: this.operator, ...r, ...v };
  }

  async fundIx(orgId: string, agentId: string, amount: bigint): Promise<Instruction> {
    return program.fund(this.programId, await this.#transferAccounts(orgId, agentId), amount);
  }

  async withdrawIx(orgId: string, agentId: string, amount: bigint): Promise<Instruction> {
    return program.withdraw(this.programId, await this.#transferAccounts(orgId, agentId), amount);
  }

  async payIx(p: {
    orgId: string;
    agentId: string;
    policyId: string;
    recipient: Address;
    amount: bigint;
    attestation: Uint8Array;
    memo?: Uint8Array;
  }): Promise<Instruction> {
    const [{ vault, vaultToken }, policy, recipientToken] = await Promise.all([
      this.vaultAddresses(p.orgId, p.agentId), this.policyAddress(p.orgId, p.policyId), this.ata(p.recipient)]);
    return program.pay(this.programId,
      { operator: this.operator, vault, vaultToken, policy, mint: this.usdcMint, recipient: p.recipient, recipientToken },
      { amount: p.amount, attestation: p.attestation, memo: p.memo });
  }

  async escrowCreateIx(p: {
    orgId: string;
    agentId: string;
    policyId: string;
    escrowId: string;
    receiver: Address;
    amount: bigint;
    taskHash: Uint8Array;
    expiresAtSeconds: bigint;
  }): Promise<Instruction> {
    const [{ vault, vaultToken }, policy, { escrow, escrowToken }] = await Promise.all([
      this.vaultAddresses(p.orgId, p.agentId), this.policyAddress(p.orgId, p.policyId), this.escrowAddresses(p.escrowId)]);
    return program.escrowCreate(this.programId,
      { operator: this.operator, vault, vaultToken, policy, mint: this.usdcMint, escrow, escrowToken,
        receiver: p.receiver, arbiter: this.arbiter.address },
      { escrowKey: program.seedOf(p.escrowId), amount: p.amount, taskHash: p.taskHash, expiresAt: p.expiresAtSeconds });
  }

  async escrowReleaseIx(escrowId: string, receiver: Address): Promise<Instruction> {
    const [{ escrow, escrowToken }, receiverToken] = await Promise.all([this.escrowAddresses(escrowId), this.ata(receiver)]);
    return program.escrowRelease(this.programId,
      { operator: this.operator, escrow, escrowToken, mint: this.usdcMint, receiver, receiverToken });
  }

  /** By the operator after expiry, or by the arbiter at any time (`asArbiter`). */
  async escrowRefundIx(escrowId: string, fromVault: Address, asArbiter = false): Promise<Instruction> {
    const [{ escrow, escrowToken }, vaultToken] = await Promise.all([this.escrowAddresses(escrowId), this.ata(fromVault)]);
    return program.escrowRefund(this.programId,
      { signer: asArbiter ? this.arbiter : this.operator, escrow, escrowToken, fromVault, vaultToken });
  }

  async escrowDisputeIx(escrowId: string): Promise<Instruction> {
    const { escrow } = await this.escrowAddresses(escrowId);
    return program.escrowDispute(this.programId, { operator: this.operator, escrow });
  }

  async escrowResolveIx(escrowId: string, receiver: Address, fromVault: Address,
    split: { toReceiver: bigint; toSender: bigint }): Promise<Instruction> {
    const [{ escrow, escrowToken }, receiverToken, vaultToken] = await Promise.all([
      this.escrowAddresses(escrowId), this.ata(receiver), this.ata(fromVault)]);
    return program.escrowResolve(this.programId,
      { arbiter: this.arbiter, escrow, escrowToken, mint: this.usdcMint, receiver, receiverToken, fromVault, vaultToken },
      split);
  }

  /** A policy's account closed, its rent back to the operator key. */
  async policyCloseIx(orgId: string, policyId: string): Promise<Instruction> {
    return program.policyClose(this.programId, { operator: this.operator, policy: await this.policyAddress(orgId, policyId) });
  }

  /** A settled escrow's accounts closed, their rent back to the operator key. */
  async escrowCloseIx(escrowId: string): Promise<Instruction> {
    const { escrow, escrowToken } = await this.escrowAddresses(escrowId);
    return program.escrowClose(this.programId, { operator: this.operator, escrow, escrowToken });
  }

  // -------------------------------------------------------------------------------------------
  // Transactions

  async #latestBlockhash(): Promise<{ blockhash: Blockhash; lastValidBlockHeight: bigint }> {
    const cached = this.#blockhash;
    if (cached && Date.now() - cached.fetchedAtMs < this.#blockhashMaxAgeMs) return cached.value;
    if (!this.#blockhashInFlight) {
      this.#blockhashInFlight = this.#call('getLatestBlockhash', this.rpc.getLatestBlockhash({ commitment: 'confirmed' }))
        .then(({ value }) => {
          this.#blockhash = { value, fetchedAtMs: Date.now() };
          return value;
        })
        .finally(() => { this.#blockhashInFlight = null; });
    }
    return this.#blockhashInFlight;
  }

  /**
   * Builds and signs; nothing is sent. The signature identifies the transaction from now on.
   *
   * The same instructions under the same blockhash make the same signature, which the chain
   * executes once: a deliberate second attempt (a refund retried after the escrow expired, two
   * equal payments) must not collide with the first. So a signature this client prepared
   * before is never handed out again: it waits for the next blockhash instead. To resend the
   * same transaction, submit the PreparedTransaction again.
   */
  async prepare(instructions: readonly Instruction[]): Promise<PreparedTransaction> {
    const deadlineMs = Date.now() + PREPARE_WAIT_MS;
    for (let attempt = 0; attempt === 0 || Date.now() < deadlineMs; attempt += 1) {
      const prepared = await this.#sign(instructions, await this.#latestBlockhash());
      if (!this.#prepared.has(prepared.signature)) {
        if (this.#prepared.size >= PREPARED_SIGNATURES_MAX) this.#prepared.clear();
        this.#prepared.add(prepared.signature);
        return prepared;
      }
      this.#blockhash = null;
      if (attempt > 0) await new Promise((resolve) => setTimeout(resolve, PREPARE_RETRY_MS));
    }
    throw new NoDistinctBlockhashError();
  }

  async #sign(instructions: readonly Instruction[],
    lifetime: { blockhash: Blockhash; lastValidBlockHeight: bigint }): Promise<PreparedTransaction> {
    const message = pipe(
      createTransactionMessage({ version: 0 }),
      (m) => setTransactionMessageFeePayerSigner(this.operator, m),
      (m) => setTransactionMessageLifetimeUsingBlockhash(lifetime, m),
      (m) => appendTransactionMessageInstructions(instructions, m),
    );
    const fast = this.#signer.sign(message);
    if (fast) return { ...fast, lastValidBlockHeight: lifetime.lastValidBlockHeight };
    const signed = await signTransactionMessageWithSigners(message);
    return {
      signature: getSignatureFromTransaction(signed),
      wire: getBase64EncodedWireTransaction(signed),
      lastValidBlockHeight: lifetime.lastValidBlockHeight,
    };
  }

  /**
   * Sends a prepared transaction. Safe to call again with the same one: the chain executes a
   * signature at most once.
   */
  async submit(prepared: PreparedTransaction): Promise<void> {
    await this.#call('sendTransaction', this.rpc.sendTransaction(prepared.wire, { encoding: 'base64', skipPreflight: true, maxRetries: 0n }));
  }

  /** prepare + submit + wait for the outcome. */
  async execute(instructions: readonly Instruction[], timeoutMs = 30_000): Promise<TransactionOutcome> {
    const prepared = await this.prepare(instructions);
    await this.submit(prepared);
    return this.waitForOutcome(prepared.signature, timeoutMs);
  }

  /**
   * Resolves once the chain has executed the transaction, successfully or not; rejects with
   * ConfirmationTimeoutError after `timeoutMs`, whether or not a poll is still waiting for the chain.
   */
  waitForOutcome(signature: Signature, timeoutMs = 30_000): Promise<TransactionOutcome> {
    return new Promise<TransactionOutcome>((resolve, reject) => {
      const waiter: Waiter = {
        resolve: (outcome) => { clearTimeout(timer); resolve(outcome); },
        reject: (error) => { clearTimeout(timer); reject(error); },
      };
      const timer = setTimeout(() => {
        const remaining = (this.#waiters.get(signature) ?? []).filter((other) => other !== waiter);
        if (remaining.length) this.#waiters.set(signature, remaining);
        else this.#waiters.delete(signature);
        reject(new ConfirmationTimeoutError(signature, timeoutMs));
      }, timeoutMs);
      const list = this.#waiters.get(signature);
      if (list) list.push(waiter);
      else this.#waiters.set(signature, [waiter]);
      this.#schedulePoll();
    });
  }

  /** One RPC call, failed with ChainUnavailableError (and its HTTP request aborted) past the call timeout. */
  async #call<T>(method: string, request: { send(options?: { abortSignal?: AbortSignal }): Promise<T> }): Promise<T> {
    const abort = new AbortController();
    let timer: NodeJS.Timeout | undefined;
    try {
      return await Promise.race([
        request.send({ abortSignal: abort.signal }),
        new Promise<never>((_resolve, reject) => {
          timer = setTimeout(() => {
            abort.abort();
            reject(new ChainUnavailableError(method, this.#callTimeoutMs));
          }, this.#callTimeoutMs);
        }),
      ]);
    } finally {
      clearTimeout(timer);
    }
  }

  #resolvePublished(statuses: readonly PublishedStatus[]): void {
    for (const status of statuses) {
      const waiters = this.#waiters.get(status.signature as Signature);
      if (!waiters) continue;
      this.#waiters.delete(status.signature as Signature);
      const outcome: TransactionOutcome = {
        // The error's integers as getSignatureStatuses gives them through kit (bigint), so its
        // name reads the same whichever way the outcome arrived.
        signature: status.signature as Signature, slot: BigInt(status.slot), err: status.err ? parseChainError(withBigints(status.err)) : null,
      };
      for (const waiter of waiters) waiter.resolve(outcome);
    }
  }

  #schedulePoll(): void {
    if (this.#pollTimer || this.#polling) return;
    this.#pollTimer = setTimeout(() => {
      this.#pollTimer = null;
      void this.#poll();
    }, this.#pollIntervalMs);
  }

  /** One poller for all outstanding signatures, in batches of at most 256 per call. */
  async #poll(): Promise<void> {
    this.#polling = true;
    try {
      const signatures = [...this.#waiters.keys()];
      for (let start = 0; start < signatures.length; start += STATUS_BATCH_MAX) {
        const batch = signatures.slice(start, start + STATUS_BATCH_MAX);
        let statuses;
        try {
          ({ value: statuses } = await this.#call('getSignatureStatuses', this.rpc.getSignatureStatuses(batch)));
        } catch {
          continue; // a transient RPC failure: waiters keep their own deadlines, and the next poll retries
        }
        batch.forEach((signature, i) => {
          const status = statuses[i];
          if (!status || status.confirmationStatus === 'processed') return;
          const outcome: TransactionOutcome = {
            signature,
            slot: status.slot,
            err: status.err ? parseChainError(status.err) : null,
          };
          for (const waiter of this.#waiters.get(signature) ?? []) waiter.resolve(outcome);
          this.#waiters.delete(signature);
        });
      }
    } finally {
      this.#polling = false;
      if (this.#waiters.size) this.#schedulePoll();
    }
  }

  /** The chain's record of a signature: null when the chain has never executed it. */
  async getOutcome(signature: Signature): Promise<TransactionOutcome | null> {
    return (await this.getOutcomes([signature]))[0]!;
  }

  /**
   * getOutcome for up to 256 signatures in one call, in order. A status a cluster reports only
   * `processed` is no outcome yet: its fork can still be dropped.
   */
  async getOutcomes(signatures: readonly Signature[]): Promise<Array<TransactionOutcome | null>> {
    if (signatures.length > STATUS_BATCH_MAX) throw new Error(`at most ${STATUS_BATCH_MAX} signatures per call`);
    const { value } = await this.#call('getSignatureStatuses', this.rpc.getSignatureStatuses(signatures, { searchTransactionHistory: true }));
    return signatures.map((signature, i) => {
      const status = value[i];
      if (!status || status.confirmationStatus === 'processed') return null;
      return { signature, slot: status.slot, err: status.err ? parseChainError(status.err) : null };
    });
  }

  /** Resolves when the node says it is healthy (a halted embedded validator, a node far behind, do not). */
  async getHealth(): Promise<void> {
    await this.#call('getHealth', this.rpc.getHealth());
  }

  async getBlockHeight(): Promise<bigint> {
    return this.#call('getBlockHeight', this.rpc.getBlockHeight({ commitment: 'confirmed' }));
  }

  // -------------------------------------------------------------------------------------------
  // Reads

  async getAccountData(account: Address): Promise<Uint8Array | null> {
    const { value } = await this.#call('getAccountInfo', this.rpc.getAccountInfo(account, { encoding: 'base64', commitment: 'confirmed' }));
    if (!value) return null;
    return new Uint8Array(Buffer.from(value.data[0], 'base64'));
  }

  /** micro-USDC held by a token account; 0 when it does not exist yet. */
  async getTokenBalance(tokenAccount: Address): Promise<bigint> {
    const data = await this.getAccountData(tokenAccount);
    return data ? program.decodeTokenAmount(data) : 0n;
  }

  /** micro-USDC held by an owner's associated USDC account (vault, reserve, escrow or any address). */
  async getUsdcBalance(owner: Address): Promise<bigint> {
    return this.getTokenBalance(await this.ata(owner));
  }

  /**
   * The data of an account our program has created; null when there is none. Anyone can send
   * lamports to an address, a program-derived one included, before the program creates the
   * account there: that leaves an account of the System program with no data, which the program
   * still creates its account over (program/src/cpi.c), so it counts as none.
   */
  async getProgramAccountData(account: Address): Promise<Uint8Array | null> {
    const data = await this.getAccountData(account);
    return data && data.length > 0 ? data : null;
  }

  /**
   * Per account, in order, whether our program owns it (up to 100 per call; no data is read). An
   * account the program closed is gone, or a System account once someone sends lamports to its
   * address.
   */
  async getProgramOwned(accounts: readonly Address[]): Promise<boolean[]> {
    if (accounts.length > MULTIPLE_ACCOUNTS_MAX) throw new Error(`at most ${MULTIPLE_ACCOUNTS_MAX} accounts per call`);
    if (accounts.length === 0) return [];
    const { value } = await this.#call('getMultipleAccounts', this.rpc.getMultipleAccounts(accounts,
      { encoding: 'base64', commitment: 'confirmed', dataSlice: { offset: 0, length: 0 } }));
    return value.map((account) => account !== null && account.owner === this.programId);
  }

  async getVault(vault: Address): Promise<program.VaultAccount | null> {
    const data = await this.getProgramAccountData(vault);
    return data ? program.decodeVault(data) : null;
  }

  async getPolicy(policy: Address): Promise<program.PolicyAccount | null> {
    const data = await this.getProgramAccountData(policy);
    return data ? program.decodePolicy(data) : null;
  }

  async getEscrow(escrow: Address): Promise<program.EscrowAccount | null> {
    const data = await this.getProgramAccountData(escrow);
    return data ? program.decodeEscrow(data) : null;
  }

  /** Stops polling; outstanding waiters are rejected. */
  close(): void {
    if (this.#pollTimer) clearTimeout(this.#pollTimer);
    this.#pollTimer = null;
    for (const [signature, list] of this.#waiters) {
      for (const waiter of list) waiter.reject(new ConfirmationTimeoutError(signature, 0));
    }
    this.#waiters.clear();
  }
}
