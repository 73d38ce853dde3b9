/**
 * The on-chain program's test bench: the committed artifact `program/agent_vault.so` (rebuilt
 * first when clang is installed) deployed through the real upgradeable loader into LiteSVM, a
 * USDC-like mint (6 decimals), and helpers that build every instruction with the service's own
 * encoders (src/chain/program.ts), so these tests also prove the client's encoding.
 *
 * Each test gets a fresh LiteSVM restored from a snapshot taken once per test file, so tests
 * never share chain state and never pay for a redeploy.
 */
import assert from 'node:assert/strict';
import { readFile, rename } from 'node:fs/promises';
import {
  AccountRole,
  appendTransactionMessageInstructions,
  createTransactionMessage,
  generateKeyPairSigner,
  getAddressEncoder,
  lamports,
  pipe,
  setTransactionMessageFeePayerSigner,
  signTransactionMessageWithSigners,
  type AccountMeta,
  type Address,
  type Instruction,
  type KeyPairSigner,
} from '@solana/kit';
import { Clock, FailedTransactionMetadata, LiteSVM } from 'litesvm';
import * as program from '../../src/chain/program.ts';
import { transactionErrorJson, type TransactionErrorJson } from '../../src/validator/transaction-error.ts';
import { deployUpgradeableProgram } from '../../src/validator/loader.ts';
import { buildProgram, isToolchainInstalled, PROGRAM_ARTIFACT_PATH } from '../build/build.ts';

export { program };
export const { ProgramError, NO_LIMIT, TOKEN_PROGRAM, SYSTEM_PROGRAM, ATA_PROGRAM } = program;

export const USDC_DECIMALS = 6;
/** 1 USDC in micro-USDC. */
export const USDC = 1_000_000n;
export const U64_MAX = 0xffff_ffff_ffff_ffffn;
export const DAY_S = 86_400n;
/** Tests start at a fixed, mid-day UTC time: 2025-01-01T12:00:00Z. */
export const START_TIME_S = 1_735_732_800n;

const SOL = 1_000_000_000n;
const MINT_SIZE = 82;
const TOKEN_ACCOUNT_SIZE = 165;
const TOKEN_INITIALIZE_ACCOUNT3 = 18;
const TOKEN_INITIALIZE_MINT2 = 20;
const TOKEN_MINT_TO = 7;
const TOKEN_FREEZE_ACCOUNT = 10;

// ---------------------------------------------------------------------------------------------
// The artifact

let artifact: Promise<Uint8Array> | undefined;

/**
 * The committed program. When clang is installed it is rebuilt first, into a file of this
 * process that is then renamed over the artifact: test files run in parallel processes, and a
 * rename is atomic, so no process ever reads half a program.
 */
export function programArtifact(): Promise<Uint8Array> {
  artifact ??= (async () => {
    if (isToolchainInstalled()) {
      const staging = `${PROGRAM_ARTIFACT_PATH}.${process.pid}.tmp`;
      await buildProgram({ outPath: staging });
      await rename(staging, PROGRAM_ARTIFACT_PATH);
    }
    return new Uint8Array(await readFile(PROGRAM_ARTIFACT_PATH));
  })();
  return artifact;
}

// ---------------------------------------------------------------------------------------------
// Outcomes and assertions

export type Outcome =
  | { ok: true; computeUnits: bigint; logs: string[] }
  | { ok: false; err: TransactionErrorJson; computeUnits: bigint; logs: string[] };

export function expectOk(outcome: Outcome): bigint {
  if (!outcome.ok) assert.fail(`transaction failed: ${JSON.stringify(outcome.err)}\n${outcome.logs.join('\n')}`);
  return outcome.computeUnits;
}

/** The transaction failed in instruction `index` with the program's error `name`, exactly. */
export function expectProgramError(outcome: Outcome, name: program.ProgramErrorName, index = 0): void {
  const expected = { InstructionError: [index, { Custom: ProgramError[name] }] };
  if (outcome.ok) assert.fail(`expected ${name} (${ProgramError[name]}), but the transaction succeeded`);
  assert.deepEqual(outcome.err, expected, `expected ${name}; logs:\n${outcome.logs.join('\n')}`);
}

