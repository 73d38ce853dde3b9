/**
 * Connects the service to its chain: the embedded local validator (in-process transport) when
 * AGENT_VAULT_RPC_URL is unset, otherwise the cluster at that URL (HTTP JSON-RPC). One client,
 * one code path either way.
 */
import { join } from 'node:path';
import { address, createSolanaRpc, createSolanaRpcFromTransport, isSolanaError, lamports, type Rpc, type SolanaRpcApi } from '@solana/kit';
import type { Logger } from 'pino';
import { Agent } from 'undici';
import { OffsetClock, type Clock } from '../clock/clock.ts';
import type { Config } from '../config/config.ts';
import { createInProcessRpc } from '../validator/in-process.ts';
import type { AgentVaultRpcApi } from '../validator/rpc.ts';
import { ValidatorThread } from '../validator/thread.ts';
import { LocalValidator } from '../validator/validator.ts';
import { ChainClient, RPC_CALL_TIMEOUT_MS } from './client.ts';
import { loadOperatorKey, loadServiceKey } from './operator-key.ts';

export const ARBITER_KEY_FILE = 'arbiter-key.json';
/** Below this the operator (and arbiter) are topped up on a local validator: they pay fees and rent. */
const LOCAL_MIN_LAMPORTS = 100_000_000_000n;

/**
 * A cluster's address as logs may show it: its origin alone. Providers carry API keys in the
 * user info, path or query of their RPC URLs.
 */
export function rpcForLogs(rpcUrl: string): string {
  return new URL(rpcUrl).origin;
}

export type ChainLogger = Pick<Logger, 'debug' | 'info' | 'warn' | 'error'>;

export interface ChainConnection {
  chain: ChainClient;
  /** the embedded validator when it runs on this thread; null in its own thread or elsewhere */
  validator: LocalValidator | null;
  /** a local validator (embedded or standalone): its agentVault_* cheatcodes answer */
  local: boolean;
  cheatcodes: Rpc<AgentVaultRpcApi> | null;
  close(): Promise<void>;
}

/**
 * The embedded validator runs in its own thread (validator/thread.ts) when `validatorThread` is
 * on and the clock can be shared with it (an OffsetClock, such as the service clock); otherwise
 * on this thread, where tests can reach it (`ChainConnection.validator`).
 */
/**
 * Sockets open to an RPC node at most; requests past them wait for one. fetch's default opens one
 * per request in flight, and a node caps its connections (this project's validator at 256,
 * resetting the ones past it): under load the service would see its calls reset.
 */
export const RPC_CONNECTIONS_MAX = 128;

/** A JSON-RPC client of the node at `url` over HTTP, on at most RPC_CONNECTIONS_MAX sockets. */
export function createHttpRpc(url: string): Rpc<SolanaRpcApi> {
  // undici's own Agent, for Node's fetch (whose bundled undici has the older types: same API).
  const dispatcher = new Agent({ connections: RPC_CONNECTIONS_MAX }) as unknown as NonNullable<Parameters<typeof createSolanaRpc>[1]>['dispatcher_NODE_ONLY'];
  return createSolanaRpc(url, { dispatcher_NODE_ONLY: dispatcher }) as unknown as Rpc<SolanaRpcApi>;
}

/** The chain given cannot be used as configured: the operator's to fix (the CLI says it in one line). */
export class ChainConnectError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ChainConnectError';
  }
}

