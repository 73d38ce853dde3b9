/**
 * The chain client against the local validator with our program deployed: the operations the
 * service performs, end to end, with balances read back from the chain.
 */
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import { createSolanaRpc, generateKeyPairSigner, lamports, type KeyPairSigner } from '@solana/kit';
import type { ServiceError } from '../errors/errors.ts';
import { dependencyDown } from '../http/app.ts';
import { ManualClock } from '../clock/clock.ts';
import { createInProcessRpc } from '../validator/in-process.ts';
import { LocalValidator } from '../validator/validator.ts';
import type { PublishedStatus } from '../validator/validator.ts';
import { beforeDeadline } from '../../test/deadline.ts';
import { ChainClient, ConfirmationTimeoutError, referenceMemoIx } from './client.ts';
import { NO_LIMIT } from './program.ts';

const ORG = 'org_client_test';
const USDC = 1_000_000n;

describe('chain client', () => {
  const clock = new ManualClock(Date.parse('2026-03-10T12:00:00Z'));
  let validator: LocalValidator;
  let chain: ChainClient;
  let operator: KeyPairSigner;

  before(async () => {
    validator = await LocalValidator.open({ slotMs: 0, clock });
    operator = await generateKeyPairSigner();
    const arbiter = await generateKeyPairSigner();
    const rpc = createInProcessRpc(validator);
    await rpc.requestAirdrop(operator.address, lamports(10_000_000_000n)).send();
    await rpc.requestAirdrop(arbiter.address, lamports(1_000_000_000n)).send();
    chain = new ChainClient({
      rpc, programId: validator.programId, usdcMint: validator.usdcMint, operator, arbiter, pollIntervalMs: 5,
    });
    const setup = await chain.execute([
      await chain.initReserveIx(ORG),
      await chain.setPolicyIx(ORG, 'pol_open', { maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT, expiry: 0n }),
      await chain.setPolicyIx(ORG, 'pol_small', { maxPerTx: 5n * USDC, maxPerDay: 8n * USDC, expiry: 0n }),
    ]);
    assert.equal(setup.err, null);
    const { reserve } = await chain.reserveAddresses(ORG);
    await validator.mintUsdc(reserve, 1_000n * USDC);
  });

  after(async () => {
    chain.close();
    await validator.close();
  });

  test('a vault address is deterministic from (organisation, agent) and differs per organisation', async () => {
    const a = await chain.vaultAddresses(ORG, 'agent-1');
    const b = await chain.vaultAddresses(ORG, 'agent-1');
    const other = await chain.vaultAddresses('org_other', 'agent-1');
    assert.equal(a.vault, b.vault);
    assert.notEqual(a.vault, other.vault);
  });

  test('create, fund, pay and withdraw move exactly the amounts asked, conserving money', async () => {
    const created = await chain.execute([await chain.createVaultIx(ORG, 'agent-pay', 'pol_open')]);
    assert.equal(created.err, null);
    const { vault } = await chain.vaultAddresses(ORG, 'agent-pay');
    const { reserve } = await chain.reserveAddresses(ORG);
    const reserveBefore = await chain.getUsdcBalance(reserve);

    assert.equal((await chain.execute([await chain.fundIx(ORG, 'agent-pay', 100n * USDC)])).err, null);
    assert.equal(await chain.getUsdcBalance(vault), 100n * USDC);
    assert.equal(await chain.getUsdcBalance(reserve), reserveBefore - 100n * USDC);

    const recipient = (await generateKeyPairSigner()).address;
    const payIx = await chain.payIx({
      orgId: ORG, agentId: 'agent-pay', policyId: 'pol_open', recipient, amount: 12_345_678n,
      attestation: new Uint8Array(32).fill(7), memo: new TextEncoder().encode('tx_01'),
    });
    // The signature is known before anything is sent, and the chain knows nothing of it yet.
    const prepared = await chain.prepare([payIx]);
    assert.equal(await chain.getOutcome(prepared.signature), null);
    await chain.submit(prepared);
    await chain.submit(prepared); // a retry must not pay twice
    const outcome = await chain.waitForOutcome(prepared.signature);
    assert.equal(outcome.err, null);
    assert.ok(outcome.slot > 0n);
    assert.deepEqual(await chain.getOutcome(prepared.signature), outcome);
    assert.equal(await chain.getUsdcBalance(recipient), 12_345_678n, 'the recipient account was created and credited once');
    assert.equal(await chain.getUsdcBalance(vault), 100n * USDC - 12_345_678n);

    assert.equal((await chain.execute([await chain.withdrawIx(ORG, 'agent-pay', 7n * USDC)])).err, null);
    assert.equal(await chain.getUsdcBalance(vault), 93n * USDC - 12_345_678n);
    assert.equal(await chain.getUsdcBalance(reserve), reserveBefore - 93n * USDC);
    const state = await chain.getVault(vault);
    assert.equal(state?.paymentCount, 1n);
    assert.equal(state?.frozen, false);
  });

  test('on-chain rules come back as named program errors and change nothing', async () => {
    await chain.execute([await chain.createVaultIx(ORG, 'agent-limited', 'pol_small'), await chain.fundIx(ORG, 'agent-limited', 20n * USDC)]);
    const { vault } = await chain.vaultAddresses(ORG, 'agent-limited');
    const recipient = (await generateKeyPairSigner()).address;
    const pay = (amount: bigint) => chain.payIx({
      orgId: ORG, agentId: 'agent-limited', policyId: 'pol_small', recipient, amount, attestation: new Uint8Array(32),
      memo: new TextEncoder().encode(`memo-${amount}`),
    });

    const over = await chain.execute([await pay(6n * USDC)]);
    assert.equal(over.err?.name, 'OverMaxPerTx');
    assert.equal(over.err?.code, 6013);
    assert.equal(await chain.getUsdcBalance(vault), 20n * USDC);

    assert.equal((await chain.execute([await pay(5n * USDC)])).err, null);
    const overDay = await chain.execute([await pay(4n * USDC)]);
    assert.equal(overDay.err?.name, 'OverDailyCap');
    assert.equal(await chain.getUsdcBalance(vault), 15n * USDC);

    assert.equal((await chain.execute([await chain.setFrozenIx(ORG, 'agent-limited', true)])).err, null);
    assert.equal((await chain.execute([await pay(1n * USDC)])).err?.name, 'VaultFrozen');
    assert.equal((await chain.getVault(vault))?.frozen, true);
  });

  test('a policy update reaches every attached vault at the next transaction', async () => {
    await chain.execute([
      await chain.setPolicyIx(ORG, 'pol_shared', { maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT, expiry: 0n }),
      await chain.createVaultIx(ORG, 'agent-s1', 'pol_shared'),
      await chain.createVaultIx(ORG, 'agent-s2', 'pol_shared'),
      await chain.fundIx(ORG, 'agent-s1', 10n * USDC),
      await chain.fundIx(ORG, 'agent-s2', 10n * USDC),
    ]);
    const updated = await chain.execute([await chain.setPolicyIx(ORG, 'pol_shared', { maxPerTx: 1n * USDC, maxPerDay: NO_LIMIT, expiry: 0n })]);
    assert.equal(updated.err, null);
    assert.equal((await chain.getPolicy(await chain.policyAddress(ORG, 'pol_shared')))?.revision, 2n);
    const recipient = (await generateKeyPairSigner()).address;
    for (const agentId of ['agent-s1', 'agent-s2']) {
      const outcome = await chain.execute([await chain.payIx({
        orgId: ORG, agentId, policyId: 'pol_shared', recipient, amount: 2n * USDC, attestation: new Uint8Array(32),
      })]);
      assert.equal(outcome.err?.name, 'OverMaxPerTx', `${agentId} follows the updated policy`);
    }
  });

  test('a policy closed: its account gone, a vault still naming it spends nothing', async () => {
    await chain.execute([
      await chain.setPolicyIx(ORG, 'pol_closed', { maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT, expiry: 0n }),
      await chain.createVaultIx(ORG, 'agent-c1', 'pol_closed'),
      await chain.fundIx(ORG, 'agent-c1', 10n * USDC),
    ]);
    const policy = await chain.policyAddress(ORG, 'pol_closed');
    assert.deepEqual(await chain.getProgramOwned([policy]), [true]);
    assert.equal((await chain.execute([await chain.policyCloseIx(ORG, 'pol_closed')])).err, null);
    assert.deepEqual(await chain.getProgramOwned([policy]), [false]);
    assert.equal(await chain.getPolicy(policy), null);
    const { vault } = await chain.vaultAddresses(ORG, 'agent-c1');
    const refused = await chain.execute([await chain.payIx({
      orgId: ORG, agentId: 'agent-c1', policyId: 'pol_closed', recipient: (await generateKeyPairSigner()).address,
      amount: 1n * USDC, attestation: new Uint8Array(32),
    })]);
    assert.equal(refused.err?.name, 'InvalidAccountOwner');
    assert.equal(await chain.getUsdcBalance(vault), 10n * USDC);
    assert.equal((await chain.execute([await chain.policyCloseIx(ORG, 'pol_closed')])).err?.name, 'InvalidAccountOwner', 'closed already');
  });

  test('escrow: lock, release to the receiving vault; refund only after expiry; closed once settled', async () => {
    await chain.execute([
      await chain.createVaultIx(ORG, 'agent-req', 'pol_open'),
      await chain.createVaultIx(ORG, 'agent-work', 'pol_open'),
      await chain.fundIx(ORG, 'agent-req', 50n * USDC),
    ]);
    const { vault: requester } = await chain.vaultAddresses(ORG, 'agent-req');
    const { vault: worker } = await chain.vaultAddresses(ORG, 'agent-work');
    const nowSeconds = BigInt(Math.floor(clock.nowMs() / 1000));
    const lock = (escrowId: string, amount: bigint) => chain.escrowCreateIx({
      orgId: ORG, agentId: 'agent-req', policyId: 'pol_open', escrowId, receiver: worker, amount,
      taskHash: new Uint8Array(32).fill(1), expiresAtSeconds: nowSeconds + 3600n,
    });

    assert.equal((await chain.execute([await lock('esc_a', 10n * USDC)])).err, null);
    const { escrow } = await chain.escrowAddresses('esc_a');
    assert.equal(await chain.getUsdcBalance(escrow), 10n * USDC);
    assert.equal(await chain.getUsdcBalance(requester), 40n * USDC);
    assert.equal((await chain.execute([await chain.escrowReleaseIx('esc_a', worker)])).err, null);
    assert.equal(await chain.getUsdcBalance(worker), 10n * USDC);
    assert.equal((await chain.getEscrow(escrow))?.state, 2);

    assert.equal((await chain.execute([await lock('esc_b', 5n * USDC)])).err, null);
    const early = await chain.execute([await chain.escrowRefundIx('esc_b', requester)]);
    assert.equal(early.err?.name, 'EscrowNotExpired');
    const { escrow: refunded } = await chain.escrowAddresses('esc_b');
    assert.equal((await chain.execute([await chain.escrowCloseIx('esc_b')])).err?.name, 'InvalidEscrowState', 'still locked');
    clock.advance(3600);
    assert.equal((await chain.execute([await chain.escrowRefundIx('esc_b', requester)])).err, null);
    assert.equal(await chain.getUsdcBalance(requester), 40n * USDC);

    assert.deepEqual(await chain.getProgramOwned([escrow, refunded, requester, worker]), [true, true, true, true]);
    assert.equal((await chain.execute([await chain.escrowCloseIx('esc_a'), await chain.escrowCloseIx('esc_b')])).err, null);
    assert.deepEqual(await chain.getProgramOwned([escrow, refunded, requester]), [false, false, true]);
    assert.equal(await chain.getEscrow(escrow), null);
  });

  test('an outcome is seen when the validator publishes it, not at the next poll', async () => {
    const slotted = await LocalValidator.open({ slotMs: 50, clock, programSoPath: null });
    const rpc = createInProcessRpc(slotted);
    const payer = await generateKeyPairSigner();
    const arbiter = await generateKeyPairSigner();
    // A poll interval far beyond the test: only the publish signal can deliver the outcome.
    const pushed = new ChainClient({
      rpc, programId: slotted.programId, usdcMint: slotted.usdcMint, operator: payer, arbiter, pollIntervalMs: 60_000,
      onPublished: (listener) => slotted.onPublished(listener),
    });
    try {
      const signature = await rpc.requestAirdrop(payer.address, lamports(1_000_000n)).send();
      // Long before the poll (60 s): the publish signal delivered it.
      const outcome = await beforeDeadline(pushed.waitForOutcome(signature), 10_000);
      assert.ok(outcome, 'the outcome arrived with the slot\'s publish');
      assert.equal(outcome.err, null);
    } finally {
      pushed.close();
      await slotted.close();
    }
  });

  test('waiting for a signature the chain never saw times out', async () => {
    const prepared = await chain.prepare([await chain.setFrozenIx(ORG, 'agent-never', true)]);
    await assert.rejects(chain.waitForOutcome(prepared.signature, 50), ConfirmationTimeoutError);
  });
});

