/**
 * The operator's CLI as operators run it: `node bin/agent-vault.js <command>` as a child
 * process, on a data dir of its own. `migrate` twice, `org create`, `keys create|list|revoke`,
 * then the service built on the same data dir (after the CLI exited: with PGlite one process
 * owns a data dir) proves the printed keys work with their roles, and the revoked one fails.
 *
 * PGlite under the data dir by default; a fresh PostgreSQL database when DATABASE_URL is set.
 * Every CLI start costs one to three seconds (tsx, then PGlite opening its files), so the
 * commands are few and those that never open a database run in parallel.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createServer, type AddressInfo } from 'node:net';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import pino from 'pino';
import { loadConfig } from '../../src/config/config.ts';
import { buildService } from '../../src/server.ts';

const ROOT = join(import.meta.dirname, '..', '..');
/** A CLI command that has not exited by then is hung, not slow. */
const COMMAND_TIMEOUT_MS = 60_000;

interface Outcome {
  code: number | null;
  stdout: string;
  stderr: string;
  ms: number;
}

/** The environment of one CLI run: ours, not whatever agent-vault settings the caller has. */
function cliEnv(dataDir: string, databaseUrl: string | null): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [name, value] of Object.entries(process.env)) {
    if (value !== undefined && !name.startsWith('AGENT_VAULT_') && name !== 'DATABASE_URL') env[name] = value;
  }
  Object.assign(env, { AGENT_VAULT_DATA_DIR: dataDir, LOG_LEVEL: 'silent', AGENT_VAULT_SLOT_MS: '0' });
  if (databaseUrl) env.DATABASE_URL = databaseUrl;
  return env;
}

function runCli(args: string[], env: Record<string, string>): Promise<Outcome> {
  const started = performance.now();
  const child = spawn(process.execPath, [join(ROOT, 'bin', 'agent-vault.js'), ...args], { env, cwd: ROOT });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (chunk) => { stdout += chunk; });
  child.stderr.on('data', (chunk) => { stderr += chunk; });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`agent-vault ${args.join(' ')} did not exit:\n${stdout}${stderr}`));
    }, COMMAND_TIMEOUT_MS);
    child.on('error', (error) => { clearTimeout(timer); reject(error); });
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr, ms: Math.round(performance.now() - started) });
    });
  });
}

/** A refusal as operators' scripts see it: exit status 2, nothing on stdout, one line on stderr, no stack. */
function assertRefused(outcome: Outcome, command: string, message: RegExp): void {
  const what = `agent-vault ${command}: ${JSON.stringify(outcome)}`;
  assert.equal(outcome.code, 2, what);
  assert.equal(outcome.stdout, '', what);
  assert.match(outcome.stderr, new RegExp(`^agent-vault ${command.split(' ')[0]}: `), what);
  assert.match(outcome.stderr, message, what);
  assert.equal(outcome.stderr.trim().split('\n').length, 1, `one line: ${what}`);
  assert.doesNotMatch(outcome.stderr, /\n\s+at /, `no stack trace: ${what}`);
}

