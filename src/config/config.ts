/**
 * Configuration, read from the environment in exactly this one place and validated once at
 * start: a bad value stops start-up with a message naming the variable.
 */
import { looksLikeApiKey } from '../auth/api-keys.ts';
import { parseSecretKey } from '../chain/operator-key.ts';
import { isIP } from 'node:net';
import { resolve } from 'node:path';

export interface Config {
  port: number;
  host: string;
  databaseUrl: string | null;
  dataDir: string;
  bootstrapKey: string | null;
  /** a Solana cluster; null = the embedded local validator */
  rpcUrl: string | null;
  slotMs: number;
  /** the embedded validator in its own worker thread (off: on the service's event loop) */
  validatorThread: boolean;
  /** `/v1/test_helpers/*`; null (unset): on with a local validator, embedded or found at the RPC URL (DESIGN §1) */
  testHelpers: boolean | null;
  allowPrivateWebhooks: boolean;
  docsUrl: string;
  /** requests per minute per API key */
  rateLimitPerMinute: number;
  /** vaults an organisation may have, archived ones included (each is a chain account, never closed) */
  walletsPerOrgMax: number;
  /** API keys an organisation may have that are not revoked (each has its own rate limit) */
  apiKeysPerOrgMax: number;
  /** policies an organisation may have that are not deleted (each is a chain account) */
  policiesPerOrgMax: number;
  /** escrows an organisation may have whose chain accounts are open (each holds the operator key's rent) */
  openEscrowsPerOrgMax: number;
  /** how long a client has to send a whole request, headers and body (over: 408, connection closed) */
  requestTimeoutSeconds: number;
  /** HTTP connections open at once; further ones are closed as they arrive */
  maxConnections: number;
  /**
   * The event loop's mean delay over a second above which new requests are refused 503 with
   * Retry-After (the process is overloaded); 0 = never
   */
  maxEventLoopDelayMs: number;
  logLevel: 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';
  /** the operator's 64-byte secret key (JSON array or base58); null = generated into dataDir */
  operatorKey: string | null;
  /** the arbiter's secret key (AGENT_VAULT_ARBITER_KEY); null = the data dir's arbiter-key.json */
  arbiterKey: string | null;
  /**
   * program id and USDC mint on a real cluster; when unset, an agent-vault validator at
   * AGENT_VAULT_RPC_URL is asked for its own (agentVault_getInfo)
   */
  programId: string | null;
  usdcMint: string | null;
}

/**
 * A host name to listen on: dot-separated labels of letters, digits, inner hyphens and
 * underscores (a container's service name may have them), at most 253 characters, perhaps
 * ending with the root's dot.
 */
