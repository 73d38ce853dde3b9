/**
 * The transaction index through the real HTTP stack: the view every endpoint shares, the
 * filters and their boundaries, pagination that stays stable while rows arrive, tenant
 * isolation, and who may read what.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import type { Queryable } from '../db/database.ts';
import { newId } from '../ids/ids.ts';
import { parseTimeBound } from './routes.ts';
import { explorerClusterQuery, listTransactions, type TransactionFilter } from './views.ts';

const LOCAL_CLUSTER = '?cluster=custom&customUrl=http%3A%2F%2F127.0.0.1%3A8899';
const VIEW_FIELDS = [
  'agent_attestation_hash', 'amount', 'approval', 'attested_at', 'batch_id', 'category', 'currency', 'escrow_id', 'explorer_url', 'explorer_url_alt', 'failure_reason', 'memo',
  'on_chain_slot', 'policy_id', 'policy_triggered', 'recipient', 'settled_at', 'status', 'timestamp', 'tx_id', 'tx_signature',
  'type', 'violation', 'wallet_id',
];

let agentCounter = 0;

async function newWallet(t: TestService, key?: string): Promise<{ wallet_id: string; chain_address: string }> {
  const response = await t.request('POST', '/v1/wallets', {
    key, body: { agentId: `txindex-${process.pid}-${(agentCounter += 1)}`, label: 'Indexed agent', policyId: 'pol_moderate' },
  });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

async function deposit(t: TestService, amount: string, key?: string): Promise<void> {
  const response = await t.request('POST', '/v1/test_helpers/deposits', { key, body: { amount } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
}

async function fund(t: TestService, walletId: string, amount: string, key?: string): Promise<{ tx_id: string; tx_signature: string; on_chain_slot: number }> {
  const response = await t.request('POST', `/v1/wallets/${walletId}/fund`, { key, body: { amount, currency: 'USDC' } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body;
}

interface ExtraRow {
  walletId: string;
  type?: string;
  status?: string;
  amount?: bigint;
  recipient?: string | null;
  createdAt?: Date;
  signature?: string | null;
  violation?: unknown;
  policyTriggered?: boolean;
  failureReason?: string | null;
  memo?: string | null;
  attestationHash?: string | null;
  orgId?: string;
}

/** A row written straight into the index, for states the chain flows of other features produce. */
async function insertRow(t: TestService, row: ExtraRow): Promise<string> {
  const createdAt = row.createdAt ?? new Date(t.service.ctx.clock.nowMs());
  const id = newId('tx', createdAt.getTime());
  await t.service.ctx.db.query(
    `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, policy_id, policy_triggered, violation, memo,
       attestation_hash, tx_signature, on_chain_slot, failure_reason, created_at, updated_at, settled_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, 'pol_moderate', $8, $9, $10, $11, $12, $13, $14, $15, $15, $16)`,
    [id, row.orgId ?? t.orgId, row.walletId, row.type ?? 'payment', row.status ?? 'confirmed', row.amount ?? 1_000_000n,
      row.recipient === undefined ? 'merchant.example' : row.recipient, row.policyTriggered ?? false,
      row.violation === undefined ? null : JSON.stringify(row.violation), row.memo ?? null, row.attestationHash ?? null,
      row.signature ?? null, row.signature ? 42n : null, row.failureReason ?? null, createdAt,
      row.status === 'pending' ? null : createdAt]);
  return id;
}

async function listAll(t: TestService, url: string, key?: string): Promise<any[]> {
  const response = await t.request('GET', url, { key });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  return response.body.data;
}

