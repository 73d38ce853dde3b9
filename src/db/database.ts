/**
 * One database interface over PostgreSQL (`pg`, production) and PGlite (PostgreSQL in WASM,
 * in-process, the embedded default): the same SQL, the same migrations, one code path.
 *
 * BIGINT comes back as bigint from both drivers (money is never a JS number).
 */
import { createHash } from 'node:crypto';
import { mkdirSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { PGlite, type PGliteOptions } from '@electric-sql/pglite';
import pg from 'pg';
import { acquireLock } from '../validator/state-file.ts';

export interface Queryable {
  query<Row = Record<string, unknown>>(sql: string, params?: readonly unknown[]): Promise<Row[]>;
  /** Several statements, no parameters (migrations). */
  exec(sql: string): Promise<void>;
}

/** The statements of one transaction. */
export interface Transaction extends Queryable {
  /**
   * The transaction's last statement, and its commit: on PostgreSQL the COMMIT is written right
   * behind the statement, one round trip for both. Answers once both are done, so the rows
   * answered are committed; throws (and nothing is committed) when either fails. The
   * transaction takes no statement after it, and the work should return right after it: on
   * PostgreSQL the transaction is committed even if the work throws later.
   */
  queryAndCommit<Row = Record<string, unknown>>(sql: string, params?: readonly unknown[]): Promise<Row[]>;
}

export interface Database extends Queryable {
  readonly kind: 'pglite' | 'postgres';
  /**
   * Runs `work` in one transaction (READ COMMITTED; use row locks for invariants). Commits when
   * it resolves (unless `queryAndCommit` did), rolls back when it throws.
   */
  transaction<T>(work: (tx: Transaction) => Promise<T>): Promise<T>;
  close(): Promise<void>;
}

/** Statement timeout for every query on PostgreSQL: nothing holds a connection forever. */
const STATEMENT_TIMEOUT_MS = 30_000;
const POOL_MAX = 10;

const bigintParser = (value: string): bigint => BigInt(value);

/**
 * A statement with parameters runs as a named prepared statement: PostgreSQL parses and plans
 * it once per connection instead of on every call (the service's statements are a fixed set).
 */
const statementNames = new Map<string, string>();
function prepared(sql: string, params: readonly unknown[]): pg.QueryConfig {
  if (params.length === 0) return { text: sql };
  let name = statementNames.get(sql);
  if (name === undefined) {
    name = `av_${createHash('sha1').update(sql).digest('hex').slice(0, 20)}`;
    if (statementNames.size < 10_000) statementNames.set(sql, name);
  }
  return { name, text: sql, values: params as unknown[] };
}

/** Sockets corked until the current burst of statements has been written. */
const corkedSockets = new WeakSet<object>();

/**
 * Holds the connection's writes back until the callbacks queued now have run, so that the
 * statements a transaction issues together (BEGIN and its first statements, the last one and
 * COMMIT) leave in one write instead of one each: a write to a socket is a system call, which
 * costs ~0.15 ms on the 2-core machine of docs/benchmarks.md, as much as planning a statement.
 * node-postgres writes each statement between cork() and uncork() of its socket; an outer cork
 * makes those inner ones keep the bytes until it is lifted. Without a socket (a client that
 * does not have one) nothing is held.
 */
function corkUntilIssued(client: pg.PoolClient): void {
  const socket = (client as unknown as { connection?: { stream?: { cork(): void; uncork(): void } } }).connection?.stream;
  if (!socket || corkedSockets.has(socket)) return;
  corkedSockets.add(socket);
  socket.cork();
  process.nextTick(() => {
    corkedSockets.delete(socket);
    socket.uncork();
  });
}

/** Its connections' name in `pg_stat_activity`; with the schema when it works in one (tests). */
export function applicationName(schema: string | null): string {
  return schema ? `agent-vault ${schema}` : 'agent-vault';
}

class PostgresDatabase implements Database {
  readonly kind = 'postgres';
  readonly #pool: pg.Pool;

  constructor(url: string, schema: string | null) {
    const types = {
      getTypeParser: ((oid: number, format?: string) =>
        oid === 20 ? bigintParser : pg.types.getTypeParser(oid, format as 'text')) as typeof pg.types.getTypeParser,
    };
    const options = [`-c statement_timeout=${STATEMENT_TIMEOUT_MS}`];
    if (schema) options.push(`-c search_path=${schema}`);
    // Pipelined (node-postgres' pipeline mode): a statement is written without waiting for the
    // answer to the one before it on the connection, each with its own Sync, so an error still
    // belongs to its statement alone. Only transaction() sends more than one at a time.
    this.#pool = new pg.Pool({
      connectionString: url, max: POOL_MAX, types, options: options.join(' '), connectionTimeoutMillis: 10_000, pipeline: true,
      application_name: applicationName(schema),
    });
    // An idle client losing its connection must not crash the process; the pool replaces it.
    this.#pool.on('error', () => {});
  }

  async query<Row>(sql: string, params: readonly unknown[] = []): Promise<Row[]> {
    const result = await this.#pool.query(prepared(sql, params));
    return result.rows as Row[];
  }

  async exec(sql: string): Promise<void> {
    await this.#pool.query(sql);
  }

  async transaction<T>(work: (tx: Transaction) => Promise<T>): Promise<T> {
    const client = await this.#pool.connect();
    // A checked-out client whose connection is lost (a failover, a terminated backend) emits
    // 'error', which would otherwise end the process; its statements fail on their own. It is
    // then destroyed, not given back to the pool.
    let broken: Error | undefined;
    const onError = (error: Error): void => { broken ??= error; };
    client.on('error', onError);
    // The first statement goes out right behind BEGIN, without waiting for its answer (in the
    // same write when the work issues it at once). BEGIN on a connection out of the pool fails
    // only when the connection does, and then so does every statement behind it; each statement
    // still waits for BEGIN's answer before it answers.
    corkUntilIssued(client);
    const begun = client.query('BEGIN');
    begun.catch(() => {});
    let committed = false;
    const statement = async (sql: string, params: readonly unknown[]) => {
      if (committed) throw new Error('the transaction is committed: no statement may follow queryAndCommit');
      corkUntilIssued(client);
      return (await Promise.all([begun, client.query(prepared(sql, params))]))[1];
    };
    const tx: Transaction = {
      query: async <Row>(sql: string, params: readonly unknown[] = []) => (await statement(sql, params)).rows as Row[],
      exec: async (sql: string) => { await statement(sql, []); },
      queryAndCommit: async <Row>(sql: string, params: readonly unknown[] = []) => {
        const pending = statement(sql, params);
        committed = true;
        // After a failed statement the transaction is aborted, and COMMIT answers ROLLBACK.
        const [result, commit] = await Promise.all([pending, client.query('COMMIT')]);
        if (commit.command !== 'COMMIT') throw new Error(`the transaction ended in ${commit.command}, not COMMIT`);
        return result.rows as Row[];
      },
    };
    try {
      const result = await work(tx);
      if (committed) return result;
      await begun;
      await client.query('COMMIT');
      return result;
    } catch (error) {
      await client.query('ROLLBACK').catch((rollbackError: Error) => { broken ??= rollbackError; });
      throw error;
    } finally {
      client.off('error', onError);
      client.release(broken);
    }
  }

  async close(): Promise<void> {
    await this.#pool.end();
  }
}

