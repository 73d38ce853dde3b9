/**
 * `agent-vault <command>`: one executable for the service, its workers, the local validator
 * and operations. Each command is a thin call into the module that owns it.
 */
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { ConfigError, loadConfig } from './config/config.ts';

const USAGE = `Usage: agent-vault <command> [options]

Commands:
  serve [--no-workers]                         the HTTP API, background workers and (by default) the embedded validator
  migrate                                      apply database migrations and exit
  validator [--port 8899] [--host 127.0.0.1]   run the local Solana validator (LiteSVM) over JSON-RPC
  program build [--check]                      rebuild program/agent_vault.so (--check: verify the committed bytes)
  help                                         this text

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

  async migrate(args) {
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
  },

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

  async help() {
    console.log(USAGE);
    return 0;
  },
};

class UsageError extends Error {}

export async function main(argv: string[]): Promise<number> {
  const [name = 'help', ...args] = argv;
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
    console.error(error);
    return 1;
  }
}
