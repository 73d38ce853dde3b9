/**
 * The Agent Vault program's interface, as docs/program.md defines it: program-derived
 * addresses, account layouts and instruction encoders. Pure: no RPC, no clock.
 */
import { createHash } from 'node:crypto';
import {
  AccountRole,
  address,
  getAddressDecoder,
  getAddressEncoder,
  getProgramDerivedAddress,
  type AccountMeta,
  type Address,
  type Instruction,
  type TransactionSigner,
} from '@solana/kit';

export const SYSTEM_PROGRAM = address('11111111111111111111111111111111');
export const TOKEN_PROGRAM = address('TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA');
export const ATA_PROGRAM = address('ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL');

/** `u64::MAX`: "no limit" for a policy's max_per_tx and max_per_day. */
export const NO_LIMIT = 0xffff_ffff_ffff_ffffn;
export const MEMO_MAX_BYTES = 128;

export const Tag = {
  InitReserve: 0,
  SetPolicy: 1,
  CreateVault: 2,
  UpdateVault: 3,
  Fund: 4,
  Withdraw: 5,
  Pay: 6,
  EscrowCreate: 7,
  EscrowRelease: 8,
  EscrowRefund: 9,
  EscrowDispute: 10,
  EscrowResolve: 11,
  EscrowClose: 12,
  PolicyClose: 13,
} as const;

export const VaultOp = { AttachPolicy: 0, Freeze: 1, Unfreeze: 2 } as const;

export const EscrowState = { Locked: 1, Released: 2, Refunded: 3, Disputed: 4, Resolved: 5 } as const;
export type EscrowStateCode = (typeof EscrowState)[keyof typeof EscrowState];

/** The program's custom error codes (`Custom(n)`), by name. */
export const ProgramError = {
  InvalidInstruction: 6000,
  MissingSigner: 6001,
  Unauthorized: 6002,
  InvalidAccountOwner: 6003,
  InvalidAccountData: 6004,
  InvalidPda: 6005,
  DuplicateAccount: 6006,
  InvalidProgramId: 6007,
  InvalidMint: 6008,
  InvalidTokenAccount: 6009,
  AlreadyInitialized: 6010,
  VaultFrozen: 6011,
  PolicyExpired: 6012,
  OverMaxPerTx: 6013,
  OverDailyCap: 6014,
  InsufficientFunds: 6015,
  InvalidAmount: 6016,
  ArithmeticOverflow: 6017,
  InvalidEscrowState: 6018,
  EscrowExpired: 6019,
  EscrowNotExpired: 6020,
  InvalidSplit: 6021,
  InvalidExpiry: 6022,
  MemoTooLong: 6023,
  PolicyMismatch: 6024,
  NotWritable: 6025,
  TokenAccountNotEmpty: 6026,
} as const;
export type ProgramErrorName = keyof typeof ProgramError;

const programErrorNames = new Map<number, ProgramErrorName>(
  Object.entries(ProgramError).map(([name, code]) => [code, name as ProgramErrorName]),
);

export function programErrorName(code: number): ProgramErrorName | undefined {
  return programErrorNames.get(code);
}

/** A 32-byte seed for a service id: sha256 of its UTF-8 bytes (fixed length, any id). */
export function seedOf(id: string): Uint8Array {
  return new Uint8Array(createHash('sha256').update(id, 'utf8').digest());
}

export function policyKeyOf(orgId: string, policyId: string): Uint8Array {
  return seedOf(`${orgId}:${policyId}`);
}

export interface Pda {
  address: Address;
  bump: number;
}

const text = new TextEncoder();
const addressEncoder = getAddressEncoder();
const addressDecoder = getAddressDecoder();

async function findPda(programId: Address, seeds: Uint8Array[]): Promise<Pda> {
  const [pda, bump] = await getProgramDerivedAddress({ programAddress: programId, seeds });
  return { address: pda, bump };
}

export function findReservePda(programId: Address, org: Uint8Array): Promise<Pda> {
  return findPda(programId, [text.encode('reserve'), org]);
}