const HOST_NAME = /^(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$/;

/**
 * The reference this process serves itself, the default of AGENT_VAULT_DOCS_URL (a wildcard
 * host is reached on loopback). With PORT=0 the port is known once listening (`serve` sets it).
 */
export function defaultDocsUrl(host: string, port: number): string {
  return `http://${host === '0.0.0.0' || host === '::' ? '127.0.0.1' : host.includes(':') ? `[${host}]` : host}:${port}/docs`;
}

export class ConfigError extends Error {
  constructor(readonly variable: string, message: string) {
    super(`${variable}: ${message}`);
    this.name = 'ConfigError';
  }
}

type Env = Record<string, string | undefined>;

function text(env: Env, name: string): string | null {
  const value = env[name];
  return value === undefined || value.trim() === '' ? null : value.trim();
}

/** A Solana secret key (base58 or a JSON array of 64 bytes), checked with the rest at start. */
function secretKey(env: Env, name: string): string | null {
  const value = text(env, name);
  if (value === null) return null;
  try {
    parseSecretKey(value);
  } catch (error) {
    throw new ConfigError(name, `not a valid secret key: ${(error as Error).message}`);
  }
  return value;
}

function integer(env: Env, name: string, fallback: number, min: number, max: number): number {
  const value = text(env, name);
  if (value === null) return fallback;
  if (!/^\d+$/.test(value)) throw new ConfigError(name, `must be an integer, got "${value}"`);
  const parsed = Number(value);
  if (parsed < min || parsed > max) throw new ConfigError(name, `must be between ${min} and ${max}, got ${parsed}`);
  return parsed;
}

function flag<Fallback extends boolean | null>(env: Env, name: string, fallback: Fallback): boolean | Fallback {
  const value = text(env, name)?.toLowerCase() ?? null;
  if (value === null) return fallback;
  if (['1', 'true', 'on', 'yes'].includes(value)) return true;
  if (['0', 'false', 'off', 'no'].includes(value)) return false;
  throw new ConfigError(name, `must be on/off (true/false, 1/0), got "${value}"`);
}

function url(env: Env, name: string, protocols: string[]): string | null {
  const value = text(env, name);
  if (value === null) return null;
  let parsed: URL;
  try {
    parsed = new URL(value);
  } catch {
    throw new ConfigError(name, 'must be a URL');
  }
  if (!protocols.includes(parsed.protocol)) {
    throw new ConfigError(name, `must use ${protocols.join(' or ')}, got ${parsed.protocol}`);
  }
  return value;
}

function base58Address(env: Env, name: string): string | null {
  const value = text(env, name);
  if (value !== null && !/^[1-9A-HJ-NP-Za-km-z]{32,44}$/.test(value)) {
    throw new ConfigError(name, 'must be a base58 Solana address');
  }
  return value;
}

const LOG_LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const;

export function loadConfig(env: Env = process.env): Config {
  const rpcUrl = url(env, 'AGENT_VAULT_RPC_URL', ['http:', 'https:']);
  const logLevel = text(env, 'LOG_LEVEL') ?? 'info';
  if (!(LOG_LEVELS as readonly string[]).includes(logLevel)) {
    throw new ConfigError('LOG_LEVEL', `must be one of ${LOG_LEVELS.join(', ')}`);
  }
  const bootstrapKey = text(env, 'AGENT_VAULT_BOOTSTRAP_KEY');
  if (bootstrapKey !== null && bootstrapKey.length < 24) {
    throw new ConfigError('AGENT_VAULT_BOOTSTRAP_KEY', 'must be at least 24 characters');
  }
  if (bootstrapKey !== null && !looksLikeApiKey(bootstrapKey)) {
    throw new ConfigError('AGENT_VAULT_BOOTSTRAP_KEY', 'must be at most 256 characters of A-Z, a-z, 0-9, "_", "." and "-"');
  }
  const programId = base58Address(env, 'AGENT_VAULT_PROGRAM_ID');
  const usdcMint = base58Address(env, 'AGENT_VAULT_USDC_MINT');
  const port = integer(env, 'PORT', 8080, 0, 65535);
  const host = text(env, 'HOST') ?? '127.0.0.1';
  if (!isIP(host) && !HOST_NAME.test(host)) {
    throw new ConfigError('HOST', 'must be an IP address or a host name (letters, digits, "-", "_" and ".")');
  }
  return {
    port,
    host,
    databaseUrl: url(env, 'DATABASE_URL', ['postgres:', 'postgresql:']),
    dataDir: resolve(text(env, 'AGENT_VAULT_DATA_DIR') ?? './data'),
    bootstrapKey,
    rpcUrl,
    slotMs: integer(env, 'AGENT_VAULT_SLOT_MS', 400, 0, 60_000),
    validatorThread: flag(env, 'AGENT_VAULT_VALIDATOR_THREAD', true),
    testHelpers: flag(env, 'AGENT_VAULT_TEST_HELPERS', null),
    allowPrivateWebhooks: flag(env, 'AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS', false),
    docsUrl: (url(env, 'AGENT_VAULT_DOCS_URL', ['http:', 'https:']) ?? defaultDocsUrl(host, port)).replace(/\/$/, ''),
    logLevel: logLevel as Config['logLevel'],
    rateLimitPerMinute: integer(env, 'AGENT_VAULT_RATE_LIMIT_PER_MINUTE', 1200, 1, 1_000_000),
    walletsPerOrgMax: integer(env, 'AGENT_VAULT_WALLETS_PER_ORG_MAX', 10_000, 1, 10_000_000),
    apiKeysPerOrgMax: integer(env, 'AGENT_VAULT_API_KEYS_PER_ORG_MAX', 1_000, 1, 1_000_000),
    policiesPerOrgMax: integer(env, 'AGENT_VAULT_POLICIES_PER_ORG_MAX', 1_000, 1, 1_000_000),
    openEscrowsPerOrgMax: integer(env, 'AGENT_VAULT_OPEN_ESCROWS_PER_ORG_MAX', 1_000, 1, 1_000_000),
    requestTimeoutSeconds: integer(env, 'AGENT_VAULT_REQUEST_TIMEOUT_SECONDS', 30, 1, 600),
    maxConnections: integer(env, 'AGENT_VAULT_MAX_CONNECTIONS', 10_000, 1, 1_000_000),
    maxEventLoopDelayMs: integer(env, 'AGENT_VAULT_MAX_EVENT_LOOP_DELAY_MS', 200, 0, 60_000),
    operatorKey: secretKey(env, 'AGENT_VAULT_OPERATOR_KEY'),
    arbiterKey: secretKey(env, 'AGENT_VAULT_ARBITER_KEY'),
    programId,
    usdcMint,
  };
}
