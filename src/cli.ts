/**
 * `agent-vault <command>`: one executable for the service, its workers, the local validator
 * and operations. Each command is a thin call into the module that owns it.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { ConfigError, loadConfig, type Config } from './config/config.ts';
import { ValidatorLockedError } from './validator/state-file.ts';
import { SchemaTooNewError } from './db/migrate.ts';
import { postgresUnreachable } from './db/unreachable.ts';
import type { ServiceClock } from './clock/service-clock.ts';
import type { Database } from './db/database.ts';

const USAGE = `Usage: agent-vault <command> [options]

Commands:
  serve [--no-workers]                         the HTTP API, background workers and (by default) the embedded validator
  worker                                       the background workers alone, no HTTP listener (beside serve --no-workers)
  migrate                                      apply database migrations and exit
  validator [--port 8899] [--host 127.0.0.1]   run the local Solana validator (LiteSVM) over JSON-RPC
  program build [--check]                      rebuild program/agent_vault.so (--check: verify the committed bytes)
  org create --name <name>                     create an organisation (reserve and presets on chain); prints its admin key once
  org list [--cursor <c>]                      list the organisations
  keys create --role <role> [--name <n>] [--org <org_id>]
                                               create an API key (admin, operator, agent, viewer, arbiter); prints it once
  keys list [--org <org_id>] [--cursor <c>]    list API keys: id, name, role, prefix…last4, created, last used, revoked
  keys revoke <api_key_id> [--org <org_id>]    revoke an API key at once
  export --format csv|json|jsonl [--wallet <id>] [--status <s>] [--type <t>] [--recipient <r>] [--from <time>] [--to <time>]
         [--out <file>] [--force] [--url <service url>] [--key <API key>]
                                               export transactions through a running service's API and write the file
                                               (key: --key or AGENT_VAULT_API_KEY; url: default http://HOST:PORT)
  help, --help, -h                             this text

keys and org work on the database directly; --org defaults to the default organisation. On PGlite
(no DATABASE_URL) they and migrate need the service stopped: one process owns a data dir. With
PostgreSQL they run beside it (org create also needs the chain: AGENT_VAULT_RPC_URL). migrate, keys
and org exit 0 on success, 2 on a refusal (bad arguments, the data dir in use, the database not
answering). See docs/operations.md.

Configuration comes from environment variables (see README.md).`;

type Command = (args: string[]) => Promise<number>;

const commands: Record<string, Command> = {
  async serve(args) {
    const { values } = parseArgs({ args, options: { 'no-workers': { type: 'boolean', default: false } }, strict: true });
    const config = loadConfig();
    const { serve } = await import('./server.ts');
    await serve(config, { workers: !values['no-workers'] });
    return 0;
  },

  async worker(args) {
    parseArgs({ args, options: {}, strict: true });
    const config = loadConfig();
    const { serve } = await import('./server.ts');
    await serve(config, { http: false });
    return 0;
  },

  migrate: refusingOperational(async (args) => {
    parseArgs({ args, options: {}, strict: true });
    const config = loadConfig();
    const { openDatabase } = await import('./db/database.ts');
    const { migrate } = await import('./db/migrate.ts');
    const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir });
    try {
      const applied = await migrate(db);
      console.log(applied.length ? `applied migrations ${applied.join(', ')}` : 'database is up to date');
    } finally {
      await db.close();
    }
    return 0;
  }),

  async validator(args) {
    const { values } = parseArgs({
      args,
      options: { port: { type: 'string', default: '8899' }, host: { type: 'string', default: '127.0.0.1' } },
      strict: true,
    });
    const port = Number(values.port);
    if (!Number.isInteger(port) || port < 0 || port > 65535) throw new UsageError('--port must be a port number');
    const config = loadConfig();
    const { runValidatorCommand } = await import('./validator/command.ts');
    await runValidatorCommand({ port, host: values.host, dataDir: join(config.dataDir, 'validator'), slotMs: config.slotMs });
    return 0;
  },

  async program(args) {
    const [sub, ...rest] = args;
    if (sub !== 'build') throw new UsageError('expected: agent-vault program build [--check]');
    const { values } = parseArgs({ args: rest, options: { check: { type: 'boolean', default: false } }, strict: true });
    const build = await import('../program/build/build.ts');
    if (values.check) {
      await build.checkProgramReproducible();
      console.log('program/agent_vault.so matches its sources');
    } else {
      const result = await build.buildProgram();
      console.log(`built ${result.outPath} (${result.size} bytes, sha256 ${result.sha256})`);
    }
    return 0;
  },

  org: operatorCommand(async (args) => {
    const [sub, ...rest] = args;
    const config = loadConfig();
    if (sub === 'create') {
      const { values } = parseArgs({ args: rest, options: { name: { type: 'string' } }, strict: true });
      if (values.name === undefined) throw new UsageError('expected: agent-vault org create --name <name>');
      const name = values.name;
      return withOperatorDatabase(config, async (db, clock) => {
        const { connectChain } = await import('./chain/connect.ts');
        const { createOrganizationCommand } = await import('./organizations/command.ts');
        const { default: pino } = await import('pino');
        const chain = await connectChain(config, clock, pino({ level: 'silent' }));
        try {
          console.log(await createOrganizationCommand({ db, clock, chain: chain.chain }, { name }));
        } finally {
          await chain.close();
        }
      });
    }
    if (sub === 'list') {
      const { values } = parseArgs({ args: rest, options: { cursor: { type: 'string' } }, strict: true });
      return withOperatorDatabase(config, async (db) => {
        const { listOrganizationsCommand } = await import('./organizations/command.ts');
        console.log(await listOrganizationsCommand(db, { cursor: values.cursor }));
      });
    }
    throw new UsageError('expected: agent-vault org create --name <name> | org list');
  }),

  keys: operatorCommand(async (args) => {
    const [sub, ...rest] = args;
    const config = loadConfig();
    // Imported once the arguments are known good: a usage error answers without loading it.
    const commandModule = () => import('./api-keys/command.ts');
    if (sub === 'create') {
      const { values } = parseArgs({
        args: rest, options: { role: { type: 'string' }, name: { type: 'string' }, org: { type: 'string' } }, strict: true,
      });
      if (values.role === undefined) throw new UsageError('expected: agent-vault keys create --role <role> [--name <n>] [--org <org_id>]');
      const options = { role: values.role, name: values.name, org: values.org };
      return withOperatorDatabase(config, async (db, clock) => {
        const { createKeyCommand } = await commandModule();
        console.log(await createKeyCommand({ db, clock }, options));
      });
    }
    if (sub === 'list') {
      const { values } = parseArgs({ args: rest, options: { org: { type: 'string' }, cursor: { type: 'string' } }, strict: true });
      return withOperatorDatabase(config, async (db, clock) => {
        const { listKeysCommand } = await commandModule();
        console.log(await listKeysCommand({ db, clock }, { org: values.org, cursor: values.cursor }));
      });
    }
    if (sub === 'revoke') {
      const { values, positionals } = parseArgs({ args: rest, options: { org: { type: 'string' } }, allowPositionals: true, strict: true });
      if (positionals.length !== 1) throw new UsageError('expected: agent-vault keys revoke <api_key_id> [--org <org_id>]');
      const options = { apiKeyId: positionals[0]!, org: values.org };
      return withOperatorDatabase(config, async (db, clock) => {
        const { revokeKeyCommand } = await commandModule();
        console.log(await revokeKeyCommand({ db, clock }, options));
      });
    }
    throw new UsageError('expected: agent-vault keys create | list | revoke');
  }),

  async export(args) {
    const { values } = parseArgs({
      args,
      options: {
        format: { type: 'string' }, wallet: { type: 'string' }, status: { type: 'string' }, type: { type: 'string' },
        recipient: { type: 'string' }, from: { type: 'string' }, to: { type: 'string' }, out: { type: 'string' },
        force: { type: 'boolean', default: false }, url: { type: 'string' }, key: { type: 'string' },
      },
      strict: true,
    });
    if (values.format === undefined) throw new UsageError('expected: agent-vault export --format csv|json|jsonl [filters] [--out <file>]');
    // The API key of a client, not the service's configuration: read here, where the client runs.
    const apiKey = values.key ?? process.env.AGENT_VAULT_API_KEY;
    if (!apiKey) throw new UsageError('give an API key with --key or AGENT_VAULT_API_KEY');
    const baseUrl = values.url ?? localServiceUrl(loadConfig());
    const filters: Record<string, string> = {};
    for (const [name, option] of [['walletId', 'wallet'], ['status', 'status'], ['type', 'type'], ['recipient', 'recipient'], ['from', 'from'], ['to', 'to']] as const) {
      if (values[option] !== undefined) filters[name] = values[option];
    }
    const { runExportCommand, ExportCommandError } = await import('./exports/command.ts');
    try {
      console.log(await runExportCommand(
        { baseUrl, apiKey, format: values.format, filters, out: values.out ?? null, force: values.force },
        { stderr: process.stderr, wait: (ms) => new Promise((resolve) => setTimeout(resolve, ms)) }));
      return 0;
    } catch (error) {
      if (!(error instanceof ExportCommandError)) throw error;
      console.error(`agent-vault export: ${error.message}`);
      return 1;
    }
  },

  async help() {
    console.log(USAGE);
    return 0;
  },
};

class UsageError extends Error {}

/** Where `serve` with this configuration listens (a wildcard host is reached on loopback). */
function localServiceUrl(config: Config): string {
  const host = config.host === '0.0.0.0' || config.host === '::' ? '127.0.0.1' : config.host.includes(':') ? `[${config.host}]` : config.host;
  return `http://${host}:${config.port}`;
}