export function findVaultPda(programId: Address, org: Uint8Array, agent: Uint8Array): Promise<Pda> {
  return findPda(programId, [text.encode('vault'), org, agent]);
}

export function findPolicyPda(programId: Address, policyKey: Uint8Array): Promise<Pda> {
  return findPda(programId, [text.encode('policy'), policyKey]);
}

export function findEscrowPda(programId: Address, escrowKey: Uint8Array): Promise<Pda> {
  return findPda(programId, [text.encode('escrow'), escrowKey]);
}

/** The associated token account of `owner` for `mint` (SPL Token, not Token-2022). */
export async function findAssociatedTokenAddress(owner: Address, mint: Address): Promise<Address> {
  const [ata] = await getProgramDerivedAddress({
    programAddress: ATA_PROGRAM,
    seeds: [addressEncoder.encode(owner), addressEncoder.encode(TOKEN_PROGRAM), addressEncoder.encode(mint)],
  });
  return ata;
}

// ---------------------------------------------------------------------------------------------
// Instruction data

class DataWriter {
  readonly bytes: Uint8Array;
  readonly #view: DataView;
  #offset = 0;

  constructor(length: number) {
    this.bytes = new Uint8Array(length);
    this.#view = new DataView(this.bytes.buffer);
  }

  u8(value: number): this {
    this.#view.setUint8(this.#offset, value);
    this.#offset += 1;
    return this;
  }

  u64(value: bigint): this {
    this.#view.setBigUint64(this.#offset, value, true);
    this.#offset += 8;
    return this;
  }

  i64(value: bigint): this {
    this.#view.setBigInt64(this.#offset, value, true);
    this.#offset += 8;
    return this;
  }

  raw(value: Uint8Array, length: number): this {
    if (value.length !== length) throw new RangeError(`expected ${length} bytes, got ${value.length}`);
    this.bytes.set(value, this.#offset);
    this.#offset += length;
    return this;
  }

  done(): Uint8Array {
    if (this.#offset !== this.bytes.length) throw new Error('instruction data length mismatch');
    return this.bytes;
  }
}

function signer(account: TransactionSigner, writable: boolean): AccountMeta {
  return {
    address: account.address,
    role: writable ? AccountRole.WRITABLE_SIGNER : AccountRole.READONLY_SIGNER,
    signer: account,
  } as AccountMeta;
}
const writable = (account: Address): AccountMeta => ({ address: account, role: AccountRole.WRITABLE });
const readonly = (account: Address): AccountMeta => ({ address: account, role: AccountRole.READONLY });

function instruction(programId: Address, accounts: AccountMeta[], data: Uint8Array): Instruction {
  return { programAddress: programId, accounts, data };
}

// ---------------------------------------------------------------------------------------------
// Instruction builders. Each takes the addresses it needs; derive them with the find* helpers.

export interface InitReserveAccounts {
  operator: TransactionSigner;
  reserve: Address;
  reserveToken: Address;
  mint: Address;
}

export function initReserve(programId: Address, a: InitReserveAccounts, org: Uint8Array): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.reserve), writable(a.reserveToken), readonly(a.mint),
      readonly(SYSTEM_PROGRAM), readonly(TOKEN_PROGRAM), readonly(ATA_PROGRAM)],
    new DataWriter(33).u8(Tag.InitReserve).raw(org, 32).done(),
  );
}

export interface PolicyLimits {
  /** micro-USDC; NO_LIMIT for none */
  maxPerTx: bigint;
  /** micro-USDC per UTC day; NO_LIMIT for none */
  maxPerDay: bigint;
  /** Unix seconds; 0n for none */
  expiry: bigint;
}

export function setPolicy(
  programId: Address,
  a: { operator: TransactionSigner; policy: Address },
  policyKey: Uint8Array,
  limits: PolicyLimits,
): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.policy), readonly(SYSTEM_PROGRAM)],
    new DataWriter(57).u8(Tag.SetPolicy).raw(policyKey, 32).u64(limits.maxPerTx).u64(limits.maxPerDay)
      .i64(limits.expiry).done(),
  );
}

