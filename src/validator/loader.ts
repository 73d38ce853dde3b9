/**
 * Deploys a program into a LiteSVM instance the way a cluster does it: through the
 * real BPF Upgradeable Loader (buffer, Write chunks, DeployWithMaxDataLen), so that
 * the loader's own ELF checks and verifier run on our linker's output. (`addProgram`
 * would skip them.) The loader instructions are encoded here, by hand, in the
 * loader's bincode layout: a u32 little-endian tag, then the fields.
 */
import {
  AccountRole,
  address,
  appendTransactionMessageInstructions,
  createTransactionMessage,
  generateKeyPairSigner,
  getAddressEncoder,
  getProgramDerivedAddress,
  getTransactionMessageSize,
  getTransactionMessageSizeLimit,
  pipe,
  setTransactionMessageFeePayerSigner,
  signTransactionMessageWithSigners,
  type AccountSignerMeta,
  type Address,
  type Instruction,
  type KeyPairSigner,
  type TransactionSigner,
} from '@solana/kit';
import { FailedTransactionMetadata, type LiteSVM, type TransactionMetadata } from 'litesvm';

export const UPGRADEABLE_LOADER = address('BPFLoaderUpgradeab1e11111111111111111111111');
const SYSTEM_PROGRAM = address('11111111111111111111111111111111');
const RENT_SYSVAR = address('SysvarRent111111111111111111111111111111111');
const CLOCK_SYSVAR = address('SysvarC1ock11111111111111111111111111111111');

/** UpgradeableLoaderState sizes: enum tag + Option<Pubkey> authority (+ slot for ProgramData). */
export const BUFFER_METADATA_SIZE = 37;
export const PROGRAM_ACCOUNT_SIZE = 36;
export const PROGRAMDATA_METADATA_SIZE = 45;

const LoaderInstruction = { InitializeBuffer: 0, Write: 1, DeployWithMaxDataLen: 2 } as const;
const SYSTEM_CREATE_ACCOUNT = 0;

/** A program larger than this is a mistake, not a deployment (the loader allows 10 MiB). */
export const PROGRAM_SIZE_MAX = 10 * 1024 * 1024;

export interface DeployUpgradeableProgramOptions {
  payer: KeyPairSigner;
  programKeypair: KeyPairSigner;
  upgradeAuthority: KeyPairSigner;
  programBytes: Uint8Array;
  /** Room for future upgrades; defaults to the program's own size. */
  maxDataLenBytes?: number;
}

export interface DeployedProgram {
  programAddress: Address;
  programDataAddress: Address;
  /** Transactions sent: create buffer, the writes, deploy. */
  transactionCount: number;
  /** Compute units the final DeployWithMaxDataLen transaction consumed. */
  deployComputeUnits: bigint;
}

export class DeployError extends Error {
  override name = 'DeployError';
  constructor(
    message: string,
    readonly step: string,
    readonly logs: readonly string[],
  ) {
    super(`${message}${logs.length > 0 ? `\n${logs.join('\n')}` : ''}`);
  }
}

export async function deployUpgradeableProgram(svm: LiteSVM, options: DeployUpgradeableProgramOptions): Promise<DeployedProgram> {
  const { payer, programKeypair, upgradeAuthority, programBytes } = options;
  const maxDataLenBytes = options.maxDataLenBytes ?? programBytes.length;
  if (programBytes.length === 0 || programBytes.length > PROGRAM_SIZE_MAX) {
    throw new RangeError(`program is ${programBytes.length} bytes; expected 1..${PROGRAM_SIZE_MAX}`);
  }
  if (!Number.isSafeInteger(maxDataLenBytes) || maxDataLenBytes < programBytes.length || maxDataLenBytes > PROGRAM_SIZE_MAX) {
    throw new RangeError(`maxDataLenBytes ${maxDataLenBytes} must be between the program size ${programBytes.length} and ${PROGRAM_SIZE_MAX}`);
  }

  const buffer = await generateKeyPairSigner();
  const bufferSize = BUFFER_METADATA_SIZE + programBytes.length;
  let transactionCount = 0;
  const send = async (step: string, instructions: Instruction[]): Promise<TransactionMetadata> => {
    transactionCount += 1;
    return sendInstructions(svm, payer, step, instructions);
  };

  await send('create buffer', [
    createAccountInstruction(payer, buffer, svm.minimumBalanceForRentExemption(BigInt(bufferSize)), bufferSize, UPGRADEABLE_LOADER),
    {
      programAddress: UPGRADEABLE_LOADER,
      accounts: [
        { address: buffer.address, role: AccountRole.WRITABLE },
        { address: upgradeAuthority.address, role: AccountRole.READONLY },
      ],
      data: u32(LoaderInstruction.InitializeBuffer),
    },
  ]);

  const chunkSize = writeChunkSizeBytes(svm, payer, buffer.address, upgradeAuthority);
  for (let offset = 0; offset < programBytes.length; offset += chunkSize) {
    const chunk = programBytes.subarray(offset, Math.min(offset + chunkSize, programBytes.length));
    await send(`write at offset ${offset}`, [writeInstruction(buffer.address, upgradeAuthority, offset, chunk)]);
  }

  const [programDataAddress] = await getProgramDerivedAddress({
    programAddress: UPGRADEABLE_LOADER,
    seeds: [getAddressEncoder().encode(programKeypair.address)],
  });
  const deployed = await send('deploy', [
    createAccountInstruction(
      payer,
      programKeypair,
      svm.minimumBalanceForRentExemption(BigInt(PROGRAM_ACCOUNT_SIZE)),
      PROGRAM_ACCOUNT_SIZE,
      UPGRADEABLE_LOADER,
    ),
    {
      programAddress: UPGRADEABLE_LOADER,
      accounts: [
        signerAccount(payer, AccountRole.WRITABLE_SIGNER),
        { address: programDataAddress, role: AccountRole.WRITABLE },
        { address: programKeypair.address, role: AccountRole.WRITABLE },
        { address: buffer.address, role: AccountRole.WRITABLE },
        { address: RENT_SYSVAR, role: AccountRole.READONLY },
        { address: CLOCK_SYSVAR, role: AccountRole.READONLY },
        { address: SYSTEM_PROGRAM, role: AccountRole.READONLY },
        signerAccount(upgradeAuthority, AccountRole.READONLY_SIGNER),
      ],
      data: concat(u32(LoaderInstruction.DeployWithMaxDataLen), u64(BigInt(maxDataLenBytes))),
    },
  ]);
  return {
    programAddress: programKeypair.address,
    programDataAddress,
    transactionCount,
    deployComputeUnits: deployed.computeUnitsConsumed(),
  };
}

