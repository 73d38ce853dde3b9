#!/usr/bin/env node
// The agent-vault executable. The code base is TypeScript run through tsx's loader, so a
// checkout works with `npm ci` alone (no build step).
import { setFlagsFromString } from 'node:v8';
import { register } from 'tsx/esm/api';

// Without this, V8 learns from the payment path to allocate database rows straight into old
// space, and an export's million short-lived rows then pile up there until a full collection
// (measured: +176 MiB during a 1M-row export, +27 MiB with it; docs/exports.md). Set before any
// allocation site is created.
setFlagsFromString('--no-allocation-site-pretenuring');

register();
const { main } = await import('../src/cli.ts');
process.exitCode = await main(process.argv.slice(2));
