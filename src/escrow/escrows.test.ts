/**
 * Agent-to-agent escrow through HTTP, on the real database and the embedded validator: every
 * transition of SPEC.md's state table, each proof type verified (forged proofs change nothing),
 * timeouts on the service clock, disputes and arbitration, concurrency, and money conserved with
 * the index equal to the chain.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import { address, type Signature } from '@solana/kit';
import { beforeDeadline } from '../../test/deadline.ts';
import { startTestService, type TestService } from '../../test/harness.ts';
import { balanceOf, fundedWallet, newPolicy, newRecipient, unique, type FundedWallet } from '../../test/fixtures.ts';
import { holdLocks, queuedBehind, queuedRequest, secondConnection, withSecondConnection } from '../../test/locks.ts';
import { processClient, sameBlockhash } from '../../test/chain-processes.ts';
import { canonicalJson } from '../http/idempotency.ts';
import { EXPIRY_MARGIN_BLOCKS, reconcilePending } from '../transactions/settlement.ts';
import { signCallbackProof } from '../verifiers/verifiers.ts';
import { newSessionAuthority, signWithSessionToken } from '../wallets/session-token.ts';
import { JOBS } from '../workers/jobs.ts';
import { startJobs } from '../workers/runner.ts';
import { prepareEscrowMove } from './escrows.ts';
import { OUTPUT_FETCHES_MAX, OUTPUT_FETCHES_PER_ORG_MAX, encodeAttestation, sha256Of } from './proofs.ts';

const OUTPUT = 'the finished report\n';
const OUTPUT_HASH = sha256Of(OUTPUT);

describe('escrow', () => {
  let t: TestService;
  let server: Server;
  let outputUrl: string;
  /** answers the outputs held back at /slow */
  const slowResponses: Array<() => void> = [];
  const SLOW_OUTPUT = 'a slow output';
  before(async () => {
    t = await startTestService({ env: { AGENT_VAULT_ALLOW_PRIVATE_WEBHOOKS: 'on' } });
    server = createServer((request, response) => {
      if (request.url === '/slow') slowResponses.push(() => response.end(SLOW_OUTPUT));
      else response.end(request.url === '/report' ? OUTPUT : 'something else');
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    outputUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  after(async () => {
    server.close();
    await t.close();
  });

  const open = (from: FundedWallet, to: string, extra: Record<string, unknown> = {}, key?: string) =>
    t.request('POST', '/v1/payments/a2a', {
      ...(key ? { key } : {}),
      body: { fromWallet: from.wallet_id, toWallet: to, amount: '4', currency: 'USDC', taskDescription: 'Summarise the filings', ...extra },
    });
  /** Resolves once `n` fetches of /slow are held, waiting for their answer. */
  const slowFetches = async (n: number) => {
    for (let i = 0; i < 500 && slowResponses.length < n; i += 1) await new Promise((resolve) => setTimeout(resolve, 10));
    assert.equal(slowResponses.length, n, `${n} outputs are being fetched`);
  };
  const escrowOf = async (id: string) => (await t.request('GET', `/v1/payments/a2a/${id}`)).body;
  const chainBalance = (owner: string) => t.service.ctx.chain.getUsdcBalance(address(owner));
  const tick = () => t.service.jobs.runOnce();
  /**
   * `request` with the chain transaction it sends reaching the chain after the escrow's expiry
   * (the clock moved 120 s on just before it is sent): the program refuses it.
   */
  const landingAfterExpiry = async <T>(request: () => Promise<T>): Promise<T> => {
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    chain.submit = async (...args: Parameters<typeof submit>) => {
      chain.submit = submit;
      await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 120 } });
      return submit.apply(chain, args);
    };
    try {
      return await request();
    } finally {
      chain.submit = submit;
    }
  };

  /** reserve + Σ vaults + Σ escrows still holding money = Σ deposits − Σ paid out of the organisation. */
  async function assertConserved(): Promise<void> {
    const { db } = t.service.ctx;
    const [row] = await db.query<{ reserve: bigint; vaults: bigint; escrowed: bigint; deposits: bigint; out: bigint }>(
      `SELECT (SELECT reserve_balance FROM organizations WHERE id = $1) AS reserve,
              (SELECT COALESCE(SUM(balance), 0) FROM wallets WHERE org_id = $1)::bigint AS vaults,
              (SELECT COALESCE(SUM(amount), 0) FROM escrows WHERE org_id = $1 AND status IN ('locked', 'completed', 'disputed'))::bigint AS escrowed,
              (SELECT COALESCE(SUM(amount), 0) FROM deposits WHERE org_id = $1)::bigint AS deposits,
              (SELECT COALESCE(SUM(amount), 0) FROM transactions WHERE org_id = $1 AND status IN ('confirmed', 'pending')
                 AND (type = 'payment' OR (type = 'escrow_release' AND escrow_id IN (
                   SELECT id FROM escrows WHERE org_id = $1 AND (receiver_org_id IS NULL OR receiver_org_id <> $1)))))::bigint AS out`,
      [t.orgId]);
    assert.equal(row!.reserve + row!.vaults + row!.escrowed, row!.deposits - row!.out, 'money is conserved');
  }

  test('create locks the amount in its own account at once; complete with a matching output releases it to the receiver', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '1');
    const askedAt = Date.parse((await t.request('GET', '/v1/test_helpers/clock')).body.now);
    const created = await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH, timeoutSeconds: 600 });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    assert.equal(created.body.status, 'locked');
    assert.equal(created.body.in_flight, null, 'confirmed on chain before answering');
    assert.equal(created.body.amount, '4.00');
    assert.equal(created.body.to_wallet, to.wallet_id);
    assert.equal(created.body.task_hash, sha256Of('Summarise the filings'));
    assert.notEqual(created.body.chain_address, from.chain_address);
    // Whole seconds on chain: never before its full timeout from the request, and less than a second after.
    const expiresAt = Date.parse(created.body.expires_at);
    assert.ok(expiresAt >= askedAt + 600_000, `${created.body.expires_at} is not before the timeout's end (${new Date(askedAt + 600_000).toISOString()})`);
    assert.ok(expiresAt < Date.parse(created.body.created_at) + 601_000, 'less than a second after it');
    assert.equal(await balanceOf(t, from.wallet_id), '6.00');
    assert.equal(await chainBalance(created.body.chain_address), 4_000_000n, 'the escrow account holds it on chain');
    const escrowState = await t.service.ctx.chain.getEscrow(address(created.body.chain_address));
    assert.equal(Buffer.from(escrowState!.taskHash).toString('hex'), created.body.task_hash.slice(7), 'task hash on chain');

    const completed = await t.request('POST', `/v1/payments/a2a/${created.body.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` },
    });
    assert.equal(completed.status, 200, JSON.stringify(completed.body));
    assert.equal(completed.body.status, 'released');
    assert.equal(completed.body.proof_type, 'output_hash');
    assert.equal(await balanceOf(t, to.wallet_id), '5.00');
    assert.equal(await chainBalance(to.chain_address), 5_000_000n);
    assert.equal(await chainBalance(created.body.chain_address), 0n);

    const types = async (walletId: string) => (await t.request('GET', `/v1/wallets/${walletId}/transactions`)).body.data
      .map((row: { type: string; status: string }) => `${row.type}:${row.status}`).sort();
    assert.deepEqual(await types(from.wallet_id), ['a2a_send:confirmed', 'escrow_lock:confirmed', 'escrow_release:confirmed', 'funding:confirmed']);
    assert.deepEqual(await types(to.wallet_id), ['a2a_receive:confirmed', 'funding:confirmed']);
    const events = await t.service.ctx.db.query<{ type: string; payload: Record<string, unknown> }>(
      `SELECT type, payload FROM events WHERE payload->>'escrow_id' = $1 ORDER BY created_at, id`, [created.body.escrow_id]);
    assert.deepEqual(events.map((e) => e.type), ['escrow.created', 'escrow.completed', 'escrow.released']);
    const released = events[2]!.payload;
    // The envelope's event, id and timestamp are added to the webhook body; the feed's details hold none of them.
    assert.deepEqual(Object.keys(released).sort(), ['amount', 'escrow_id', 'from_wallet', 'to_wallet', 'tx_signature']);
    assert.equal(released.amount, '4.00');
    // Both vaults of the organisation see the escrow in their feed: the one event of each move.
    const feedOf = async (walletId: string, limit: number) => {
      const seen: string[] = [];
      let cursor: string | null = null;
      do {
        const page: { body: { data: Array<{ type: string }>; next_cursor: string | null } } = await t.request('GET',
          `/v1/events?walletId=${walletId}&limit=${limit}${cursor ? `&cursor=${cursor}` : ''}`);
        seen.push(...page.body.data.map((e) => e.type));
        cursor = page.body.next_cursor;
      } while (cursor);
      return seen;
    };
    const escrowEvents = ['escrow.released', 'escrow.completed', 'escrow.created'];
    for (const wallet of [from, to]) {
      for (const limit of [1, 100]) {
        assert.deepEqual((await feedOf(wallet.wallet_id, limit)).filter((type) => type.startsWith('escrow.')), escrowEvents,
          `${wallet === from ? 'paying' : 'receiving'} vault's feed, pages of ${limit}`);
      }
    }
    const again = await t.request('POST', `/v1/payments/a2a/${created.body.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` },
    });
    assert.equal(again.status, 422);
    assert.equal(again.body.error.code, 'escrow_already_settled');
    await assertConserved();
  });

  test('a release the chain refuses (it landed after the expiry) leaves the escrow locked, with no completion on it', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '1');
    const created = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH, timeoutSeconds: 60 })).body;
    const completed = await landingAfterExpiry(() => t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` },
    }));
    assert.equal(completed.status, 200, JSON.stringify(completed.body));
    await t.settled();
    const escrow = await escrowOf(created.escrow_id);
    assert.equal(escrow.status, 'locked', JSON.stringify(escrow));
    assert.equal(escrow.completed_at, null);
    assert.equal(escrow.proof_type, null);
    assert.equal(await balanceOf(t, to.wallet_id), '1.00', 'nothing reached the receiver');
    assert.equal(await chainBalance(created.chain_address), 4_000_000n, 'the escrow account still holds it');
    // Told after escrow.completed, so that a party does not wait for a release that will not come.
    const feed = (await t.request('GET', `/v1/events?walletId=${from.wallet_id}&type=escrow.completed,escrow.release_failed`)).body.data;
    assert.deepEqual(feed.map((e: { type: string }) => e.type), ['escrow.release_failed', 'escrow.completed'], JSON.stringify(feed));
    const [failed] = feed;
    assert.equal(failed.severity, 'warning');
    assert.deepEqual([failed.details.escrow_id, failed.details.status, failed.details.amount], [created.escrow_id, 'locked', '4.00']);
    assert.ok(typeof failed.details.reason === 'string' && failed.details.reason.length > 0, 'the chain\'s reason');
  });

  test('a dispute the chain refuses (it landed after the expiry) is 422 escrow_expired, told in both vaults\' feeds', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '1');
    const created = (await open(from, to.wallet_id, { timeoutSeconds: 60 })).body;
    const disputed = await landingAfterExpiry(() =>
      t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: 'not delivered' } }));
    assert.equal(disputed.status, 422, JSON.stringify(disputed.body));
    assert.equal(disputed.body.error.code, 'escrow_expired');
    await t.settled();
    const escrow = await escrowOf(created.escrow_id);
    assert.deepEqual([escrow.status, escrow.dispute], ['locked', null], 'left for its timeout to refund');
    for (const wallet of [from, to]) {
      const feed = (await t.request('GET', `/v1/events?walletId=${wallet.wallet_id}&type=escrow.disputed,escrow.dispute_failed`)).body.data;
      assert.deepEqual(feed.map((e: { type: string }) => e.type), ['escrow.dispute_failed'], JSON.stringify(feed));
      assert.deepEqual([feed[0].severity, feed[0].details.reason, feed[0].details.status], ['warning', 'EscrowExpired', 'locked']);
    }
  });

  test('a vault that is a party to an open escrow cannot be archived: its refund or release would be stranded', async () => {
    const from = await fundedWallet(t, '4');
    const to = await fundedWallet(t, '1');
    assert.equal((await t.request('POST', `/v1/wallets/${to.wallet_id}/withdraw`, { body: { amount: 'all' } })).status, 200);
    const created = await open(from, to.wallet_id, { timeoutSeconds: 60 });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    assert.equal(await balanceOf(t, from.wallet_id), '0.00', 'everything is in the escrow');
    for (const party of [from, to]) {
      const refused = await t.request('DELETE', `/v1/wallets/${party.wallet_id}`);
      assert.equal(refused.status, 422, JSON.stringify(refused.body));
      assert.equal(refused.body.error.code, 'wallet_balance_not_zero');
      assert.match(refused.body.error.message, /escrow still open/);
      assert.notEqual((await t.request('GET', `/v1/wallets/${party.wallet_id}`)).body.status, 'archived');
    }
    // Refunded at its timeout, the money is back in the sender's vault, which can then be emptied and archived.
    assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } })).status, 200);
    await tick();
    assert.equal((await escrowOf(created.body.escrow_id)).status, 'refunded');
    assert.equal(await balanceOf(t, from.wallet_id), '4.00');
    assert.equal((await t.request('DELETE', `/v1/wallets/${to.wallet_id}`)).status, 200, 'the receiver, with nothing open, can go');
    assert.equal((await t.request('POST', `/v1/wallets/${from.wallet_id}/withdraw`, { body: { amount: 'all' } })).status, 200);
    assert.equal((await t.request('DELETE', `/v1/wallets/${from.wallet_id}`)).status, 200);
    await assertConserved();
  });

  // Guarantee: an escrow never opens to a vault archived while the escrow was being opened (its
  // refund could go back, but its release would be stranded in a vault that answers only reads).
  test('a receiving vault archived while an escrow to it waits for the payer\'s lock: the escrow is refused', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const from = await fundedWallet(t, '10');
      const to = await fundedWallet(t, '1');
      assert.ok(from.wallet_id < to.wallet_id, 'the receiving vault comes after the payer in id order: it is locked second');
      assert.equal((await t.request('POST', `/v1/wallets/${to.wallet_id}/withdraw`, { body: { amount: 'all' } })).status, 200);
      const payer = await holdLocks(other, (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [from.wallet_id]));
      const refused = await queuedRequest(t.service.ctx.db, payer, () => open(from, to.wallet_id), async () => {
        const archived = await t.request('DELETE', `/v1/wallets/${to.wallet_id}`);
        assert.equal(archived.status, 200, JSON.stringify(archived.body));
      });
      assert.equal(refused.status, 422, JSON.stringify(refused.body));
      assert.equal(refused.body.error.code, 'wallet_archived');
      const [{ n }] = await t.service.ctx.db.query<{ n: number }>(
        'SELECT count(*)::int AS n FROM escrows WHERE to_wallet_id = $1', [to.wallet_id]) as [{ n: number }];
      assert.equal(n, 0, 'no escrow to the archived vault');
      assert.equal(await balanceOf(t, from.wallet_id), '10.00', 'nothing locked');
      await assertConserved();
    });
  });

  test('a session token rotated while its escrow waits for the vault\'s lock: the escrow is refused, nothing locked', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const from = await fundedWallet(t, '10');
      const to = await fundedWallet(t, '1');
      const agentKey = await t.createKey('agent');
      const token = (await t.request('POST', `/v1/wallets/${from.wallet_id}/rotate-token`, { body: {} })).body.session_token;
      // The rotation's own statement, held uncommitted: the request's read still sees the old key.
      const rotation = await holdLocks(other, (tx) => tx.query(
        'UPDATE wallets SET session_public_key = $2 WHERE id = $1', [from.wallet_id, newSessionAuthority().publicKey]));
      const refused = await queuedRequest(t.service.ctx.db, rotation, () => t.request('POST', '/v1/payments/a2a', {
        key: agentKey, headers: { 'session-token': token },
        body: { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '4', currency: 'USDC', taskDescription: 'a task' },
      }));
      assert.equal(refused.status, 403, JSON.stringify(refused.body));
      assert.equal(refused.body.error.code, 'session_token_invalid');
      assert.equal(await balanceOf(t, from.wallet_id), '10.00', 'nothing locked');
      await assertConserved();
    });
  });

  test('an agent without a party vault\'s token is told to send one of the escrow\'s vaults, not "this wallet"', async () => {
    const from = await fundedWallet(t, '2');
    const to = await fundedWallet(t, '0.5');
    const outsider = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id, { amount: '1' })).body;
    const agent = await t.createKey('agent');
    const outsiderToken = (await t.request('POST', `/v1/wallets/${outsider.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    for (const headers of [{}, { 'session-token': outsiderToken }] as Array<Record<string, string>>) {
      for (const [method, path] of [['GET', ''], ['POST', '/dispute']] as const) {
        const refused = await t.request(method, `/v1/payments/a2a/${created.escrow_id}${path}`, {
          key: agent, headers, ...(method === 'POST' ? { body: { reason: 'not done' } } : {}),
        });
        assert.deepEqual([refused.status, refused.body.error?.code, refused.body.error?.message],
          [403, 'session_token_invalid', 'Send the Session-Token of a vault taking part in this escrow.'], `${method} ${path} ${JSON.stringify(headers)}`);
      }
    }
    assert.equal((await escrowOf(created.escrow_id)).status, 'locked', 'nothing done');
  });

  test('a provider agent lists the escrows its vault is offered, with that vault\'s token; no other vault\'s', async () => {
    const from = await fundedWallet(t, '3');
    const to = await fundedWallet(t, '0.5');
    const other = await fundedWallet(t, '0.5');
    const offered = (await open(from, to.wallet_id, { amount: '1' })).body;
    await open(from, other.wallet_id, { amount: '1' });
    const agent = await t.createKey('agent');
    const token = (await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    const listed = await t.request('GET', `/v1/payments/a2a?walletId=${to.wallet_id}&status=locked`, { key: agent, headers: { 'session-token': token } });
    assert.equal(listed.status, 200, JSON.stringify(listed.body));
    assert.deepEqual(listed.body.data.map((e: { escrow_id: string }) => e.escrow_id), [offered.escrow_id], 'its own vault\'s offer, not the other vault\'s');
    const all = await t.request('GET', '/v1/payments/a2a', { key: agent, headers: { 'session-token': token } });
    assert.deepEqual([all.status, all.body.error?.code, all.body.error?.param], [400, 'invalid_request', 'wallet_id'], 'not the organisation\'s list');
    const another = await t.request('GET', `/v1/payments/a2a?walletId=${other.wallet_id}`, { key: agent, headers: { 'session-token': token } });
    assert.deepEqual([another.status, another.body.error?.code], [403, 'session_token_invalid'], 'not another vault\'s');
    const viewer = await t.request('GET', `/v1/payments/a2a?walletId=${to.wallet_id}`, { key: await t.createKey('viewer') });
    assert.equal(viewer.body.data.length, 1, 'other roles as before');
  });

  // Guarantee: rotating a vault's session token revokes it at once (DESIGN §7), also for an
  // agent's completion already past its authorisation: fetching its output takes seconds, and
  // the token it showed must still be the vault's when the release is recorded.
  test('a session token rotated while an agent\'s completion fetches its output: refused, the escrow stays locked, nothing released', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id)).body;
    assert.equal(created.status, 'locked', JSON.stringify(created));
    const agent = await t.createKey('agent');
    const token = (await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    const completing = t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
      key: agent, headers: { 'session-token': token },
      body: { proofType: 'output_hash', proof: sha256Of(SLOW_OUTPUT), outputUrl: `${outputUrl}/slow` },
    });
    await slowFetches(1); // authorised with the token; its output is being fetched
    assert.equal((await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).status, 200);
    slowResponses.shift()!();
    const refused = await completing;
    assert.equal(refused.status, 403, JSON.stringify(refused.body));
    assert.equal(refused.body.error.code, 'session_token_invalid');
    const escrow = await escrowOf(created.escrow_id);
    assert.equal(escrow.status, 'locked', JSON.stringify(escrow));
    assert.equal(escrow.in_flight, null, 'no release in flight');
    assert.equal(escrow.completed_at, null);
    assert.equal(await balanceOf(t, to.wallet_id), '0.50', 'nothing reached the receiver');
    assert.equal(await chainBalance(created.chain_address), 4_000_000n, 'the escrow account still holds it on chain');
    const [{ n }] = await t.service.ctx.db.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM transactions WHERE escrow_id = $1 AND type IN ('escrow_release', 'a2a_receive')`,
      [created.escrow_id]) as [{ n: number }];
    assert.equal(n, 0, 'no release recorded');
    await assertConserved();
  });

  // Guarantee: an API key revoked while its completion fetches the output releases nothing, as a
  // revoked key pays nothing (docs/api-keys.md).
  test('an API key revoked while its completion fetches the output: 401, the escrow stays locked', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id)).body;
    const operator = await t.request('POST', '/v1/api-keys', { body: { name: unique('completer'), role: 'operator' } });
    assert.equal(operator.status, 200, JSON.stringify(operator.body));
    const completing = t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
      key: operator.body.key, body: { proofType: 'output_hash', proof: sha256Of(SLOW_OUTPUT), outputUrl: `${outputUrl}/slow` },
    });
    await slowFetches(1);
    assert.equal((await t.request('DELETE', `/v1/api-keys/${operator.body.api_key_id}`)).status, 200);
    slowResponses.shift()!();
    const refused = await completing;
    assert.equal(refused.status, 401, JSON.stringify(refused.body));
    assert.equal(refused.body.error.code, 'authentication_failed');
    const escrow = await escrowOf(created.escrow_id);
    assert.deepEqual([escrow.status, escrow.in_flight, escrow.completed_at], ['locked', null, null]);
    assert.equal(await balanceOf(t, to.wallet_id), '0.50', 'nothing reached the receiver');
    await assertConserved();
  });

  // Guarantee: the same for a dispute. Its only step between the token's check and the record
  // is signing its chain transaction, so the token is taken back there: rotated (403), or its
  // session expired on the service clock (401), as a payment would answer.
  test('a session token rotated or expired while an agent\'s dispute is being signed: refused, the escrow stays locked', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const agent = await t.createKey('agent');
    const { chain } = t.service.ctx;
    const prepare = chain.prepare;
    const cases: Array<[string, (ttlSeconds: number) => Promise<void>, number, string]> = [
      ['rotated', async () => {
        assert.equal((await t.request('POST', `/v1/wallets/${from.wallet_id}/rotate-token`, { body: {} })).status, 200);
      }, 403, 'session_token_invalid'],
      ['expired', async (ttlSeconds) => {
        assert.equal((await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: ttlSeconds } })).status, 200);
      }, 401, 'session_token_expired'],
    ];
    for (const [name, takeBack, status, code] of cases) {
      const created = (await open(from, to.wallet_id)).body;
      const onChainBefore = (await chain.getEscrow(address(created.chain_address)))!.state;
      const ttlSeconds = 120;
      const token = (await t.request('POST', `/v1/wallets/${from.wallet_id}/rotate-token`, { body: { ttlSeconds } })).body.session_token;
      chain.prepare = async (...args: Parameters<typeof prepare>) => {
        chain.prepare = prepare;
        await takeBack(ttlSeconds);
        return prepare.apply(chain, args);
      };
      try {
        const refused = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, {
          key: agent, headers: { 'session-token': token }, body: { reason: 'not delivered' },
        });
        assert.equal(refused.status, status, `${name}: ${JSON.stringify(refused.body)}`);
        assert.equal(refused.body.error.code, code, name);
      } finally {
        chain.prepare = prepare;
      }
      const escrow = await escrowOf(created.escrow_id);
      assert.equal(escrow.status, 'locked', `${name}: ${JSON.stringify(escrow)}`);
      assert.equal(escrow.in_flight, null, name);
      assert.equal(escrow.dispute, null, name);
      assert.equal((await chain.getEscrow(address(created.chain_address)))!.state, onChainBefore, `${name}: not disputed on chain`);
    }
    await assertConserved();
  });

  // Guarantee: an escrow whose creation is still in flight is not "already settled": a client
  // told so would give up on an escrow about to be locked. It is told to retry, and the retry
  // goes through once the creation settled.
  test('complete or dispute while the escrow is still being created: 503 with Retry-After; once created, complete works', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    // The creation's transaction is held on its way to the chain: the escrow is recorded, its lock in flight.
    let reached!: () => void;
    const recorded = new Promise<void>((resolve) => { reached = resolve; });
    let letGo!: () => void;
    const gate = new Promise<void>((resolve) => { letGo = resolve; });
    chain.submit = async (...args: Parameters<typeof submit>) => {
      chain.submit = submit;
      reached();
      await gate;
      return submit.apply(chain, args);
    };
    let created;
    try {
      const creating = open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH, waitForConfirmation: false });
      await recorded;
      const [creatingView] = (await t.request('GET', `/v1/payments/a2a?walletId=${from.wallet_id}`)).body.data;
      assert.equal(creatingView.in_flight, 'create', JSON.stringify(creatingView));
      const moves: Array<[string, Record<string, unknown>]> = [
        ['complete', { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` }],
        ['dispute', { reason: 'too early' }],
      ];
      for (const [move, body] of moves) {
        const early = await t.request('POST', `/v1/payments/a2a/${creatingView.escrow_id}/${move}`, { body });
        assert.equal(early.status, 503, `${move}: ${JSON.stringify(early.body)}`);
        assert.equal(early.body.error.code, 'service_unavailable', move);
        assert.match(early.body.error.message, /still being created on chain: retry shortly/, move);
        assert.equal(early.headers['retry-after'], '1', `${move}: Retry-After`);
      }
      letGo();
      created = await creating;
    } finally {
      chain.submit = submit;
      letGo();
    }
    assert.equal(created.status, 200, JSON.stringify(created.body));
    await chain.waitForOutcome(created.body.lock_tx_signature, 20_000);
    // Listing the vault's transactions settles those whose outcome the chain has.
    assert.equal((await t.request('GET', `/v1/transactions?walletId=${from.wallet_id}&type=a2a_send`)).body.data[0].status, 'confirmed');
    await t.settled();
    const locked = await escrowOf(created.body.escrow_id);
    assert.deepEqual([locked.status, locked.in_flight, locked.dispute], ['locked', null, null], 'the early moves changed nothing');
    const completed = await t.request('POST', `/v1/payments/a2a/${created.body.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` },
    });
    assert.equal(completed.status, 200, JSON.stringify(completed.body));
    assert.equal(completed.body.status, 'released');
    await assertConserved();
  });

  test('forged or unverifiable proofs are invalid_proof and change nothing', async () => {
    const from = await fundedWallet(t, '20');
    const to = await fundedWallet(t, '0.5');
    const other = await fundedWallet(t, '0.5');
    const verifier = await t.request('POST', '/v1/verifiers', { body: { name: unique('verifier') } });
    assert.equal(verifier.status, 200, JSON.stringify(verifier.body));
    const withHash = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH })).body;
    const plain = (await open(from, to.wallet_id)).body;
    const verified = (await open(from, to.wallet_id, { verifierId: verifier.body.verifier_id })).body;
    const outside = (await open(await fundedWallet(t, '4'), await newRecipient())).body;
    assert.deepEqual([withHash.accepted_proofs, plain.accepted_proofs, verified.accepted_proofs, outside.accepted_proofs],
      [['output_hash'], ['output_hash', 'signed_attestation'], ['webhook_callback'], ['output_hash']],
      'each escrow says what completes it (an attestation needs a receiving vault of the service)');
    const token = (await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    const otherToken = (await t.request('POST', `/v1/wallets/${other.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    const nowS = Math.floor(t.service.ctx.clock.nowMs() / 1000);
    const attest = (escrow: { escrow_id: string; task_hash: string }, signer: string, extra = {}) =>
      encodeAttestation({ escrow_id: escrow.escrow_id, task_hash: escrow.task_hash, ...extra },
        (message) => signWithSessionToken(signer, message));

    const forged: Array<[string, Record<string, unknown>, RegExp, string?]> = [
      [withHash.escrow_id, { proofType: 'output_hash', proof: 'sha256:abc' }, /64 lowercase hex/],
      [withHash.escrow_id, { proofType: 'output_hash', proof: sha256Of('other output') }, /expectedOutputHash/],
      [plain.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH }, /needs outputUrl/, 'output_url'],
      // The receiver can read the expected hash in the escrow: sending it back proves nothing.
      [withHash.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH }, /needs outputUrl/, 'output_url'],
      [withHash.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/elsewhere` }, /bytes at outputUrl differs/],
      [plain.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/elsewhere` }, /bytes at outputUrl differs/],
      [plain.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: 'http://127.0.0.1:1/report' }, /could not be fetched/, 'output_url'],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: attest(plain, otherToken) }, /not signed by the receiving vault/],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: attest(withHash, token) }, /another escrow/],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: attest({ ...plain, task_hash: sha256Of('x') }, token) }, /another task/],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: `${attest(plain, token)}x` }, /not signed/],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: 'not-base64' }, /base64url payload/],
      [plain.escrow_id, { proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS, plain.escrow_id) }, /accepts output_hash or signed_attestation proofs/],
      // A check the requester chose cannot be stepped around: the receiver's own attestation of
      // the expected hash, or delivered bytes where a verifier was named, are not accepted.
      [withHash.escrow_id, { proofType: 'signed_attestation', proof: attest(withHash, token, { output_hash: OUTPUT_HASH }) }, /accepts output_hash proofs/],
      [verified.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` }, /accepts webhook_callback proofs/],
      [verified.escrow_id, { proofType: 'webhook_callback', proof: signCallbackProof('whsec_wrong', nowS, verified.escrow_id) }, /does not verify/],
      [verified.escrow_id, { proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS, plain.escrow_id) }, /does not verify/],
      [verified.escrow_id, { proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS - 3600, verified.escrow_id) }, /seconds away/],
    ];
    for (const [escrowId, body, message, param = 'proof'] of forged) {
      const response = await t.request('POST', `/v1/payments/a2a/${escrowId}/complete`, { body });
      assert.equal(response.status, 400, `${message}: ${JSON.stringify(response.body)}`);
      assert.equal(response.body.error.code, 'invalid_proof');
      assert.match(response.body.error.message, message);
      assert.equal(response.body.error.param, param, `${message}: the field to correct`);
    }
    for (const escrow of [withHash, plain, verified]) assert.equal((await escrowOf(escrow.escrow_id)).status, 'locked', 'unchanged');
    assert.equal(await balanceOf(t, to.wallet_id), '0.50');
    assert.equal(await balanceOf(t, from.wallet_id), '8.00', 'three escrows of 4.00 locked out of 20.00');

    const good: Array<[string, Record<string, unknown>]> = [
      [withHash.escrow_id, { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` }],
      [plain.escrow_id, { proofType: 'signed_attestation', proof: attest(plain, token, { output_hash: OUTPUT_HASH }) }],
      [verified.escrow_id, { proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS, verified.escrow_id) }],
    ];
    for (const [escrowId, body] of good) {
      const response = await t.request('POST', `/v1/payments/a2a/${escrowId}/complete`, { body });
      assert.equal(response.status, 200, JSON.stringify(response.body));
      assert.equal(response.body.status, 'released');
    }
    assert.equal(await balanceOf(t, to.wallet_id), '12.50');
    assert.equal((await escrowOf(withHash.escrow_id)).output_url, `${outputUrl}/report`, 'the requester sees where the output is');
    await assertConserved();
  });

  test('a verifier revoked while an escrow naming it is being signed: the escrow is refused, nothing is locked', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const late = await t.request('POST', '/v1/verifiers', { body: { name: unique('verifier') } });
    const { chain } = t.service.ctx;
    const prepare = chain.prepare;
    chain.prepare = async (...args: Parameters<typeof prepare>) => {
      chain.prepare = prepare;
      assert.equal((await t.request('DELETE', `/v1/verifiers/${late.body.verifier_id}`)).status, 200);
      return prepare.apply(chain, args);
    };
    const balanceBefore = await balanceOf(t, from.wallet_id);
    try {
      const refused = await open(from, to.wallet_id, { verifierId: late.body.verifier_id });
      assert.equal(refused.status, 400, JSON.stringify(refused.body));
      assert.equal(refused.body.error.code, 'invalid_request');
      assert.equal(refused.body.error.param, 'verifier_id');
      assert.match(refused.body.error.message, /revoked/);
    } finally {
      chain.prepare = prepare;
    }
    assert.equal(await balanceOf(t, from.wallet_id), balanceBefore);
  });

  // Guarantee: revoking a verifier, or rotating the receiving vault's session token, stops the
  // proofs they signed at once, even one already checked by a completion still on its way to
  // recording the release.
  test('a credential taken back while a completion it signed is in flight: the escrow is not released', async (context) => {
    const other = await secondConnection(t, context);
    if (!other) return;
    /** Completes with `body` while the escrow's row is held (after the proof's check, before the release), calling `takeBack` meanwhile. */
    const completeWhileHeld = async (escrowId: string, body: Record<string, unknown>, takeBack: () => Promise<void>) => {
      const held = await holdLocks(other, (tx) => tx.query('SELECT id FROM escrows WHERE id = $1 FOR UPDATE', [escrowId]));
      try {
        const completing = t.request('POST', `/v1/payments/a2a/${escrowId}/complete`, { body });
        await queuedBehind(t.service.ctx.db, held.pid, 1); // the completion's proof was checked; its release waits for the escrow
        await takeBack();
        held.release();
        await held.done;
        return await completing;
      } finally {
        held.release();
        await held.done.catch(() => {});
      }
    };
    try {
      const from = await fundedWallet(t, '10');
      const to = await fundedWallet(t, '0.5');
      const nowS = Math.floor(t.service.ctx.clock.nowMs() / 1000);

      const verifier = await t.request('POST', '/v1/verifiers', { body: { name: unique('verifier') } });
      assert.equal(verifier.status, 200, JSON.stringify(verifier.body));
      const verified = (await open(from, to.wallet_id, { verifierId: verifier.body.verifier_id })).body;
      const revoked = await completeWhileHeld(verified.escrow_id,
        { proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS, verified.escrow_id) },
        async () => { assert.equal((await t.request('DELETE', `/v1/verifiers/${verifier.body.verifier_id}`)).status, 200); });
      assert.equal(revoked.status, 400, JSON.stringify(revoked.body));
      assert.equal(revoked.body.error.code, 'invalid_proof');
      assert.match(revoked.body.error.message, /revoked/);

      const plain = (await open(from, to.wallet_id)).body;
      const token = (await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).body.session_token;
      const attestation = encodeAttestation({ escrow_id: plain.escrow_id, task_hash: plain.task_hash }, (message) => signWithSessionToken(token, message));
      const rotated = await completeWhileHeld(plain.escrow_id, { proofType: 'signed_attestation', proof: attestation },
        async () => { assert.equal((await t.request('POST', `/v1/wallets/${to.wallet_id}/rotate-token`, { body: {} })).status, 200); });
      assert.equal(rotated.status, 400, JSON.stringify(rotated.body));
      assert.equal(rotated.body.error.code, 'invalid_proof');
      assert.match(rotated.body.error.message, /current session authority/);

      for (const escrow of [verified, plain]) assert.equal((await escrowOf(escrow.escrow_id)).status, 'locked', 'unchanged');
      assert.equal(await balanceOf(t, to.wallet_id), '0.50');
    } finally {
      await other.close();
    }
  });

  // Guarantee: a completion never deadlocks with a payment batch (or a funding) that locks the
  // same two vaults, whichever of them comes first in id order.
  test('a completion and a batch locking both its vaults in id order do not deadlock', async (context) => {
    await withSecondConnection(t, context, async (other) => {
      const [first, second] = [await fundedWallet(t, '10'), await fundedWallet(t, '10')].sort((x, y) => (x.wallet_id < y.wallet_id ? -1 : 1)) as [FundedWallet, FundedWallet];
      const verifier = await t.request('POST', '/v1/verifiers', { body: { name: unique('verifier') } });
      const nowS = Math.floor(t.service.ctx.clock.nowMs() / 1000);
      const cases = [
        { name: 'sender first, attestation', from: first, to: second, proofOf: async (escrow: { escrow_id: string; task_hash: string }) => {
          const token = (await t.request('POST', `/v1/wallets/${second.wallet_id}/rotate-token`, { body: {} })).body.session_token;
          return { proofType: 'signed_attestation', proof: encodeAttestation({ escrow_id: escrow.escrow_id, task_hash: escrow.task_hash },
            (message) => signWithSessionToken(token, message)) };
        }, extra: {} },
        { name: 'receiver first, verifier', from: second, to: first, proofOf: async (escrow: { escrow_id: string }) =>
          ({ proofType: 'webhook_callback', proof: signCallbackProof(verifier.body.signing_secret, nowS, escrow.escrow_id) }),
        extra: { verifierId: verifier.body.verifier_id } },
      ];
      /** `request` while a payment batch of both vaults holds the first in id order, then (once it waits) takes the second too. */
      const beside = async (name: string, request: () => ReturnType<typeof t.request>): Promise<any> => {
        const batch = await holdLocks(other, (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [first.wallet_id]),
          (tx) => tx.query('SELECT id FROM wallets WHERE id = $1 FOR UPDATE', [second.wallet_id]));
        try {
          const requesting = request();
          await queuedBehind(t.service.ctx.db, batch.pid, 1);
          batch.release();
          const [batchOutcome, answered] = await Promise.allSettled([batch.done, requesting]);
          assert.equal(batchOutcome.status === 'rejected' ? String(batchOutcome.reason) : 'ok', 'ok', name);
          assert.equal(answered.status, 'fulfilled', name);
          const response = (answered as PromiseFulfilledResult<Awaited<typeof requesting>>).value;
          assert.equal(response.status, 200, `${name}: ${JSON.stringify(response.body)}`);
          return response.body;
        } finally {
          batch.release();
          await batch.done.catch(() => {});
        }
      };
      for (const { name, from, to, proofOf, extra } of cases) {
        const escrow = (await open(from, to.wallet_id, extra)).body;
        assert.equal(escrow.status, 'locked', `${name}: ${JSON.stringify(escrow)}`);
        const body = await proofOf(escrow);
        const completed = await beside(name, () => t.request('POST', `/v1/payments/a2a/${escrow.escrow_id}/complete`, { body }));
        assert.equal(completed.status, 'released', name);
      }
      // A dispute split by the arbiter, the receiver first: the payout writes a row for each vault.
      const disputed = (await open(second, first.wallet_id)).body;
      assert.equal((await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/dispute`, { body: { reason: 'half done' } })).status, 200);
      const arbiter = await t.createKey('arbiter');
      const split = await beside('resolved by a split, receiver first', () => t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/resolve`,
        { key: arbiter, body: { decision: 'split', toReceiver: '2', toSender: '2' } }));
      assert.equal(split.status, 'resolved');
      // An escrow opened by the later vault to the earlier one: its foreign key locks the receiver.
      const opened = await beside('opened, receiver first', () => open(second, first.wallet_id));
      assert.equal(opened.status, 'locked');
    });
  });

  test('a timeout refunds on the service clock; completing after it is escrow_expired; a settled escrow refuses everything', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id, { timeoutSeconds: 120, expectedOutputHash: OUTPUT_HASH })).body;
    assert.equal(await balanceOf(t, from.wallet_id), '6.00');
    await tick();
    assert.equal((await escrowOf(created.escrow_id)).status, 'locked', 'not before its time');
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 121 } });
    const late = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, { body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` } });
    assert.equal(late.status, 422);
    assert.equal(late.body.error.code, 'escrow_expired');
    const lateDispute = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: 'too late' } });
    assert.equal(lateDispute.body.error.code, 'escrow_expired');
    await tick();
    await tick();
    const refunded = await escrowOf(created.escrow_id);
    assert.equal(refunded.status, 'refunded');
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
    assert.equal(await chainBalance(from.chain_address), 10_000_000n);
    assert.equal(await chainBalance(created.chain_address), 0n);
    const events = await t.service.ctx.db.query<{ type: string; severity: string; payload: Record<string, unknown> }>(
      `SELECT type, severity, payload FROM events WHERE payload->>'escrow_id' = $1 AND type = 'escrow.refunded'`, [created.escrow_id]);
    assert.equal(events.length, 1);
    assert.equal(events[0]!.payload.reason, 'timeout');
    assert.equal(events[0]!.severity, 'info');
    for (const [path, body] of [
      ['complete', { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` }], ['dispute', { reason: 'x' }],
    ] as const) {
      const response = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/${path}`, { body });
      assert.equal(response.body.error.code, 'escrow_already_settled', path);
    }
    const arbiter = await t.createKey('arbiter');
    const resolve = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: arbiter, body: { decision: 'release' } });
    assert.equal(resolve.body.error.code, 'escrow_already_settled');
    const spending = (await t.request('GET', `/v1/wallets/${from.wallet_id}`)).body.spending;
    assert.equal(spending.day.spent, '0.00', 'a refunded escrow gives its budget back');
    await assertConserved();
  });

  test('a timeout refund the chain keeps refusing is sent again later and later, and other expired escrows are still refunded', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const stuck = (await open(from, to.wallet_id, { timeoutSeconds: 120, expectedOutputHash: OUTPUT_HASH })).body;
    const other = (await open(from, to.wallet_id, { timeoutSeconds: 120, expectedOutputHash: OUTPUT_HASH })).body;
    // The chain and the index disagree: the escrow's account was refunded on chain by the arbiter
    // key outside the service, so every refund the service sends is refused there.
    const chain = t.service.ctx.chain;
    const outside = await chain.execute([await chain.escrowRefundIx(stuck.escrow_id, address(from.chain_address), true)]);
    assert.equal(outside.err, null);
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 121 } });
    const refunds = async () => t.service.ctx.db.query<{ status: string }>(
      `SELECT status FROM transactions WHERE escrow_id = $1 AND type = 'escrow_refund' ORDER BY created_at`, [stuck.escrow_id]);
    await tick();
    assert.equal((await escrowOf(other.escrow_id)).status, 'refunded', 'the other expired escrow was refunded');
    assert.deepEqual((await refunds()).map((row) => row.status), ['failed'], 'sent once, refused');
    // Sent again 1 s, then 2 s, then 4 s after each refusal (docs/escrow.md), on the service clock.
    for (const [sent, waitS] of [[2, 1], [3, 2], [4, 4]] as const) {
      await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: waitS } });
      await tick();
      assert.equal((await refunds()).length, sent, `sent again ${waitS} s after the last refusal`);
    }
    // The next waits 8 s: not sent at a tick before that, sent at one after it.
    await tick();
    await tick();
    assert.equal((await refunds()).length, 4, 'not before its 8 s');
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 8 } });
    await tick();
    const all = await refunds();
    assert.deepEqual(all.map((row) => row.status), ['failed', 'failed', 'failed', 'failed', 'failed']);
    assert.equal((await escrowOf(stuck.escrow_id)).status, 'locked');
    const [row] = await t.service.ctx.db.query<{ refund_failures: number }>('SELECT refund_failures FROM escrows WHERE id = $1', [stuck.escrow_id]);
    assert.equal(row!.refund_failures, 5);
  });

  test('the service arbitrates: arbiter keys of the default organisation see and resolve disputes of any organisation; a party\'s own arbiter cannot', async () => {
    const tenant = await t.createOrganization('Disputing tenant');
    const from = await fundedWallet(t, '10', 'pol_permissive', tenant.adminKey);
    const to = await fundedWallet(t, '0.5', 'pol_permissive', tenant.adminKey);
    const disputed = (await open(from, to.wallet_id, {}, tenant.adminKey)).body;
    const untouched = (await open(from, to.wallet_id, { amount: '1' }, tenant.adminKey)).body;
    assert.equal((await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/dispute`, { key: tenant.adminKey, body: { reason: 'not delivered' } })).status, 200);
    const theirArbiter = await t.createKey('arbiter', tenant.orgId);
    const refused = await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/resolve`, { key: theirArbiter, body: { decision: 'refund' } });
    assert.equal(refused.status, 403, JSON.stringify(refused.body));
    assert.equal(refused.body.error.code, 'insufficient_permissions');
    assert.match(refused.body.error.message, /default organisation/);
    // Whatever the decision says: a key that may not decide learns nothing of its validity.
    for (const body of [{ decision: 'refund', toReceiver: '1' }, { decision: 'split' }, { decision: 'split', toReceiver: 'x', toSender: '1' }]) {
      const invalid = await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/resolve`, { key: theirArbiter, body });
      assert.deepEqual([invalid.status, invalid.body.error?.code], [403, 'insufficient_permissions'], JSON.stringify(body));
    }

    const serviceArbiter = await t.createKey('arbiter');
    assert.equal((await t.request('GET', `/v1/payments/a2a/${disputed.escrow_id}`, { key: serviceArbiter })).body.status, 'disputed');
    // Disputed too: an escrow paying a chain address outside the service (its receiver has no organisation).
    const outside = (await open(from, await newRecipient(), { amount: '0.5' }, tenant.adminKey)).body;
    assert.equal((await t.request('POST', `/v1/payments/a2a/${outside.escrow_id}/dispute`, { key: tenant.adminKey, body: { reason: 'not delivered' } })).status, 200);
    for (const query of ['?status=disputed&limit=100', '?limit=100']) {
      const listed = ((await t.request('GET', `/v1/payments/a2a${query}`, { key: serviceArbiter })).body.data as Array<{ escrow_id: string }>)
        .map((e) => e.escrow_id);
      assert.ok(listed.includes(disputed.escrow_id) && listed.includes(outside.escrow_id), `${query}: listed among the disputes to decide`);
      assert.ok(!listed.includes(untouched.escrow_id), `${query}: another organisation's escrow that is not disputed is not listed`);
    }
    const refundedOutside = await t.request('POST', `/v1/payments/a2a/${outside.escrow_id}/resolve`, { key: serviceArbiter, body: { decision: 'refund' } });
    assert.equal(refundedOutside.body.status, 'refunded', JSON.stringify(refundedOutside.body));
    assert.equal((await t.request('GET', `/v1/payments/a2a/${untouched.escrow_id}`, { key: serviceArbiter })).status, 404,
      'another organisation\'s escrow that is not disputed stays its own');
    assert.equal((await t.request('GET', `/v1/payments/a2a/${disputed.escrow_id}`)).status, 404, 'other roles of the service\'s organisation see nothing');
    const decided = await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/resolve`, { key: serviceArbiter, body: { decision: 'refund' } });
    assert.equal(decided.status, 200, JSON.stringify(decided.body));
    assert.equal(decided.body.status, 'refunded');
    // The decision sent again (its answer lost): told it is settled, not that the escrow is unknown.
    const again = await t.request('POST', `/v1/payments/a2a/${disputed.escrow_id}/resolve`, { key: serviceArbiter, body: { decision: 'refund' } });
    assert.deepEqual([again.status, again.body.error?.code], [422, 'escrow_already_settled'], JSON.stringify(again.body));
    assert.equal((await t.request('GET', `/v1/payments/a2a/${disputed.escrow_id}`, { key: serviceArbiter })).body.status, 'refunded');
    assert.equal(await balanceOf(t, from.wallet_id, tenant.adminKey), '9.00', 'the 4.00 came back; 1.00 is still locked');
    const events = (await t.request('GET', `/v1/events?type=escrow.refunded&limit=100`, { key: tenant.adminKey })).body.data as Array<{ details: { escrow_id: string } }>;
    assert.ok(events.some((e) => e.details.escrow_id === disputed.escrow_id), 'the tenant is told');
  });

  test('an arbiter\'s refund gives the day\'s budget back on chain as in the service: the policy\'s next payment lands', async () => {
    const policyId = await newPolicy(t, { maxPerDay: '10' });
    const from = await fundedWallet(t, '20', policyId);
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id, { amount: '8' })).body;
    assert.equal(created.status, 'locked', JSON.stringify(created));
    assert.equal((await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: 'not delivered' } })).status, 200);
    const refunded = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, {
      key: await t.createKey('arbiter'), body: { decision: 'refund' },
    });
    assert.equal(refunded.body.status, 'refunded', JSON.stringify(refunded.body));
    const vault = await t.service.ctx.chain.getVault(address(from.chain_address));
    assert.equal(vault!.daySpent, 0n, 'the chain gave the day its 8.00 back');
    const paid = await t.request('POST', '/v1/payments', {
      body: { walletId: from.wallet_id, to: await newRecipient(), amount: '5', currency: 'USDC' },
    });
    assert.equal(paid.status, 200, JSON.stringify(paid.body));
    assert.equal(paid.body.status, 'confirmed', 'allowed by the policy and by the program alike');
    await assertConserved();
  });

  test('a dispute hands the escrow to an arbiter: release, refund or split, written on chain', async () => {
    const from = await fundedWallet(t, '30');
    const to = await fundedWallet(t, '0.5');
    const arbiter = await t.createKey('arbiter');
    const operator = await t.createKey('operator');
    const cases: Array<[Record<string, string>, string, string, string]> = [
      [{ decision: 'release' }, 'released', '4.50', '26.00'],
      [{ decision: 'refund' }, 'refunded', '4.50', '26.00'],
      [{ decision: 'split', toReceiver: '1.25', toSender: '2.75' }, 'resolved', '5.75', '24.75'],
    ];
    for (const [decision, status, receiverBalance, senderBalance] of cases) {
      const created = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH })).body;
      // A reason of spaces gives the arbiter nothing to judge: refused, the escrow left locked.
      const blank = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: ' \n ' } });
      assert.deepEqual([blank.status, blank.body.error?.code, blank.body.error?.param], [400, 'invalid_request', 'reason'], JSON.stringify(blank.body));
      assert.equal(blank.body.error.message, 'Invalid value for "reason": must not be blank: say why, for the arbiter.');
      assert.equal((await escrowOf(created.escrow_id)).status, 'locked');
      const disputed = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, {
        body: { reason: 'The summary misses half the filings', evidence: sha256Of('screenshot') },
      });
      assert.equal(disputed.status, 200, JSON.stringify(disputed.body));
      assert.equal(disputed.body.status, 'disputed');
      assert.equal(disputed.body.dispute.reason, 'The summary misses half the filings');
      const onChain = await t.service.ctx.chain.getEscrow(address(created.chain_address));
      assert.equal(onChain!.state, 4, 'disputed on chain');
      const complete = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, { body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` } });
      assert.equal(complete.body.error.code, 'escrow_already_settled', 'a disputed escrow is not completed');
      assert.equal((await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: operator, body: decision })).status, 403,
        'only the arbiter role resolves');
      const bad = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, {
        key: arbiter, body: { decision: 'split', toReceiver: '1', toSender: '1' },
      });
      assert.equal(bad.body.error.code, 'invalid_amount', 'a split adds up to the escrow');
      const resolved = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: arbiter, body: decision });
      assert.equal(resolved.status, 200, JSON.stringify(resolved.body));
      assert.equal(resolved.body.status, status);
      assert.equal(resolved.body.resolution.decided_by.startsWith('key_'), true, 'the arbiter key decided');
      assert.equal(await balanceOf(t, to.wallet_id), receiverBalance, `${status}: receiver`);
      assert.equal(await balanceOf(t, from.wallet_id), senderBalance, `${status}: sender`);
      assert.equal(await chainBalance(to.chain_address), BigInt(Math.round(Number(receiverBalance) * 1e6)));
      assert.equal((await t.service.ctx.chain.getEscrow(address(created.chain_address)))!.state, status === 'refunded' ? 3 : 5,
        'refunded or resolved on chain');
      if (status === 'refunded') {
        const [event] = await t.service.ctx.db.query<{ severity: string }>(
          `SELECT severity FROM events WHERE payload->>'escrow_id' = $1 AND type = 'escrow.refunded'`, [created.escrow_id]);
        assert.equal(event!.severity, 'critical', 'a refund decided by dispute is critical');
      }
    }
    await assertConserved();
  });

  test('two processes attempting one escrow move with one blockhash make two transactions, not one the chain ran already', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id)).body;
    const { chain } = t.service.ctx;
    const [a, b] = [processClient(chain), processClient(chain)];
    await sameBlockhash(a, b);
    // A timeout refund the chain refused (its clock behind the service's), tried again by another
    // process: the same move, the same instructions, the same blockhash.
    const refund = await chain.escrowRefundIx(created.escrow_id, address(from.chain_address));
    const [first, retried] = await Promise.all([
      prepareEscrowMove(a, created.escrow_id, 'refund', [refund]), prepareEscrowMove(b, created.escrow_id, 'refund', [refund]),
    ]);
    assert.notEqual(first.signature, retried.signature, 'the retry is a transaction of its own');
  });

  test('a release lost before the chain kept it (a process that died) is sent again while it can land; the receiver is paid', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const created = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH })).body;
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    chain.submit = async () => { chain.submit = submit; }; // recorded and answered, never sent: the process died there
    const completed = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
      body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report`, waitForConfirmation: false },
    });
    chain.submit = submit;
    assert.deepEqual([completed.body.status, completed.body.in_flight], ['completed', 'release'], JSON.stringify(completed.body));
    const [row] = await t.service.ctx.db.query<{ closing_signature: string }>('SELECT closing_signature FROM escrows WHERE id = $1', [created.escrow_id]);
    await tick();
    assert.equal((await escrowOf(created.escrow_id)).in_flight, 'release', 'not sent again at once: the request may still be sending it');
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 3 } });
    await tick(); // sent again (and, as may happen, settled in the same run)
    await chain.waitForOutcome(row!.closing_signature as Signature, 10_000);
    await reconcilePending(t.service.ctx, 0);
    const escrow = await escrowOf(created.escrow_id);
    assert.deepEqual([escrow.status, escrow.in_flight], ['released', null]);
    assert.equal(await balanceOf(t, to.wallet_id), '4.50');
    assert.equal(await chainBalance(to.chain_address), 4_500_000n);
    await assertConserved();
  });

  // Guarantee: a move whose send failed is sent again each second whatever else the escrow jobs
  // wait for. escrows.tick waits up to 20 s for the timeout refunds it sends; a release recorded
  // meanwhile, its own send failed (a chain not answering for a moment), must not wait behind it,
  // or it reaches the chain after its escrow's expiry and the requester is refunded although the
  // completion was accepted.
  test('a release whose send failed is sent again while escrows.tick waits for a refund: the receiver is paid', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const expiring = (await open(from, to.wallet_id, { timeoutSeconds: 60 })).body;
    const created = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH, timeoutSeconds: 600 })).body;
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } });
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    // The first send of the expired escrow's refund, and of the completion's release, never
    // reach the chain (a chain not answering for a moment); every other send goes through.
    const lost = new Set<string>();
    chain.submit = async (...args: Parameters<typeof submit>) => {
      const [row] = await t.service.ctx.db.query<{ id: string }>('SELECT id FROM escrows WHERE closing_signature = $1', [args[0].signature]);
      if (row && (row.id === expiring.escrow_id || row.id === created.escrow_id) && !lost.has(row.id)) {
        lost.add(row.id);
        return;
      }
      return submit.apply(chain, args);
    };
    const until = async (what: () => Promise<boolean>) => beforeDeadline((async () => {
      while (!(await what())) await new Promise((resolve) => setTimeout(resolve, 20));
      return true;
    })(), 10_000);
    const runner = startJobs(t.service.ctx, JOBS.filter((job) => job.name === 'escrows.tick' || job.name === 'escrows.resend'));
    try {
      assert.ok(await until(async () => lost.has(expiring.escrow_id)), 'the tick sent the refund, and waits for it to settle');
      const completed = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
        body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report`, waitForConfirmation: false },
      });
      assert.deepEqual([completed.body.status, completed.body.in_flight], ['completed', 'release'], JSON.stringify(completed.body));
      assert.ok(lost.has(created.escrow_id), 'the release\'s first send was lost');
      await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 3 } });
      // Sent again within a second or two; the tick's wait would have held it for 20.
      assert.ok(await until(async () => (await escrowOf(created.escrow_id)).status === 'released'), 'released while the tick still waited');
      assert.ok(await until(async () => (await escrowOf(expiring.escrow_id)).status === 'refunded'), 'the lost refund was sent again too');
    } finally {
      chain.submit = submit;
      await runner.stop();
    }
    assert.equal(await balanceOf(t, to.wallet_id), '4.50');
    await assertConserved();
  });

  test('an arbiter\'s decision lost before the chain kept it (a process that died) is taken back and told; it can be decided again', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const arbiter = await t.createKey('arbiter');
    const created = (await open(from, to.wallet_id)).body;
    assert.equal((await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: 'half done' } })).status, 200);
    const { chain, db } = t.service.ctx;
    const submit = chain.submit;
    // Recorded, never sent: the process died there. Its blockhash's life is made over at once
    // (as its minute would be), past the reconciler's margin: it can no longer land.
    chain.submit = async (prepared) => {
      chain.submit = submit;
      const over = (await chain.getBlockHeight()) - EXPIRY_MARGIN_BLOCKS - 1n;
      await db.query('UPDATE transactions SET last_valid_block_height = $2 WHERE tx_signature = $1', [prepared.signature, over]);
      await db.query('UPDATE escrows SET closing_valid_height = $2 WHERE closing_signature = $1', [prepared.signature, over]);
    };
    const decided = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, {
      key: arbiter, body: { decision: 'release', waitForConfirmation: false },
    });
    chain.submit = submit;
    assert.deepEqual([decided.status, decided.body.in_flight], [200, 'resolve'], JSON.stringify(decided.body));
    await reconcilePending(t.service.ctx, 0);
    const escrow = await escrowOf(created.escrow_id);
    assert.deepEqual([escrow.status, escrow.in_flight, escrow.resolution], ['disputed', null, null]);
    const told = (await t.request('GET', `/v1/events?type=escrow.resolve_failed&walletId=${from.wallet_id}`)).body.data;
    assert.equal(told.length, 1);
    assert.equal(told[0].severity, 'warning');
    assert.deepEqual([told[0].details.status, told[0].details.reason, told[0].details.resolution.to_receiver], ['disputed', 'Expired', '4.00']);
    const again = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: arbiter, body: { decision: 'release' } });
    assert.equal(again.body.status, 'released', JSON.stringify(again.body));
    assert.equal(await balanceOf(t, to.wallet_id), '4.50');
    await assertConserved();
  });

  // Guarantee: every amount of a money move answers a malformed value as invalid_amount, naming
  // the field (docs/decisions.md), the arbiter's split included; nothing is decided.
  test('a split\'s amounts as a JSON number or a malformed string: 400 invalid_amount naming the field, the dispute left as it was', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const arbiter = await t.createKey('arbiter');
    const created = (await open(from, to.wallet_id)).body;
    // Not disputed yet: not "already settled" (it is not), a request the escrow's state does not take.
    const early = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: arbiter, body: { decision: 'refund' } });
    assert.deepEqual([early.status, early.body.error?.code, early.body.error?.param], [400, 'invalid_request', 'escrow_id'], JSON.stringify(early.body));
    // Its dispute on its way to the chain (sent, not landed yet): decidable in a moment, so "retry", not "dispute it first".
    const { chain } = t.service.ctx;
    const submit = chain.submit;
    let sendDispute!: () => Promise<void>;
    let sent!: () => void;
    const submitted = new Promise<void>((resolve) => { sent = resolve; });
    chain.submit = async (prepared) => {
      chain.submit = submit;
      sendDispute = () => submit.call(chain, prepared);
      sent();
    };
    const disputing = t.request('POST', `/v1/payments/a2a/${created.escrow_id}/dispute`, { body: { reason: 'half done' } });
    await submitted;
    const landing = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, { key: arbiter, body: { decision: 'refund' } });
    assert.deepEqual([landing.status, landing.body.error?.code, landing.headers['retry-after']], [503, 'service_unavailable', '1'], JSON.stringify(landing.body));
    await sendDispute();
    assert.equal((await disputing).body.status, 'disputed');
    const malformed: Array<[Record<string, unknown>, string]> = [
      [{ toReceiver: 2, toSender: '2' }, 'to_receiver'],
      [{ toReceiver: '2', toSender: 2 }, 'to_sender'],
      [{ toReceiver: '2.0000001', toSender: '2' }, 'to_receiver'],
      [{ toReceiver: '2', toSender: '-2' }, 'to_sender'],
    ];
    for (const [amounts, param] of malformed) {
      const refused = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/resolve`, {
        key: arbiter, body: { decision: 'split', ...amounts },
      });
      assert.equal(refused.status, 400, `${JSON.stringify(amounts)}: ${JSON.stringify(refused.body)}`);
      assert.equal(refused.body.error.code, 'invalid_amount', JSON.stringify(amounts));
      assert.equal(refused.body.error.param, param, JSON.stringify(amounts));
    }
    const escrow = await escrowOf(created.escrow_id);
    assert.deepEqual([escrow.status, escrow.in_flight, escrow.resolution], ['disputed', null, null], 'nothing decided');
    assert.equal(await balanceOf(t, from.wallet_id), '6.00');
    assert.equal(await balanceOf(t, to.wallet_id), '0.50');
    assert.equal(await chainBalance(created.chain_address), 4_000_000n);
    await assertConserved();
  });

  test(`outputs are fetched at most ${OUTPUT_FETCHES_PER_ORG_MAX} at once per organisation and ${OUTPUT_FETCHES_MAX} per process: a completion beyond is 503, to retry, and changes nothing`, async () => {
    assert.equal(OUTPUT_FETCHES_MAX, 2 * OUTPUT_FETCHES_PER_ORG_MAX, 'two organisations fill the process');
    const perOrg = OUTPUT_FETCHES_PER_ORG_MAX;
    const orgs = [{ key: t.adminKey }, { key: (await t.createOrganization('Fetcher B')).adminKey }, { key: (await t.createOrganization('Fetcher C')).adminKey }];
    const escrowsOf = async (key: string, n: number) => {
      const from = await fundedWallet(t, '10', 'pol_permissive', key);
      const to = await fundedWallet(t, '0.5', 'pol_permissive', key);
      const ids: string[] = [];
      for (let i = 0; i < n; i += 1) ids.push((await open(from, to.wallet_id, { amount: '1' }, key)).body.escrow_id as string);
      return ids;
    };
    const [a, b, c] = [await escrowsOf(orgs[0]!.key, perOrg + 1), await escrowsOf(orgs[1]!.key, perOrg), await escrowsOf(orgs[2]!.key, 1)];
    const complete = (key: string, escrowId: string) => t.request('POST', `/v1/payments/a2a/${escrowId}/complete`, {
      key, body: { proofType: 'output_hash', proof: sha256Of(SLOW_OUTPUT), outputUrl: `${outputUrl}/slow` },
    });
    const refused = async (key: string, escrowId: string, message: RegExp) => {
      const answer = await complete(key, escrowId);
      assert.equal(answer.status, 503, JSON.stringify(answer.body));
      assert.equal(answer.body.error.code, 'service_unavailable');
      assert.match(answer.body.error.message, message);
      assert.equal((await t.request('GET', `/v1/payments/a2a/${escrowId}`, { key })).body.status, 'locked', 'unchanged');
    };
    const held = a.slice(0, perOrg).map((id) => complete(orgs[0]!.key, id));
    await slowFetches(perOrg);
    await refused(orgs[0]!.key, a[perOrg]!, /this organisation/);
    held.push(...b.map((id) => complete(orgs[1]!.key, id)));
    await slowFetches(OUTPUT_FETCHES_MAX);
    await refused(orgs[2]!.key, c[0]!, new RegExp(`${OUTPUT_FETCHES_MAX} escrow outputs`));
    while (slowResponses.length) slowResponses.shift()!();
    for (const answer of await Promise.all(held)) assert.equal(answer.body.status, 'released', JSON.stringify(answer.body));
    for (const [key, escrowId] of [[orgs[0]!.key, a[perOrg]!], [orgs[2]!.key, c[0]!]] as const) {
      const retried = complete(key, escrowId);
      await slowFetches(1);
      slowResponses.shift()!();
      assert.equal((await retried).body.status, 'released', 'the retry goes through');
    }
  });

  test('the outputs a receiving organisation has fetched count against its own share, not the requester\'s', async () => {
    const perOrg = OUTPUT_FETCHES_PER_ORG_MAX;
    const receiverKey = (await t.createOrganization('Fetching receiver')).adminKey;
    await t.request('POST', '/v1/test_helpers/deposits', { key: receiverKey, body: { amount: '1' } });
    const theirs = (await t.request('POST', '/v1/wallets', {
      key: receiverKey, body: { agentId: unique('receiver'), label: 'Receiver', policyId: 'pol_permissive' },
    })).body;
    const from = await fundedWallet(t, '10', 'pol_permissive');
    const ours = await fundedWallet(t, '0.5', 'pol_permissive');
    const toThem: string[] = [];
    for (let i = 0; i <= perOrg; i += 1) toThem.push((await open(from, theirs.chain_address, { amount: '1' })).body.escrow_id as string);
    const toUs = (await open(from, ours.wallet_id, { amount: '1' })).body.escrow_id as string;
    const complete = (key: string, escrowId: string) => t.request('POST', `/v1/payments/a2a/${escrowId}/complete`, {
      key, body: { proofType: 'output_hash', proof: sha256Of(SLOW_OUTPUT), outputUrl: `${outputUrl}/slow` },
    });
    const held = toThem.slice(0, perOrg).map((id) => complete(receiverKey, id));
    await slowFetches(perOrg);
    const beyond = await complete(receiverKey, toThem[perOrg]!);
    assert.equal(beyond.status, 503, 'the receiving organisation has used its own share');
    assert.match(beyond.body.error.message, /this organisation/);
    held.push(complete(t.adminKey, toUs));
    await slowFetches(perOrg + 1);
    while (slowResponses.length) slowResponses.shift()!();
    for (const answer of await Promise.all(held)) assert.equal(answer.body.status, 'released', JSON.stringify(answer.body));
    await assertConserved();
  });

  test('a receiver the directory puts in a blocked category is refused, by its address or its vault id', async () => {
    const policyId = await newPolicy(t, { blockedCategories: ['gambling'] });
    const from = await fundedWallet(t, '10', policyId);
    const to = await fundedWallet(t, '0.5');
    assert.equal((await t.request('POST', '/v1/recipients', { body: { domain: `${unique('casino')}.example`, address: to.chain_address, category: 'gambling' } })).status, 200);
    for (const toWallet of [to.chain_address, to.wallet_id]) {
      const refused = await open(from, toWallet);
      assert.equal(refused.status, 402, JSON.stringify(refused.body));
      assert.equal(refused.body.error.violation.rule, 'blocked_categories');
      const record = await t.request('GET', `/v1/transactions/${refused.body.error.tx_id}`);
      assert.equal(record.body.status, 'blocked');
      assert.equal(record.body.category, 'gambling');
    }
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
  });

  test('the requester\'s policy is checked at creation: a violation is 402, recorded blocked, and locks nothing', async () => {
    const policyId = await newPolicy(t, { maxPerTx: '3' });
    const from = await fundedWallet(t, '10', policyId);
    const to = await fundedWallet(t, '0.5');
    const refused = await open(from, to.wallet_id);
    assert.equal(refused.status, 402);
    assert.deepEqual(refused.body.error.violation, { rule: 'max_per_tx', limit: '3.00', attempted: '4.00' });
    assert.equal(refused.body.error.wallet_id, from.wallet_id, 'like a payment\'s: the vault and its policy');
    assert.equal(refused.body.error.policy_id, policyId);
    const record = await t.request('GET', `/v1/transactions/${refused.body.error.tx_id}`);
    assert.equal(record.body.type, 'a2a_send');
    assert.equal(record.body.status, 'blocked');
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
    assert.equal((await t.request('GET', `/v1/payments/a2a?walletId=${from.wallet_id}`)).body.data.length, 0);
    // An account of the service that is not a vault (a reserve, a token account) would take the
    // release where nothing can move it on.
    const reserve = (await t.request('GET', '/v1/organization')).body.reserve;
    const errors: Array<[Record<string, unknown>, number, string, string?]> = [
      [{ toWallet: reserve.chain_address }, 400, 'invalid_recipient'],
      [{ toWallet: reserve.token_account }, 400, 'invalid_recipient'],
      [{ toWallet: to.token_account }, 400, 'invalid_recipient'],
      [{ amount: '0' }, 400, 'invalid_amount'],
      [{ amount: 10 }, 400, 'invalid_amount'],
      [{ currency: 'EUR' }, 400, 'invalid_currency'],
      [{ toWallet: 'not an address' }, 400, 'invalid_recipient'],
      [{ toWallet: '' }, 400, 'invalid_recipient', 'to_wallet'],
      [{ toWallet: 'x'.repeat(65) }, 400, 'invalid_recipient', 'to_wallet'],
      [{ toWallet: 5 }, 400, 'invalid_recipient', 'to_wallet'],
      [{ toWallet: from.wallet_id }, 400, 'invalid_recipient'],
      [{ toWallet: 'wal_missing' }, 404, 'wallet_not_found', 'to_wallet'],
      [{ fromWallet: 'wal_missing' }, 404, 'wallet_not_found', 'from_wallet'],
      [{ amount: '3', toWallet: from.wallet_id, fromWallet: to.wallet_id }, 422, 'wallet_insufficient_balance'],
      [{ timeoutSeconds: 5 }, 400, 'invalid_request'],
      [{ expectedOutputHash: 'md5:abc' }, 400, 'invalid_request'],
      [{ verifierId: 'vrf_missing' }, 400, 'invalid_request'],
    ];
    for (const [extra, status, code, param] of errors) {
      const response = await open(from, to.wallet_id, { amount: '1', ...extra });
      assert.equal(response.status, status, `${code}: ${JSON.stringify(response.body)}`);
      assert.equal(response.body.error.code, code);
      if (param) assert.equal(response.body.error.param, param, JSON.stringify(extra));
    }
    // An unknown vault is refused before the idempotency key is taken: the corrected escrow runs under it.
    const key = unique('mistyped-escrow');
    const mistyped = await open(from, 'wal_missing', { amount: '1', idempotencyKey: key });
    assert.equal(mistyped.body.error.code, 'wallet_not_found');
    const corrected = await open(from, to.wallet_id, { amount: '1', idempotencyKey: key });
    assert.equal(corrected.status, 200, JSON.stringify(corrected.body));
    assert.equal(corrected.body.status, 'locked');
    assert.equal(await balanceOf(t, from.wallet_id), '9.00', 'only the corrected escrow locked anything');
    assert.equal(await balanceOf(t, to.wallet_id), '0.50');
  });

  test('an escrow\'s a2a_send carries an attestation hash reproducible from its transaction view', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    // The receiver's directory category counts (blockedCategories applies) and is hashed with it.
    assert.equal((await t.request('POST', '/v1/recipients', { body: { domain: `${unique('worker')}.example`, address: to.chain_address, category: 'software' } })).status, 200);
    const created = (await open(from, to.wallet_id)).body;
    const send = (await t.request('GET', `/v1/transactions?walletId=${from.wallet_id}&type=a2a_send`)).body.data[0];
    assert.ok(send, JSON.stringify(created));
    assert.equal(send.escrow_id, created.escrow_id, 'the row names its escrow');
    const intent = {
      wallet: send.wallet_id, recipient: send.recipient, amount: send.amount, currency: send.currency, memo: send.memo,
      category: send.category, time: send.attested_at,
    };
    assert.equal(send.category, 'software');
    assert.equal(send.agent_attestation_hash, `sha256:${createHash('sha256').update(canonicalJson(intent)).digest('hex')}`);
  });

  test('an escrow above the requester\'s co-signature threshold is refused (402, require_co_sign with the threshold), not held', async () => {
    const policyId = await newPolicy(t, { requireCoSign: '2.5' });
    const from = await fundedWallet(t, '10', policyId);
    const to = await fundedWallet(t, '0.5');
    const refused = await open(from, to.wallet_id);
    assert.equal(refused.status, 402, JSON.stringify(refused.body));
    assert.deepEqual(refused.body.error.violation, { rule: 'require_co_sign', limit: '2.50', attempted: '4.00' });
    assert.equal((await t.request('GET', `/v1/transactions/${refused.body.error.tx_id}`)).body.status, 'blocked');
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
    const under = await open(from, to.wallet_id, { amount: '2.5' });
    assert.equal(under.status, 200, 'at the threshold: no co-signature needed');
  });

  test('the escrow list is newest first, and pages through every escrow once', async () => {
    const org = await t.createOrganization('Paging escrows');
    const from = await fundedWallet(t, '10', 'pol_permissive', org.adminKey);
    const to = await fundedWallet(t, '0.5', 'pol_permissive', org.adminKey);
    const opened: string[] = [];
    for (let i = 0; i < 3; i += 1) opened.push((await open(from, to.wallet_id, { amount: '1' }, org.adminKey)).body.escrow_id);
    const first = await t.request('GET', '/v1/payments/a2a?limit=2', { key: org.adminKey });
    assert.deepEqual(first.body.data.map((e: { escrow_id: string }) => e.escrow_id), [opened[2], opened[1]]);
    assert.equal(first.body.has_more, true);
    const second = await t.request('GET', `/v1/payments/a2a?limit=2&cursor=${first.body.next_cursor}`, { key: org.adminKey });
    assert.deepEqual(second.body.data.map((e: { escrow_id: string }) => e.escrow_id), [opened[0]]);
    assert.deepEqual([second.body.has_more, second.body.next_cursor], [false, null]);
  });

  test('a vault of another organisation receives by its chain address; both organisations see the escrow, nobody else', async () => {
    const from = await fundedWallet(t, '10');
    const other = await t.createOrganization();
    const otherKey = other.adminKey;
    await t.request('POST', '/v1/test_helpers/deposits', { key: otherKey, body: { amount: '1' } });
    const theirs = await t.request('POST', '/v1/wallets', { key: otherKey, body: { agentId: unique('worker'), label: 'Worker', policyId: 'pol_permissive' } });
    const created = (await open(from, theirs.body.chain_address, { expectedOutputHash: OUTPUT_HASH })).body;
    assert.equal(created.to_wallet_id, theirs.body.wallet_id);
    const seen = await t.request('GET', `/v1/payments/a2a/${created.escrow_id}`, { key: otherKey });
    assert.equal(seen.status, 200, 'the receiving organisation sees it');
    assert.equal((await t.request('GET', '/v1/payments/a2a', { key: otherKey })).body.data.length, 1);
    const stranger = await t.createOrganization();
    assert.equal((await t.request('GET', `/v1/payments/a2a/${created.escrow_id}`, { key: stranger.adminKey })).status, 404);
    // The list by vault: the other organisation's vault our escrow pays, by either spelling; a
    // vault we have nothing to do with, or none, is 404; an empty id is refused.
    const byReceiver = await t.request('GET', `/v1/payments/a2a?wallet_id=${theirs.body.wallet_id}`);
    assert.deepEqual(byReceiver.body.data.map((e: { escrow_id: string }) => e.escrow_id), [created.escrow_id]);
    const byPayer = await t.request('GET', `/v1/payments/a2a?walletId=${from.wallet_id}`, { key: otherKey });
    assert.deepEqual(byPayer.body.data?.map((e: { escrow_id: string }) => e.escrow_id), [created.escrow_id],
      'the receiving organisation filters by the paying vault it is shown');
    for (const walletId of ['wal_nope', from.wallet_id]) {
      const unknown = await t.request('GET', `/v1/payments/a2a?walletId=${walletId}`, { key: stranger.adminKey });
      assert.equal(unknown.status, 404, walletId);
      assert.equal(unknown.body.error.code, 'wallet_not_found');
    }
    assert.equal((await t.request('GET', '/v1/payments/a2a?walletId=')).body.error?.param, 'wallet_id');
    const done = await t.request('POST', `/v1/payments/a2a/${created.escrow_id}/complete`, {
      key: otherKey, body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` },
    });
    assert.equal(done.body.status, 'released', JSON.stringify(done.body));
    assert.equal(await balanceOf(t, theirs.body.wallet_id, otherKey), '4.00');
    const theirEvents = (await t.request('GET', `/v1/events?walletId=${theirs.body.wallet_id}&limit=100`, { key: otherKey })).body.data as Array<{
      type: string; details: { escrow_id?: string };
    }>;
    assert.deepEqual(theirEvents.filter((e) => e.details.escrow_id === created.escrow_id).map((e) => e.type).reverse(),
      ['escrow.created', 'escrow.completed', 'escrow.released'], 'the receiving organisation sees every escrow event, completion included');
    const received = await t.request('GET', `/v1/wallets/${theirs.body.wallet_id}/transactions`, { key: otherKey });
    assert.deepEqual(received.body.data.map((row: { type: string }) => row.type), ['a2a_receive']);
    const external = await newRecipient();
    const toAddress = (await open(from, external, { amount: '1', expectedOutputHash: OUTPUT_HASH })).body;
    await t.request('POST', `/v1/payments/a2a/${toAddress.escrow_id}/complete`, { body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` } });
    assert.equal(await chainBalance(external), 1_000_000n, 'any address can be paid through an escrow');
    await assertConserved();
  });

  test('concurrent completes and disputes on one escrow end in exactly one outcome; a late complete races the timeout safely', async () => {
    const from = await fundedWallet(t, '40');
    const to = await fundedWallet(t, '0.5');
    for (let round = 0; round < 3; round += 1) {
      const created = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH })).body;
      // Two completes and four disputes (completes beyond the outputs an organisation may fetch at
      // once, OUTPUT_FETCHES_PER_ORG_MAX, would be 503 rather than racing).
      const responses = await Promise.all(Array.from({ length: 6 }, (_, i) => t.request('POST',
        `/v1/payments/a2a/${created.escrow_id}/${i % 3 ? 'dispute' : 'complete'}`,
        { body: i % 3 ? { reason: 'race' } : { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` } })));
      const winners = responses.filter((r) => r.status === 200);
      assert.equal(winners.length, 1, `exactly one move wins: ${responses.map((r) => r.status)}`);
      assert.deepEqual([...new Set(responses.filter((r) => r.status !== 200).map((r) => r.body.error.code))], ['escrow_already_settled']);
      const final = await escrowOf(created.escrow_id);
      assert.ok(['released', 'disputed'].includes(final.status), `one terminal or dispute state, not ${final.status}`);
    }
    const racing = (await open(from, to.wallet_id, { expectedOutputHash: OUTPUT_HASH, timeoutSeconds: 60 })).body;
    // The timeout and the second it was rounded up to: at its expiry.
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 61 } });
    const [complete] = await Promise.all([
      t.request('POST', `/v1/payments/a2a/${racing.escrow_id}/complete`, { body: { proofType: 'output_hash', proof: OUTPUT_HASH, outputUrl: `${outputUrl}/report` } }),
      tick(),
    ]);
    assert.equal(complete.status, 422, JSON.stringify(complete.body));
    assert.ok(['escrow_expired', 'escrow_already_settled'].includes(complete.body.error.code), 'refused at its expiry');
    await tick();
    assert.equal((await escrowOf(racing.escrow_id)).status, 'refunded');
    const [row] = await t.service.ctx.db.query<{ released: bigint }>(
      `SELECT COALESCE(SUM(amount), 0)::bigint AS released FROM transactions WHERE wallet_id = $1 AND type = 'a2a_receive' AND status = 'confirmed'`,
      [to.wallet_id]);
    assert.equal(await chainBalance(to.chain_address), 500_000n + row!.released, 'the index equals the chain');
    assert.equal(await chainBalance(from.chain_address), BigInt(Math.round(Number(await balanceOf(t, from.wallet_id)) * 1e6)));
    await assertConserved();
  });

  test('the receiving side declines an escrow it never asked for: refunded at once, budgets back, its vault free to archive', async () => {
    const from = await fundedWallet(t, '10');
    const other = await t.createOrganization();
    const theirs = (await t.request('POST', '/v1/wallets', { key: other.adminKey, body: { agentId: unique('target'), label: 'Target', policyId: 'pol_permissive' } })).body;
    const created = (await open(from, theirs.chain_address)).body;
    assert.equal(created.status, 'locked', JSON.stringify(created));
    const decline = (key?: string) => t.request('POST', `/v1/payments/a2a/${created.escrow_id}/decline`, { key, body: {} });
    assert.equal((await t.request('DELETE', `/v1/wallets/${theirs.wallet_id}`, { key: other.adminKey })).status, 422, 'an open escrow pays it');

    const byRequester = await decline();
    assert.deepEqual([byRequester.status, byRequester.body.error?.code], [403, 'insufficient_permissions'], 'the requester cannot take it back');
    const declined = await decline(other.adminKey);
    assert.deepEqual([declined.status, declined.body.status, declined.body.in_flight], [200, 'refunded', null], JSON.stringify(declined.body));
    assert.equal(await balanceOf(t, from.wallet_id), '10.00', 'the requester has it back');
    assert.equal(await chainBalance(from.chain_address), 10_000_000n);
    assert.equal((await t.request('GET', `/v1/wallets/${from.wallet_id}`)).body.spending.day.spent, '0.00', 'and its budget');
    for (const [key, walletId] of [[undefined, from.wallet_id], [other.adminKey, theirs.wallet_id]] as const) {
      await t.settled();
      const refunded = (await t.request('GET', `/v1/events?type=escrow.refunded&walletId=${walletId}`, { key })).body.data;
      assert.deepEqual(refunded.map((e: { details: { reason: string }; severity: string }) => [e.details.reason, e.severity]), [['declined', 'info']]);
    }
    assert.equal((await decline(other.adminKey)).body.error.code, 'escrow_already_settled');
    assert.equal((await t.request('DELETE', `/v1/wallets/${theirs.wallet_id}`, { key: other.adminKey })).status, 200, 'archived');
    await assertConserved();

    // Within one organisation: only an agent, through the receiving vault's token.
    const to = await fundedWallet(t, '0.5');
    const mine = (await open(from, to.wallet_id)).body;
    const agent = await t.createKey('agent');
    const tokenOf = async (walletId: string) => (await t.request('POST', `/v1/wallets/${walletId}/rotate-token`)).body.session_token;
    const asAgent = async (walletId: string) => t.request('POST', `/v1/payments/a2a/${mine.escrow_id}/decline`,
      { key: agent, headers: { 'session-token': await tokenOf(walletId) }, body: {} });
    assert.equal((await asAgent(from.wallet_id)).status, 403, 'the paying vault\'s agent cannot');
    const byOperator = await t.request('POST', `/v1/payments/a2a/${mine.escrow_id}/decline`, { key: await t.createKey('operator'), body: {} });
    assert.equal(byOperator.status, 403, 'nor its organisation\'s operators, who opened it too');
    assert.equal((await asAgent(to.wallet_id)).body.status, 'refunded');
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
    await assertConserved();
  });

  test('a malformed toWallet is refused before the idempotency key is taken: corrected, the same key locks', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const key = unique('escrow');
    const body = { fromWallet: from.wallet_id, amount: '1', currency: 'USDC', taskDescription: 'once' };
    const refused = await t.request('POST', '/v1/payments/a2a', { headers: { 'idempotency-key': key }, body: { ...body, toWallet: 'not an address' } });
    assert.equal(refused.status, 400);
    assert.equal(refused.body.error.code, 'invalid_recipient');
    const locked = await t.request('POST', '/v1/payments/a2a', { headers: { 'idempotency-key': key }, body: { ...body, toWallet: to.wallet_id } });
    assert.equal(locked.status, 200, JSON.stringify(locked.body));
    assert.equal(await balanceOf(t, from.wallet_id), '9.00');
  });

  test('idempotent creation makes one escrow; an agent needs its vault\'s session token', async () => {
    const from = await fundedWallet(t, '10');
    const to = await fundedWallet(t, '0.5');
    const key = unique('escrow');
    const responses = await Promise.all(Array.from({ length: 5 }, () => t.request('POST', '/v1/payments/a2a', {
      headers: { 'idempotency-key': key },
      body: { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '1', currency: 'USDC', taskDescription: 'once' },
    })));
    const ok = responses.filter((r) => r.status === 200);
    assert.ok(ok.length >= 1, 'one answered with the escrow');
    assert.equal(new Set(ok.map((r) => r.body.escrow_id)).size, 1);
    assert.equal((await t.request('GET', `/v1/payments/a2a?walletId=${from.wallet_id}`)).body.data.length, 1);
    assert.equal(await balanceOf(t, from.wallet_id), '9.00');
    const agent = await t.createKey('agent');
    const without = await open(from, to.wallet_id, { amount: '1' }, agent);
    assert.equal(without.body.error.code, 'session_token_invalid');
    const token = (await t.request('POST', `/v1/wallets/${from.wallet_id}/rotate-token`, { body: {} })).body.session_token;
    const withToken = await t.request('POST', '/v1/payments/a2a', {
      key: agent, headers: { 'session-token': token },
      body: { fromWallet: from.wallet_id, toWallet: to.wallet_id, amount: '1', currency: 'USDC', taskDescription: 'agent' },
    });
    assert.equal(withToken.status, 200, JSON.stringify(withToken.body));

    // The token of the paying vault, expired: 401 session_token_expired (rotate it), not the 403
    // the receiving vault of the same organisation, which it does not match, would give.
    const shortLived = (await t.request('POST', `/v1/wallets/${from.wallet_id}/rotate-token`, { body: { ttlSeconds: 60 } })).body.session_token;
    const escrowId = withToken.body.escrow_id;
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 120 } });
    const reads = [
      await t.request('GET', `/v1/payments/a2a/${escrowId}`, { key: agent, headers: { 'session-token': shortLived } }),
      await t.request('POST', `/v1/payments/a2a/${escrowId}/dispute`, { key: agent, headers: { 'session-token': shortLived }, body: { reason: 'late' } }),
    ];
    for (const response of reads) {
      assert.equal(response.status, 401, JSON.stringify(response.body));
      assert.equal(response.body.error.code, 'session_token_expired');
    }
  });

  // Guarantee (docs/recipients.md): the receiver is judged by every category the requester's
  // directory gives its address; a domain of its own with another category hides none of them.
  test('a receiver is judged by every category the directory gives its address: an older entry\'s category does not hide a blocked one', async () => {
    const from = await fundedWallet(t, '10', await newPolicy(t, { blockedCategories: ['gambling'] }));
    const to = await fundedWallet(t, '0.5');
    for (const [name, category] of [['shop', 'shopping'], ['casino', 'gambling']] as const) {
      const added = await t.request('POST', '/v1/recipients', { body: { domain: `${unique(name)}.example`, address: to.chain_address, category } });
      assert.equal(added.status, 200, JSON.stringify(added.body));
    }
    for (const toWallet of [to.chain_address, to.wallet_id]) {
      const refused = await open(from, toWallet);
      assert.equal(refused.status, 402, `${toWallet}: ${JSON.stringify(refused.body)}`);
      assert.deepEqual(refused.body.error.violation, { rule: 'blocked_categories', limit: 'gambling', attempted: 'gambling' });
      const send = (await t.request('GET', `/v1/transactions/${refused.body.error.tx_id}`)).body;
      assert.deepEqual([send.type, send.status, send.category], ['a2a_send', 'blocked', 'gambling'], 'recorded under the category that refused it');
      const intent = {
        wallet: send.wallet_id, recipient: send.recipient, amount: send.amount, currency: send.currency, memo: send.memo,
        category: send.category, time: send.attested_at,
      };
      assert.equal(send.agent_attestation_hash, `sha256:${createHash('sha256').update(canonicalJson(intent)).digest('hex')}`, 'and hashed with it');
    }
    assert.equal(await balanceOf(t, from.wallet_id), '10.00');
    assert.equal((await t.request('GET', `/v1/payments/a2a?walletId=${from.wallet_id}`)).body.data.length, 0, 'nothing locked');
  });
});
