/**
 * The local validator: LiteSVM (the real Solana runtime, in-process) made to behave like a
 * cluster for the service. Transactions execute as they arrive, a slice at a time, and become
 * visible when their slot ends; the Clock sysvar follows the service clock; blockhashes stay
 * valid for 150 slots; accounts and transaction results survive restarts. docs/validator.md
 * describes the design and its bounds.
 *
 * Durability rule: a transaction's status becomes visible (getSignatureStatuses) only after the
 * chain snapshot containing its effects, and its status line, are on disk. The service treats a
 * visible status as final, so nothing it saw can be lost by a crash.
 */
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import {
  AccountRole,
  address,
  appendTransactionMessageInstructions,
  createKeyPairSignerFromBytes,
  createTransactionMessage,
  getAddressEncoder,
  getProgramDerivedAddress,
  getTransactionEncoder,
  pipe,
  setTransactionMessageFeePayerSigner,
  setTransactionMessageLifetimeUsingBlockhash,
  signTransactionMessageWithSigners,
  type Address,
  type Blockhash,
  type Instruction,
  type KeyPairSigner,
} from '@solana/kit';
import { LiteSVM } from 'litesvm';
import {
  Account,
  Clock as SysvarClock,
  FailedTransactionMetadata,
  type LiteSvm as LiteSvmInner,
  type TransactionMetadata,
} from 'litesvm/dist/internal.js';
import { OffsetClock, ManualClock, type Clock } from '../clock/clock.ts';
import { referenceMemoIx } from '../chain/client.ts';
import { generateSecretKey, loadOrCreateKeyFile } from '../chain/operator-key.ts';
import { decodeBase58, encodeBase58 } from '../chain/base58.ts';
import { deployUpgradeableProgram, PROGRAMDATA_METADATA_SIZE, UPGRADEABLE_LOADER } from './loader.ts';
import { acquireLock, readSnapshot, writeSnapshot, type SnapshotFile, type SnapshotMeta } from './state-file.ts';
import { describeTransactionError, transactionErrorJson, type TransactionErrorJson } from './transaction-error.ts';
import {
  addressKey,
  TransactionStore,
  type AddressQuery,
  type ExecutedTransaction,
  type TokenBalance,
  type TransactionDetail,
  type TransactionRecord,
} from './transaction-store.ts';
import { feeOf, MalformedTransactionError, parseWireTransaction, type WireTransaction } from './wire.ts';

export const SYSTEM_PROGRAM = address('11111111111111111111111111111111');
export const TOKEN_PROGRAM = address('TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA');
export const TOKEN_2022_PROGRAM = address('TokenzQdBNbLqP5VEhdkAS6EPFLC1PHnBqCXEpPxuEb');
export const ASSOCIATED_TOKEN_PROGRAM = address('ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL');
export const CLOCK_SYSVAR = address('SysvarC1ock11111111111111111111111111111111');

/** The project's built program, deployed when present. */
export const DEFAULT_PROGRAM_SO_PATH = resolve(dirname(fileURLToPath(import.meta.url)), '../../program/agent_vault.so');

export const USDC_DECIMALS = 6;
/** A blockhash is accepted for this many slots after its own (Solana's MAX_PROCESSING_AGE). */
export const BLOCKHASH_VALIDITY_SLOTS = 150;
/** Slot length used for blockhash ageing when transactions execute at once (slotMs 0). */
const NOMINAL_SLOT_MS = 400;
/**
 * Slots run at most this far past the slot of the oldest executed transaction whose snapshot is
 * not written yet. A snapshot that hangs (a stalled disk) holds the slots, as a failed one halts
 * them: otherwise the block height would pass the transaction's last valid height while its
 * status is not visible, and a client (the service's reconciler, whose margin is 32 blocks)
 * would judge it expired although it ran.
 */
export const UNPUBLISHED_SLOTS_MAX = 16;
/** Like a block's compute limit: what is left waits for the next slot. */
export const MAX_TRANSACTIONS_PER_SLOT = 4_000;
/** Transactions waiting for a slot; beyond this sendTransaction is refused. */
export const MAX_QUEUED_TRANSACTIONS = 50_000;
/**
 * Sent transactions execute this long at a time, then the thread answers what arrived meanwhile
 * (a call waits at most about this long behind a burst of transactions).
 */
const EXECUTE_SLICE_MS = 2;
/**
 * Executed transactions' status lines are written (and flushed) at most this often while a slot
 * runs, so that its end has only its last moments' lines and the snapshot left to write.
 */
const LOG_APPEND_INTERVAL_MS = 25;
/** The validator's own account starts with this much SOL for airdrops and cheatcode fees. */
const AUTHORITY_LAMPORTS = 1_000_000_000n * 1_000_000_000n;
const U64_MAX = (1n << 64n) - 1n;
const MINT_SIZE = 82;
const TOKEN_ACCOUNT_SIZE = 165;
/** SPL token account layout: mint, owner, amount, then the state byte (0 = uninitialised). */
const TOKEN_ACCOUNT_STATE_OFFSET = 108;
/** Mints whose decimals are remembered; decimals never change, the bound only caps memory. */
const MINT_DECIMALS_CACHE_MAX = 10_000;
const TOKEN_PROGRAMS = [TOKEN_PROGRAM, TOKEN_2022_PROGRAM].map((program) => ({
  id: program as string, key: Buffer.from(getAddressEncoder().encode(program)),
}));

export const VALIDATOR_KEY_FILE = 'validator-key.json';
export const PROGRAM_KEY_FILE = 'program-keypair.json';

export interface LocalValidatorOptions {
  /** Where state lives; undefined keeps everything in memory. */
  dataDir?: string;
  /** Slot length; 0 executes each transaction at once. Default 400. */
  slotMs?: number;
  /** The service clock; the Clock sysvar's unix_timestamp follows it. */
  clock: Clock;
  /** The program to deploy; default program/agent_vault.so; null deploys nothing. */
  programSoPath?: string | null;
  /** Signatures whose status is kept (default 1,000,000). */
  signatureCapacity?: number;
  /** Minimum gap between two snapshots; statuses wait for theirs. Default 100. */
  persistIntervalMs?: number;
  log?: (entry: Record<string, unknown>) => void;
}

/** A transaction's status as it becomes visible: its slot and its error (null when it succeeded). */
export interface PublishedStatus {
  signature: string;
  slot: number;
  err: TransactionErrorJson | null;
}

export interface ValidatorInfo {
  programId: Address;
  usdcMint: Address;
  slotMs: number;
  /** The validator's key: USDC mint authority, payer of airdrops and cheatcodes. */
  authority: Address;
  /** Whether the program account exists (false when no .so was available). */
  programDeployed: boolean;
}