/**
 * keys and org are run by operators, often in scripts: any failure (a refused key, a locked
 * data dir, an unreachable database) is one line on stderr and exit status 2, never a stack;
 * but a failure that holds a key shown once (`printWhole`) is printed whole.
 */
export function operatorCommand(run: Command): Command {
  return async (args) => {
    try {
      return await run(args);
    } catch (error) {
      if (error instanceof UsageError) throw error;
      const message = error instanceof Error ? error.message : String(error);
      const whole = (error as { printWhole?: boolean } | null)?.printWhole === true;
      throw new UsageError((whole ? message.trimEnd() : message.split('\n')[0]) || 'failed');
    }
  };
}

/**
 * migrate is run by the same operators and scripts as keys and org, on the same database: what
 * the operator can fix (the data dir in use, a database not answering) is a refusal with exit
 * status 2, as there. Unlike there, a fault of ours (a migration failing) keeps its stack and
 * exit status 1.
 */
function refusingOperational(run: Command): Command {
  return async (args) => {
    try {
      return await run(args);
    } catch (error) {
      const operational = operationalMessage(error);
      if (operational === null) throw error;
      throw new UsageError(operational);
    }
  };
}

/**
 * Opens the database an operator command works on, with the service clock, and closes it after.
 * It must exist and be migrated already: an operator pointing at the wrong data dir or
 * database is told so, instead of getting an empty database created or altered.
 */
