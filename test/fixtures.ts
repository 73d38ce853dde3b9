/**
 * Set-up steps many tests share, made through the API as a user would: a policy, a funded
 * wallet, a fresh recipient address.
 */
import assert from 'node:assert/strict';
import { generateKeyPairSigner, lamports } from '@solana/kit';
import { ChainClient } from '../src/chain/client.ts';
import type { TestService } from './harness.ts';

let counter = 0;
/** A name no other test of this process uses. */
export const unique = (prefix: string) => `${prefix}-${process.pid}-${(counter += 1)}`;

/** A chain address nobody holds. */
export async function newRecipient(): Promise<string> {
  return (await generateKeyPairSigner()).address;
}

export async function newPolicy(t: TestService, rules: Record<string, unknown>): Promise<string> {
  const response = await t.request('POST', '/v1/policies', { body: { name: unique('policy'), ...rules } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body.policy_id;
}

export interface FundedWallet {
  wallet_id: string;
  chain_address: string;
  token_account: string;
}

/** A wallet under `policyId` holding `balance` USDC, deposited into the reserve first (of `key`'s organisation). */
export async function fundedWallet(t: TestService, balance: string, policyId = 'pol_permissive', key?: string): Promise<FundedWallet> {
  const deposit = await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount: balance } });
  assert.equal(deposit.status, 200, JSON.stringify(deposit.body));
  const wallet = await t.request('POST', '/v1/wallets', { key, body: { agentId: unique('agent'), label: 'Agent', policyId } });
  assert.equal(wallet.status, 200, JSON.stringify(wallet.body));
  const funded = await t.request('POST', `/v1/wallets/${wallet.body.wallet_id}/fund`, { key, body: { amount: balance } });
  assert.equal(funded.status, 200, JSON.stringify(funded.body));
  return wallet.body as FundedWallet;
}

export async function balanceOf(t: TestService, walletId: string, key?: string): Promise<string> {
  return (await t.request('GET', `/v1/wallets/${walletId}`, key ? { key } : {})).body.usdc_balance;
}

/**
 * `chain` whose sends all fail, as with an operator key that cannot pay fees on a real cluster:
 * what it reads and signs is real. Given to createOrganization, it leaves the organisation
 * `pending`.
 */
export function unfundedChain(chain: ChainClient): ChainClient {
  return new Proxy(chain, {
    get(target, property) {
      if (property === 'execute') return async () => { throw new Error('the operator cannot pay the fee'); };
      const value = Reflect.get(target, property) as unknown;
      return typeof value === 'function' ? (value as (...args: unknown[]) => unknown).bind(target) : value;
    },
  });
}

/**
 * Runs `work` with a client of the same chain and program signing with another key, funded with
 * SOL: someone else, who can create the program's accounts at addresses the service will use.
 */
export async function withAnotherKey<T>(chain: ChainClient, work: (theirs: ChainClient) => Promise<T>): Promise<T> {
  const [operator, arbiter] = await Promise.all([generateKeyPairSigner(), generateKeyPairSigner()]);
  await chain.rpc.requestAirdrop(operator.address, lamports(10_000_000_000n)).send();
  const theirs = new ChainClient({ rpc: chain.rpc, programId: chain.programId, usdcMint: chain.usdcMint, operator, arbiter });
  try {
    return await work(theirs);
  } finally {
    theirs.close();
  }
}