export interface SimulationResult {
  err: TransactionErrorJson | null;
  logs: string[];
  unitsConsumed: bigint;
  returnData: { programId: string; data: Uint8Array } | null;
}

/** sendTransaction's preflight simulation failed: JSON-RPC -32002. */
export class PreflightFailureError extends Error {
  constructor(readonly simulation: SimulationResult) {
    super(`Transaction simulation failed: ${describeTransactionError(simulation.err!)}`);
    this.name = 'PreflightFailureError';
  }
}

/** A signature does not verify: JSON-RPC -32003. */
export class SignatureVerificationError extends Error {
  constructor() {
    super('Transaction signature verification failure');
    this.name = 'SignatureVerificationError';
  }
}

export class ValidatorBusyError extends Error {
  constructor(queued: number) {
    super(`transaction queue is full (${queued} waiting); retry later`);
    this.name = 'ValidatorBusyError';
  }
}

/** The validator's state cannot be written: it takes no transaction and makes no slot until it can. */
export class ValidatorHaltedError extends Error {
  constructor(cause: string) {
    super(`the validator cannot persist its state (${cause}); it takes no transaction until it can`);
    this.name = 'ValidatorHaltedError';
  }
}

export class ValidatorClosedError extends Error {
  constructor() {
    super('the local validator is closed');
    this.name = 'ValidatorClosedError';
  }
}

interface Genesis {
  seed: Buffer;
  genesisSlot: number;
  usdcMint: Address;
  programId: Address;
  authority: Address;
}

/**
 * The keys whose token balances getTransaction reports: the writable ones that are not invoked
 * programs. Solana also lists read-only token accounts; their balance cannot change in the
 * transaction, and reading every read-only account (programs, sysvars) twice per transaction
 * costs a fifth of the validator's throughput, so they are left out.
 */
function tokenBalanceIndexes(tx: WireTransaction): number[] {
  const invoked = new Set(tx.instructions.map((ix) => ix.programIdIndex));
  const count = tx.accountKeys.length;
  const indexes: number[] = [];
  for (let i = 0; i < count; i++) {
    const writable = i < tx.numRequiredSignatures
      ? i < tx.numRequiredSignatures - tx.numReadonlySignedAccounts
      : i < count - tx.numReadonlyUnsignedAccounts;
    if (writable && !invoked.has(i)) indexes.push(i);
  }
  return indexes;
}

function blockhashBytes(seed: Buffer, slot: number): Buffer {
  const slotBytes = Buffer.alloc(8);
  slotBytes.writeBigUInt64LE(BigInt(slot));
  return createHash('sha256').update(seed).update(slotBytes).digest();
}

function hexOf(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('hex');
}

export class LocalValidator {
  readonly programId: Address;
  readonly usdcMint: Address;
  readonly authority: Address;
  readonly slotMs: number;
  readonly genesisHash: string;

  readonly #svm: LiteSVM;
  readonly #inner: LiteSvmInner;
  readonly #clock: Clock;
  readonly #dataDir: string | null;
  readonly #seed: Buffer;
  readonly #genesisSlot: number;
  readonly #authoritySigner: KeyPairSigner;
  readonly #store: TransactionStore;
  readonly #persistIntervalMs: number;
  readonly #log: (entry: Record<string, unknown>) => void;
  readonly #releaseLock: () => void;
  readonly #epochFields: { epochStartTimestamp: bigint; epoch: bigint; leaderScheduleEpoch: bigint };

  #slot: number;
  #slotStartedWallMs: number;
  #lastUnixTimestamp: number;
  /** blockhash hex → the slot it belongs to, for the last BLOCKHASH_VALIDITY_SLOTS + 1 slots. */
  readonly #blockhashSlots = new Map<string, number>();
  #latestBlockhash: string;
  #seq: number;
  /** mint (latin1 of its bytes) → decimals, for the token balances of getTransaction. */
  readonly #mintDecimals = new Map<string, number>();

  /** Sent and not yet executed, in arrival order, from `#queueHead` on. */
  #queue: WireTransaction[] = [];
  #queueHead = 0;
  /** Executed in the current slot (at most MAX_TRANSACTIONS_PER_SLOT). */
  #executedInSlot = 0;
  #sliceScheduled: NodeJS.Immediate | null = null;
  /** A persist was asked for while one was being written: write again when it is done. */
  #persistAgain = false;
  /** Signatures queued or executed but not yet visible: a resend must not run them twice. */
  readonly #inFlight = new Set<string>();
  #unpublished: ExecutedTransaction[] = [];
  /** Executed and not yet written to the transaction log (with a dataDir), in execution order. */
  #unappended: ExecutedTransaction[] = [];
  /** The last sequence number written to the transaction log. */
  #appendedSeq: number;
  #appending: Promise<void> | null = null;
  #appendTimer: NodeJS.Timeout | null = null;
  /** A write ahead failed: the next snapshot's write tries again before any other. */
  #appendFailed = false;

  #slotTimer: NodeJS.Timeout | null = null;
  #nextSlotAtMs = 0;
  #persistTimer: NodeJS.Timeout | null = null;
  #persisting: Promise<void> | null = null;
  #lastPersistStartMs = 0;
  #nextSnapshotFile: SnapshotFile;
  #stateDirty = false;
  /**
   * The last snapshot failed (a full or failing disk): what executed since is not visible, and
   * slots stop until a snapshot succeeds, so that no transaction it executed passes its last
   * valid block height unseen (a client would declare it expired while it ran).
   */
  #haltedBy: string | null = null;
  /** The batch the snapshot being written will make visible. */
  #persistingBatch: readonly ExecutedTransaction[] = [];
  /** Slots are held behind a snapshot that takes too long (UNPUBLISHED_SLOTS_MAX); logged once per hold. */
  #heldBySnapshot = false;
  #closed = false;
  #closing: Promise<void> | null = null;
  #programDeployed = false;