describe('chain client, statuses as a cluster gives them', () => {
  // A cluster's getSignatureStatuses answer, as kit hands it over (integers as bigint): the only
  // RPC method these tests reach. The client under test is the real one.
  const clusterRpc = (statuses: unknown[]) => ({
    getSignatureStatuses: () => ({ send: async () => ({ context: { slot: 10n }, value: statuses }) }),
  });
  const clientOn = async (rpc: unknown, onPublished?: ConstructorParameters<typeof ChainClient>[0]['onPublished']) => new ChainClient({
    rpc: rpc as ConstructorParameters<typeof ChainClient>[0]['rpc'], programId: (await generateKeyPairSigner()).address,
    usdcMint: (await generateKeyPairSigner()).address, operator: await generateKeyPairSigner(), arbiter: await generateKeyPairSigner(),
    pollIntervalMs: 60_000, onPublished,
  });

  test('a status only processed is no outcome yet; confirmed or finalized is', async () => {
    const chain = await clientOn(clusterRpc([
      { slot: 7n, err: null, confirmationStatus: 'processed', confirmations: 0n },
      { slot: 7n, err: null, confirmationStatus: 'confirmed', confirmations: null },
      null,
    ]));
    const [a, b, c] = [(await generateKeyPairSigner()).address, (await generateKeyPairSigner()).address, (await generateKeyPairSigner()).address];
    const outcomes = await chain.getOutcomes([a, b, c] as never[]);
    assert.deepEqual(outcomes.map((o) => o && [o.slot, o.err]), [null, [7n, null], null]);
  });

  test('an error reads the same pushed by the embedded validator (plain numbers) or asked for (bigints)', async () => {
    let push: (statuses: readonly PublishedStatus[]) => void = () => {};
    const signature = (await generateKeyPairSigner()).address as never;
    const asked = await clientOn(clusterRpc([
      { slot: 9n, err: { InsufficientFundsForRent: { account_index: 2n } }, confirmationStatus: 'finalized', confirmations: null },
    ]));
    const pushed = await clientOn(clusterRpc([]), (listener) => { push = listener; });
    const waiting = pushed.waitForOutcome(signature, 5_000);
    push([{ signature, slot: 9, err: { InsufficientFundsForRent: { account_index: 2 } } }]);
    const [fromPush, fromAsk] = [await waiting, (await asked.getOutcomes([signature]))[0]!];
    assert.equal(fromPush.slot, 9n);
    assert.equal(fromPush.err!.name, fromAsk.err!.name);
    assert.equal(fromAsk.err!.name, '{"InsufficientFundsForRent":{"account_index":"2"}}');
  });
});

