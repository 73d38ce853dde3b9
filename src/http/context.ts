/**
 * What every route and worker is given: explicit dependencies, no container.
 */
import type { FastifyBaseLogger } from 'fastify';
import type { ChainClient } from '../chain/client.ts';
import type { ServiceClock } from '../clock/service-clock.ts';
import type { Config } from '../config/config.ts';
import type { Database } from '../db/database.ts';
import type { Rpc } from '@solana/kit';
import type { AgentVaultRpcApi } from '../validator/rpc.ts';
import type { LocalValidator } from '../validator/validator.ts';
import type { AttemptSender } from '../webhooks/sender.ts';

export interface AppContext {
  config: Config;
  db: Database;
  clock: ServiceClock;
  chain: ChainClient;
  /** the embedded local validator; null against a real cluster or a standalone validator */
  validator: LocalValidator | null;
  /** a local validator's own methods (mint local USDC, set time); null on a real cluster */
  cheatcodes: Rpc<AgentVaultRpcApi> | null;
  /** makes webhook attempts on a thread of its own */
  webhookSender: AttemptSender;
  log: FastifyBaseLogger;
}