class PGliteDatabase implements Database {
  readonly kind = 'pglite';
  readonly #db: PGlite;
  readonly #release: () => void;

  constructor(db: PGlite, release: () => void) {
    this.#db = db;
    this.#release = release;
  }

  async query<Row>(sql: string, params: readonly unknown[] = []): Promise<Row[]> {
    return (await this.#db.query<Row>(sql, params as unknown[])).rows;
  }

  // PGlite has one connection: its transaction() holds it exclusively until the work is done,
  // so other queries wait. Row locks are then trivially held, and the same SQL stays correct
  // on PostgreSQL where they matter.
  async transaction<T>(work: (tx: Transaction) => Promise<T>): Promise<T> {
    return this.#db.transaction(async (inner) => {
      let committed = false;
      const query = async <Row>(sql: string, params: readonly unknown[] = []) => {
        if (committed) throw new Error('the transaction is committed: no statement may follow queryAndCommit');
        return (await inner.query<Row>(sql, params as unknown[])).rows;
      };
      // No round trip to save in-process: the commit follows when `work` resolves.
      return work({
        query,
        exec: async (sql: string) => {
          if (committed) throw new Error('the transaction is committed: no statement may follow queryAndCommit');
          await inner.exec(sql);
        },
        queryAndCommit: async <Row>(sql: string, params: readonly unknown[] = []) => {
          const rows = await query<Row>(sql, params);
          committed = true;
          return rows;
        },
      });
    });
  }

  async exec(sql: string): Promise<void> {
    await this.#db.exec(sql);
  }

  async close(): Promise<void> {
    try {
      await this.#db.close();
    } finally {
      this.#release();
    }
  }
}

