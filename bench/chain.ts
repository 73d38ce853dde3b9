/**
 * Confirmed pay instructions per second through the local validator: build, sign, submit,
 * wait for confirmation, at the real slot length. Prints figures; asserts nothing.
 *
 *   npm run bench:chain -- [--seconds 10] [--slot-ms 400] [--pays-per-tx 6] [--concurrency 256]
 *                          [--vaults 16] [--http]
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { randomBytes } from 'node:crypto';
import { generateKeyPairSigner, lamports, type Address } from '@solana/kit';
import { OffsetClock } from '../src/clock/clock.ts';
import { ChainClient, type SolanaRpc } from '../src/chain/client.ts';
import { createHttpRpc } from '../src/chain/connect.ts';
import { NO_LIMIT } from '../src/chain/program.ts';
import { startRpcServer } from '../src/validator/http.ts';
import { createInProcessRpc } from '../src/validator/in-process.ts';
import { LocalValidator } from '../src/validator/validator.ts';

const { values } = parseArgs({
  options: {
    seconds: { type: 'string', default: '10' },
    'slot-ms': { type: 'string', default: '400' },
    'pays-per-tx': { type: 'string', default: '6' },
    concurrency: { type: 'string', default: '256' },
    vaults: { type: 'string', default: '16' },
    http: { type: 'boolean', default: false },
  },
});
const seconds = Number(values.seconds);
const slotMs = Number(values['slot-ms']);
const paysPerTx = Number(values['pays-per-tx']);
const concurrency = Number(values.concurrency);
const vaultCount = Number(values.vaults);
const ORG = 'org_bench';
const POLICY = 'pol_bench';

const dataDir = mkdtempSync(join(tmpdir(), 'av-bench-'));
const clock = new OffsetClock();
const validator = await LocalValidator.open({ dataDir, slotMs, clock });
const server = values.http ? await startRpcServer(validator, { port: 0 }) : null;
const rpc: SolanaRpc = server ? createHttpRpc(server.url) : createInProcessRpc(validator);
const operator = await generateKeyPairSigner();
const arbiter = await generateKeyPairSigner();
await rpc.requestAirdrop(operator.address, lamports(1_000_000_000_000n)).send();
const chain = new ChainClient({
  rpc, programId: validator.programId, usdcMint: validator.usdcMint, operator, arbiter,
  pollIntervalMs: Math.max(10, Math.floor(slotMs / 4)),
});

const agents = Array.from({ length: vaultCount }, (_, i) => `agent-${i}`);
const recipients: Address[] = [];
for (let i = 0; i < 64; i += 1) recipients.push((await generateKeyPairSigner()).address);

async function must(instructionsPromise: Promise<Parameters<ChainClient['execute']>[0]>): Promise<void> {
  const outcome = await chain.execute(await instructionsPromise, 60_000);
  if (outcome.err) throw new Error(`setup failed: ${outcome.err.name}`);
}

await must(Promise.all([
  chain.initReserveIx(ORG),
  chain.setPolicyIx(ORG, POLICY, { maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT, expiry: 0n }),
]));
await validator.mintUsdc((await chain.reserveAddresses(ORG)).reserve, 1_000_000_000_000_000n);
for (let i = 0; i < agents.length; i += 4) {
  const batch = agents.slice(i, i + 4);
  await must(Promise.all(batch.flatMap((agent) => [chain.createVaultIx(ORG, agent, POLICY), chain.fundIx(ORG, agent, 10_000_000_000_000n)])));
}

function payInstructions(agent: string, first: number) {
  return Promise.all(Array.from({ length: paysPerTx }, (_, k) => chain.payIx({
    orgId: ORG, agentId: agent, policyId: POLICY,
    recipient: recipients[(first + k) % recipients.length]!,
    amount: 1_000n, attestation: randomBytes(32),
  })));
}

// Warm-up: every recipient's token account exists, so the timed run measures steady-state pays.
for (let i = 0; i < recipients.length; i += paysPerTx) {
  await must(payInstructions(agents[0]!, i));
}

let confirmedPays = 0;
let failedTxs = 0;
let submittedTxs = 0;
const latenciesMs: number[] = [];
const sampleSignatures: string[] = [];
const rssBeforeBytes = process.memoryUsage().rss;
const startMs = Date.now();
const endMs = startMs + seconds * 1000;

async function worker(id: number): Promise<void> {
  let n = id * paysPerTx;
  while (Date.now() < endMs) {
    const agent = agents[n % agents.length]!;
    const sentAtMs = Date.now();
    const prepared = await chain.prepare(await payInstructions(agent, n));
    n += paysPerTx * concurrency;
    await chain.submit(prepared);
    submittedTxs += 1;
    const outcome = await chain.waitForOutcome(prepared.signature, 60_000);
    if (outcome.err) {
      failedTxs += 1;
      continue;
    }
    confirmedPays += paysPerTx;
    latenciesMs.push(Date.now() - sentAtMs);
    if (sampleSignatures.length < 20) sampleSignatures.push(prepared.signature);
  }
}

await Promise.all(Array.from({ length: concurrency }, (_, id) => worker(id)));
const elapsedSeconds = (Date.now() - startMs) / 1000;
const rssAfterBytes = process.memoryUsage().rss;

let unitsTotal = 0n;
for (const signature of sampleSignatures) {
  const tx = await rpc.getTransaction(signature as never, { maxSupportedTransactionVersion: 0, encoding: 'json' }).send();
  unitsTotal += BigInt(tx?.meta?.computeUnitsConsumed ?? 0n);
}
const cuPerPay = sampleSignatures.length ? Number(unitsTotal) / (sampleSignatures.length * paysPerTx) : NaN;
latenciesMs.sort((a, b) => a - b);
const percentile = (p: number) => latenciesMs[Math.min(latenciesMs.length - 1, Math.floor(latenciesMs.length * p))] ?? NaN;
const mib = (bytes: number) => (bytes / 1024 / 1024).toFixed(1);

console.log(JSON.stringify({
  transport: server ? 'http' : 'in-process',
  slot_ms: slotMs,
  seconds: Number(elapsedSeconds.toFixed(2)),
  pays_per_tx: paysPerTx,
  concurrency,
  vaults: vaultCount,
  confirmed_pays: confirmedPays,
  confirmed_pays_per_second: Math.round(confirmedPays / elapsedSeconds),
  transactions_submitted: submittedTxs,
  transactions_failed: failedTxs,
  latency_ms: { p50: percentile(0.5), p99: percentile(0.99) },
  cu_per_pay_instruction: Math.round(cuPerPay),
  rss_mib: { before: mib(rssBeforeBytes), after: mib(rssAfterBytes) },
  heap_used_mib: mib(process.memoryUsage().heapUsed),
}, null, 2));

chain.close();
await server?.close();
await validator.close();
rmSync(dataDir, { recursive: true, force: true });
