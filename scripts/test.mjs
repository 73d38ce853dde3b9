#!/usr/bin/env node
// Runs every *.test.ts under src/, program/ and test/ with Node's own test runner.
// Node 20's runner has no glob support, so the file list is built here.
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { spawnSync } from 'node:child_process';
import { PGlite } from '@electric-sql/pglite';

const roots = ['src', 'program', 'test'];
const files = [];
function walk(dir) {
  for (const name of readdirSync(dir)) {
    if (name === 'node_modules') continue;
    const path = join(dir, name);
    if (statSync(path).isDirectory()) walk(path);
    else if (name.endsWith('.test.ts')) files.push(path);
  }
}
for (const root of roots) {
  try { walk(root); } catch (error) { if (error.code !== 'ENOENT') throw error; }
}
const only = process.argv.slice(2);
const selected = only.length ? files.filter((f) => only.some((o) => f.includes(o))) : files;

/**
 * A fresh PGlite cluster (initdb's output) for the test processes' in-memory databases to start
 * from, so that they run no initdb of their own (src/db/database.ts): made once per PGlite
 * version, kept in node_modules/.cache.
 */
async function freshCluster() {
  const { version } = JSON.parse(readFileSync('node_modules/@electric-sql/pglite/package.json', 'utf8'));
  const dir = join('node_modules', '.cache', 'agent-vault');
  const path = join(dir, `pglite-${version}-cluster.tar`);
  if (existsSync(path)) return path;
  mkdirSync(dir, { recursive: true });
  const db = await PGlite.create();
  const tarball = new Uint8Array(await (await db.dumpDataDir('none')).arrayBuffer());
  await db.close();
  const partial = `${path}.${process.pid}`;
  writeFileSync(partial, tarball);
  renameSync(partial, path);
  return path;
}

const env = { ...process.env };
if (!env.DATABASE_URL) env.AGENT_VAULT_TEST_PGLITE_CLUSTER = await freshCluster();
const result = spawnSync(process.execPath, [
  '--import', 'tsx', '--test', '--test-concurrency=2', '--test-timeout=300000', ...selected.sort(),
], { stdio: 'inherit', env });
process.exit(result.status ?? 1);