export interface CreateVaultAccounts {
  operator: TransactionSigner;
  reserve: Address;
  vault: Address;
  vaultToken: Address;
  policy: Address;
  mint: Address;
}

export function createVault(programId: Address, a: CreateVaultAccounts, org: Uint8Array, agent: Uint8Array): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), readonly(a.reserve), writable(a.vault), writable(a.vaultToken), readonly(a.policy),
      readonly(a.mint), readonly(SYSTEM_PROGRAM), readonly(TOKEN_PROGRAM), readonly(ATA_PROGRAM)],
    new DataWriter(65).u8(Tag.CreateVault).raw(org, 32).raw(agent, 32).done(),
  );
}

export type VaultUpdate = { op: 'attach_policy'; policy: Address } | { op: 'freeze' } | { op: 'unfreeze' };

export function updateVault(
  programId: Address,
  a: { operator: TransactionSigner; vault: Address },
  update: VaultUpdate,
): Instruction {
  const accounts = [signer(a.operator, false), writable(a.vault)];
  let op: number;
  if (update.op === 'attach_policy') {
    accounts.push(readonly(update.policy));
    op = VaultOp.AttachPolicy;
  } else {
    op = update.op === 'freeze' ? VaultOp.Freeze : VaultOp.Unfreeze;
  }
  return instruction(programId, accounts, new DataWriter(2).u8(Tag.UpdateVault).u8(op).done());
}

export interface TransferAccounts {
  operator: TransactionSigner;
  reserve: Address;
  reserveToken: Address;
  vault: Address;
  vaultToken: Address;
}

export function fund(programId: Address, a: TransferAccounts, amount: bigint): Instruction {
  return instruction(
    programId,
    [signer(a.operator, false), readonly(a.reserve), writable(a.reserveToken), readonly(a.vault),
      writable(a.vaultToken), readonly(TOKEN_PROGRAM)],
    new DataWriter(9).u8(Tag.Fund).u64(amount).done(),
  );
}

export function withdraw(programId: Address, a: TransferAccounts, amount: bigint): Instruction {
  return instruction(
    programId,
    [signer(a.operator, false), readonly(a.vault), writable(a.vaultToken), readonly(a.reserve),
      writable(a.reserveToken), readonly(TOKEN_PROGRAM)],
    new DataWriter(9).u8(Tag.Withdraw).u64(amount).done(),
  );
}

export interface PayAccounts {
  operator: TransactionSigner;
  vault: Address;
  vaultToken: Address;
  policy: Address;
  mint: Address;
  recipient: Address;
  recipientToken: Address;
}

export interface PayData {
  amount: bigint;
  /** 32 bytes: sha256 of the payment intent */
  attestation: Uint8Array;
  /** at most MEMO_MAX_BYTES bytes of UTF-8 */
  memo?: Uint8Array;
}

export function pay(programId: Address, a: PayAccounts, d: PayData): Instruction {
  const memo = d.memo ?? new Uint8Array(0);
  if (memo.length > MEMO_MAX_BYTES) throw new RangeError(`memo is longer than ${MEMO_MAX_BYTES} bytes`);
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.vault), writable(a.vaultToken), readonly(a.policy), readonly(a.mint),
      readonly(a.recipient), writable(a.recipientToken), readonly(SYSTEM_PROGRAM), readonly(TOKEN_PROGRAM),
      readonly(ATA_PROGRAM)],
    new DataWriter(1 + 8 + 32 + 1 + memo.length).u8(Tag.Pay).u64(d.amount).raw(d.attestation, 32)
      .u8(memo.length).raw(memo, memo.length).done(),
  );
}

export interface EscrowCreateAccounts {
  operator: TransactionSigner;
  vault: Address;
  vaultToken: Address;
  policy: Address;
  mint: Address;
  escrow: Address;
  escrowToken: Address;
  receiver: Address;
  arbiter: Address;
}

export interface EscrowCreateData {
  escrowKey: Uint8Array;
  amount: bigint;
  taskHash: Uint8Array;
  /** Unix seconds */
  expiresAt: bigint;
}

