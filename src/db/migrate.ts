/**
 * Numbered plain-SQL migrations (`migrations/NNNN_name.sql`), applied in order, each in its own
 * transaction, at start and by `agent-vault migrate`. An advisory lock keeps two processes
 * starting together from applying the same migration twice.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Database, Queryable } from './database.ts';

const MIGRATIONS_DIR = join(dirname(fileURLToPath(import.meta.url)), 'migrations');
/** An arbitrary constant naming "agent-vault migrations" for pg_advisory_xact_lock. */
const MIGRATION_LOCK_KEY = 734_551_201;

export interface Migration {
  version: number;
  name: string;
  sql: string;
}

export function listMigrations(dir = MIGRATIONS_DIR): Migration[] {
  return readdirSync(dir)
    .filter((file) => /^\d{4}_[a-z0-9_]+\.sql$/.test(file))
    .sort()
    .map((file) => ({ version: Number(file.slice(0, 4)), name: file.slice(5, -4), sql: readFileSync(join(dir, file), 'utf8') }));
}

/**
 * A migration (an index built over a large table) and the wait of a process starting beside the
 * one running it may take longer than the pool's statement timeout (30 s): neither is cut.
 */
async function untimed(tx: Queryable): Promise<void> {
  await tx.query('SET LOCAL statement_timeout = 0');
  await tx.query('SET LOCAL lock_timeout = 0');
}

/**
 * The database was migrated by a newer build: this one's code would run on tables it does not
 * know (a constraint it writes against replaced, a column it never sets made required), failing
 * at some request or job long after start, possibly after moving money on chain. Refused at start.
 */
export class SchemaTooNewError extends Error {
  constructor(unknown: Array<{ version: number; name: string }>, migrations: Migration[]) {
    const newest = migrations.at(-1);
    super(`the database has migrations this build does not have (${unknown.map((m) => `${pad(m.version)}_${m.name}`).join(', ')}; `
      + `this build's newest is ${newest ? pad(newest.version) : 'none'}): a newer agent-vault migrated it. Run that version, `
      + 'or restore the backup taken before the upgrade (docs/operations.md "Migrations")');
    this.name = 'SchemaTooNewError';
  }
}

const pad = (version: number) => String(version).padStart(4, '0');

/** Throws SchemaTooNewError when `applied` holds a version that is not one of `migrations`. */
export function refuseNewerSchema(applied: Array<{ version: number; name: string }>, migrations: Migration[]): void {
  const known = new Set(migrations.map((migration) => migration.version));
  const unknown = applied.filter((row) => !known.has(row.version)).sort((a, b) => a.version - b.version);
  if (unknown.length) throw new SchemaTooNewError(unknown, migrations);
}

/** Applies what is missing; returns the versions applied now. */
export async function migrate(db: Database, migrations = listMigrations()): Promise<number[]> {
  // Under the lock too: CREATE TABLE IF NOT EXISTS is not safe against another process creating
  // the same table at the same moment (two processes starting together on an empty database).
  await db.transaction(async (tx) => {
    await untimed(tx);
    await tx.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
    await tx.query(`CREATE TABLE IF NOT EXISTS schema_migrations (
      version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())`);
    refuseNewerSchema(await tx.query<{ version: number; name: string }>('SELECT version, name FROM schema_migrations'), migrations);
  });
  const applied: number[] = [];
  for (const migration of migrations) {
    const done = await db.transaction(async (tx) => {
      await untimed(tx);
      await tx.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
      const existing = await tx.query('SELECT 1 FROM schema_migrations WHERE version = $1', [migration.version]);
      if (existing.length) return false;
      await tx.exec(migration.sql);
      await tx.query('INSERT INTO schema_migrations (version, name) VALUES ($1, $2)', [migration.version, migration.name]);
      return true;
    });
    if (done) applied.push(migration.version);
  }
  return applied;
}
