/**
 * The escrows.close job through HTTP, on the real database and the embedded validator: a settled
 * escrow's two chain accounts are closed and their rent is the operator key's again; an open one
 * is left alone; nothing is sent twice, by a second run, a second process or after a crash; a
 * program that does not know the instruction stops the job trying, once per escrow.
 */
import assert from 'node:assert/strict';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import { address, type Address, type Signature } from '@solana/kit';
import { startTestService, type TestService } from '../../test/harness.ts';
import { holdFirstRead } from '../../test/closing.ts';
import { fundedWallet, type FundedWallet } from '../../test/fixtures.ts';
import * as program from '../chain/program.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';
import { closeSettledEscrows, ESCROW_CLOSE_LIMITS } from './close.ts';
import { tickEscrows } from './escrows.ts';
import { sha256Of } from './proofs.ts';

const OUTPUT = 'the finished report\n';
const OUTPUT_HASH = sha256Of(OUTPUT);
/** Rows for an assertion's message (their block heights are bigints). */
const show = (value: unknown) => JSON.stringify(value, (_key, each: unknown) => (typeof each === 'bigint' ? String(each) : each));
/** The most a transaction may be on the wire. */
const TRANSACTION_BYTES_MAX = 1_232;

interface CloseRow {
  id: string;
  chain_closed_at: Date | null;
  chain_close_signature: string | null;
  chain_close_valid_height: bigint | null;
  chain_close_refused: string | null;
}

