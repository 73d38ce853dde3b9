/**
 * Transactions, on the database the suite runs against (PGlite; PostgreSQL when DATABASE_URL is
 * set, where BEGIN goes out with the first statement and queryAndCommit's COMMIT with the last):
 * what a transaction wrote is there once it answered, and nothing of it when it failed.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Socket } from 'node:net';
import { after, before, test } from 'node:test';
import { openDatabase, quoteIdentifier, type Database } from './database.ts';
import { listMigrations, migrate, SchemaTooNewError } from './migrate.ts';

const databaseUrl = process.env.DATABASE_URL ?? null;
const schema = databaseUrl ? `t_${randomBytes(6).toString('hex')}` : undefined;
let db: Database;

before(async () => {
  db = await openDatabase({ databaseUrl, dataDir: null, schema });
  await db.exec('CREATE TABLE items (id INT PRIMARY KEY, note TEXT NOT NULL)');
});

after(async () => {
  if (schema) await db.query(`DROP SCHEMA ${quoteIdentifier(schema)} CASCADE`);
  await db.close();
});

const notes = async () => (await db.query<{ id: number; note: string }>('SELECT id, note FROM items ORDER BY id')).map((row) => `${row.id}:${row.note}`);

test('queryAndCommit answers the rows of its statement, committed: another connection sees them', async () => {
  await db.query('DELETE FROM items');
  const rows = await db.transaction(async (tx) => {
    await tx.query('INSERT INTO items VALUES ($1, $2)', [1, 'first']);
    return tx.queryAndCommit<{ id: number }>('INSERT INTO items VALUES ($1, $2), ($3, $4) RETURNING id', [2, 'second', 3, 'third']);
  });
  assert.deepEqual(rows.map((row) => row.id), [2, 3], 'the rows of the last statement');
  assert.deepEqual(await notes(), ['1:first', '2:second', '3:third'], 'everything the transaction wrote is committed');
});

test('a failing last statement commits nothing: neither it nor the statements before it', async () => {
  await db.query('DELETE FROM items');
  await db.query('INSERT INTO items VALUES (1, $1)', ['kept']);
  await assert.rejects(db.transaction(async (tx) => {
    await tx.query('UPDATE items SET note = $1 WHERE id = 1', ['changed']);
    await tx.query('INSERT INTO items VALUES ($1, $2)', [2, 'new']);
    return tx.queryAndCommit('INSERT INTO items VALUES ($1, $2)', [1, 'duplicate']);
  }), /duplicate key/, 'the statement\'s error is answered');
  assert.deepEqual(await notes(), ['1:kept'], 'the transaction was rolled back');
  // The connection went back to the pool usable, outside any transaction.
  await db.transaction(async (tx) => tx.queryAndCommit('INSERT INTO items VALUES ($1, $2)', [3, 'after']));
  assert.deepEqual(await notes(), ['1:kept', '3:after']);
});

test('no statement may follow queryAndCommit', async () => {
  await db.query('DELETE FROM items');
  await assert.rejects(db.transaction(async (tx) => {
    await tx.queryAndCommit('INSERT INTO items VALUES ($1, $2)', [1, 'one']);
    await tx.query('INSERT INTO items VALUES ($1, $2)', [2, 'two']);
  }), /no statement may follow queryAndCommit/);
  assert.deepEqual((await notes()).filter((note) => note.startsWith('2:')), [], 'the statement after it ran nowhere');
});

test('a transaction that throws after its statements commits nothing; one that returns commits', async () => {
  await db.query('DELETE FROM items');
  await assert.rejects(db.transaction(async (tx) => {
    await tx.query('INSERT INTO items VALUES ($1, $2)', [1, 'one']);
    throw new Error('changed my mind');
  }), /changed my mind/);
  assert.deepEqual(await notes(), [], 'rolled back');
  await db.transaction(async (tx) => {
    await tx.query('INSERT INTO items VALUES ($1, $2)', [1, 'one']);
  });
  assert.deepEqual(await notes(), ['1:one'], 'committed when the work resolved');
});

test('the first statement runs inside the transaction: a row lock it takes is held until the end', async () => {
  await db.query('DELETE FROM items');
  await db.query('INSERT INTO items VALUES (1, $1)', ['0']);
  // Twenty increments by read-then-write under FOR UPDATE, side by side: none is lost.
  await Promise.all(Array.from({ length: 20 }, () => db.transaction(async (tx) => {
    const [row] = await tx.query<{ note: string }>('SELECT note FROM items WHERE id = $1 FOR UPDATE', [1]);
    await new Promise((resolve) => setImmediate(resolve));
    await tx.queryAndCommit('UPDATE items SET note = $2 WHERE id = $1', [1, String(Number(row!.note) + 1)]);
  })));
  assert.deepEqual(await notes(), ['1:20'], 'every increment saw the one before it');
});

test('statements issued together leave in one write: BEGIN with the first ones, the last with COMMIT', {
  skip: databaseUrl ? false : 'PGlite has no socket',
}, async () => {
  await db.query('DELETE FROM items');
  // Counted where a socket hands its bytes to the system: one call per write.
  const socket = Socket.prototype as unknown as Record<'_write' | '_writev', (...args: unknown[]) => unknown>;
  const [write, writev] = [socket._write, socket._writev];
  let writes = 0;
  socket._write = function counted(...args: unknown[]) { writes += 1; return write.apply(this, args); };
  socket._writev = function counted(...args: unknown[]) { writes += 1; return writev.apply(this, args); };
  try {
    await db.transaction(async (tx) => {
      await Promise.all([tx.query('INSERT INTO items VALUES ($1, $2)', [1, 'a']), tx.query('INSERT INTO items VALUES ($1, $2)', [2, 'b'])]);
      await tx.queryAndCommit('INSERT INTO items VALUES ($1, $2)', [3, 'c']);
    });
  } finally {
    [socket._write, socket._writev] = [write, writev];
  }
  assert.equal(writes, 2, 'BEGIN and two statements in one write, the last statement and COMMIT in another');
  assert.deepEqual(await notes(), ['1:a', '2:b', '3:c']);
});

test('two processes migrating an empty database together both succeed, each migration applied once', { skip: !databaseUrl && 'needs DATABASE_URL (PGlite has one connection)' }, async () => {
  for (let round = 0; round < 10; round += 1) {
    const fresh = `t_${randomBytes(6).toString('hex')}`;
    const [a, b] = [await openDatabase({ databaseUrl, dataDir: null, schema: fresh }), await openDatabase({ databaseUrl, dataDir: null, schema: fresh })];
    try {
      const [fromA, fromB] = await Promise.all([migrate(a), migrate(b)]);
      assert.deepEqual([...fromA, ...fromB].sort((x, y) => x - y), listMigrations().map((m) => m.version));
    } finally {
      await a.query(`DROP SCHEMA ${quoteIdentifier(fresh)} CASCADE`);
      await a.close();
      await b.close();
    }
  }
});

test('a migration runs without the pool\'s statement timeout: a long index build is not cut at 30 s', { skip: !databaseUrl && 'needs DATABASE_URL (PGlite has no statement timeout)' }, async () => {
  const fresh = `t_${randomBytes(6).toString('hex')}`;
  const other = await openDatabase({ databaseUrl, dataDir: null, schema: fresh });
  try {
    assert.equal((await other.query<{ t: string }>(`SELECT current_setting('statement_timeout') AS t`))[0]!.t, '30s', 'the pool\'s');
    await migrate(other, [{ version: 1, name: 'seen', sql: `CREATE TABLE seen AS SELECT current_setting('statement_timeout') AS t` }]);
    assert.deepEqual(await other.query('SELECT t FROM seen'), [{ t: '0' }]);
  } finally {
    await other.query(`DROP SCHEMA ${quoteIdentifier(fresh)} CASCADE`);
    await other.close();
  }
});

test('a database holding a migration this build does not have is refused before anything is applied', async () => {
  const fresh = databaseUrl ? `t_${randomBytes(6).toString('hex')}` : undefined;
  const other = await openDatabase({ databaseUrl, dataDir: null, schema: fresh });
  try {
    const one = { version: 1, name: 'one', sql: 'CREATE TABLE one (id INT)' };
    const two = { version: 2, name: 'two', sql: 'CREATE TABLE two (id INT)' };
    const three = { version: 3, name: 'three', sql: 'CREATE TABLE three (id INT)' };
    assert.deepEqual(await migrate(other, [one, three]), [1, 3], 'the newer build');
    // The older build knows 1 and 2: 3 is not its, so it must not run (nor apply its own 2).
    await assert.rejects(migrate(other, [one, two]), (error: unknown) => error instanceof SchemaTooNewError
      && /does not have \(0003_three; this build's newest is 0002\)/.test(error.message));
    assert.deepEqual((await other.query<{ version: number }>('SELECT version FROM schema_migrations ORDER BY version')).map((row) => row.version), [1, 3]);
    assert.deepEqual(await other.query(`SELECT to_regclass('two') IS NULL AS absent`), [{ absent: true }]);
  } finally {
    if (fresh) await other.query(`DROP SCHEMA ${quoteIdentifier(fresh)} CASCADE`);
    await other.close();
  }
});

test('in-memory databases start from a fresh cluster each: nothing one writes is in another, opened at once or after', { skip: !!databaseUrl && 'PGlite only' }, async () => {
  const open = () => openDatabase({ databaseUrl: null, dataDir: null });
  const [first, second] = await Promise.all([open(), open()]);
  try {
    await migrate(first);
    await first.exec('CREATE TABLE only_here (id INT)');
    const third = await open();
    try {
      for (const other of [second, third]) {
        assert.deepEqual(await other.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"), [], 'an empty cluster');
        assert.equal((await migrate(other)).length, listMigrations().length, 'every migration applies');
      }
      assert.deepEqual(await third.query('SHOW shared_buffers'), [{ shared_buffers: '16MB' }]);
    } finally {
      await third.close();
    }
  } finally {
    await first.close();
    await second.close();
  }
});