export function escrowCreate(programId: Address, a: EscrowCreateAccounts, d: EscrowCreateData): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.vault), writable(a.vaultToken), readonly(a.policy), readonly(a.mint),
      writable(a.escrow), writable(a.escrowToken), readonly(a.receiver), readonly(a.arbiter),
      readonly(SYSTEM_PROGRAM), readonly(TOKEN_PROGRAM), readonly(ATA_PROGRAM)],
    new DataWriter(1 + 32 + 8 + 32 + 8).u8(Tag.EscrowCreate).raw(d.escrowKey, 32).u64(d.amount)
      .raw(d.taskHash, 32).i64(d.expiresAt).done(),
  );
}

export interface EscrowReleaseAccounts {
  operator: TransactionSigner;
  escrow: Address;
  escrowToken: Address;
  mint: Address;
  receiver: Address;
  receiverToken: Address;
}

export function escrowRelease(programId: Address, a: EscrowReleaseAccounts): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.escrow), writable(a.escrowToken), readonly(a.mint), readonly(a.receiver),
      writable(a.receiverToken), readonly(SYSTEM_PROGRAM), readonly(TOKEN_PROGRAM), readonly(ATA_PROGRAM)],
    new Uint8Array([Tag.EscrowRelease]),
  );
}

export interface EscrowRefundAccounts {
  /** the operator (after expiry) or the escrow's arbiter (any time) */
  signer: TransactionSigner;
  escrow: Address;
  escrowToken: Address;
  fromVault: Address;
  vaultToken: Address;
}

export function escrowRefund(programId: Address, a: EscrowRefundAccounts): Instruction {
  return instruction(
    programId,
    [signer(a.signer, false), writable(a.escrow), writable(a.escrowToken), writable(a.fromVault),
      writable(a.vaultToken), readonly(TOKEN_PROGRAM)],
    new Uint8Array([Tag.EscrowRefund]),
  );
}

export function escrowDispute(programId: Address, a: { operator: TransactionSigner; escrow: Address }): Instruction {
  return instruction(programId, [signer(a.operator, false), writable(a.escrow)], new Uint8Array([Tag.EscrowDispute]));
}

export interface EscrowResolveAccounts {
  arbiter: TransactionSigner;
  escrow: Address;
  escrowToken: Address;
  mint: Address;
  receiver: Address;
  receiverToken: Address;
  fromVault: Address;
  vaultToken: Address;
}

export function escrowResolve(
  programId: Address,
  a: EscrowResolveAccounts,
  split: { toReceiver: bigint; toSender: bigint },
): Instruction {
  return instruction(
    programId,
    [signer(a.arbiter, true), writable(a.escrow), writable(a.escrowToken), readonly(a.mint), readonly(a.receiver),
      writable(a.receiverToken), writable(a.fromVault), writable(a.vaultToken), readonly(SYSTEM_PROGRAM),
      readonly(TOKEN_PROGRAM), readonly(ATA_PROGRAM)],
    new DataWriter(17).u8(Tag.EscrowResolve).u64(split.toReceiver).u64(split.toSender).done(),
  );
}

export interface EscrowCloseAccounts {
  /** the escrow's authority: it receives both accounts' lamports */
  operator: TransactionSigner;
  escrow: Address;
  escrowToken: Address;
}

/** Closes a settled escrow's account and its empty token account, their rent back to the operator. */
export function escrowClose(programId: Address, a: EscrowCloseAccounts): Instruction {
  return instruction(
    programId,
    [signer(a.operator, true), writable(a.escrow), writable(a.escrowToken), readonly(TOKEN_PROGRAM)],
    new Uint8Array([Tag.EscrowClose]),
  );
}

export interface PolicyCloseAccounts {
  /** the policy's authority: it receives the account's lamports */
  operator: TransactionSigner;
  policy: Address;
}

/** Closes a policy's account, its rent back to the operator that created it. */
export function policyClose(programId: Address, a: PolicyCloseAccounts): Instruction {
  return instruction(programId, [signer(a.operator, true), writable(a.policy)], new Uint8Array([Tag.PolicyClose]));
}

// ---------------------------------------------------------------------------------------------
// Account decoders