describe('transaction index', () => {
  let t: TestService;
  let walletA: { wallet_id: string; chain_address: string };
  let walletB: { wallet_id: string; chain_address: string };
  let funding: { tx_id: string; tx_signature: string; on_chain_slot: number };
  let withdrawalId: string;
  let blockedId: string;
  let failedId: string;

  before(async () => {
    t = await startTestService();
    await deposit(t, '100');
    walletA = await newWallet(t);
    walletB = await newWallet(t);
    funding = await fund(t, walletA.wallet_id, '30');
    await fund(t, walletB.wallet_id, '5');
    const withdrawn = await t.request('POST', `/v1/wallets/${walletA.wallet_id}/withdraw`, { body: { amount: '10' } });
    assert.equal(withdrawn.status, 200, JSON.stringify(withdrawn.body));
    withdrawalId = withdrawn.body.tx_id;
    blockedId = await insertRow(t, {
      walletId: walletA.wallet_id, status: 'blocked', amount: 500_000_000n, recipient: 'api.vendor.example', policyTriggered: true,
      violation: { rule: 'max_per_tx', limit: '100.00', attempted: '500.00' }, memo: 'too big',
      attestationHash: `sha256:${'ab'.repeat(32)}`,
    });
    failedId = await insertRow(t, {
      walletId: walletB.wallet_id, status: 'failed', amount: 9_000_000n, recipient: 'api.vendor.example',
      signature: '5'.repeat(88), failureReason: 'InsufficientFunds',
    });
  });
  after(async () => { await t.close(); });

  test('a funding reads back with every field of the view and explorer links to the local validator', async () => {
    const response = await t.request('GET', `/v1/transactions/${funding.tx_id}`);
    assert.equal(response.status, 200, JSON.stringify(response.body));
    const view = response.body;
    assert.deepEqual(Object.keys(view).sort(), VIEW_FIELDS);
    assert.equal(view.tx_id, funding.tx_id);
    assert.equal(view.wallet_id, walletA.wallet_id);
    assert.equal(view.type, 'funding');
    assert.equal(view.recipient, walletA.chain_address);
    assert.equal(view.amount, '30.00');
    assert.equal(view.currency, 'USDC');
    assert.equal(view.status, 'confirmed');
    assert.equal(view.tx_signature, funding.tx_signature);
    assert.equal(view.on_chain_slot, funding.on_chain_slot);
    assert.equal(view.policy_triggered, false);
    assert.equal(view.violation, null);
    assert.equal(view.failure_reason, null);
    assert.equal(view.approval, null);
    assert.equal(view.explorer_url, `https://explorer.solana.com/tx/${funding.tx_signature}${LOCAL_CLUSTER}`);
    assert.equal(view.explorer_url_alt, `https://solscan.io/tx/${funding.tx_signature}${LOCAL_CLUSTER}`);
    assert.match(view.timestamp, /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/);
    assert.ok(Date.parse(view.settled_at) >= Date.parse(view.timestamp), 'settled at or after it was recorded');

    // The payments route answers any transaction id with the same view, and `signature` as paying does.
    const viaPayments = await t.request('GET', `/v1/payments/${funding.tx_id}`);
    assert.equal(viaPayments.status, 200);
    assert.deepEqual(viaPayments.body, { ...view, signature: view.tx_signature });
  });

  test('a blocked payment shows its violation and no chain fields; a failed one its reason', async () => {
    const blocked = (await t.request('GET', `/v1/transactions/${blockedId}`)).body;
    assert.equal(blocked.status, 'blocked');
    assert.equal(blocked.amount, '500.00');
    assert.equal(blocked.policy_id, 'pol_moderate');
    assert.equal(blocked.policy_triggered, true);
    assert.deepEqual(blocked.violation, { rule: 'max_per_tx', limit: '100.00', attempted: '500.00' });
    assert.equal(blocked.memo, 'too big');
    assert.equal(blocked.agent_attestation_hash, `sha256:${'ab'.repeat(32)}`);
    assert.equal(blocked.tx_signature, null);
    assert.equal(blocked.on_chain_slot, null);
    assert.equal(blocked.explorer_url, null);
    assert.equal(blocked.explorer_url_alt, null);
    assert.equal(blocked.failure_reason, null);

    const failed = (await t.request('GET', `/v1/transactions/${failedId}`)).body;
    assert.equal(failed.status, 'failed');
    assert.equal(failed.failure_reason, 'InsufficientFunds');
    assert.equal(failed.on_chain_slot, 42);
    assert.equal(failed.violation, null);
  });

  test('the explorer cluster follows the RPC address without ever showing its credentials', () => {
    assert.equal(explorerClusterQuery(null, true), LOCAL_CLUSTER);
    assert.equal(explorerClusterQuery('http://10.0.0.5:8899', true), LOCAL_CLUSTER, 'the embedded validator wins');
    assert.equal(explorerClusterQuery('https://api.devnet.solana.com', false), '?cluster=devnet');
    assert.equal(explorerClusterQuery('https://devnet.helius-rpc.com/?api-key=secret', false), '?cluster=devnet');
    assert.equal(explorerClusterQuery('https://api.testnet.solana.com', false), '?cluster=testnet');
    assert.equal(explorerClusterQuery('https://api.mainnet-beta.solana.com', false), '');
    assert.equal(explorerClusterQuery('http://127.0.0.1:8899', false), LOCAL_CLUSTER);
    const custom = explorerClusterQuery('https://user:pass@rpc.example.com:8443/v1?token=secret#x', false);
    assert.equal(custom, `?cluster=custom&customUrl=${encodeURIComponent('https://rpc.example.com:8443')}`);
    assert.ok(!custom.includes('secret') && !custom.includes('pass'), 'no credential reaches a link');
    // Some providers carry the key in the path.
    const inPath = explorerClusterQuery('https://rpc.ankr.com/solana/0123456789abcdef', false);
    assert.equal(inPath, `?cluster=custom&customUrl=${encodeURIComponent('https://rpc.ankr.com')}`);
  });

  test('time bounds: dates, zones, sub-millisecond fractions, and everything else refused', () => {
    assert.equal(parseTimeBound('from', '2026-04-01').toISOString(), '2026-04-01T00:00:00.000Z');
    assert.equal(parseTimeBound('from', '2026-04-01T10:00Z').toISOString(), '2026-04-01T10:00:00.000Z');
    assert.equal(parseTimeBound('from', '2026-04-01T10:00:00+02:00').toISOString(), '2026-04-01T08:00:00.000Z');
    assert.equal(parseTimeBound('from', '2026-04-01T10:00:00 02:00').toISOString(), '2026-04-01T08:00:00.000Z');
    assert.equal(parseTimeBound('to', '2026-04-01T10:00:00.123Z').toISOString(), '2026-04-01T10:00:00.123Z');
    assert.equal(parseTimeBound('to', '2026-04-01T10:00:00.1234Z').toISOString(), '2026-04-01T10:00:00.124Z');
    // The years PostgreSQL stores: none before 0001, none after 9999 once the offset is applied.
    assert.equal(parseTimeBound('from', '0001-01-01').toISOString(), '0001-01-01T00:00:00.000Z');
    assert.equal(parseTimeBound('to', '9999-12-31T23:59:59.999Z').toISOString(), '9999-12-31T23:59:59.999Z');
    for (const bad of ['2026-04-01T10:00:00', '2026-02-30', '2026-13-01', '2026-04-01T24:00:00Z', 'yesterday', '1711900000', '2026-04-01T10:00:00+25:00',
      '0000-01-01', '0001-01-01T00:00:00+00:01', '9999-12-31T23:00:00-02:00']) {
      assert.throws(() => parseTimeBound('from', bad), (error: any) => error.code === 'invalid_request' && error.details.param === 'from', bad);
    }
  });

  test('the organisation list shows every type newest first and each filter narrows it', async () => {
    const all = await listAll(t, '/v1/transactions?limit=100');
    const ids = all.map((row) => row.tx_id);
    for (const id of [funding.tx_id, withdrawalId, blockedId, failedId]) assert.ok(ids.includes(id), `${id} is listed`);
    for (let i = 1; i < all.length; i += 1) {
      const newer = all[i - 1];
      const older = all[i];
      assert.ok(newer.timestamp > older.timestamp || (newer.timestamp === older.timestamp && newer.tx_id > older.tx_id), 'newest first');
    }
    assert.deepEqual(Object.keys(all[0]).sort(), VIEW_FIELDS);

    const blocked = await listAll(t, '/v1/transactions?status=blocked');
    assert.deepEqual(blocked.map((row) => row.tx_id), [blockedId]);
    const withdrawals = await listAll(t, '/v1/transactions?type=withdrawal');
    assert.deepEqual(withdrawals.map((row) => row.tx_id), [withdrawalId]);
    const fundings = await listAll(t, '/v1/transactions?type=funding');
    assert.ok(fundings.length >= 2 && fundings.every((row) => row.type === 'funding'), 'only fundings');
    const ofA = await listAll(t, `/v1/transactions?walletId=${walletA.wallet_id}`);
    assert.ok(ofA.length === 3 && ofA.every((row) => row.wallet_id === walletA.wallet_id), 'only wallet A');
    const alias = await listAll(t, `/v1/transactions?wallet_id=${walletA.wallet_id}`);
    assert.deepEqual(alias, ofA);
    const toVendor = await listAll(t, '/v1/transactions?recipient=api.vendor.example');
    assert.deepEqual(toVendor.map((row) => row.tx_id).sort(), [blockedId, failedId].sort());
    const combined = await listAll(t, `/v1/transactions?recipient=api.vendor.example&walletId=${walletB.wallet_id}&status=failed&type=payment`);
    assert.deepEqual(combined.map((row) => row.tx_id), [failedId]);
    assert.deepEqual(await listAll(t, '/v1/transactions?type=escrow_refund'), []);
    const unknown = await t.request('GET', '/v1/transactions?walletId=wal_unknown');
    assert.equal(unknown.status, 404, 'a mistyped vault id is not an empty list');
    assert.equal(unknown.body.error.code, 'wallet_not_found');
  });

  test('a domain recorded in the case it was typed in (before 2026-11-26) is found by that spelling; lowercase finds those recorded since', async () => {
    const wallet = await newWallet(t);
    const domain = `Legacy-${process.pid}.Vendor.Example`;
    const typedThen = await insertRow(t, { walletId: wallet.wallet_id, recipient: domain });
    const recordedNow = await insertRow(t, { walletId: wallet.wallet_id, recipient: domain.toLowerCase() });
    const ids = async (recipient: string) => (await listAll(t, `/v1/transactions?recipient=${encodeURIComponent(recipient)}`)).map((row) => row.tx_id);
    assert.deepEqual((await ids(domain)).sort(), [typedThen, recordedNow].sort(), 'the spelling it was typed in finds both');
    assert.deepEqual(await ids(domain.toLowerCase()), [recordedNow]);
    assert.deepEqual(await ids(domain.toUpperCase()), [recordedNow], 'another spelling finds those recorded lowercase');
  });

  test('from is inclusive and to exclusive, to the millisecond', async () => {
    const wallet = await newWallet(t);
    const t0 = new Date('2025-06-01T12:00:00.000Z');
    const t1 = new Date('2025-06-01T12:00:00.001Z');
    const t2 = new Date('2025-06-02T00:00:00.000Z');
    const [r0, r1, r2] = [
      await insertRow(t, { walletId: wallet.wallet_id, createdAt: t0 }),
      await insertRow(t, { walletId: wallet.wallet_id, createdAt: t1 }),
      await insertRow(t, { walletId: wallet.wallet_id, createdAt: t2 }),
    ];
    const ids = async (query: string) =>
      (await listAll(t, `/v1/wallets/${wallet.wallet_id}/transactions?${query}`)).map((row) => row.tx_id);
    assert.deepEqual(await ids(`from=${t1.toISOString()}`), [r2, r1]);
    assert.deepEqual(await ids(`to=${t1.toISOString()}`), [r0]);
    assert.deepEqual(await ids(`from=${t0.toISOString()}&to=${t2.toISOString()}`), [r1, r0]);
    assert.deepEqual(await ids('from=2025-06-01&to=2025-06-02'), [r1, r0], 'a date is its UTC midnight');
    assert.deepEqual(await ids(`from=${encodeURIComponent('2025-06-02T02:00:00+02:00')}`), [r2], 'offsets are honoured');
    assert.deepEqual(await ids(`from=${t1.toISOString()}&to=${encodeURIComponent('2025-06-01T12:00:00.0015Z')}`), [r1],
      'a finer fraction keeps both bounds exact');
    // The organisation list applies the same bounds.
    const orgIds = (await listAll(t, `/v1/transactions?walletId=${wallet.wallet_id}&from=2025-06-01T12:00:00.001Z&to=2025-06-02T00:00:00Z`))
      .map((row) => row.tx_id);
    assert.deepEqual(orgIds, [r1]);
  });

  test('pages stay stable while new transactions arrive between them', async () => {
    const wallet = await newWallet(t);
    const base = Date.parse('2025-07-01T00:00:00.000Z');
    const original: string[] = [];
    for (let i = 0; i < 5; i += 1) original.unshift(await insertRow(t, { walletId: wallet.wallet_id, createdAt: new Date(base + i * 1000) }));
    // Two rows at one instant: the id orders them, so neither is skipped nor repeated.
    const twinTime = new Date(base + 2500);
    const twins = [await insertRow(t, { walletId: wallet.wallet_id, createdAt: twinTime }),
      await insertRow(t, { walletId: wallet.wallet_id, createdAt: twinTime })].sort().reverse();
    original.splice(2, 0, ...twins);

    const seen: string[] = [];
    let cursor: string | null = null;
    let pages = 0;
    do {
      const query: string = `limit=2${cursor ? `&cursor=${cursor}` : ''}`;
      const response = await t.request('GET', `/v1/wallets/${wallet.wallet_id}/transactions?${query}`);
      assert.equal(response.status, 200, JSON.stringify(response.body));
      assert.ok(response.body.data.length <= 2, 'a page holds at most limit rows');
      seen.push(...response.body.data.map((row: any) => row.tx_id));
      cursor = response.body.next_cursor;
      assert.equal(response.body.has_more, cursor !== null);
      // Newer rows land between the pages: a funding through the API, and one written directly.
      if (pages === 0) await fund(t, wallet.wallet_id, '1');
      await insertRow(t, { walletId: wallet.wallet_id, createdAt: new Date(base + 60_000 + pages) });
      pages += 1;
    } while (cursor !== null && pages < 10);
    assert.deepEqual(seen, original);
    assert.equal(pages, 4);

    const orgPage = await t.request('GET', `/v1/transactions?walletId=${wallet.wallet_id}&limit=3`);
    assert.equal(orgPage.body.data.length, 3);
    assert.equal(orgPage.body.has_more, true);
    const next = await t.request('GET', `/v1/transactions?walletId=${wallet.wallet_id}&limit=3&cursor=${orgPage.body.next_cursor}`);
    assert.ok(next.body.data.every((row: any) => !orgPage.body.data.some((seenRow: any) => seenRow.tx_id === row.tx_id)), 'no row twice');
  });

  test('the wallet list holds only that wallet\'s transactions and takes the same filters', async () => {
    const rows = await listAll(t, `/v1/wallets/${walletA.wallet_id}/transactions`);
    assert.deepEqual(rows.map((row) => row.tx_id).sort(), [funding.tx_id, withdrawalId, blockedId].sort());
    const confirmed = await listAll(t, `/v1/wallets/${walletA.wallet_id}/transactions?status=confirmed&type=funding`);
    assert.deepEqual(confirmed.map((row) => row.tx_id), [funding.tx_id]);
    const unknown = await t.request('GET', '/v1/wallets/wal_unknown/transactions');
    assert.equal(unknown.status, 404);
    assert.equal(unknown.body.error.code, 'wallet_not_found');
    // recipient and walletId belong to the organisation list only.
    for (const query of ['recipient=x', `walletId=${walletB.wallet_id}`]) {
      const response = await t.request('GET', `/v1/wallets/${walletA.wallet_id}/transactions?${query}`);
      assert.equal(response.status, 400, query);
      assert.equal(response.body.error.code, 'invalid_request');
    }
  });

  test('bad filters, limits and cursors are 400 invalid_request naming the parameter', async () => {
    const cases: Array<[string, string]> = [
      ['status=settled', 'status'], ['type=deposit', 'type'], ['type=', 'type'], ['from=yesterday', 'from'],
      ['to=2026-04-01T10:00:00', 'to'], ['from=2026-04-02&to=2026-04-01', 'to'], ['from=2026-04-01&to=2026-04-01', 'to'],
      ['limit=101', 'limit'], ['limit=0', 'limit'], ['limit=ten', 'limit'], ['cursor=garbage', 'cursor'],
      ['sort=asc', 'sort'], [`walletId=${walletA.wallet_id}&wallet_id=${walletA.wallet_id}`, 'wallet_id'],
      [`recipient=${'x'.repeat(257)}`, 'recipient'], ['status=blocked&status=failed', 'status'],
      // Well-formed cursors whose instant no timestamp holds (past JavaScript's dates, before PostgreSQL's, past the year 9999).
      ...[9_007_199_254_740_991, -8_640_000_000_000_000, Date.UTC(10_000, 0, 1)].map((ms): [string, string] =>
        [`cursor=${Buffer.from(JSON.stringify([ms, 'tx_x'])).toString('base64url')}`, 'cursor']),
      // Instants PostgreSQL has no timestamp for, and NUL characters, which it stores nowhere.
      ['from=0000-01-01', 'from'], [`to=${encodeURIComponent('9999-12-31T23:00:00-02:00')}`, 'to'],
      ['recipient=%00', 'recipient'], ['walletId=wal%00x', 'wallet_id'],
      [`cursor=${Buffer.from(JSON.stringify([Date.UTC(2026, 0, 1), 'tx_\u0000'])).toString('base64url')}`, 'cursor'],
    ];
    for (const [query, param] of cases) {
      const response = await t.request('GET', `/v1/transactions?${query}`);
      assert.equal(response.status, 400, query);
      assert.equal(response.body.error.code, 'invalid_request', query);
      assert.equal(response.body.error.param, param, query);
    }
    const walletList = await t.request('GET', `/v1/wallets/${walletA.wallet_id}/transactions?limit=101`);
    assert.equal(walletList.status, 400);
    assert.equal(walletList.body.error.param, 'limit');
    const walletTo = await t.request('GET', `/v1/wallets/${walletA.wallet_id}/transactions?to=${encodeURIComponent('9999-12-31T23:00:00-02:00')}`);
    assert.equal(walletTo.status, 400, JSON.stringify(walletTo.body));
    assert.equal(walletTo.body.error.param, 'to');
    for (const path of ['/v1/transactions/tx%00', '/v1/payments/tx%00']) {
      const byId = await t.request('GET', path);
      assert.equal(byId.status, 400, `${path}: ${JSON.stringify(byId.body)}`);
      assert.equal(byId.body.error.code, 'invalid_request');
    }
  });

  test('another organisation\'s transactions answer exactly like missing ones and are never listed', async () => {
    const other = await t.createOrganization('Transaction isolation');
    const missing = await t.request('GET', '/v1/transactions/tx_doesnotexist', { key: other.adminKey });
    const foreign = await t.request('GET', `/v1/transactions/${funding.tx_id}`, { key: other.adminKey });
    assert.equal(missing.status, 404);
    assert.equal(foreign.status, 404);
    assert.equal(foreign.body.error.code, 'transaction_not_found');
    assert.equal(foreign.body.error.code, missing.body.error.code);
    assert.equal(foreign.body.error.param, missing.body.error.param);
    const viaPayments = await t.request('GET', `/v1/payments/${funding.tx_id}`, { key: other.adminKey });
    assert.equal(viaPayments.status, 404);
    assert.equal(viaPayments.body.error.code, 'transaction_not_found');

    await deposit(t, '3', other.adminKey);
    const theirWallet = await newWallet(t, other.adminKey);
    const theirFunding = await fund(t, theirWallet.wallet_id, '1', other.adminKey);
    const theirs = await listAll(t, '/v1/transactions?limit=100', other.adminKey);
    assert.deepEqual(theirs.map((row) => row.tx_id), [theirFunding.tx_id]);
    const filtered = await t.request('GET', `/v1/transactions?walletId=${walletA.wallet_id}`, { key: other.adminKey });
    assert.equal(filtered.status, 404, 'our vault as their filter answers as a missing one');
    assert.equal(filtered.body.error.code, 'wallet_not_found');
    const ours = await listAll(t, '/v1/transactions?limit=100');
    assert.ok(!ours.some((row) => row.tx_id === theirFunding.tx_id), 'their funding is not in our list');
    const walletList = await t.request('GET', `/v1/wallets/${walletA.wallet_id}/transactions`, { key: other.adminKey });
    assert.equal(walletList.status, 404);
    assert.equal(walletList.body.error.code, 'wallet_not_found');
  });

  test('a filter matching few of many rows is an index range scan, not a walk of the organisation', async () => {
    const busy = await t.createOrganization('Busy filters');
    const wallet = await newWallet(t, busy.adminKey);
    const { db } = t.service.ctx;
    await db.query(
      `INSERT INTO transactions (id, org_id, wallet_id, type, status, amount, recipient, created_at, updated_at)
       SELECT 'tx_filterseed' || lpad(g::text, 9, '0'), $1, $2, 'payment', 'confirmed', 10000, 'api.example.com',
              timestamptz '2026-01-01' + g * interval '1 second', timestamptz '2026-01-01'
       FROM generate_series(1, 20000) g`, [busy.orgId, wallet.wallet_id]);
    await db.query('ANALYZE transactions');
    // Planned for any value of its parameters (a generic plan, which PostgreSQL uses for a
    // prepared statement after its fifth run): a partial index must be provable from the SQL.
    const literal = (value: unknown) => `'${(value instanceof Date ? value.toISOString() : String(value)).replace(/'/g, "''")}'`;
    const indexesUsed = (filter: TransactionFilter): Promise<string[]> => db.transaction(async (tx) => {
      let statement = { sql: '', params: [] as readonly unknown[] };
      const recorder = { query: async (sql: string, params: readonly unknown[] = []) => { statement = { sql, params }; return []; }, exec: async () => {} };
      await listTransactions(recorder as Queryable, busy.orgId, filter, { limit: 1, after: null });
      await tx.query('SET LOCAL plan_cache_mode = force_generic_plan');
      await tx.query(`PREPARE filter_probe AS ${statement.sql}`);
      const [plan] = await tx.query(`EXPLAIN (FORMAT JSON) EXECUTE filter_probe(${statement.params.map(literal).join(', ')})`);
      await tx.query('DEALLOCATE filter_probe');
      return [...JSON.stringify(plan).matchAll(/"Index Name":"([a-z_]+)"/g)].map((match) => match[1]!);
    });
    for (const [filter, index, query] of [
      [{ recipient: 'rare.example' }, 'transactions_org_recipient', 'recipient=rare.example'],
      [{ type: 'withdrawal' }, 'transactions_org_type', 'type=withdrawal'],
      [{ status: 'failed' }, 'transactions_org_status', 'status=failed'],
    ] as Array<[TransactionFilter, string, string]>) {
      assert.deepEqual(await indexesUsed(filter), [index], query);
      const page = await t.request('GET', `/v1/transactions?limit=1&${query}`, { key: busy.adminKey });
      assert.equal(page.status, 200, JSON.stringify(page.body));
      assert.deepEqual(page.body.data, [], query);
    }
    await db.query(`DELETE FROM transactions WHERE org_id = $1 AND id LIKE 'tx_filterseed%'`, [busy.orgId]);
  });

  test('a viewer reads everything; an agent reads only its vault, with its session token', async () => {
    const viewer = await t.createKey('viewer');
    for (const url of [`/v1/transactions/${funding.tx_id}`, `/v1/payments/${funding.tx_id}`, '/v1/transactions?limit=100',
      `/v1/wallets/${walletA.wallet_id}/transactions?limit=100`]) {
      const [asViewer, asAdmin] = [await t.request('GET', url, { key: viewer }), await t.request('GET', url)];
      assert.equal(asViewer.status, 200, url);
      assert.deepEqual(asViewer.body, asAdmin.body, `${url}: what the admin reads`);
    }

    const agent = await t.createKey('agent');
    for (const url of ['/v1/transactions', `/v1/transactions/${funding.tx_id}`]) {
      const response = await t.request('GET', url, { key: agent });
      assert.equal(response.status, 403, url);
      assert.equal(response.body.error.code, 'insufficient_permissions');
    }
    const url = `/v1/wallets/${walletA.wallet_id}/transactions`;
    const withoutToken = await t.request('GET', url, { key: agent });
    assert.equal(withoutToken.status, 403);
    assert.equal(withoutToken.body.error.code, 'session_token_invalid');
    const rotated = await t.request('POST', `/v1/wallets/${walletA.wallet_id}/rotate-token`, { body: {} });
    assert.equal(rotated.status, 200, JSON.stringify(rotated.body));
    const headers = { 'session-token': rotated.body.session_token as string };
    const withToken = await t.request('GET', url, { key: agent, headers });
    assert.equal(withToken.status, 200);
    assert.ok(withToken.body.data.length > 0);
    assert.deepEqual(withToken.body, (await t.request('GET', url)).body, 'its vault\'s, as the admin reads them');
    assert.equal((await t.request('GET', `/v1/payments/${funding.tx_id}`, { key: agent, headers })).status, 200);
    const foreignTx = await t.request('GET', `/v1/payments/${failedId}`, { key: agent, headers });
    assert.equal(foreignTx.status, 403);
    assert.equal(foreignTx.body.error.code, 'session_token_invalid');
    const foreignWallet = await t.request('GET', `/v1/wallets/${walletB.wallet_id}/transactions`, { key: agent, headers });
    assert.equal(foreignWallet.status, 403);
    assert.equal(foreignWallet.body.error.code, 'session_token_invalid');

    const anonymous = await t.request('GET', '/v1/transactions', { key: null });
    assert.equal(anonymous.status, 401);
    assert.equal(anonymous.body.error.code, 'authentication_failed');
  });
});
