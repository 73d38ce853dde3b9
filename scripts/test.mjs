#!/usr/bin/env node
// Runs every *.test.ts under src/, program/ and test/ with Node's own test runner.
// Node 20's runner has no glob support, so the file list is built here.
import { readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { spawnSync } from 'node:child_process';

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
const result = spawnSync(process.execPath, [
  '--import', 'tsx', '--test', '--test-concurrency=2', '--test-timeout=300000', ...selected.sort(),
], { stdio: 'inherit' });
process.exit(result.status ?? 1);