describe('chain client, a cluster that answers with HTTP errors', () => {
  // Real HTTP answers from a node: 503 and 429 are a node down or busy (retry), 401 a key it refuses (do not).
  let status = 503;
  const server = createServer((_request, response) => { response.writeHead(status).end(); });
  let url: string;
  before(async () => {
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  after(async () => { await new Promise((resolve) => server.close(resolve)); });

  test('5xx and 429 are a dependency down (503); 4xx is not', async () => {
    const chain = new ChainClient({
      rpc: createSolanaRpc(url), programId: (await generateKeyPairSigner()).address, usdcMint: (await generateKeyPairSigner()).address,
      operator: await generateKeyPairSigner(), arbiter: await generateKeyPairSigner(),
    });
    for (const [answer, down] of [[503, true], [502, true], [429, true], [401, false], [404, false]] as const) {
      status = answer;
      const error = await chain.getBlockHeight().then(() => null, (caught: unknown) => caught);
      assert.ok(error, `${answer} is an error`);
      assert.equal(dependencyDown(error), down, `HTTP ${answer}`);
    }
  });

  test('closing the client ends every wait, and its timer', async () => {
    const chain = new ChainClient({
      rpc: createSolanaRpc(url), programId: (await generateKeyPairSigner()).address, usdcMint: (await generateKeyPairSigner()).address,
      operator: await generateKeyPairSigner(), arbiter: await generateKeyPairSigner(), pollIntervalMs: 60_000,
    });
    const timers = () => process.getActiveResourcesInfo().filter((name) => name === 'Timeout').length;
    const before = timers();
    const waiting = chain.waitForOutcome((await generateKeyPairSigner()).address as never, 30_000);
    assert.ok(timers() > before);
    chain.close();
    await assert.rejects(waiting, ConfirmationTimeoutError);
    assert.equal(timers(), before, 'no timer is left to hold the process');
  });
});

describe('chain client, a cluster that hangs up', () => {
  // A node (or the proxy in front of it) that closes the connection without answering.
  const hangingUp = createServer((request) => { request.socket.destroy(); });
  let url: string;
  before(async () => {
    await new Promise<void>((resolve) => hangingUp.listen(0, '127.0.0.1', resolve));
    url = `http://127.0.0.1:${(hangingUp.address() as AddressInfo).port}`;
  });
  after(async () => { await new Promise((resolve) => hangingUp.close(resolve)); });

  test('a connection closed without an answer is a dependency down (503), not a fault of ours (500)', async () => {
    const chain = new ChainClient({
      rpc: createSolanaRpc(url), programId: (await generateKeyPairSigner()).address, usdcMint: (await generateKeyPairSigner()).address,
      operator: await generateKeyPairSigner(), arbiter: await generateKeyPairSigner(),
    });
    for (const call of [() => chain.getBlockHeight(), () => chain.prepare([referenceMemoIx('tx_hung_up')])]) {
      const error = await call().then(() => null, (caught: unknown) => caught);
      assert.ok(error, 'the call failed');
      assert.equal(dependencyDown(error), true, String(error));
    }
  });
});

describe('chain client, a cluster that does not answer', () => {
  // A real HTTP endpoint that takes every request and never answers: what a hung RPC node is.
  const silent = createServer(() => {});
  let url: string;
  before(async () => {
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    url = `http://127.0.0.1:${(silent.address() as AddressInfo).port}`;
  });
  after(async () => {
    silent.closeAllConnections();
    await new Promise((resolve) => silent.close(resolve));
  });

  test('each call fails as service_unavailable within its timeout, and a wait for an outcome ends on time', async () => {
    const clientOf = async (callTimeoutMs: number) => new ChainClient({
      rpc: createSolanaRpc(url), programId: (await generateKeyPairSigner()).address, usdcMint: (await generateKeyPairSigner()).address,
      operator: await generateKeyPairSigner(), arbiter: await generateKeyPairSigner(), pollIntervalMs: 10, callTimeoutMs,
    });
    // Each call ends at its own timeout (200 ms), long before fetch's own limit (300 s) or the deadline.
    const chain = await clientOf(200);
    const prepared = await beforeDeadline(chain.prepare([referenceMemoIx('tx_silent')]).catch((error: ServiceError) => error), 10_000);
    assert.ok(prepared instanceof Error && (prepared as ServiceError).code === 'service_unavailable'
      && /getLatestBlockhash within 200 ms/.test(prepared.message), String(prepared));
    const height = await beforeDeadline(chain.getBlockHeight().catch((error: ServiceError) => error), 10_000);
    assert.equal((height as ServiceError | null)?.code, 'service_unavailable');
    // The poll asking for its status hangs for its call timeout (60 s here): the wait for the
    // outcome ends at its own deadline (50 ms) all the same, not after the poll.
    const waiting = await clientOf(60_000);
    const signature = (await generateKeyPairSigner()).address as never;
    const waited = await beforeDeadline(waiting.waitForOutcome(signature, 50).catch((error: unknown) => error), 10_000);
    assert.ok(waited instanceof ConfirmationTimeoutError, String(waited));
  });
});