/** A fresh PostgreSQL database when DATABASE_URL is set; null = PGlite under the data dir. */
async function freshDatabase(): Promise<{ url: string | null; drop(): Promise<void> }> {
  const base = process.env.DATABASE_URL;
  if (!base) return { url: null, async drop() {} };
  const name = `av_cli_${randomBytes(6).toString('hex')}`;
  const run = async (sql: string) => {
    const client = new pg.Client({ connectionString: base });
    await client.connect();
    try {
      await client.query(sql);
    } finally {
      await client.end();
    }
  };
  await run(`CREATE DATABASE ${name}`);
  const url = new URL(base);
  url.pathname = `/${name}`;
  return { url: url.toString(), drop: () => run(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`) };
}

describe('agent-vault operator commands', () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-cli-'));
  const emptyDir = mkdtempSync(join(tmpdir(), 'av-cli-empty-'));
  let database: { url: string | null; drop(): Promise<void> };
  let env: Record<string, string>;
  const timings: string[] = [];
  const cli = async (...args: string[]): Promise<Outcome> => {
    const outcome = await runCli(args, env);
    timings.push(`${args.slice(0, 2).join(' ')} ${outcome.ms} ms`);
    return outcome;
  };

  before(async () => {
    database = await freshDatabase();
    env = cliEnv(dataDir, database.url);
  });
  after(async () => {
    rmSync(dataDir, { recursive: true, force: true });
    rmSync(emptyDir, { recursive: true, force: true });
    await database?.drop();
  });

  test('bad arguments and a missing database: exit 2 with one clear line on stderr, nothing created', async () => {
    // None of these opens a database, so they run side by side.
    const emptyEnv = cliEnv(emptyDir, null);
    const [noRole, noId, twoIds, unknownOption, noName, unknownSub, noDatabase, unknownCommand, help, dashHelp, h, keysHelp] = await Promise.all([
      runCli(['keys', 'create'], env),
      runCli(['keys', 'revoke'], env),
      runCli(['keys', 'revoke', 'key_a', 'key_b'], env),
      runCli(['keys', 'list', '--bogus'], env),
      runCli(['org', 'create'], env),
      runCli(['keys', 'rotate'], env),
      runCli(['keys', 'list'], emptyEnv),
      runCli(['frobnicate'], env),
      runCli(['help'], env),
      runCli(['--help'], env),
      runCli(['-h'], env),
      runCli(['keys', '--help'], env),
    ]);
    assertRefused(noRole!, 'keys create', /expected: agent-vault keys create --role <role>/);
    assertRefused(noId!, 'keys revoke', /expected: agent-vault keys revoke <api_key_id>/);
    assertRefused(twoIds!, 'keys revoke', /expected: agent-vault keys revoke <api_key_id>/);
    assertRefused(unknownOption!, 'keys list', /--bogus/);
    assertRefused(noName!, 'org create', /expected: agent-vault org create --name <name>/);
    assertRefused(unknownSub!, 'keys rotate', /expected: agent-vault keys create \| list \| revoke/);
    // Pointing at the wrong data dir must not create an empty database there.
    assertRefused(noDatabase!, 'keys list', /no database in .*run agent-vault migrate/);
    assert.equal(existsSync(join(emptyDir, 'pglite')), false, 'no database was created');
    assert.equal(unknownCommand!.code, 2);
    assert.equal(unknownCommand!.stdout, '');
    assert.match(unknownCommand!.stderr, /^unknown command "frobnicate"/);
    assert.match(unknownCommand!.stderr, /keys create --role <role>/, 'the usage follows');
    // --help and -h are what operators type by habit: the usage, as `help` prints it, exit 0.
    assert.equal(help!.code, 0, help!.stderr);
    assert.match(help!.stdout, /^Usage: agent-vault <command>/);
    for (const outcome of [dashHelp!, h!, keysHelp!]) assert.deepEqual(outcome, { ...help!, ms: outcome.ms });
  });

  test('a port already taken: exit 1 with one line saying so, no stack; a database that does not answer: migrate refuses, exit 2', async () => {
    const taken = createServer();
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
    try {
      const port = String((taken.address() as AddressInfo).port);
      const [unreachable, busy] = await Promise.all([
        runCli(['migrate'], { ...env, DATABASE_URL: 'postgres://postgres@127.0.0.1:1/nothing' }),
        runCli(['validator', '--port', port], cliEnv(mkdtempSync(join(tmpdir(), 'av-cli-port-')), null)),
      ]);
      assert.equal(busy.code, 1, JSON.stringify(busy));
      assert.match(busy.stderr, /^agent-vault validator: .*EADDRINUSE.*\n$/, JSON.stringify(busy));
      assert.doesNotMatch(busy.stderr, /\n\s+at /, 'no stack');
      // migrate is an operator command beside keys and org: the same refusal, the same status.
      assertRefused(unreachable, 'migrate', /ECONNREFUSED/);
    } finally {
      await new Promise((resolve) => taken.close(resolve));
    }
  });

  test('a database or a chain that takes the connection and never answers: one line each, migrate exit 2, serve exit 1', async () => {
    // Both time out (node-postgres' connection timeout has no error code; the chain's is our call
    // timeout), 10 s each, run side by side.
    const sockets: import('node:net').Socket[] = [];
    const silent = createServer((socket) => { sockets.push(socket); });
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    try {
      const port = (silent.address() as AddressInfo).port;
      const [database, chain] = await Promise.all([
        runCli(['migrate'], { ...env, DATABASE_URL: `postgres://postgres@127.0.0.1:${port}/nothing` }),
        runCli(['serve'], { ...cliEnv(mkdtempSync(join(tmpdir(), 'av-cli-silent-')), null), AGENT_VAULT_RPC_URL: `http://127.0.0.1:${port}`, PORT: '0' }),
      ]);
      assertRefused(database, 'migrate', /connection timeout/);
      assert.equal(chain.code, 1, JSON.stringify(chain));
      assert.match(chain.stderr, /^agent-vault serve: the chain at http:\/\/127\.0\.0\.1:\d+ \(AGENT_VAULT_RPC_URL\) did not answer: nothing within 10000 ms\n$/,
        JSON.stringify(chain));
    } finally {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => silent.close(resolve));
    }
  });

  test('migrate applies every migration once; run again, it changes nothing', async () => {
    const first = await cli('migrate');
    assert.equal(first.code, 0, first.stderr);
    assert.match(first.stdout, /^applied migrations 1, 2, 3(, \d+)*\n$/);
    const again = await cli('migrate');
    assert.equal(again.code, 0, again.stderr);
    assert.equal(again.stdout, 'database is up to date\n');
  });

  // Guarantee: with PGlite, a command meeting the service's data dir is refused alike whichever
  // it is (exit 2, as operators' scripts test), and says what to do, as docs/api-keys.md does.
  test('a PGlite data dir in use: migrate, keys list and org list refuse alike, exit 2, saying what to do', async (t) => {
    if (database.url) {
      t.skip('PostgreSQL: the CLI runs beside the service');
      return;
    }
    // A live process (this one) holding the data dir, as a running service does.
    mkdirSync(join(dataDir, 'pglite'), { recursive: true });
    const lock = join(dataDir, 'pglite', 'agent-vault.lock');
    writeFileSync(lock, `${process.pid}\n`);
    try {
      const [migrate, keys, orgs] = await Promise.all([cli('migrate'), cli('keys', 'list'), cli('org', 'list')]);
      for (const [outcome, command] of [[migrate, 'migrate'], [keys, 'keys list'], [orgs, 'org list']] as const) {
        assertRefused(outcome, command, new RegExp(`the PGlite database at \\S+ is in use by pid ${process.pid}: `
          + 'stop the process that holds it first \\(for the CLI beside a running service, use PostgreSQL: DATABASE_URL'));
      }
    } finally {
      rmSync(lock);
    }
  });

  test('org create and keys create/list/revoke: printed keys work with their roles, the revoked one fails', async (t) => {
    const created = await cli('org', 'create', '--name', 'Acme Robotics');
    assert.equal(created.code, 0, created.stderr);
    const orgId = /^Created organisation (org_[0-9a-z]{26}) \("Acme Robotics"\)/.exec(created.stdout)?.[1];
    const adminKey = /Admin API key \(shown once, store it now\):\n\n {2}(av_admin_[0-9A-Za-z]{32})\n/.exec(created.stdout)?.[1];
    assert.ok(orgId && adminKey, `org create prints the organisation and its admin key:\n${created.stdout}`);

    const createKey = async (...args: string[]) => {
      const outcome = await cli('keys', 'create', ...args, '--org', orgId);
      assert.equal(outcome.code, 0, outcome.stderr);
      const match = new RegExp('^Created API key (key_[0-9a-z]{26}) \\((\\w+), "([^"]*)"\\) in organisation (org_\\w+)\\.\\n'
        + 'API key \\(shown once, store it now\\):\\n\\n {2}(\\S+)\\n').exec(outcome.stdout);
      assert.ok(match, `keys create prints the key once:\n${outcome.stdout}`);
      assert.equal(match[4], orgId);
      return { id: match[1]!, role: match[2]!, name: match[3]!, key: match[5]! };
    };
    const viewer = await createKey('--role', 'viewer', '--name', 'Dashboard');
    assert.equal(viewer.role, 'viewer');
    assert.equal(viewer.name, 'Dashboard');
    assert.match(viewer.key, /^av_viewer_[0-9A-Za-z]{32}$/);
    const operator = await createKey('--role', 'operator');
    assert.equal(operator.name, 'operator key (CLI)', 'a key without --name gets one saying where it came from');

    const revoked = await cli('keys', 'revoke', operator.id, '--org', orgId);
    assert.equal(revoked.code, 0, revoked.stderr);
    assert.match(revoked.stdout, new RegExp(`^API key ${operator.id} \\(operator, "operator key \\(CLI\\)"\\) `
      + `of organisation ${orgId} is revoked since \\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\dZ\\.\\n$`));

    const listed = await cli('keys', 'list', '--org', orgId);
    assert.equal(listed.code, 0, listed.stderr);
    const lines = listed.stdout.trimEnd().split('\n');
    assert.equal(lines[0], `API keys of organisation ${orgId} ("Acme Robotics"), newest first:`);
    assert.match(lines[1]!, /^ID +NAME +ROLE +KEY +CREATED +LAST USED +REVOKED$/);
    const rows = lines.slice(2).map((line) => line.split(/ {2,}/));
    assert.deepEqual(rows.map((row) => [row[0]!.startsWith('key_'), row[2]]), [[true, 'operator'], [true, 'viewer'], [true, 'admin']],
      `three keys, newest first:\n${listed.stdout}`);
    const [operatorRow, viewerRow, adminRow] = rows;
    const shown = (key: string) => `${key.slice(0, key.lastIndexOf('_') + 5)}…${key.slice(-4)}`;
    assert.deepEqual(operatorRow!.slice(0, 4), [operator.id, 'operator key (CLI)', 'operator', shown(operator.key)]);
    assert.match(operatorRow![6]!, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/, 'the revoked key shows when');
    assert.deepEqual(viewerRow!.slice(0, 4), [viewer.id, 'Dashboard', 'viewer', shown(viewer.key)]);
    assert.deepEqual(viewerRow!.slice(5), ['-', '-'], 'never used, not revoked');
    for (const secret of [adminKey, viewer.key, operator.key]) {
      assert.ok(!listed.stdout.includes(secret), 'keys list never shows a key');
    }

    const lastAdmin = await cli('keys', 'revoke', adminRow![0]!, '--org', orgId);
    assertRefused(lastAdmin, 'keys revoke', /last active admin key/);

    // Now the service, on the same data dir and database.
    const service = await buildService(loadConfig(env), { workers: false, scheduleJobs: false, logger: pino({ level: 'silent' }) });
    try {
      const request = async (method: 'GET' | 'POST', url: string, key: string, body?: unknown) => {
        const response = await service.app.inject({
          method, url, headers: { authorization: `Bearer ${key}` }, ...(body === undefined ? {} : { payload: body as object }),
        });
        return { status: response.statusCode, body: response.json() };
      };
      const org = await request('GET', '/v1/organization', adminKey);
      assert.equal(org.status, 200, 'the admin key printed by org create works');
      assert.equal(org.body.org_id, orgId);
      const keys = await request('GET', '/v1/api-keys', adminKey);
      assert.deepEqual(keys.body.data.map((k: { api_key_id: string }) => k.api_key_id), rows.map((row) => row[0]),
        'the API lists what the CLI listed');
      assert.equal(keys.body.data[2].revoked_at, null, 'the refused revocation left the admin key active');

      assert.equal((await request('GET', '/v1/organization', viewer.key)).status, 200, 'the viewer key reads');
      const write = await request('POST', '/v1/policies', viewer.key, { name: 'x' });
      assert.equal(write.status, 403, 'the viewer key cannot write');
      assert.equal(write.body.error.code, 'insufficient_permissions');
      const gone = await request('GET', '/v1/organization', operator.key);
      assert.equal(gone.status, 401, 'the revoked key fails');
      assert.equal(gone.body.error.code, 'authentication_failed');
    } finally {
      await service.close();
    }
    t.diagnostic(`CLI runs: ${timings.join(', ')}`);
  });

  // Guarantee: a build older than the database's schema (a rollback after an upgrade) refuses to
  // start or to touch it, saying why; it used to start and fail later, at a deposit already made
  // on chain.
  test('a database migrated by a newer build: serve refuses to start (exit 1), migrate and keys list refuse (exit 2), one line, nothing changed', async () => {
    assert.equal((await cli('migrate')).code, 0);
    const { openDatabase } = await import('../../src/db/database.ts');
    const withDb = async <T>(work: (db: Awaited<ReturnType<typeof openDatabase>>) => Promise<T>): Promise<T> => {
      const db = await openDatabase({ databaseUrl: database.url, dataDir });
      try {
        return await work(db);
      } finally {
        await db.close();
      }
    };
    const versions = () => withDb((db) => db.query<{ version: number }>('SELECT version FROM schema_migrations ORDER BY version'));
    await withDb((db) => db.query(`INSERT INTO schema_migrations (version, name) VALUES (9999, 'from_a_newer_build')`));
    const before = await versions();
    try {
      const message = /the database has migrations this build does not have \(9999_from_a_newer_build; this build's newest is \d{4}\): a newer agent-vault migrated it/;
      const serve = await cli('serve');
      assert.equal(serve.code, 1, JSON.stringify(serve));
      assert.match(serve.stderr, new RegExp(`^agent-vault serve: ${message.source}.*\n$`), JSON.stringify(serve));
      assert.doesNotMatch(serve.stderr, /\n\s+at /, 'no stack');
      assertRefused(await cli('migrate'), 'migrate', message);
      assertRefused(await cli('keys', 'list'), 'keys list', message);
      assert.deepEqual(await versions(), before, 'nothing applied or removed');
    } finally {
      await withDb((db) => db.query('DELETE FROM schema_migrations WHERE version = 9999'));
    }
  });
});