  private constructor(args: {
    svm: LiteSVM;
    clock: Clock;
    dataDir: string | null;
    slotMs: number;
    genesis: Genesis;
    authoritySigner: KeyPairSigner;
    store: TransactionStore;
    slot: number;
    seq: number;
    lastUnixTimestamp: number;
    persistIntervalMs: number;
    /** the snapshot file the next snapshot goes to: not the one loaded */
    nextSnapshotFile: SnapshotFile;
    log: (entry: Record<string, unknown>) => void;
    releaseLock: () => void;
  }) {
    this.#svm = args.svm;
    this.#inner = (args.svm as unknown as { inner: LiteSvmInner }).inner;
    this.#clock = args.clock;
    this.#dataDir = args.dataDir;
    this.slotMs = args.slotMs;
    this.#seed = args.genesis.seed;
    this.#genesisSlot = args.genesis.genesisSlot;
    this.programId = args.genesis.programId;
    this.usdcMint = args.genesis.usdcMint;
    this.authority = args.genesis.authority;
    this.#authoritySigner = args.authoritySigner;
    this.#store = args.store;
    this.#seq = args.seq;
    this.#appendedSeq = args.seq;
    this.#lastUnixTimestamp = args.lastUnixTimestamp;
    this.#nextSnapshotFile = args.nextSnapshotFile;
    this.#persistIntervalMs = args.persistIntervalMs;
    this.#log = args.log;
    this.#releaseLock = args.releaseLock;
    const current = this.#inner.getClock();
    this.#epochFields = {
      epochStartTimestamp: current.epochStartTimestamp, epoch: current.epoch, leaderScheduleEpoch: current.leaderScheduleEpoch,
    };
    this.genesisHash = encodeBase58(createHash('sha256').update('genesis').update(this.#seed).digest());
    this.#slot = args.slot;
    this.#slotStartedWallMs = Date.now();
    this.#latestBlockhash = '';
    // Every blockhash of the validity window is valid again after a restart: they derive from the seed.
    for (let s = Math.max(this.#genesisSlot, args.slot - BLOCKHASH_VALIDITY_SLOTS); s <= args.slot; s++) this.#registerBlockhash(s);
    this.#setClockSysvar();
  }

  static async open(options: LocalValidatorOptions): Promise<LocalValidator> {
    const slotMs = options.slotMs ?? 400;
    if (!Number.isInteger(slotMs) || slotMs < 0 || slotMs > 60_000) throw new RangeError('slotMs must be an integer in 0..60000');
    const log = options.log ?? (() => {});
    const dataDir = options.dataDir === undefined ? null : resolve(options.dataDir);
    const programSoPath = options.programSoPath === undefined ? DEFAULT_PROGRAM_SO_PATH : options.programSoPath;
    let releaseLock = (): void => {};
    if (dataDir) {
      mkdirSync(dataDir, { recursive: true, mode: 0o700 });
      releaseLock = acquireLock(dataDir);
    }
    try {
      const authoritySigner = dataDir
        ? await loadOrCreateKeyFile(join(dataDir, VALIDATOR_KEY_FILE))
        : await createKeyPairSignerFromBytes(generateSecretKey());
      const programSigner = dataDir
        ? await loadOrCreateKeyFile(join(dataDir, PROGRAM_KEY_FILE))
        : await createKeyPairSignerFromBytes(generateSecretKey());
      const store = new TransactionStore(dataDir ? join(dataDir, 'transactions') : null, { capacity: options.signatureCapacity });

      const snapshot = dataDir ? readSnapshot(dataDir) : null;
      let svm: LiteSVM;
      let genesis: Genesis;
      let slot: number;
      let seq = 0;
      let lastUnixTimestamp = 0;
      let fresh = false;
      if (snapshot) {
        const { meta } = snapshot;
        if (snapshot.damaged.length) {
          // A crash while a snapshot was written leaves it torn; the one before it is used, and
          // nothing of the torn one was ever visible.
          log({ level: 'warn', msg: 'validator snapshot passed over: it fails its check', files: snapshot.damaged, loadedSeq: meta.seq });
        }
        if (meta.authority !== authoritySigner.address || meta.programId !== programSigner.address) {
          throw new Error(`validator state at ${dataDir} does not match its key files (${VALIDATOR_KEY_FILE}, ${PROGRAM_KEY_FILE})`);
        }
        svm = LiteSVM.fromBytes(snapshot.state);
        genesis = {
          seed: Buffer.from(meta.seedHex, 'hex'),
          genesisSlot: meta.genesisSlot,
          usdcMint: address(meta.usdcMint),
          programId: address(meta.programId),
          authority: address(meta.authority),
        };
        // Slots kept passing while the validator was down (or after its last snapshot): resume
        // past every slot it may have announced, so no slot number or blockhash is reused.
        slot = meta.slot + 1 + Math.max(0, Math.floor((Date.now() - meta.wallMs) / (slotMs || NOMINAL_SLOT_MS)));
        seq = meta.seq;
        lastUnixTimestamp = meta.lastUnixTimestamp;
        store.load(meta.seq);
      } else {
        if (dataDir) TransactionStore.reset(join(dataDir, 'transactions'));
        svm = new LiteSVM();
        const usdcMint = await createKeyPairSignerFromBytes(generateSecretKey());
        genesis = {
          seed: randomBytes(32),
          genesisSlot: Number(svm.getClock().slot),
          usdcMint: usdcMint.address,
          programId: programSigner.address,
          authority: authoritySigner.address,
        };
        slot = genesis.genesisSlot;
        fresh = true;
      }
      // Blockhash ages are checked here, over a 150-slot window; duplicates are refused here too
      // (LiteSVM's own history would keep every transaction in the snapshot).
      svm.withBlockhashCheck(false).withTransactionHistory(0n).withSigverify(true);

      const validator = new LocalValidator({
        svm, clock: options.clock, dataDir, slotMs, genesis, authoritySigner, store, slot, seq, lastUnixTimestamp,
        persistIntervalMs: options.persistIntervalMs ?? 100, nextSnapshotFile: snapshot?.file === 0 ? 1 : 0, log, releaseLock,
      });
      if (fresh) validator.#createGenesisAccounts();
      await validator.#ensureProgram(programSigner, programSoPath);
      if (dataDir && (fresh || validator.#stateDirty)) await validator.#persist();
      validator.#startSlots();
      return validator;
    } catch (error) {
      releaseLock();
      throw error;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Genesis

  #createGenesisAccounts(): void {
    const encoder = getAddressEncoder();
    this.#inner.setAccount(new Uint8Array(encoder.encode(this.authority)),
      new Account(AUTHORITY_LAMPORTS, new Uint8Array(0), new Uint8Array(encoder.encode(SYSTEM_PROGRAM)), false, 0n));
    // SPL Token Mint layout: mint_authority COption<Pubkey>, supply u64, decimals u8,
    // is_initialized bool, freeze_authority COption<Pubkey>.
    const mint = new Uint8Array(MINT_SIZE);
    const view = new DataView(mint.buffer);
    view.setUint32(0, 1, true);
    mint.set(encoder.encode(this.authority), 4);
    mint[44] = USDC_DECIMALS;
    mint[45] = 1;
    this.#inner.setAccount(new Uint8Array(encoder.encode(this.usdcMint)),
      new Account(this.#inner.minimumBalanceForRentExemption(BigInt(MINT_SIZE)), mint,
        new Uint8Array(encoder.encode(TOKEN_PROGRAM)), false, 0n));
    this.#stateDirty = true;
  }

  async #ensureProgram(programSigner: KeyPairSigner, programSoPath: string | null): Promise<void> {
    const existing = this.#inner.getAccount(new Uint8Array(getAddressEncoder().encode(this.programId)));
    this.#programDeployed = existing !== null && existing.executable();
    if (!programSoPath || !existsSync(programSoPath)) return;
    const programBytes = new Uint8Array(readFileSync(programSoPath));
    if (this.#programDeployed) {
      const [programData] = await getProgramDerivedAddress({
        programAddress: UPGRADEABLE_LOADER, seeds: [getAddressEncoder().encode(this.programId)],
      });
      const deployed = this.#inner.getAccount(new Uint8Array(getAddressEncoder().encode(programData)))?.data();
      const same = deployed !== undefined
        && Buffer.from(deployed.subarray(PROGRAMDATA_METADATA_SIZE)).equals(Buffer.from(programBytes));
      if (!same) {
        this.#log({ level: 'warn', msg: 'the deployed program differs from the file; upgrades are not supported, '
          + 'start from an empty data dir to deploy the new build', programSoPath, programId: this.programId });
      }
      return;
    }
    const deployed = await deployUpgradeableProgram(this.#svm, {
      payer: this.#authoritySigner, programKeypair: programSigner, upgradeAuthority: this.#authoritySigner, programBytes,
    });
    // A deployed program becomes callable from the next slot, as on a cluster.
    this.#advanceSlot(1);
    this.#programDeployed = true;
    this.#stateDirty = true;
    this.#log({ level: 'info', msg: 'program deployed', programId: deployed.programAddress, bytes: programBytes.length });
  }