/** The transaction failed with this error as JSON-RPC would report it (e.g. another program's). */
export function expectError(outcome: Outcome, err: TransactionErrorJson): void {
  if (outcome.ok) assert.fail(`expected ${JSON.stringify(err)}, but the transaction succeeded`);
  assert.deepEqual(outcome.err, err, `logs:\n${outcome.logs.join('\n')}`);
}

// ---------------------------------------------------------------------------------------------
// Instruction surgery for negative tests

/** The instruction with account `index` no longer a signer (the fee payer must be someone else). */
export function withoutSigner(instruction: Instruction, index: number): Instruction {
  return withAccount(instruction, index, (meta) => ({
    address: meta.address,
    role: meta.role === AccountRole.WRITABLE_SIGNER ? AccountRole.WRITABLE : AccountRole.READONLY,
  }));
}

/** The instruction with account `index` read-only. */
export function withoutWritable(instruction: Instruction, index: number): Instruction {
  return withAccount(instruction, index, (meta) => {
    const signer = (meta as { signer?: KeyPairSigner }).signer;
    return signer
      ? ({ address: meta.address, role: AccountRole.READONLY_SIGNER, signer } as AccountMeta)
      : { address: meta.address, role: AccountRole.READONLY };
  });
}

/** The instruction with account `index` replaced by `replacement` (same role). */
export function withAddress(instruction: Instruction, index: number, replacement: Address): Instruction {
  return withAccount(instruction, index, (meta) => ({ address: replacement, role: meta.role }));
}

/** The instruction with other data. */
export function withData(instruction: Instruction, data: Uint8Array): Instruction {
  return { ...instruction, data };
}

function withAccount(instruction: Instruction, index: number, change: (meta: AccountMeta) => AccountMeta): Instruction {
  const accounts = [...(instruction.accounts ?? [])];
  const meta = accounts[index];
  assert.ok(meta, `instruction has no account ${index}`);
  accounts[index] = change(meta);
  return { ...instruction, accounts };
}

// ---------------------------------------------------------------------------------------------
// The bench

interface Snapshot {
  state: Uint8Array;
  programId: Address;
  operator: KeyPairSigner;
  mint: Address;
  mintAuthority: KeyPairSigner;
}

let snapshot: Promise<Snapshot> | undefined;

async function baseSnapshot(): Promise<Snapshot> {
  snapshot ??= (async () => {
    const svm = new LiteSVM();
    const operator = await generateKeyPairSigner();
    svm.airdrop(operator.address, lamports(1_000n * SOL));
    const programKeypair = await generateKeyPairSigner();
    await deployUpgradeableProgram(svm, {
      payer: operator,
      programKeypair,
      upgradeAuthority: operator,
      programBytes: await programArtifact(),
    });
    const mintAuthority = await generateKeyPairSigner();
    const mint = await generateKeyPairSigner();
    const bench = new Bench(svm, programKeypair.address, operator, mint.address, mintAuthority);
    expectOk(await bench.send([
      {
        programAddress: SYSTEM_PROGRAM,
        accounts: [signerMeta(operator), signerMeta(mint)],
        data: concat(u32(0), u64(svm.minimumBalanceForRentExemption(BigInt(MINT_SIZE))), u64(BigInt(MINT_SIZE)),
          getAddressEncoder().encode(TOKEN_PROGRAM)),
      },
      initializeMintInstruction(mint.address, mintAuthority.address),
    ]));
    bench.setTime(START_TIME_S);
    return { state: svm.toBytes(), programId: programKeypair.address, operator, mint: mint.address, mintAuthority };
  })();
  return snapshot;
}

/** A fresh chain with the program deployed and the mint created. */
export async function createBench(): Promise<Bench> {
  const base = await baseSnapshot();
  return new Bench(LiteSVM.fromBytes(base.state), base.programId, base.operator, base.mint, base.mintAuthority);
}

export interface Org {
  orgId: string;
  org: Uint8Array;
  reserve: Address;
  reserveToken: Address;
  policyKey: Uint8Array;
  policy: Address;
}