describe('escrows.close', () => {
  let t: TestService;
  let server: Server;
  let outputUrl: string;
  before(async () => {
    t = await startTestService({ env: { AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'on' } });
    server = createServer((_request, response) => response.end(OUTPUT));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    outputUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}/report`;
  });
  after(async () => {
    server.close();
    await t.close();
  });

  const ok = (response: { status: number; body: unknown }) => {
    assert.equal(response.status, 200, JSON.stringify(response.body));
    return response.body as Record<string, any>;
  };
  const open = async (from: FundedWallet, to: FundedWallet, extra: Record<string, unknown> = {}) => ok(await t.request('POST', '/v1/payments/a2a', {
    body: { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '4', currency: 'USDC', taskDescription: 'Summarise the filings', ...extra },
  }));
  const advance = (seconds: number) => t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } });

  /** Escrows settled each way the service settles them: released on a proof, refunded at its timeout, split by the arbiter. */
  async function settledEscrows(from: FundedWallet, to: FundedWallet): Promise<Record<'released' | 'refunded' | 'resolved', string>> {
    const toRelease = await open(from, to, { expectedOutputHash: OUTPUT_HASH });
    const released = ok(await t.request('POST', `/v1/payments/a2a/${toRelease.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl },
    }));
    assert.equal(released.status, 'released');

    const toResolve = await open(from, to);
    ok(await t.request('POST', `/v1/payments/a2a/${toResolve.escrow_id}/dispute`, { body: { reason: 'half of it' } }));
    const resolved = ok(await t.request('POST', `/v1/payments/a2a/${toResolve.escrow_id}/resolve`, {
      key: await t.createKey('arbiter'), body: { decision: 'split', toReceiver: '1.25', toSender: '2.75' },
    }));
    assert.equal(resolved.status, 'resolved');

    const toRefund = await open(from, to, { timeoutSeconds: 60 });
    assert.equal((await advance(61)).status, 200);
    // The escrows.tick job alone: a run of every job would close what it refunds at once.
    await tickEscrows(t.service.ctx);
    assert.equal((await t.request('GET', `/v1/payments/a2a/${toRefund.escrow_id}`)).body.status, 'refunded');
    return { released: toRelease.escrow_id, refunded: toRefund.escrow_id, resolved: toResolve.escrow_id };
  }

  const accountsOf = (escrowId: string) => t.service.ctx.chain.escrowAddresses(escrowId);
  const lamportsOf = async (account: Address) => (await t.service.ctx.chain.rpc.getBalance(account, { commitment: 'confirmed' }).send()).value;
  const operatorLamports = () => lamportsOf(t.service.ctx.chain.operator.address);
  /** Both accounts' lamports: the rent the operator paid when the escrow was created. */
  const rentOf = async (escrowId: string) => {
    const { escrow, escrowToken } = await accountsOf(escrowId);
    return (await lamportsOf(escrow)) + (await lamportsOf(escrowToken));
  };
  const existing = async (escrowId: string) => {
    const { escrow, escrowToken } = await accountsOf(escrowId);
    const { chain } = t.service.ctx;
    return [(await chain.getAccountData(escrow)) !== null, (await chain.getAccountData(escrowToken)) !== null];
  };
  const closeRows = (ids: readonly string[]) => t.service.ctx.db.query<CloseRow>(
    `SELECT id, chain_closed_at, chain_close_signature, chain_close_valid_height, chain_close_refused FROM escrows
     WHERE id = ANY($1::text[]) ORDER BY id`, [ids]);
  const transactionCount = async () => (await t.service.ctx.db.query<{ count: string }>('SELECT count(*)::text AS count FROM transactions'))[0]!.count;
  const feeOf = async (signature: string) => {
    const sent = await t.service.ctx.chain.rpc.getTransaction(signature as Signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
    return sent!.meta!.fee;
  };
  /** Every settled escrow of earlier tests closed, so that a test's runs see only its own. */
  const drain = async () => {
    for (let i = 0; i < 10 && (await closeSettledEscrows(t.service.ctx)).closed > 0; i += 1);
  };
  /** A test's own escrows, settled each way, between two new vaults; every earlier one closed first. */
  const freshSettled = async () => {
    await drain();
    const from = await fundedWallet(t, '20');
    const to = await fundedWallet(t, '1');
    return { from, to, escrows: await settledEscrows(from, to) };
  };

  // The guarantee: the rent of a settled escrow's accounts goes back to the operator key, to the
  // lamport (less the closing transaction's fee), and an escrow still holding money is never touched.
  test('released, refunded and resolved escrows: after the job both accounts are gone and the operator has their rent back; a locked one is left alone; a second run does nothing', async () => {
    const { from, to, escrows: settled } = await freshSettled();
    const locked = await open(from, to, { timeoutSeconds: 30 * 24 * 3600 });
    const ids = Object.values(settled);
    const rent = (await Promise.all(ids.map(rentOf))).reduce((sum, each) => sum + each, 0n);
    const lockedRent = await rentOf(locked.escrow_id);
    const views = await Promise.all([...ids, locked.escrow_id].map(async (id) => (await t.request('GET', `/v1/payments/a2a/${id}`)).body));
    const transactionsBefore = await transactionCount();
    const operatorBefore = await operatorLamports();

    await t.service.jobs.runOnce();

    for (const id of ids) assert.deepEqual(await existing(id), [false, false], `${id}: both accounts closed`);
    const rows = await closeRows(ids);
    assert.ok(rows.every((row) => row.chain_closed_at !== null && row.chain_close_refused === null), show(rows));
    const signatures = [...new Set(rows.map((row) => row.chain_close_signature!))];
    assert.equal(signatures.length, 1, 'the three closed by one transaction');
    const fee = await feeOf(signatures[0]!);
    assert.equal(await operatorLamports(), operatorBefore + rent - fee, 'the operator has both accounts\' lamports of each back, less the fee');

    assert.deepEqual(await existing(locked.escrow_id), [true, true], 'the locked escrow keeps its accounts');
    assert.equal(await rentOf(locked.escrow_id), lockedRent);
    assert.equal(await t.service.ctx.chain.getUsdcBalance(address(locked.chain_address)), 4_000_000n);
    assert.deepEqual((await closeRows([locked.escrow_id]))[0], {
      id: locked.escrow_id, chain_closed_at: null, chain_close_signature: null, chain_close_valid_height: null, chain_close_refused: null,
    });
    const viewsAfter = await Promise.all([...ids, locked.escrow_id].map(async (id) => (await t.request('GET', `/v1/payments/a2a/${id}`)).body));
    assert.deepEqual(viewsAfter, views, 'the escrows read as before');
    assert.equal(await transactionCount(), transactionsBefore, 'no transaction row');

    await t.service.jobs.runOnce();
    assert.equal(await operatorLamports(), operatorBefore + rent - fee, 'a second run sends nothing');
    assert.deepEqual(await closeRows(ids), rows);
    assert.deepEqual(await closeSettledEscrows(t.service.ctx), { closed: 0, refused: 0 });
  });

  /** Each escrow's accounts are gone, closed by the recorded transaction, and no close of it failed on chain (none was sent twice). */
  async function closedOnce(ids: readonly string[]): Promise<void> {
    for (const id of ids) {
      assert.deepEqual(await existing(id), [false, false]);
      const { escrow } = await accountsOf(id);
      const sent = await t.service.ctx.chain.rpc.getSignaturesForAddress(escrow).send();
      assert.deepEqual(sent.filter((each) => each.err !== null), [], 'no close refused on chain: none was sent twice');
      const [row] = await closeRows([id]);
      assert.ok(sent.some((each) => each.signature === row!.chain_close_signature), 'the recorded close is the one on chain');
    }
  }

  // The guarantee: several processes running the job never send the same close (the second would
  // fail on chain, a fee for nothing): an escrow a run has claimed is not another run's.
  test('two runs at once, the first still between its claim and its close: the second takes none of its escrows, nothing is sent twice', async () => {
    const ids = Object.values((await freshSettled()).escrows);
    const hold = holdFirstRead(t.service.ctx.chain);
    try {
      const first = closeSettledEscrows(t.service.ctx);
      await hold.firstReached;
      const second = await closeSettledEscrows(t.service.ctx);
      hold.release();
      assert.deepEqual([second, await first], [{ closed: 0, refused: 0 }, { closed: ids.length, refused: 0 }]);
    } finally {
      hold.restore();
    }
    await closedOnce(ids);
  });

  // The guarantee: a run stalled past its claim (a process paused, a slow chain) sends nothing
  // once another run has taken its escrows over; the one that took them closes them.
  test('a run whose claim lapsed while it was held sends nothing; the run that took its escrows over closes them', async () => {
    const ids = Object.values((await freshSettled()).escrows);
    const hold = holdFirstRead(t.service.ctx.chain);
    try {
      const stalled = closeSettledEscrows(t.service.ctx);
      await hold.firstReached;
      assert.equal((await advance(ESCROW_CLOSE_LIMITS.claimMs / 1000 + 1)).status, 200);
      const takeover = await closeSettledEscrows(t.service.ctx);
      // Whichever recorded them (the stalled run may find them gone), each once.
      const runs = [takeover, await stalled];
      assert.deepEqual([runs[0]!.closed + runs[1]!.closed, runs[0]!.refused + runs[1]!.refused], [ids.length, 0]);
    } finally {
      hold.restore();
    }
    await closedOnce(ids);
  });

  // The guarantee: after a crash, an escrow whose close landed is recorded closed without another
  // transaction; one whose close was noted but never sent is sent again only once that close can
  // no longer land.
  test('after a crash: an account already gone counts as closed; a close noted and not sent is sent again only once it can no longer land', async () => {
    const { released, refunded, resolved } = (await freshSettled()).escrows;
    const { chain, db } = t.service.ctx;

    // Closed on chain by a run that died before recording it.
    const landed = await chain.execute([await chain.escrowCloseIx(released)]);
    assert.equal(landed.err, null);
    // The others' closes noted, never sent: the process died in between.
    const submit = chain.submit;
    chain.submit = async () => { throw new Error('the process died'); };
    try {
      await closeSettledEscrows(t.service.ctx);
    } finally {
      chain.submit = submit;
    }
    const [gone] = await closeRows([released]);
    assert.ok(gone!.chain_closed_at !== null && gone!.chain_close_signature === null, 'recorded closed, no close of its own sent');
    const noted = await closeRows([refunded, resolved]);
    assert.ok(noted.every((row) => row.chain_close_signature !== null && row.chain_closed_at === null), show(noted));
    for (const id of [refunded, resolved]) assert.deepEqual(await existing(id), [true, true]);

    const operatorBefore = await operatorLamports();
    const rent = (await rentOf(refunded)) + (await rentOf(resolved));
    assert.deepEqual(await closeSettledEscrows(t.service.ctx), { closed: 0, refused: 0 });
    assert.deepEqual(await closeRows([refunded, resolved]), noted, 'the noted closes can still land: nothing sent');
    assert.equal(await operatorLamports(), operatorBefore, 'no transaction');

    // Their blockhash's life made over at once (as its minute would be), past the reconciler's margin.
    const over = (await chain.getBlockHeight()) - EXPIRY_MARGIN_BLOCKS - 1n;
    await db.query('UPDATE escrows SET chain_close_valid_height = $2 WHERE id = ANY($1::text[])', [[refunded, resolved], over]);
    assert.deepEqual(await closeSettledEscrows(t.service.ctx), { closed: 2, refused: 0 });
    const closed = await closeRows([refunded, resolved]);
    for (const [i, row] of closed.entries()) assert.notEqual(row.chain_close_signature, noted[i]!.chain_close_signature, 'a new close');
    for (const id of [refunded, resolved]) assert.deepEqual(await existing(id), [false, false]);
    const fees = (await Promise.all([...new Set(closed.map((row) => row.chain_close_signature!))].map(feeOf))).reduce((sum, fee) => sum + fee, 0n);
    assert.equal(await operatorLamports(), operatorBefore + rent - fees);
  });

  // The guarantee: an account seen gone is not taken for a close that landed while the escrow's
  // own noted close has no known outcome: a local validator shows accounts before it has saved the
  // slot that changed them, and a close lost with that slot would leave the rent on chain for ever.
  test('an account gone while the noted close has no outcome yet is recorded closed only once that close is known or can no longer land', async () => {
    const { released } = (await freshSettled()).escrows;
    const { chain, db } = t.service.ctx;
    // The account closed on chain; the row notes a close whose outcome the chain cannot tell yet
    // (here, one never sent), still able to land, and the claim free for a run to take.
    assert.equal((await chain.execute([await chain.escrowCloseIx(released)])).err, null);
    const unknown = (await chain.prepare([await chain.escrowCloseIx(released)])).signature;
    await db.query(
      `UPDATE escrows SET chain_closed_at = NULL, chain_close_signature = $2, chain_close_valid_height = $3, chain_close_claimed_until = NULL
       WHERE id = $1`, [released, unknown, (await chain.getBlockHeight()) + 100n]);
    await closeSettledEscrows(t.service.ctx); // the other two escrows are closed; this one waits
    assert.equal((await closeRows([released]))[0]!.chain_closed_at, null, 'not recorded while its close may still be lost or land');
    // Past its blockhash's life (and the margin): the account gone is the escrow's closed state.
    await db.query('UPDATE escrows SET chain_close_valid_height = $2 WHERE id = $1',
      [released, (await chain.getBlockHeight()) - EXPIRY_MARGIN_BLOCKS - 1n]);
    assert.deepEqual(await closeSettledEscrows(t.service.ctx), { closed: 1, refused: 0 });
    assert.notEqual((await closeRows([released]))[0]!.chain_closed_at, null);
  });

  // The guarantee: a program that refuses the close for good (one deployed before EscrowClose: a
  // local validator keeps the program its data dir was created with) costs one attempt per escrow,
  // logged once, and the job stops trying for it.
  test('a program that does not know the instruction: the close is recorded as not possible, logged once per escrow, never sent again', async () => {
    const ids = Object.values((await freshSettled()).escrows);
    const { chain, log } = t.service.ctx;
    // The first tag the program does not know (none of Tag's), as an older program does not know EscrowClose's.
    const escrowCloseIx = chain.escrowCloseIx;
    chain.escrowCloseIx = async (escrowId) => ({
      ...await escrowCloseIx.call(chain, escrowId), data: new Uint8Array([Math.max(...Object.values(program.Tag)) + 1]),
    });
    const warn = log.warn;
    const warned: string[] = [];
    log.warn = ((data: { escrowId?: string }, message: string) => { warned.push(`${data.escrowId}: ${message}`); }) as typeof log.warn;
    try {
      await t.service.jobs.runOnce();
      const rows = await closeRows(ids);
      assert.deepEqual(rows.map((row) => [row.chain_closed_at, row.chain_close_refused]), ids.map(() => [null, 'InvalidInstruction']));
      for (const id of ids) {
        assert.deepEqual(await existing(id), [true, true], 'the accounts stay');
        assert.equal(warned.filter((line) => line.startsWith(`${id}: the deployed program does not know EscrowClose`)).length, 1, warned.join('\n'));
      }
      const operatorBefore = await operatorLamports();
      const logged = warned.length;
      await t.service.jobs.runOnce();
      assert.deepEqual(await closeSettledEscrows(t.service.ctx), { closed: 0, refused: 0 });
      assert.equal(await operatorLamports(), operatorBefore, 'not sent again');
      assert.equal(warned.length, logged, 'not logged again');
      assert.deepEqual(await closeRows(ids), rows);
    } finally {
      chain.escrowCloseIx = escrowCloseIx;
      log.warn = warn;
    }
  });

  test('a transaction of the most closes a run puts in one fits the chain\'s limit', async () => {
    const { chain } = t.service.ctx;
    const closes = await Promise.all(Array.from({ length: ESCROW_CLOSE_LIMITS.perTransactionMax }, (_, i) => chain.escrowCloseIx(`esc_fits_${i}`)));
    const prepared = await chain.prepare(closes);
    assert.ok(Buffer.from(prepared.wire, 'base64').length <= TRANSACTION_BYTES_MAX);
  });
});