  // ---------------------------------------------------------------------------------------------
  // Slots and time

  info(): ValidatorInfo {
    return {
      programId: this.programId, usdcMint: this.usdcMint, slotMs: this.slotMs, authority: this.authority,
      programDeployed: this.#programDeployed,
    };
  }

  get slot(): number {
    this.#rollImmediateSlot();
    return this.#slot;
  }

  /** Throws ValidatorHaltedError while its state cannot be persisted (getHealth answers it too). */
  assertHealthy(): void {
    if (this.#haltedBy !== null) throw new ValidatorHaltedError(this.#haltedBy);
  }

  get blockHeight(): number {
    return this.slot - this.#genesisSlot;
  }

  latestBlockhash(): { blockhash: Blockhash; lastValidBlockHeight: number; slot: number } {
    this.#rollImmediateSlot();
    return {
      blockhash: this.#latestBlockhash as Blockhash,
      lastValidBlockHeight: this.#slot - this.#genesisSlot + BLOCKHASH_VALIDITY_SLOTS,
      slot: this.#slot,
    };
  }

  isBlockhashValid(blockhash: string): boolean {
    this.#rollImmediateSlot();
    const bytes = decodeBase58(blockhash);
    return bytes !== null && bytes.length === 32 && this.#blockhashSlots.has(hexOf(bytes));
  }

  #registerBlockhash(slot: number): void {
    const bytes = blockhashBytes(this.#seed, slot);
    this.#blockhashSlots.set(bytes.toString('hex'), slot);
    this.#latestBlockhash = encodeBase58(bytes);
    // Map order is slot order: drop those that left the window.
    for (const [hash, hashSlot] of this.#blockhashSlots) {
      if (hashSlot >= slot - BLOCKHASH_VALIDITY_SLOTS) break;
      this.#blockhashSlots.delete(hash);
    }
  }

  /** Clock sysvar ← (current slot, the service clock's second); time never goes back. */
  #setClockSysvar(): void {
    const unix = Math.max(this.#lastUnixTimestamp, Math.floor(this.#clock.nowMs() / 1000));
    this.#lastUnixTimestamp = unix;
    this.#inner.setClock(new SysvarClock(BigInt(this.#slot), this.#epochFields.epochStartTimestamp,
      this.#epochFields.epoch, this.#epochFields.leaderScheduleEpoch, BigInt(unix)));
  }

  #advanceSlot(by: number): void {
    this.#slot += by;
    this.#slotStartedWallMs = Date.now();
    this.#registerBlockhash(this.#slot);
    this.#setClockSysvar();
  }

  /**
   * With slotMs 0, slots are notional (400 ms) and move forward when looked at; so does the
   * Clock sysvar, since no slot timer refreshes it.
   */
  #rollImmediateSlot(): void {
    if (this.slotMs !== 0 || this.#haltedBy !== null) return;
    const elapsed = Date.now() - this.#slotStartedWallMs;
    const by = elapsed >= NOMINAL_SLOT_MS ? this.#slotsAllowed(Math.floor(elapsed / NOMINAL_SLOT_MS)) : 0;
    if (by > 0) this.#advanceSlot(by);
    else this.#setClockSysvar();
  }

  /**
   * How many of `wanted` slots may be made now: none past UNPUBLISHED_SLOTS_MAX slots after the
   * oldest executed transaction not yet visible (its snapshot still being written).
   */
  #slotsAllowed(wanted: number): number {
    const oldest = this.#persistingBatch[0] ?? this.#unpublished[0];
    const allowed = oldest ? Math.max(0, Math.min(wanted, oldest.record.slot + UNPUBLISHED_SLOTS_MAX - this.#slot)) : wanted;
    if ((allowed < wanted) !== this.#heldBySnapshot) {
      this.#heldBySnapshot = allowed < wanted;
      this.#log(this.#heldBySnapshot
        ? { level: 'warn', msg: 'validator snapshot is slow: slots held until it is written', slot: this.#slot, oldestUnpublishedSlot: oldest!.record.slot }
        : { level: 'warn', msg: 'validator snapshot written: slots resume' });
    }
    return allowed;
  }

  #startSlots(): void {
    if (this.slotMs === 0) return;
    this.#nextSlotAtMs = Date.now() + this.slotMs;
    this.#scheduleSlot();
  }