export interface AgentVault {
  org: Org;
  agent: Uint8Array;
  vault: Address;
  vaultToken: Address;
}

export interface EscrowAddresses {
  escrowKey: Uint8Array;
  escrow: Address;
  escrowToken: Address;
}

export interface PolicyLimitsInput {
  maxPerTx?: bigint;
  maxPerDay?: bigint;
  expiry?: bigint;
}

export class Bench {
  constructor(
    readonly svm: LiteSVM,
    readonly programId: Address,
    readonly operator: KeyPairSigner,
    readonly mint: Address,
    readonly mintAuthority: KeyPairSigner,
  ) {}

  /**
   * Sends one transaction (fee payer: the operator unless given). The blockhash is expired
   * afterwards so that sending the same instructions again is a new transaction.
   */
  async send(instructions: Instruction[], feePayer: KeyPairSigner = this.operator): Promise<Outcome> {
    const message = pipe(
      createTransactionMessage({ version: 0 }),
      (m) => setTransactionMessageFeePayerSigner(feePayer, m),
      (m) => this.svm.setTransactionMessageLifetimeUsingLatestBlockhash(m),
      (m) => appendTransactionMessageInstructions(instructions, m),
    );
    const transaction = await signTransactionMessageWithSigners(message);
    const result = this.svm.sendTransaction(transaction);
    this.svm.expireBlockhash();
    if (result instanceof FailedTransactionMetadata) {
      const meta = result.meta();
      return { ok: false, err: transactionErrorJson(result), computeUnits: meta.computeUnitsConsumed(), logs: meta.logs() };
    }
    return { ok: true, computeUnits: result.computeUnitsConsumed(), logs: result.logs() };
  }

  /** A funded keypair. */
  async keypair(): Promise<KeyPairSigner> {
    const signer = await generateKeyPairSigner();
    this.svm.airdrop(signer.address, lamports(10n * SOL));
    return signer;
  }

  setTime(unixTimestampS: bigint): void {
    const clock = this.svm.getClock();
    this.svm.setClock(new Clock(clock.slot + 1n, clock.epochStartTimestamp, clock.epoch, clock.leaderScheduleEpoch, unixTimestampS));
  }

  now(): bigint {
    return this.svm.getClock().unixTimestamp;
  }

  data(account: Address): Uint8Array | null {
    const found = this.svm.getAccount(account);
    return found.exists ? new Uint8Array(found.data) : null;
  }

  /** The program that owns the account; null when it does not exist. */
  owner(account: Address): Address | null {
    const found = this.svm.getAccount(account);
    return found.exists ? found.programAddress : null;
  }

  lamports(account: Address): bigint {
    return this.svm.getBalance(account) ?? 0n;
  }

  /** A token account's amount; 0 when the account does not exist. */
  tokens(account: Address): bigint {
    const data = this.data(account);
    return data === null ? 0n : program.decodeTokenAmount(data);
  }

  vault(account: Address): program.VaultAccount {
    const data = this.data(account);
    assert.ok(data, `no vault at ${account}`);
    return program.decodeVault(data);
  }

  policyAccount(account: Address): program.PolicyAccount {
    const data = this.data(account);
    assert.ok(data, `no policy at ${account}`);
    return program.decodePolicy(data);
  }

  escrow(account: Address): program.EscrowAccount {
    const data = this.data(account);
    assert.ok(data, `no escrow at ${account}`);
    return program.decodeEscrow(data);
  }

  /** Writes raw account state, for the tests that must start from a forged or corrupted account. */
  setAccount(account: Address, data: Uint8Array, owner: Address, lamportsHeld?: bigint): void {
    this.svm.setAccount({
      address: account,
      data,
      executable: false,
      lamports: lamports(lamportsHeld ?? this.svm.minimumBalanceForRentExemption(BigInt(data.length))),
      programAddress: owner,
      space: BigInt(data.length),
    });
  }

  /**
   * Rewrites an existing account: its data through `change`, and optionally its owner. For the
   * tests that must start from state the program itself would never write.
   */
  forge(account: Address, change: (data: Uint8Array) => void, owner?: Address): void {
    const found = this.svm.getAccount(account);
    assert.ok(found.exists, `no account at ${account}`);
    const data = new Uint8Array(found.data);
    change(data);
    this.setAccount(account, data, owner ?? found.programAddress, found.lamports);
  }

