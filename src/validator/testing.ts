/**
 * What the validator's tests share: building and signing small transactions with @solana/kit,
 * polling for a status with a bound, a stand-in program, and the Clock sysvar layout.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import {
  AccountRole,
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
  type Instruction,
  type KeyPairSigner,
  type Rpc,
  type Signature,
  type SolanaRpcApi,
} from '@solana/kit';
import { LiteSVM } from 'litesvm';
import type { AgentVaultRpcApi } from './rpc.ts';
import { ASSOCIATED_TOKEN_PROGRAM, SYSTEM_PROGRAM, TOKEN_PROGRAM } from './validator.ts';

export type TestRpc = Rpc<SolanaRpcApi & AgentVaultRpcApi>;

export const MEMO_PROGRAM = address('MemoSq4gqABAXKb96qnH8TysNcWxMyWCqXgDLGmfcHr');

/**
 * The SPL Memo program's ELF, taken from LiteSVM's bundled copy and written to `dir`: a real
 * SBF program to deploy through the upgradeable loader when our own is not built.
 */
export function writeMemoProgram(dir: string): string {
  const account = new LiteSVM().getAccount(MEMO_PROGRAM);
  if (!account.exists) throw new Error('LiteSVM has no memo program');
  const path = join(dir, 'memo.so');
  writeFileSync(path, account.data);
  return path;
}

export async function signedTransaction(rpc: Rpc<SolanaRpcApi>, payer: KeyPairSigner, instructions: Instruction[],
  lifetime?: { blockhash: string; lastValidBlockHeight: bigint }): Promise<{ wire: Base64EncodedWireTransaction; signature: Signature }> {
  const blockhash = lifetime ?? (await rpc.getLatestBlockhash().send()).value;
  const message = pipe(
    createTransactionMessage({ version: 0 }),
    (m) => setTransactionMessageFeePayerSigner(payer, m),
    (m) => setTransactionMessageLifetimeUsingBlockhash(blockhash as never, m),
    (m) => appendTransactionMessageInstructions(instructions, m),
  );
  const signed = await signTransactionMessageWithSigners(message);
  return { wire: getBase64EncodedWireTransaction(signed), signature: getSignatureFromTransaction(signed) };
}

export function transferSol(from: KeyPairSigner, to: Address, lamports: bigint): Instruction {
  const data = new Uint8Array(12);
  const view = new DataView(data.buffer);
  view.setUint32(0, 2, true);
  view.setBigUint64(4, lamports, true);
  return {
    programAddress: SYSTEM_PROGRAM,
    accounts: [
      { address: from.address, role: AccountRole.WRITABLE_SIGNER, signer: from },
      { address: to, role: AccountRole.WRITABLE },
    ],
    data,
  } as Instruction;
}

export function createAtaIdempotent(payer: KeyPairSigner, ata: Address, owner: Address, mint: Address): Instruction {
  return {
    programAddress: ASSOCIATED_TOKEN_PROGRAM,
    accounts: [
      { address: payer.address, role: AccountRole.WRITABLE_SIGNER, signer: payer },
      { address: ata, role: AccountRole.WRITABLE },
      { address: owner, role: AccountRole.READONLY },
      { address: mint, role: AccountRole.READONLY },
      { address: SYSTEM_PROGRAM, role: AccountRole.READONLY },
      { address: TOKEN_PROGRAM, role: AccountRole.READONLY },
    ],
    data: new Uint8Array([1]),
  } as Instruction;
}

export function transferToken(source: Address, destination: Address, owner: KeyPairSigner, amount: bigint): Instruction {
  const data = new Uint8Array(9);
  data[0] = 3;
  new DataView(data.buffer).setBigUint64(1, amount, true);
  return {
    programAddress: TOKEN_PROGRAM,
    accounts: [
      { address: source, role: AccountRole.WRITABLE },
      { address: destination, role: AccountRole.WRITABLE },
      { address: owner.address, role: AccountRole.READONLY_SIGNER, signer: owner },
    ],
    data,
  } as Instruction;
}

export function memoInstruction(program: Address, signer: KeyPairSigner, text: string): Instruction {
  return {
    programAddress: program,
    accounts: [{ address: signer.address, role: AccountRole.READONLY_SIGNER, signer }],
    data: new TextEncoder().encode(text),
  } as unknown as Instruction;
}

/** Polls until `probe` returns a value, within `timeoutMs`. */
export async function eventually<T>(probe: () => Promise<T | null | undefined>, what: string, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (value !== null && value !== undefined) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolveWait) => setTimeout(resolveWait, 5));
  }
}

export async function confirmed(rpc: Rpc<SolanaRpcApi>, signature: Signature, timeoutMs = 10_000) {
  return eventually(async () => (await rpc.getSignatureStatuses([signature]).send()).value[0], `status of ${signature}`, timeoutMs);
}

/** Clock sysvar layout: slot u64, epoch_start_timestamp i64, epoch u64, leader_schedule_epoch u64, unix_timestamp i64. */
export function decodeClockSysvar(data: Uint8Array): { slot: bigint; unixTimestamp: bigint } {
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  return { slot: view.getBigUint64(0, true), unixTimestamp: view.getBigInt64(32, true) };
}
