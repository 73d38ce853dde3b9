/**
 * Connects the service to its chain: the embedded local validator (in-process transport) when
 * AGENT_VAULT_RPC_URL is unset, otherwise the cluster at that URL (HTTP JSON-RPC). One client,
 * one code path either way.
 */
import { join } from 'node:path';
import { address, createSolanaRpc, lamports, type Rpc, type SolanaRpcApi } from '@solana/kit';
import type { Clock } from '../clock/clock.ts';
import type { Config } from '../config/config.ts';
import { createInProcessRpc } from '../validator/in-process.ts';
import type { AgentVaultRpcApi } from '../validator/rpc.ts';
import { LocalValidator } from '../validator/validator.ts';
import { ChainClient } from './client.ts';
import { loadOperatorKey, loadOrCreateKeyFile } from './operator-key.ts';

export const ARBITER_KEY_FILE = 'arbiter-key.json';
/** Below this the operator (and arbiter) are topped up on a local validator: they pay fees and rent. */
const LOCAL_MIN_LAMPORTS = 100_000_000_000n;

export interface ChainConnection {
  chain: ChainClient;
  validator: LocalValidator | null;
  /** a local validator (embedded or standalone): its agentVault_* cheatcodes answer */
  local: boolean;
  cheatcodes: Rpc<AgentVaultRpcApi> | null;
  close(): Promise<void>;
}

export async function connectChain(config: Config, clock: Clock, log: (msg: string, data?: object) => void): Promise<ChainConnection> {
  const operator = await loadOperatorKey({ dataDir: config.dataDir, secretKey: config.operatorKey ?? undefined });
  const arbiter = await loadOrCreateKeyFile(join(config.dataDir, ARBITER_KEY_FILE));
  let validator: LocalValidator | null = null;
  let rpc: Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  if (config.rpcUrl) {
    rpc = createSolanaRpc(config.rpcUrl) as unknown as Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  } else {
    validator = await LocalValidator.open({ dataDir: join(config.dataDir, 'validator'), slotMs: config.slotMs, clock });
    rpc = createInProcessRpc(validator) as unknown as Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  }
  try {
    let programId = config.programId ?? validator?.programId ?? null;
    let usdcMint = config.usdcMint ?? validator?.usdcMint ?? null;
    let local = validator !== null;
    if (!validator) {
      try {
        const info = await rpc.agentVault_getInfo().send();
        local = true;
        programId ??= info.programId;
        usdcMint ??= info.usdcMint;
      } catch {
        // A real cluster: it has no agentVault_* methods.
      }
    }
    if (!programId || !usdcMint) {
      throw new Error('AGENT_VAULT_PROGRAM_ID and AGENT_VAULT_USDC_MINT are required for this AGENT_VAULT_RPC_URL');
    }
    const chain = new ChainClient({
      rpc, programId: address(programId), usdcMint: address(usdcMint), operator, arbiter,
      // In-process a status poll is cheap: every 20 ms, so a confirmation is seen soon after its
      // slot. Over the network, at most a tenth of a second.
      pollIntervalMs: validator !== null ? 20 : Math.max(10, Math.min(100, Math.floor(config.slotMs / 4) || 10)),
    });
    if (local) {
      for (const key of [operator.address, arbiter.address]) {
        const { value } = await rpc.getBalance(key).send();
        if (value < LOCAL_MIN_LAMPORTS) await rpc.requestAirdrop(key, lamports(LOCAL_MIN_LAMPORTS * 10n)).send();
      }
    }
    log('chain connected', { rpc: config.rpcUrl ?? 'embedded', programId, usdcMint, operator: operator.address, local });
    return {
      chain, validator, local, cheatcodes: local ? rpc : null,
      async close() {
        chain.close();
        await validator?.close();
      },
    };
  } catch (error) {
    await validator?.close();
    throw error;
  }
}