function readAddress(data: Uint8Array, offset: number): Address {
  return addressDecoder.decode(data.subarray(offset, offset + 32));
}

function view(data: Uint8Array): DataView {
  return new DataView(data.buffer, data.byteOffset, data.byteLength);
}

function expectAccount(data: Uint8Array, discriminator: number, size: number, name: string): DataView {
  if (data.length !== size || data[0] !== discriminator) throw new Error(`not a ${name} account`);
  return view(data);
}

export interface ReserveAccount {
  bump: number;
  authority: Address;
  org: Uint8Array;
  mint: Address;
  tokenAccount: Address;
}

export function decodeReserve(data: Uint8Array): ReserveAccount {
  expectAccount(data, 1, 136, 'reserve');
  return {
    bump: data[2]!,
    authority: readAddress(data, 8),
    org: data.slice(40, 72),
    mint: readAddress(data, 72),
    tokenAccount: readAddress(data, 104),
  };
}

export interface VaultAccount {
  bump: number;
  frozen: boolean;
  authority: Address;
  org: Uint8Array;
  agent: Uint8Array;
  reserve: Address;
  policy: Address;
  mint: Address;
  tokenAccount: Address;
  dayStart: bigint;
  daySpent: bigint;
  paymentCount: bigint;
}

export function decodeVault(data: Uint8Array): VaultAccount {
  const v = expectAccount(data, 2, 256, 'vault');
  return {
    bump: data[2]!,
    frozen: (data[3]! & 1) === 1,
    authority: readAddress(data, 8),
    org: data.slice(40, 72),
    agent: data.slice(72, 104),
    reserve: readAddress(data, 104),
    policy: readAddress(data, 136),
    mint: readAddress(data, 168),
    tokenAccount: readAddress(data, 200),
    dayStart: v.getBigInt64(232, true),
    daySpent: v.getBigUint64(240, true),
    paymentCount: v.getBigUint64(248, true),
  };
}

export interface PolicyAccount extends PolicyLimits {
  bump: number;
  authority: Address;
  policyKey: Uint8Array;
  revision: bigint;
}

export function decodePolicy(data: Uint8Array): PolicyAccount {
  const v = expectAccount(data, 3, 112, 'policy');
  return {
    bump: data[2]!,
    authority: readAddress(data, 8),
    policyKey: data.slice(40, 72),
    maxPerTx: v.getBigUint64(72, true),
    maxPerDay: v.getBigUint64(80, true),
    expiry: v.getBigInt64(88, true),
    revision: v.getBigUint64(96, true),
  };
}

export interface EscrowAccount {
  bump: number;
  state: EscrowStateCode;
  authority: Address;
  escrowKey: Uint8Array;
  fromVault: Address;
  receiver: Address;
  arbiter: Address;
  mint: Address;
  tokenAccount: Address;
  taskHash: Uint8Array;
  amount: bigint;
  createdAt: bigint;
  expiresAt: bigint;
  releasedAmount: bigint;
  refundedAmount: bigint;
}

export function decodeEscrow(data: Uint8Array): EscrowAccount {
  const v = expectAccount(data, 4, 304, 'escrow');
  return {
    bump: data[2]!,
    state: data[3]! as EscrowStateCode,
    authority: readAddress(data, 8),
    escrowKey: data.slice(40, 72),
    fromVault: readAddress(data, 72),
    receiver: readAddress(data, 104),
    arbiter: readAddress(data, 136),
    mint: readAddress(data, 168),
    tokenAccount: readAddress(data, 200),
    taskHash: data.slice(232, 264),
    amount: v.getBigUint64(264, true),
    createdAt: v.getBigInt64(272, true),
    expiresAt: v.getBigInt64(280, true),
    releasedAmount: v.getBigUint64(288, true),
    refundedAmount: v.getBigUint64(296, true),
  };
}

/** The amount of an SPL token account (u64 at offset 64). */
export function decodeTokenAmount(data: Uint8Array): bigint {
  if (data.length < 72) throw new Error('not a token account');
  return view(data).getBigUint64(64, true);
}