export async function connectChain(
  config: Config, clock: Clock, logger: ChainLogger, options: { callTimeoutMs?: number } = {},
): Promise<ChainConnection> {
  // Start-up's calls end as every other call does: a node that takes the connection and never
  // answers stops the start in seconds, not at fetch's own limit (300 s).
  const callTimeoutMs = options.callTimeoutMs ?? RPC_CALL_TIMEOUT_MS;
  const bounded = () => ({ abortSignal: AbortSignal.timeout(callTimeoutMs) });
  const operator = await loadOperatorKey({ dataDir: config.dataDir, secretKey: config.operatorKey ?? undefined });
  // Each escrow names its arbiter on chain, and only that key can decide its dispute: every
  // process must have the same one (AGENT_VAULT_ARBITER_KEY, or one data dir's file).
  const arbiter = await loadServiceKey({
    dataDir: config.dataDir, secretKey: config.arbiterKey ?? undefined, file: ARBITER_KEY_FILE, variable: 'AGENT_VAULT_ARBITER_KEY',
  });
  let validator: LocalValidator | null = null;
  let thread: ValidatorThread | null = null;
  let rpc: Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  const validatorLog = ({ level, msg, ...data }: Record<string, unknown>): void => {
    const write = level === 'error' ? logger.error : level === 'warn' ? logger.warn : level === 'debug' ? logger.debug : logger.info;
    write.call(logger, { ...data, component: 'validator' }, String(msg));
  };
  const validatorOptions = { dataDir: join(config.dataDir, 'validator'), slotMs: config.slotMs, log: validatorLog };
  if (config.rpcUrl) {
    rpc = createHttpRpc(config.rpcUrl) as unknown as Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  } else if (config.validatorThread && clock instanceof OffsetClock) {
    thread = await ValidatorThread.start({ ...validatorOptions, offsetCell: clock.offsetCell });
    rpc = createSolanaRpcFromTransport(thread.transport()) as unknown as Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  } else {
    validator = await LocalValidator.open({ ...validatorOptions, clock });
    rpc = createInProcessRpc(validator) as unknown as Rpc<SolanaRpcApi & AgentVaultRpcApi>;
  }
  const embedded = validator?.info() ?? thread?.info ?? null;
  const publisher = validator ?? thread;
  const closeValidator = async (): Promise<void> => {
    await validator?.close();
    await thread?.close();
  };
  try {
    let programId = config.programId ?? embedded?.programId ?? null;
    let usdcMint = config.usdcMint ?? embedded?.usdcMint ?? null;
    let local = embedded !== null;
    /** a local validator's slot length; null on a real cluster */
    let localSlotMs = embedded?.slotMs ?? null;
    if (!embedded) {
      try {
        const info = await rpc.agentVault_getInfo().send(bounded());
        local = true;
        localSlotMs = Number(info.slotMs);
        programId ??= info.programId;
        usdcMint ??= info.usdcMint;
      } catch (error) {
        // A node that answered, with an error: a real cluster, which has no agentVault_* methods.
        // No answer at all (refused, unreachable, timed out) is no cluster: said as such, rather
        // than taken for one.
        if (!isSolanaError(error)) {
          const cause = (error as { name?: unknown }).name === 'TimeoutError' ? `nothing within ${callTimeoutMs} ms` : describeCause(error);
          throw new ChainConnectError(`the chain at ${rpcForLogs(config.rpcUrl!)} (AGENT_VAULT_RPC_URL) did not answer: ${cause}`);
        }
      }
    }
    if (!programId || !usdcMint) {
      throw new ChainConnectError('AGENT_VAULT_PROGRAM_ID and AGENT_VAULT_USDC_MINT are required for this AGENT_VAULT_RPC_URL');
    }
    const chain = new ChainClient({
      rpc, programId: address(programId), usdcMint: address(usdcMint), operator, arbiter,
      embedded: embedded !== null,
      // The embedded validator pushes the statuses it publishes, and the waits among them resolve
      // at once; the interval is then only a fallback. Over the network, polls every quarter
      // slot, at most a tenth of a second.
      onPublished: publisher ? (listener) => publisher.onPublished(listener) : undefined,
      pollIntervalMs: Math.max(10, Math.min(100, Math.floor(config.slotMs / 4) || 10)),
      // A blockhash is valid for 150 slots: with short local slots (slot 0 means notional 400 ms
      // slots) it is reused for at most a third of that.
      ...(localSlotMs ? { blockhashMaxAgeMs: Math.min(5_000, localSlotMs * 50) } : {}),
    });
    if (local) {
      for (const key of [operator.address, arbiter.address]) {
        const { value } = await rpc.getBalance(key).send(bounded());
        if (value < LOCAL_MIN_LAMPORTS) await rpc.requestAirdrop(key, lamports(LOCAL_MIN_LAMPORTS * 10n)).send(bounded());
      }
    }
    logger.info({
      rpc: config.rpcUrl ? rpcForLogs(config.rpcUrl) : thread ? 'embedded (own thread)' : 'embedded', programId, usdcMint,
      operator: operator.address, arbiter: arbiter.address, local,
    },
      'chain connected');
    return {
      chain, validator, local, cheatcodes: local ? rpc : null,
      async close() {
        chain.close();
        await closeValidator();
      },
    };
  } catch (error) {
    await closeValidator();
    throw error;
  }
}

/** An error and its cause, in one line (fetch's "fetch failed" says why only in its cause). */
function describeCause(error: unknown): string {
  const parts: string[] = [];
  for (let cause = error; cause && parts.length < 3; cause = (cause as { cause?: unknown }).cause) {
    parts.push(cause instanceof Error ? cause.message : String(cause));
  }
  return parts.join(': ');
}