async function withOperatorDatabase(
  config: Config, work: (db: Database, clock: ServiceClock) => Promise<void>,
): Promise<number> {
  if (!config.databaseUrl && !existsSync(join(config.dataDir, 'pglite'))) {
    throw new UsageError(`no database in ${config.dataDir}: run agent-vault migrate (or serve) first, or set AGENT_VAULT_DATA_DIR or DATABASE_URL`);
  }
  const { openDatabase } = await import('./db/database.ts');
  const { listMigrations, refuseNewerSchema } = await import('./db/migrate.ts');
  const { ServiceClock } = await import('./clock/service-clock.ts');
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir });
  try {
    const [table] = await db.query<{ exists: boolean }>(`SELECT to_regclass('schema_migrations') IS NOT NULL AS exists`);
    const applied = table?.exists ? await db.query<{ version: number; name: string }>('SELECT version, name FROM schema_migrations') : [];
    const migrations = listMigrations();
    refuseNewerSchema(applied, migrations);
    const missing = migrations.filter((migration) => !applied.some((row) => row.version === migration.version));
    if (missing.length) {
      throw new UsageError(`the database lacks migrations ${missing.map((m) => m.version).join(', ')}: run agent-vault migrate first`);
    }
    await work(db, await ServiceClock.load(db));
    return 0;
  } finally {
    await db.close();
  }
}

/** What operators type by habit for the usage. */
const HELP_FLAGS = new Set(['--help', '-h']);

export async function main(argv: string[]): Promise<number> {
  const [given = 'help', ...args] = argv;
  // `agent-vault keys --help` too: the usage covers every command.
  const name = HELP_FLAGS.has(given) || (Object.hasOwn(commands, given) && args.some((arg) => HELP_FLAGS.has(arg))) ? 'help' : given;
  const command = commands[name];
  if (!command) {
    console.error(`unknown command "${name}"\n\n${USAGE}`);
    return 2;
  }
  try {
    return await command(args);
  } catch (error) {
    if (error instanceof ConfigError || error instanceof UsageError) {
      console.error(`agent-vault ${name}: ${error.message}`);
      return 2;
    }
    if ((error as { code?: string }).code?.startsWith('ERR_PARSE_ARGS')) {
      console.error(`agent-vault ${name}: ${(error as Error).message}`);
      return 2;
    }
    // What the operator can fix (the data dir in use, a port taken, a database not reachable)
    // in one line; anything else is a fault of ours, with its stack for the report.
    const operational = operationalMessage(error);
    console.error(operational === null ? error : `agent-vault ${name}: ${operational}`);
    return 1;
  }
}

/** Errors of the machine around the service, not of the service: their message says all. */
const OPERATIONAL_CODES = new Set([
  'EADDRINUSE', 'EADDRNOTAVAIL', 'EACCES', 'ECONNREFUSED', 'ECONNRESET', 'ENOTFOUND', 'EAI_AGAIN', 'ETIMEDOUT', 'EHOSTUNREACH',
  'ENETUNREACH',
]);

function operationalMessage(error: unknown): string | null {
  // By name: the embedded validator's thread hands its error back by name and message only.
  // (ChainMismatchError of organizations.ts, ChainConnectError of chain/connect.ts: named, not
  // imported, so that a command that needs neither loads neither.)
  if (error instanceof Error && [ValidatorLockedError.name, SchemaTooNewError.name, 'ChainMismatchError', 'ChainConnectError'].includes(error.name)) {
    return error.message;
  }
  const code = (error as { code?: unknown } | null)?.code;
  if (typeof code === 'string' && OPERATIONAL_CODES.has(code)) return (error as Error).message;
  // PostgreSQL down, refusing the login or not answering (node-postgres' connection timeout has no code).
  if (error instanceof Error && postgresUnreachable(error)) return error.message;
  // node-postgres reports a refused connection to each of a host's addresses as one AggregateError.
  if (error instanceof AggregateError && error.errors.length > 0 && error.errors.every((inner) => operationalMessage(inner) !== null)) {
    return operationalMessage(error.errors[0]);
  }
  return null;
}