export interface OpenDatabaseOptions {
  /** PostgreSQL; null = PGlite */
  databaseUrl: string | null;
  /** PGlite's directory is `<dataDir>/pglite`; null = in memory */
  dataDir: string | null;
  /** PostgreSQL only: a schema to work in (tests isolate themselves this way) */
  schema?: string;
}

export async function openDatabase(options: OpenDatabaseOptions): Promise<Database> {
  if (options.databaseUrl) {
    const db = new PostgresDatabase(options.databaseUrl, options.schema ?? null);
    if (options.schema) await db.query(`CREATE SCHEMA IF NOT EXISTS ${quoteIdentifier(options.schema)}`);
    return db;
  }
  // PGlite parses int8 as a number when it fits and a bigint when not: always bigint here.
  const pgliteOptions = { parsers: { 20: bigintParser } };
  if (!options.dataDir) return new PGliteDatabase(await openInMemory(pgliteOptions), () => {});
  const dir = join(options.dataDir, 'pglite');
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  // PGlite allows one process per directory; a second one would corrupt it. The refused one is
  // most often an operator's `migrate`, `keys` or `org` beside the service (docs/api-keys.md).
  const release = acquireLock(dir, {
    file: 'agent-vault.lock',
    what: 'the PGlite database',
    remedy: 'stop the process that holds it first (for the CLI beside a running service, use PostgreSQL: DATABASE_URL, where it runs alongside)',
  });
  try {
    return new PGliteDatabase(await PGlite.create(dir, pgliteOptions), release);
  } catch (error) {
    release();
    throw error;
  }
}

/**
 * An in-memory database (the tests' store: the suite opens some fifty, one or two in each test
 * file's process). Most of opening one is initdb (~3 s, ~4 CPU s), which makes the same cluster
 * every time, so a process starts them all from one fresh cluster: the tarball the test runner
 * made for every process (`AGENT_VAULT_TEST_PGLITE_CLUSTER`, scripts/test.mjs), or else its
 * first in-memory database's, kept as it was made. Its buffer pool is 16 MB rather than
 * PostgreSQL's 128 MB, which PGlite sets up at every start (~0.4 s): its pages are in memory
 * anyway.
 */
async function openInMemory(options: PGliteOptions): Promise<PGlite> {
  const inMemory: PGliteOptions = { ...options, postgresqlconf: ['shared_buffers = 16MB'] };
  const madeByRunner = process.env.AGENT_VAULT_TEST_PGLITE_CLUSTER;
  if (!freshCluster && madeByRunner) freshCluster = readFile(madeByRunner).then((tarball) => new Blob([tarball]));
  if (freshCluster) return PGlite.create({ ...inMemory, loadDataDir: await freshCluster });
  let keep!: (cluster: Blob) => void;
  let fail!: (error: unknown) => void;
  freshCluster = new Promise((resolve, reject) => { keep = resolve; fail = reject; });
  freshCluster.catch(() => {}); // thrown to the first one, and to those waiting for it
  try {
    const db = await PGlite.create(inMemory);
    // One chunk: PGlite reads the tarball whole, and a Blob of one chunk is read in one copy.
    keep(new Blob([await (await db.dumpDataDir('none')).arrayBuffer()]));
    return db;
  } catch (error) {
    freshCluster = null;
    fail(error);
    throw error;
  }
}
let freshCluster: Promise<Blob> | null = null;

export function quoteIdentifier(name: string): string {
  if (!/^[a-z_][a-z0-9_]{0,62}$/.test(name)) throw new Error(`unsafe identifier ${name}`);
  return `"${name}"`;
}