  /** The owner's associated token account for the mint, created by the operator. */
  async tokenAccount(owner: Address, mint: Address = this.mint): Promise<Address> {
    const ata = await program.findAssociatedTokenAddress(owner, mint);
    expectOk(await this.send([this.createAtaInstruction(owner, ata, mint)]));
    return ata;
  }

  createAtaInstruction(owner: Address, ata: Address, mint: Address = this.mint): Instruction {
    return {
      programAddress: ATA_PROGRAM,
      accounts: [
        signerMeta(this.operator),
        { address: ata, role: AccountRole.WRITABLE },
        { address: owner, role: AccountRole.READONLY },
        { address: mint, role: AccountRole.READONLY },
        { address: SYSTEM_PROGRAM, role: AccountRole.READONLY },
        { address: TOKEN_PROGRAM, role: AccountRole.READONLY },
      ],
      data: new Uint8Array([1]),
    };
  }

  /**
   * A token account of the mint owned by `owner` at a fresh address, not the owner's ATA, made
   * and paid for by `payer`: as anyone can, since InitializeAccount3 needs no signature of the
   * owner.
   */
  async strayTokenAccount(owner: Address, payer: KeyPairSigner): Promise<Address> {
    const account = await generateKeyPairSigner();
    expectOk(await this.send([
      {
        programAddress: SYSTEM_PROGRAM,
        accounts: [signerMeta(payer), signerMeta(account)],
        data: concat(u32(0), u64(this.svm.minimumBalanceForRentExemption(BigInt(TOKEN_ACCOUNT_SIZE))), u64(BigInt(TOKEN_ACCOUNT_SIZE)),
          getAddressEncoder().encode(TOKEN_PROGRAM)),
      },
      {
        programAddress: TOKEN_PROGRAM,
        accounts: [{ address: account.address, role: AccountRole.WRITABLE }, { address: this.mint, role: AccountRole.READONLY }],
        data: concat([TOKEN_INITIALIZE_ACCOUNT3], getAddressEncoder().encode(owner)),
      },
    ], payer));
    return account.address;
  }

  /** Another 6-decimal mint (authority: the bench's mint authority). */
  async createMint(): Promise<Address> {
    const mint = await generateKeyPairSigner();
    expectOk(await this.send([
      {
        programAddress: SYSTEM_PROGRAM,
        accounts: [signerMeta(this.operator), signerMeta(mint)],
        data: concat(u32(0), u64(this.svm.minimumBalanceForRentExemption(BigInt(MINT_SIZE))), u64(BigInt(MINT_SIZE)),
          getAddressEncoder().encode(TOKEN_PROGRAM)),
      },
      initializeMintInstruction(mint.address, this.mintAuthority.address),
    ]));
    return mint.address;
  }

  async mintTo(tokenAccount: Address, amount: bigint, mint: Address = this.mint): Promise<void> {
    expectOk(await this.send([{
      programAddress: TOKEN_PROGRAM,
      accounts: [
        { address: mint, role: AccountRole.WRITABLE },
        { address: tokenAccount, role: AccountRole.WRITABLE },
        signerMeta(this.mintAuthority, false),
      ],
      data: concat(new Uint8Array([TOKEN_MINT_TO]), u64(amount)),
    }]));
  }

  /** Freezes a token account with the mint's freeze authority. */
  async freezeTokenAccount(tokenAccount: Address): Promise<void> {
    expectOk(await this.send([{
      programAddress: TOKEN_PROGRAM,
      accounts: [
        { address: tokenAccount, role: AccountRole.WRITABLE },
        { address: this.mint, role: AccountRole.READONLY },
        signerMeta(this.mintAuthority, false),
      ],
      data: new Uint8Array([TOKEN_FREEZE_ACCOUNT]),
    }]));
  }

  // -------------------------------------------------------------------------------------------
  // The program's instructions, through the service's encoders