  #scheduleSlot(): void {
    this.#slotTimer = setTimeout(() => this.#onSlotTimer(), Math.max(0, this.#nextSlotAtMs - Date.now()));
    this.#slotTimer.unref();
  }

  #onSlotTimer(): void {
    this.#slotTimer = null;
    if (this.#closed) return;
    try {
      this.#produceSlot();
    } catch (error) {
      this.#log({ level: 'error', msg: 'slot failed', err: String(error) });
    }
    // Fixed cadence; after a stall, continue from now rather than bursting to catch up.
    const now = Date.now();
    this.#nextSlotAtMs = Math.max(this.#nextSlotAtMs + this.slotMs, now);
    if (!this.#closed) this.#scheduleSlot();
  }

  /**
   * A slot boundary: the slot ends and a new one begins. What the ended slot executed is sealed:
   * persisted with the state, and only then visible (its statuses, as `confirmed`). What its
   * limit left waiting runs in the new slot.
   */
  #produceSlot(): void {
    if (this.#haltedBy !== null) return; // its failed snapshot is being written again
    if (this.#slotsAllowed(1) === 0) return; // a snapshot being written holds it
    this.#advanceSlot(1);
    this.#executedInSlot = 0;
    this.#scheduleSlice();
    if (this.#unpublished.length > 0 || this.#stateDirty) this.#persistAtSlotEnd();
  }

  /**
   * The ended slot's snapshot starts now when it may (none being written, the minimum gap
   * passed): its state is captured before the new slot executes anything, and no timer or
   * slice of the new slot runs ahead of it. Otherwise it is scheduled as any other.
   */
  #persistAtSlotEnd(): void {
    const idle = this.#dataDir && !this.#persisting && !this.#persistTimer;
    if (idle && Date.now() >= this.#lastPersistStartMs + this.#persistIntervalMs) void this.#persist();
    else this.#schedulePersist();
  }

  #scheduleSlice(): void {
    if (this.#sliceScheduled || this.#closed || this.queuedCount === 0) return;
    this.#sliceScheduled = setImmediate(() => {
      this.#sliceScheduled = null;
      this.#executeSlice(EXECUTE_SLICE_MS);
    });
  }

  /**
   * Executes sent transactions in arrival order, as a leader fills its block while the slot
   * runs, for up to `budgetMs` (at least one) and within the slot's limit; schedules the rest
   * after a turn of the event loop, so that calls are answered in between. The Clock sysvar
   * follows the service clock's second (never back) as they run.
   */
  #executeSlice(budgetMs: number): void {
    if (this.queuedCount === 0 || this.#executedInSlot >= MAX_TRANSACTIONS_PER_SLOT) return;
    if (Math.floor(this.#clock.nowMs() / 1000) > this.#lastUnixTimestamp) this.#setClockSysvar();
    const deadline = performance.now() + budgetMs;
    do {
      const tx = this.#queue[this.#queueHead]!;
      this.#queueHead += 1;
      this.#executedInSlot += 1;
      try {
        this.#execute(tx);
      } catch (error) {
        // Dropped without a status, as a cluster drops what it cannot process.
        this.#inFlight.delete(tx.signature);
        this.#log({ level: 'error', msg: 'transaction failed to execute', signature: tx.signature, err: String(error) });
      }
    } while (this.queuedCount > 0 && this.#executedInSlot < MAX_TRANSACTIONS_PER_SLOT && performance.now() < deadline);
    if (this.queuedCount === 0) {
      this.#queue = [];
      this.#queueHead = 0;
    } else if (this.#queueHead > 4096) {
      this.#queue = this.#queue.slice(this.#queueHead);
      this.#queueHead = 0;
    }
    if (this.#executedInSlot < MAX_TRANSACTIONS_PER_SLOT) this.#scheduleSlice();
  }

  /** Moves the service clock forward to at least `unixMs` (never back) and the sysvar with it. */
  setTime(unixMs: number): void {
    if (!Number.isFinite(unixMs)) throw new RangeError('unixMs must be a number');
    // Never back; and a time already passed writes nothing (the service sends its own each second).
    if (unixMs <= this.#clock.nowMs()) return;
    if (this.#clock instanceof OffsetClock) this.#clock.setAtLeast(unixMs);
    else if (this.#clock instanceof ManualClock) this.#clock.set(Math.max(this.#clock.nowMs(), unixMs));
    else throw new Error('this validator\'s clock cannot be set');
    this.#setClockSysvar();
    this.#stateDirty = true;
    this.#schedulePersist();
  }

  /** The Clock sysvar's unix_timestamp (seconds). */
  get clockUnixTimestamp(): number {
    return this.#lastUnixTimestamp;
  }

  /** Re-reads the service clock into the Clock sysvar now rather than at the next slot. */
  syncClock(): void {
    this.#setClockSysvar();
  }

  // ---------------------------------------------------------------------------------------------
  // Transactions

  /**
   * Queues a wire transaction and returns its signature at once (with slotMs 0 it executes
   * before returning). Sending a signature again that is queued or already executed does nothing.
   * Without `skipPreflight` the transaction is simulated first and refused if that fails.
   */
  sendTransaction(bytes: Uint8Array, options: { skipPreflight?: boolean } = {}): string {
    if (this.#closed) throw new ValidatorClosedError();
    this.assertHealthy();
    const tx = parseWireTransaction(bytes);
    if (this.#inFlight.has(tx.signature) || this.#store.has(tx.signature)) {
      if (!options.skipPreflight) {
        throw new PreflightFailureError({ err: 'AlreadyProcessed', logs: [], unitsConsumed: 0n, returnData: null });
      }
      return tx.signature;
    }
    if (!options.skipPreflight) {
      const simulation = this.#simulate(tx, { sigVerify: true, replaceRecentBlockhash: false });
      if (simulation.err === 'SignatureFailure') throw new SignatureVerificationError();
      if (simulation.err !== null) throw new PreflightFailureError(simulation);
    }
    if (this.queuedCount >= MAX_QUEUED_TRANSACTIONS) throw new ValidatorBusyError(this.queuedCount);
    this.#inFlight.add(tx.signature);
    if (this.slotMs === 0) {
      this.#rollImmediateSlot(); // also sets the Clock sysvar from the service clock
      this.#execute(tx);
      this.#schedulePersist();
    } else {
      this.#queue.push(tx);
      this.#scheduleSlice();
    }
    return tx.signature;
  }

  simulateTransaction(bytes: Uint8Array, options: { sigVerify?: boolean; replaceRecentBlockhash?: boolean } = {}):
    SimulationResult & { replacementBlockhash: { blockhash: string; lastValidBlockHeight: number } | null } {
    const tx = parseWireTransaction(bytes);
    const replaceRecentBlockhash = options.replaceRecentBlockhash ?? false;
    const result = this.#simulate(tx, { sigVerify: options.sigVerify ?? false, replaceRecentBlockhash });
    const latest = this.latestBlockhash();
    return {
      ...result,
      replacementBlockhash: replaceRecentBlockhash ? { blockhash: latest.blockhash, lastValidBlockHeight: latest.lastValidBlockHeight } : null,
    };
  }

  #simulate(tx: WireTransaction, options: { sigVerify: boolean; replaceRecentBlockhash: boolean }): SimulationResult {
    if (!options.replaceRecentBlockhash && !this.#blockhashSlots.has(hexOf(tx.recentBlockhash))) {
      return { err: 'BlockhashNotFound', logs: [], unitsConsumed: 0n, returnData: null };
    }
    if (!options.sigVerify) this.#inner.setSigverify(false);
    let outcome;
    try {
      outcome = tx.version === 'legacy' ? this.#inner.simulateLegacyTransaction(tx.bytes) : this.#inner.simulateVersionedTransaction(tx.bytes);
    } finally {
      if (!options.sigVerify) this.#inner.setSigverify(true);
    }
    const meta: TransactionMetadata = outcome.meta();
    const returned = meta.returnData();
    const returnBytes = returned.data();
    return {
      err: outcome instanceof FailedTransactionMetadata ? transactionErrorJson(outcome) : null,
      logs: meta.logs(),
      unitsConsumed: meta.computeUnitsConsumed(),
      returnData: returnBytes.length > 0 ? { programId: encodeBase58(returned.programId()), data: returnBytes } : null,
    };
  }

  /**
   * Runs one transaction against the state. Transactions that would not land on a cluster
   * (expired blockhash, bad signature, fee payer unable to pay: no fee charged) are dropped
   * without a status, as a cluster drops them.
   */
  #execute(tx: WireTransaction): void {
    const blockhashSlot = this.#blockhashSlots.get(hexOf(tx.recentBlockhash));
    if (blockhashSlot === undefined) {
      this.#inFlight.delete(tx.signature);
      this.#log({ level: 'debug', msg: 'transaction dropped', signature: tx.signature, reason: 'BlockhashNotFound' });
      return;
    }
    const keys = tx.accountKeys;
    const preBalances = keys.map((key) => this.#inner.getBalance(key) ?? 0n);
    const balanceIndexes = tokenBalanceIndexes(tx);
    const preTokenBalances = this.#tokenBalances(keys, balanceIndexes);
    const outcome = tx.version === 'legacy' ? this.#inner.sendLegacyTransaction(tx.bytes) : this.#inner.sendVersionedTransaction(tx.bytes);
    const postBalances = keys.map((key) => this.#inner.getBalance(key) ?? 0n);
    const postTokenBalances = this.#tokenBalances(keys, balanceIndexes);
    let err: TransactionErrorJson | null = null;
    let meta: TransactionMetadata;
    let fee: bigint;
    if (outcome instanceof FailedTransactionMetadata) {
      err = transactionErrorJson(outcome);
      meta = outcome.meta();
      // A failed transaction changes nothing but the fee payer's balance, by the fee.
      fee = preBalances[0]! - postBalances[0]!;
      if (fee <= 0n) {
        this.#inFlight.delete(tx.signature);
        this.#log({ level: 'debug', msg: 'transaction dropped', signature: tx.signature, reason: err });
        return;
      }
    } else {
      meta = outcome;
      fee = feeOf(tx);
    }
    this.#seq += 1;
    const record: TransactionRecord = {
      seq: this.#seq,
      signature: tx.signature,
      slot: this.#slot,
      blockTime: this.#lastUnixTimestamp,
      err,
      computeUnits: Number(meta.computeUnitsConsumed()),
      fee: Number(fee),
    };
    const detail: TransactionDetail = { wire: tx.bytes, logs: meta.logs(), preBalances, postBalances, preTokenBalances, postTokenBalances };
    const executed = { record, detail, accountKeys: keys.map(addressKey) };
    this.#unpublished.push(executed);
    if (this.#dataDir) {
      this.#unappended.push(executed);
      this.#scheduleAppend();
    }
    this.#stateDirty = true;
  }

  /** The initialised SPL token accounts at these key indexes whose mint exists. */
  #tokenBalances(keys: readonly Uint8Array[], indexes: readonly number[]): TokenBalance[] {
    const balances: TokenBalance[] = [];
    for (const accountIndex of indexes) {
      const account = this.#inner.getAccount(keys[accountIndex]!);
      if (!account) continue;
      const owner = account.owner();
      const program = TOKEN_PROGRAMS.find((p) => p.key.equals(owner));
      if (!program) continue;
      const data = account.data();
      if (data.length < TOKEN_ACCOUNT_SIZE || data[TOKEN_ACCOUNT_STATE_OFFSET] === 0) continue;
      const mint = data.slice(0, 32);
      const decimals = this.#decimalsOf(mint);
      if (decimals === null) continue;
      balances.push({
        accountIndex,
        mint,
        owner: data.slice(32, 64),
        programId: program.id,
        amount: new DataView(data.buffer, data.byteOffset, data.byteLength).getBigUint64(64, true),
        decimals,
      });
    }
    return balances;
  }

  #decimalsOf(mint: Uint8Array): number | null {
    const cacheKey = Buffer.from(mint.buffer, mint.byteOffset, mint.byteLength).toString('latin1');
    const known = this.#mintDecimals.get(cacheKey);
    if (known !== undefined) return known;
    const data = this.#inner.getAccount(mint)?.data();
    if (!data || data.length < MINT_SIZE) return null;
    if (this.#mintDecimals.size >= MINT_DECIMALS_CACHE_MAX) this.#mintDecimals.clear();
    this.#mintDecimals.set(cacheKey, data[44]!);
    return data[44]!;
  }

  // ---------------------------------------------------------------------------------------------
  // Persistence

  #schedulePersist(): void {
    if (!this.#dataDir) {
      this.#publish(this.#unpublished);
      this.#unpublished = [];
      this.#stateDirty = false;
      return;
    }
    if (this.#persistTimer) return;
    if (this.#persisting) {
      this.#persistAgain = true;
      return;
    }
    const waitMs = Math.max(0, this.#lastPersistStartMs + this.#persistIntervalMs - Date.now());
    this.#persistTimer = setTimeout(() => {
      this.#persistTimer = null;
      void this.#persist();
    }, waitMs);
  }

  /**
   * Writes the transaction log ahead of the snapshot, as transactions execute: at most every
   * LOG_APPEND_INTERVAL_MS, one write at a time. A line is visible only once a snapshot that
   * contains its effects is written, and lines newer than the snapshot are cut at load, so
   * writing them early changes nothing a crash can show; it takes their flush off the slot's end.
   */
  #scheduleAppend(): void {
    if (this.#appendTimer || this.#appending || this.#appendFailed || this.#closed) return;
    this.#appendTimer = setTimeout(() => {
      this.#appendTimer = null;
      if (this.#unappended.length === 0 || this.#appending) return;
      this.#appendLog().then(() => {
        if (this.#unappended.length > 0) this.#scheduleAppend();
      }, (error: unknown) => {
        // Left for the next snapshot, which writes the log again first (and fails if it must);
        // no more writes ahead until one succeeds.
        this.#appendFailed = true;
        this.#log({ level: 'error', msg: 'validator transaction log write failed', err: String(error) });
      });
    }, LOG_APPEND_INTERVAL_MS);
    this.#appendTimer.unref();
  }

  /** Writes what is unwritten in the log, one write at a time; a call during a write shares it. */
  #appendLog(): Promise<void> {
    this.#appending ??= (async () => {
      const batch = this.#unappended;
      this.#unappended = [];
      try {
        await this.#store.append(batch);
        if (batch.length > 0) this.#appendedSeq = batch.at(-1)!.record.seq;
        this.#appendFailed = false;
      } catch (error) {
        this.#unappended = batch.concat(this.#unappended);
        throw error;
      } finally {
        this.#appending = null;
      }
    })();
    return this.#appending;
  }

  /** Resolves once the log holds every transaction through `seq`. */
  async #appendThrough(seq: number): Promise<void> {
    while (this.#appendedSeq < seq) {
      if (!this.#appending && this.#unappended.length === 0) throw new Error(`the transaction log stops before ${seq}`);
      await this.#appendLog();
    }
  }

  #publish(batch: readonly ExecutedTransaction[]): void {
    this.#store.publish(batch);
    for (const { record } of batch) this.#inFlight.delete(record.signature);
    if (batch.length === 0 || this.#publishedListeners.length === 0) return;
    const statuses = batch.map(({ record }): PublishedStatus => ({ signature: record.signature, slot: record.slot, err: record.err }));
    // After the caller's own bookkeeping (publishing happens inside sendTransaction at slotMs 0).
    queueMicrotask(() => {
      for (const listener of this.#publishedListeners) {
        try {
          listener(statuses);
        } catch (error) {
          this.#log({ level: 'error', msg: 'a publish listener failed', err: String(error) });
        }
      }
    });
  }

  readonly #publishedListeners: Array<(statuses: readonly PublishedStatus[]) => void> = [];

  /**
   * Calls `listener` each time executed transactions' statuses become visible, with those
   * statuses (what getSignatureStatuses answers for them from then on).
   */
  onPublished(listener: (statuses: readonly PublishedStatus[]) => void): void {
    this.#publishedListeners.push(listener);
  }

  /**
   * Group commit: the state and the results executed so far are captured together, written
   * (the status lines not yet in the log, then the snapshot, each flushed), and only then made
   * visible.
   */
  #persist(): Promise<void> {
    if (this.#persisting) return this.#persisting.then(() => this.#persist());
    if (!this.#dataDir) return Promise.resolve();
    const dataDir = this.#dataDir;
    this.#lastPersistStartMs = Date.now();
    const startedMs = performance.now();
    // Captured before the batch is taken: a capture that throws leaves it for the next snapshot.
    const state = this.#inner.toBytes();
    const captureMs = performance.now() - startedMs;
    const batch = this.#unpublished;
    this.#unpublished = [];
    this.#persistingBatch = batch;
    this.#stateDirty = false;
    const meta: SnapshotMeta = {
      version: 1,
      seq: this.#seq,
      slot: this.#slot,
      genesisSlot: this.#genesisSlot,
      wallMs: Date.now(),
      seedHex: this.#seed.toString('hex'),
      usdcMint: this.usdcMint,
      programId: this.programId,
      authority: this.authority,
      lastUnixTimestamp: this.#lastUnixTimestamp,
    };
    const run = (async () => {
      let failed = false;
      try {
        await this.#appendThrough(meta.seq);
        await writeSnapshot(dataDir, this.#nextSnapshotFile, meta, state);
        // The next one goes to the other file, leaving this one whole. After a failed write,
        // the same file again: the other still holds the last snapshot that was made visible.
        this.#nextSnapshotFile = this.#nextSnapshotFile === 0 ? 1 : 0;
        if (this.#haltedBy !== null) {
          this.#haltedBy = null;
          this.#log({ level: 'warn', msg: 'validator snapshot written again: slots and transactions resume' });
        }
        this.#publish(batch);
        this.#lastPersist = { bytes: state.length, captureMs, totalMs: performance.now() - startedMs, transactions: batch.length };
      } catch (error) {
        // Nothing was made visible; the batch goes out with the next snapshot.
        this.#unpublished = batch.concat(this.#unpublished);
        this.#stateDirty = true;
        failed = true;
        this.#haltedBy = String(error);
        this.#log({ level: 'error', msg: 'validator snapshot failed', err: String(error) });
      } finally {
        this.#persisting = null;
        this.#persistingBatch = [];
      }
      // Asked for meanwhile, or failed: again. Otherwise what executes from now on waits for its
      // slot's end, not for this write.
      if (!this.#closed && (failed || this.#persistAgain)) {
        this.#persistAgain = false;
        this.#schedulePersist();
      }
    })();
    this.#persisting = run;
    return run;
  }

  #lastPersist: { bytes: number; captureMs: number; totalMs: number; transactions: number } | null = null;

  /** Size and cost of the last snapshot, for logs and benchmarks. */
  get lastPersist(): { bytes: number; captureMs: number; totalMs: number; transactions: number } | null {
    return this.#lastPersist;
  }

  /**
   * Stops the slots, executes what is queued, writes the final snapshot and releases the lock.
   * Safe to call twice.
   */
  close(): Promise<void> {
    if (this.#closing) return this.#closing;
    this.#closing = (async () => {
      if (this.#slotTimer) clearTimeout(this.#slotTimer);
      this.#slotTimer = null;
      if (this.#sliceScheduled) clearImmediate(this.#sliceScheduled);
      this.#sliceScheduled = null;
      while (this.queuedCount > 0) {
        if (this.#executedInSlot >= MAX_TRANSACTIONS_PER_SLOT) {
          this.#advanceSlot(1);
          this.#executedInSlot = 0;
        }
        this.#executeSlice(Infinity);
      }
      this.#closed = true;
      if (this.#persistTimer) clearTimeout(this.#persistTimer);
      this.#persistTimer = null;
      if (this.#appendTimer) clearTimeout(this.#appendTimer);
      this.#appendTimer = null;
      try {
        if (this.#dataDir) {
          if (this.#persisting) await this.#persisting;
          await this.#persist();
          if (this.#unpublished.length > 0) throw new Error('the final validator snapshot could not be written');
        }
      } finally {
        await this.#store.close();
        this.#releaseLock();
      }
    })();
    return this.#closing;
  }

  get closed(): boolean {
    return this.#closed;
  }

  // ---------------------------------------------------------------------------------------------
  // Reads

  /** The status of a signature once it is visible (executed and persisted). */
  transaction(signature: string): { record: TransactionRecord; detail: TransactionDetail | undefined } | null {
    const record = this.#store.get(signature);
    return record ? { record, detail: this.#store.detail(signature) } : null;
  }

  /**
   * Visible transactions whose message lists `address`, newest first (getSignaturesForAddress).
   * Addresses that are not base58 keys throw RangeError.
   */
  signaturesForAddress(addressText: string, query: AddressQuery): TransactionRecord[] {
    const key = decodeBase58(addressText);
    if (!key || key.length !== 32) throw new RangeError(`invalid address ${addressText}`);
    return this.#store.forAddress(addressKey(key), query);
  }

  /** Account by address, or null. Addresses that are not base58 keys throw RangeError. */
  getAccount(addressText: string): { lamports: bigint; data: Uint8Array; owner: string; executable: boolean; rentEpoch: bigint } | null {
    const key = decodeBase58(addressText);
    if (!key || key.length !== 32) throw new RangeError(`invalid address ${addressText}`);
    const account = this.#inner.getAccount(key);
    if (!account) return null;
    return {
      lamports: account.lamports(),
      data: account.data(),
      owner: encodeBase58(account.owner()),
      executable: account.executable(),
      rentEpoch: account.rentEpoch(),
    };
  }

  getBalance(addressText: string): bigint {
    const key = decodeBase58(addressText);
    if (!key || key.length !== 32) throw new RangeError(`invalid address ${addressText}`);
    return this.#inner.getBalance(key) ?? 0n;
  }

  minimumBalanceForRentExemption(dataLength: number): bigint {
    return this.#inner.minimumBalanceForRentExemption(BigInt(dataLength));
  }

  get queuedCount(): number {
    return this.#queue.length - this.#queueHead;
  }

  // ---------------------------------------------------------------------------------------------
  // Cheatcodes: transactions of the validator's own key, queued like any other.

  /**
   * Sends a transaction signed by the validator's own key. A random memo makes each one
   * distinct: two identical mints within one blockhash would otherwise share a signature, and
   * the second would be dropped as already processed.
   */
  async #sendOwnTransaction(instructions: Instruction[]): Promise<string> {
    instructions = [referenceMemoIx(`validator-${randomBytes(12).toString('hex')}`), ...instructions];
    const { blockhash, lastValidBlockHeight } = this.latestBlockhash();
    const message = pipe(
      createTransactionMessage({ version: 0 }),
      (m) => setTransactionMessageFeePayerSigner(this.#authoritySigner, m),
      (m) => setTransactionMessageLifetimeUsingBlockhash({ blockhash, lastValidBlockHeight: BigInt(lastValidBlockHeight) }, m),
      (m) => appendTransactionMessageInstructions(instructions, m),
    );
    const signed = await signTransactionMessageWithSigners(message);
    return this.sendTransaction(new Uint8Array(getTransactionEncoder().encode(signed)), { skipPreflight: true });
  }

  async associatedTokenAddress(owner: Address, mint: Address = this.usdcMint): Promise<Address> {
    const encoder = getAddressEncoder();
    const [ata] = await getProgramDerivedAddress({
      programAddress: ASSOCIATED_TOKEN_PROGRAM,
      seeds: [encoder.encode(owner), encoder.encode(TOKEN_PROGRAM), encoder.encode(mint)],
    });
    return ata;
  }

  /** Mints local USDC (micro-USDC) to the owner's associated token account, creating it. */
  async mintUsdc(owner: Address, amount: bigint): Promise<string> {
    if (amount <= 0n || amount > U64_MAX) throw new RangeError('amount must be a positive u64');
    const ata = await this.associatedTokenAddress(owner);
    const signer = this.#authoritySigner;
    const amountBytes = new Uint8Array(8);
    new DataView(amountBytes.buffer).setBigUint64(0, amount, true);
    const createAta: Instruction = {
      programAddress: ASSOCIATED_TOKEN_PROGRAM,
      accounts: [
        { address: signer.address, role: AccountRole.WRITABLE_SIGNER, signer },
        { address: ata, role: AccountRole.WRITABLE },
        { address: owner, role: AccountRole.READONLY },
        { address: this.usdcMint, role: AccountRole.READONLY },
        { address: SYSTEM_PROGRAM, role: AccountRole.READONLY },
        { address: TOKEN_PROGRAM, role: AccountRole.READONLY },
      ],
      data: new Uint8Array([1]), // CreateIdempotent
    } as Instruction;
    const mintTo: Instruction = {
      programAddress: TOKEN_PROGRAM,
      accounts: [
        { address: this.usdcMint, role: AccountRole.WRITABLE },
        { address: ata, role: AccountRole.WRITABLE },
        { address: signer.address, role: AccountRole.READONLY_SIGNER, signer },
      ],
      data: new Uint8Array([7, ...amountBytes]), // MintTo
    } as Instruction;
    return this.#sendOwnTransaction([createAta, mintTo]);
  }

  /** A System transfer from the validator's key, like a faucet. */
  async requestAirdrop(to: Address, lamports: bigint): Promise<string> {
    if (lamports <= 0n || lamports > U64_MAX) throw new RangeError('lamports must be a positive u64');
    const signer = this.#authoritySigner;
    const data = new Uint8Array(12);
    const view = new DataView(data.buffer);
    view.setUint32(0, 2, true); // Transfer
    view.setBigUint64(4, lamports, true);
    return this.#sendOwnTransaction([{
      programAddress: SYSTEM_PROGRAM,
      accounts: [
        { address: signer.address, role: AccountRole.WRITABLE_SIGNER, signer },
        { address: to, role: AccountRole.WRITABLE },
      ],
      data,
    } as Instruction]);
  }

  /** SPL token account fields, or null when the account is not one. */
  tokenAccount(addressText: string): { mint: string; owner: string; amount: bigint; decimals: number } | null {
    const account = this.getAccount(addressText);
    if (!account || account.owner !== TOKEN_PROGRAM || account.data.length < TOKEN_ACCOUNT_SIZE) return null;
    const view = new DataView(account.data.buffer, account.data.byteOffset, account.data.byteLength);
    const mint = encodeBase58(account.data.subarray(0, 32));
    const mintAccount = this.getAccount(mint);
    const decimals = mintAccount && mintAccount.data.length >= MINT_SIZE ? mintAccount.data[44]! : 0;
    return { mint, owner: encodeBase58(account.data.subarray(32, 64)), amount: view.getBigUint64(64, true), decimals };
  }
}

export { MalformedTransactionError };