/** Builds, signs and sends one transaction; throws DeployError with the logs if it fails. */
async function sendInstructions(svm: LiteSVM, payer: KeyPairSigner, step: string, instructions: Instruction[]): Promise<TransactionMetadata> {
  const message = pipe(
    createTransactionMessage({ version: 0 }),
    (m) => setTransactionMessageFeePayerSigner(payer, m),
    (m) => svm.setTransactionMessageLifetimeUsingLatestBlockhash(m),
    (m) => appendTransactionMessageInstructions(instructions, m),
  );
  const transaction = await signTransactionMessageWithSigners(message);
  const result = svm.sendTransaction(transaction);
  if (result instanceof FailedTransactionMetadata) {
    throw new DeployError(`program deployment failed at step "${step}": ${result.err().toString()}`, step, result.meta().logs());
  }
  return result;
}

/** The largest Write payload that keeps the transaction within the size limit. */
function writeChunkSizeBytes(svm: LiteSVM, payer: KeyPairSigner, buffer: Address, authority: KeyPairSigner): number {
  const emptyWrite = pipe(
    createTransactionMessage({ version: 0 }),
    (m) => setTransactionMessageFeePayerSigner(payer, m),
    (m) => svm.setTransactionMessageLifetimeUsingLatestBlockhash(m),
    (m) => appendTransactionMessageInstructions([writeInstruction(buffer, authority, 0, new Uint8Array(0))], m),
  );
  // The instruction data's compact-u16 length prefix grows from 1 to 2 bytes past 127.
  const lengthPrefixGrowth = 1;
  const chunk = getTransactionMessageSizeLimit(emptyWrite) - getTransactionMessageSize(emptyWrite) - lengthPrefixGrowth;
  if (chunk < 128) throw new Error(`write chunk of ${chunk} bytes is too small; the transaction overhead is wrong`);
  return chunk;
}

function writeInstruction(buffer: Address, authority: TransactionSigner, offset: number, bytes: Uint8Array): Instruction {
  return {
    programAddress: UPGRADEABLE_LOADER,
    accounts: [
      { address: buffer, role: AccountRole.WRITABLE },
      signerAccount(authority, AccountRole.READONLY_SIGNER),
    ],
    // bincode Vec<u8>: u64 length, then the bytes.
    data: concat(u32(LoaderInstruction.Write), u32(offset), u64(BigInt(bytes.length)), bytes),
  };
}

function createAccountInstruction(
  payer: TransactionSigner,
  account: TransactionSigner,
  lamports: bigint,
  space: number,
  owner: Address,
): Instruction {
  return {
    programAddress: SYSTEM_PROGRAM,
    accounts: [
      signerAccount(payer, AccountRole.WRITABLE_SIGNER),
      signerAccount(account, AccountRole.WRITABLE_SIGNER),
    ],
    data: concat(u32(SYSTEM_CREATE_ACCOUNT), u64(lamports), u64(BigInt(space)), getAddressEncoder().encode(owner)),
  };
}

/** A signer's account meta; the signer travels with it so signTransactionMessageWithSigners finds it. */
function signerAccount(signer: TransactionSigner, role: AccountRole.READONLY_SIGNER | AccountRole.WRITABLE_SIGNER): AccountSignerMeta {
  return { address: signer.address, role, signer };
}

function u32(value: number): Uint8Array {
  const bytes = new Uint8Array(4);
  new DataView(bytes.buffer).setUint32(0, value, true);
  return bytes;
}

function u64(value: bigint): Uint8Array {
  const bytes = new Uint8Array(8);
  new DataView(bytes.buffer).setBigUint64(0, value, true);
  return bytes;
}

function concat(...parts: ArrayLike<number>[]): Uint8Array {
  const output = new Uint8Array(parts.reduce((size, part) => size + part.length, 0));
  let at = 0;
  for (const part of parts) {
    output.set(part, at);
    at += part.length;
  }
  return output;
}