  async orgAddresses(orgId: string, policyId = 'default'): Promise<Org> {
    const org = program.seedOf(orgId);
    const reserve = (await program.findReservePda(this.programId, org)).address;
    const policyKey = program.policyKeyOf(orgId, policyId);
    return {
      orgId,
      org,
      reserve,
      reserveToken: await program.findAssociatedTokenAddress(reserve, this.mint),
      policyKey,
      policy: (await program.findPolicyPda(this.programId, policyKey)).address,
    };
  }

  initReserveInstruction(org: Org, operator: KeyPairSigner = this.operator, mint: Address = this.mint): Instruction {
    return program.initReserve(this.programId, { operator, reserve: org.reserve, reserveToken: org.reserveToken, mint }, org.org);
  }

  setPolicyInstruction(org: Org, limits: PolicyLimitsInput = {}, operator: KeyPairSigner = this.operator): Instruction {
    return program.setPolicy(this.programId, { operator, policy: org.policy }, org.policyKey, {
      maxPerTx: limits.maxPerTx ?? NO_LIMIT,
      maxPerDay: limits.maxPerDay ?? NO_LIMIT,
      expiry: limits.expiry ?? 0n,
    });
  }

  async vaultAddresses(org: Org, agentId: string): Promise<AgentVault> {
    const agent = program.seedOf(agentId);
    const vault = (await program.findVaultPda(this.programId, org.org, agent)).address;
    return { org, agent, vault, vaultToken: await program.findAssociatedTokenAddress(vault, this.mint) };
  }

  createVaultInstruction(v: AgentVault, operator: KeyPairSigner = this.operator): Instruction {
    return program.createVault(this.programId, {
      operator,
      reserve: v.org.reserve,
      vault: v.vault,
      vaultToken: v.vaultToken,
      policy: v.org.policy,
      mint: this.mint,
    }, v.org.org, v.agent);
  }

  fundInstruction(v: AgentVault, amount: bigint, operator: KeyPairSigner = this.operator): Instruction {
    return program.fund(this.programId, {
      operator,
      reserve: v.org.reserve,
      reserveToken: v.org.reserveToken,
      vault: v.vault,
      vaultToken: v.vaultToken,
    }, amount);
  }

  withdrawInstruction(v: AgentVault, amount: bigint, operator: KeyPairSigner = this.operator): Instruction {
    return program.withdraw(this.programId, {
      operator,
      reserve: v.org.reserve,
      reserveToken: v.org.reserveToken,
      vault: v.vault,
      vaultToken: v.vaultToken,
    }, amount);
  }

  async payInstruction(
    v: AgentVault,
    recipient: Address,
    amount: bigint,
    options: { recipientToken?: Address; memo?: Uint8Array; operator?: KeyPairSigner } = {},
  ): Promise<Instruction> {
    return program.pay(this.programId, {
      operator: options.operator ?? this.operator,
      vault: v.vault,
      vaultToken: v.vaultToken,
      policy: v.org.policy,
      mint: this.mint,
      recipient,
      recipientToken: options.recipientToken ?? await program.findAssociatedTokenAddress(recipient, this.mint),
    }, { amount, attestation: new Uint8Array(32).fill(7), memo: options.memo });
  }

  async escrowAddresses(escrowId: string): Promise<EscrowAddresses> {
    const escrowKey = program.seedOf(escrowId);
    const escrow = (await program.findEscrowPda(this.programId, escrowKey)).address;
    return { escrowKey, escrow, escrowToken: await program.findAssociatedTokenAddress(escrow, this.mint) };
  }

  escrowCreateInstruction(
    v: AgentVault,
    e: EscrowAddresses,
    d: { receiver: Address; arbiter: Address; amount: bigint; expiresAt: bigint; operator?: KeyPairSigner },
  ): Instruction {
    return program.escrowCreate(this.programId, {
      operator: d.operator ?? this.operator,
      vault: v.vault,
      vaultToken: v.vaultToken,
      policy: v.org.policy,
      mint: this.mint,
      escrow: e.escrow,
      escrowToken: e.escrowToken,
      receiver: d.receiver,
      arbiter: d.arbiter,
    }, { escrowKey: e.escrowKey, amount: d.amount, taskHash: new Uint8Array(32).fill(9), expiresAt: d.expiresAt });
  }

