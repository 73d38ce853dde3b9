#!/usr/bin/env node
// The agent-vault executable. The code base is TypeScript run through tsx's loader, so a
// checkout works with `npm ci` alone (no build step).
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../src/cli.ts');
process.exitCode = await main(process.argv.slice(2));
