#!/usr/bin/env node
// The npm registry this project installs from lacks litesvm's non-linux-x64-gnu binaries, so
// `npm install` leaves them out of package-lock.json and `npm ci` then refuses the lock as out
// of sync. This writes their entries back (optional, platform-gated: never downloaded here).
// Run after any `npm install` that rewrites the lock.
import { readFileSync, writeFileSync } from 'node:fs';

const lock = JSON.parse(readFileSync('package-lock.json', 'utf8'));
const litesvm = lock.packages['node_modules/litesvm'];
const platforms = {
  'litesvm-darwin-arm64': { os: ['darwin'], cpu: ['arm64'] },
  'litesvm-darwin-x64': { os: ['darwin'], cpu: ['x64'] },
  'litesvm-linux-arm64-gnu': { os: ['linux'], cpu: ['arm64'], libc: ['glibc'] },
  'litesvm-linux-arm64-musl': { os: ['linux'], cpu: ['arm64'], libc: ['musl'] },
  'litesvm-linux-x64-gnu': { os: ['linux'], cpu: ['x64'], libc: ['glibc'] },
  'litesvm-linux-x64-musl': { os: ['linux'], cpu: ['x64'], libc: ['musl'] },
};
for (const [name, gate] of Object.entries(platforms)) {
  const key = `node_modules/${name}`;
  lock.packages[key] ??= { version: litesvm.version, ...gate, license: 'MIT', optional: true, engines: { node: '>= 20' } };
}
const sorted = {};
for (const key of Object.keys(lock.packages).sort((a, b) => (a === '' ? -1 : b === '' ? 1 : a.localeCompare(b)))) {
  sorted[key] = lock.packages[key];
}
lock.packages = sorted;
writeFileSync('package-lock.json', `${JSON.stringify(lock, null, 2)}\n`);