  async escrowReleaseInstruction(e: EscrowAddresses, receiver: Address, operator: KeyPairSigner = this.operator): Promise<Instruction> {
    return program.escrowRelease(this.programId, {
      operator,
      escrow: e.escrow,
      escrowToken: e.escrowToken,
      mint: this.mint,
      receiver,
      receiverToken: await program.findAssociatedTokenAddress(receiver, this.mint),
    });
  }

  escrowRefundInstruction(e: EscrowAddresses, v: AgentVault, signer: KeyPairSigner = this.operator): Instruction {
    return program.escrowRefund(this.programId, {
      signer,
      escrow: e.escrow,
      escrowToken: e.escrowToken,
      fromVault: v.vault,
      vaultToken: v.vaultToken,
    });
  }

  escrowDisputeInstruction(e: EscrowAddresses, operator: KeyPairSigner = this.operator): Instruction {
    return program.escrowDispute(this.programId, { operator, escrow: e.escrow });
  }

  async escrowResolveInstruction(
    e: EscrowAddresses,
    v: AgentVault,
    receiver: Address,
    arbiter: KeyPairSigner,
    split: { toReceiver: bigint; toSender: bigint },
  ): Promise<Instruction> {
    return program.escrowResolve(this.programId, {
      arbiter,
      escrow: e.escrow,
      escrowToken: e.escrowToken,
      mint: this.mint,
      receiver,
      receiverToken: await program.findAssociatedTokenAddress(receiver, this.mint),
      fromVault: v.vault,
      vaultToken: v.vaultToken,
    }, split);
  }

  escrowCloseInstruction(e: EscrowAddresses, operator: KeyPairSigner = this.operator): Instruction {
    return program.escrowClose(this.programId, { operator, escrow: e.escrow, escrowToken: e.escrowToken });
  }

  policyCloseInstruction(org: Org, operator: KeyPairSigner = this.operator): Instruction {
    return program.policyClose(this.programId, { operator, policy: org.policy });
  }

  /** An organisation with its reserve holding `reserveAmount` and its default policy. */
  async createOrg(orgId: string, limits: PolicyLimitsInput = {}, reserveAmount = 1_000n * USDC): Promise<Org> {
    const org = await this.orgAddresses(orgId);
    expectOk(await this.send([this.initReserveInstruction(org), this.setPolicyInstruction(org, limits)]));
    if (reserveAmount > 0n) await this.mintTo(org.reserveToken, reserveAmount);
    return org;
  }

  /** A vault of the org, funded from its reserve with `amount`. */
  async createVault(org: Org, agentId: string, amount = 100n * USDC): Promise<AgentVault> {
    const v = await this.vaultAddresses(org, agentId);
    const instructions = [this.createVaultInstruction(v)];
    if (amount > 0n) instructions.push(this.fundInstruction(v, amount));
    expectOk(await this.send(instructions));
    return v;
  }
}

function initializeMintInstruction(mint: Address, authority: Address): Instruction {
  return {
    programAddress: TOKEN_PROGRAM,
    accounts: [{ address: mint, role: AccountRole.WRITABLE }],
    data: concat(new Uint8Array([TOKEN_INITIALIZE_MINT2, USDC_DECIMALS]), getAddressEncoder().encode(authority),
      new Uint8Array([1]), getAddressEncoder().encode(authority)),
  };
}

// ---------------------------------------------------------------------------------------------
// Bytes

export function signerMeta(signer: KeyPairSigner, writable = true): AccountMeta {
  return { address: signer.address, role: writable ? AccountRole.WRITABLE_SIGNER : AccountRole.READONLY_SIGNER, signer } as AccountMeta;
}

export function u32(value: number): Uint8Array {
  const bytes = new Uint8Array(4);
  new DataView(bytes.buffer).setUint32(0, value, true);
  return bytes;
}

export function u64(value: bigint): Uint8Array {
  const bytes = new Uint8Array(8);
  new DataView(bytes.buffer).setBigUint64(0, value, true);
  return bytes;
}

export function concat(...parts: ArrayLike<number>[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}
