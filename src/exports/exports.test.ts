/**
 * Transaction exports through the real HTTP stack, database and job runner: request, build (the
 * `exports.build` job, run by hand), poll, download; checked against GET /v1/transactions, which
 * is the truth an export must reproduce. The CSV is parsed here with an RFC 4180 parser of the
 * test's own, so a quoting bug in the writer cannot hide behind a matching bug in a reader.
 */
import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer, request as httpRequest } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { startTestService, type TestService } from '../../test/harness.ts';
import { fundedWallet, newPolicy, newRecipient } from '../../test/fixtures.ts';
import { listMigrations, migrate } from '../db/migrate.ts';
import { newId } from '../ids/ids.ts';
import { ExportCommandError, runExportCommand } from './command.ts';
import {
  BUILD_ATTEMPTS_MAX, BUILD_LEASE_MS, KEPT_PER_ORG_MAX, KEPT_ROWS_PER_ORG_MAX, PROCESSING_PER_ORG_MAX, claimExport,
} from './exports.ts';
import { ContentWriter } from './storage.ts';

type View = Record<string, any>;

const COLUMNS = [
  'tx_id', 'wallet_id', 'type', 'recipient', 'amount', 'currency', 'status', 'tx_signature', 'on_chain_slot', 'policy_id',
  'policy_triggered', 'violation_rule', 'violation_limit', 'violation_attempted', 'memo', 'agent_attestation_hash',
  'explorer_url', 'explorer_url_alt', 'failure_reason', 'approval_required', 'approval_status', 'approval_expires_at',
  'approval_decided_by', 'approval_decided_at', 'timestamp', 'settled_at', 'category', 'attested_at', 'escrow_id', 'batch_id',
];

/** RFC 4180: fields separated by commas, records ended by CRLF, quoted fields with doubled quotes. */
function parseCsv(text: string): string[][] {
  const records: string[][] = [];
  let record: string[] = [];
  let field = '';
  let quoted = false;
  let wasQuoted = false;
  for (let i = 0; i < text.length; i += 1) {
    const c = text[i]!;
    if (quoted) {
      if (c === '"' && text[i + 1] === '"') { field += '"'; i += 1; } else if (c === '"') quoted = false; else field += c;
    } else if (c === '"') {
      assert.ok(field === '' && !wasQuoted, `a quote inside an unquoted field at ${i}`);
      quoted = true;
      wasQuoted = true;
    } else if (c === ',') {
      record.push(field); field = ''; wasQuoted = false;
    } else if (c === '\r' && text[i + 1] === '\n') {
      record.push(field); records.push(record); record = []; field = ''; wasQuoted = false; i += 1;
    } else {
      assert.ok(c !== '\r' && c !== '\n', `a bare line break outside quotes at ${i}`);
      assert.ok(!wasQuoted, `text after a closing quote at ${i}`);
      field += c;
    }
  }
  assert.ok(!quoted && field === '' && record.length === 0, 'the file ends with a complete record and CRLF');
  return records;
}

/** What the CSV must hold for a view: the API's value, as text, neutralised when a spreadsheet would run it. */
function expectedCells(view: View): string[] {
  return COLUMNS.map((column) => {
    let value: unknown = view[column];
    if (!(column in view)) {
      const field = ['violation', 'approval'].find((name) => column.startsWith(`${name}_`))!;
      value = view[field] === null ? null : view[field][column.slice(field.length + 1)];
    }
    const text = value === null || value === undefined ? '' : String(value);
    return /^[=+\-@\t\r]/.test(text) ? `'${text}` : text;
  });
}

/**
 * A download as raw text, as a client receives it: the harness's request() parses any body whose
 * content type mentions json, which would hide whether the file itself parses.
 */
async function download(t: TestService, url: string, key: string | null = t.adminKey) {
  const response = await t.service.app.inject({ method: 'GET', url, headers: key === null ? {} : { authorization: `Bearer ${key}` } });
  return { status: response.statusCode, body: response.body, headers: response.headers };
}

/**
 * Large objects belong to the database, not to the schema a PostgreSQL test run drops: the
 * files this run made are deleted first, so test runs leave nothing behind.
 */
async function closeDeletingFiles(t: TestService): Promise<void> {
  await t.service.ctx.db.query('SELECT lo_unlink(content_oid) FROM exports WHERE content_oid IS NOT NULL');
  await t.close();
}

describe('transaction exports', () => {
  let t: TestService;
  let walletA: string;
  let walletB: string;
  let recipient: string;
  let other: { orgId: string; adminKey: string };
  let viewerKey: string;
  let agentKey: string;
  const memos = [
    'plain', 'comma, and "quotes"', 'two\nlines', 'crlf\r\ninside', 'café ✓ 日本',
    '=HYPERLINK("http://evil.example","click")', '+1+1', '-2+3', '@SUM(A1:A9)', '\t=1',
  ];

  before(async () => {
    t = await startTestService();
    viewerKey = await t.createKey('viewer');
    agentKey = await t.createKey('agent');
    other = await t.createOrganization();
    walletA = (await fundedWallet(t, '200')).wallet_id;
    walletB = (await fundedWallet(t, '200', await newPolicy(t, { maxPerTx: '5', requireCoSign: '3' }))).wallet_id;
    recipient = await newRecipient();
    for (const memo of memos) {
      const paid = await t.request('POST', '/v1/payments', { body: { walletId: walletA, to: recipient, amount: '1.25', currency: 'USDC', memo } });
      assert.equal(paid.status, 200, JSON.stringify(paid.body));
    }
    const payee = await newRecipient();
    // Blocked (violation filled in), awaiting a co-signature (approval filled in), and plain.
    assert.equal((await t.request('POST', '/v1/payments', { body: { walletId: walletB, to: payee, amount: '9', currency: 'USDC' } })).status, 402);
    assert.equal((await t.request('POST', '/v1/payments', { body: { walletId: walletB, to: payee, amount: '4', currency: 'USDC' } })).status, 200);
    assert.equal((await t.request('POST', '/v1/payments', { body: { walletId: walletB, to: payee, amount: '0.5', currency: 'USDC' } })).status, 200);
    await t.service.jobs.runOnce();
  });
  after(async () => { await closeDeletingFiles(t); });

  async function listAll(query = ''): Promise<View[]> {
    const rows: View[] = [];
    let cursor: string | null = null;
    do {
      const response: { status: number; body: any } = await t.request('GET', `/v1/transactions?limit=100${query}${cursor ? `&cursor=${cursor}` : ''}`);
      assert.equal(response.status, 200, JSON.stringify(response.body));
      rows.push(...response.body.data);
      cursor = response.body.next_cursor;
    } while (cursor);
    return rows;
  }

  /** Requests an export, runs the build job, and answers the ready export and its file. */
  async function exportOf(body: Record<string, unknown>, key?: string) {
    const created = await t.request('POST', '/v1/transactions/export', { body, key });
    assert.equal(created.status, 200, JSON.stringify(created.body));
    assert.equal(created.body.status, 'processing');
    assert.equal(created.body.download_url, null);
    await t.service.jobs.runOnce();
    const ready = await t.request('GET', `/v1/transactions/exports/${created.body.export_id}`, { key });
    assert.equal(ready.status, 200, JSON.stringify(ready.body));
    assert.equal(ready.body.status, 'ready', JSON.stringify(ready.body));
    const file = await download(t, ready.body.download_url, key ?? t.adminKey);
    assert.equal(file.status, 200, String(file.body));
    return { created: created.body, ready: ready.body, file };
  }

  async function exportedJson(body: Record<string, unknown>): Promise<View[]> {
    const { file } = await exportOf({ ...body, format: 'json' });
    return JSON.parse(String(file.body));
  }

  test('a CSV export holds every transaction of the organisation exactly once, with the transaction view\'s fields', async () => {
    const expected = await listAll();
    assert.ok(expected.length >= memos.length + 5, 'the set-up made the transactions');
    const { created, ready, file } = await exportOf({ format: 'csv' });
    assert.match(created.export_id, /^exp_/);
    assert.ok(Date.parse(created.estimated_ready_at) >= Date.parse(created.created_at), 'estimated after the request');
    assert.equal(ready.row_count, expected.length);
    assert.equal(ready.download_url, `/v1/transactions/exports/${created.export_id}/download`);
    assert.equal(ready.size_bytes, Buffer.byteLength(String(file.body), 'utf8'));
    assert.equal(Date.parse(ready.expires_at) - Date.parse(ready.ready_at), 24 * 3_600_000, 'downloadable for 24 hours (docs/exports.md)');
    const [header, ...records] = parseCsv(String(file.body));
    assert.deepEqual(header, COLUMNS);
    assert.equal(records.length, expected.length);
    const byId = new Map(records.map((record) => [record[0], record]));
    assert.equal(byId.size, records.length, 'no transaction twice');
    for (const view of expected) assert.deepEqual(byId.get(view.tx_id), expectedCells(view), view.tx_id);
    // Newest first, as the lists are.
    assert.deepEqual(records.map((record) => record[0]), expected.map((view) => view.tx_id));
  });

  // SPEC: `format` is `csv` or JSON. A developer who asks for JSON calls JSON.parse on the file:
  // it must be one document, whatever the number of rows, holding what the CSV holds.
  test('a JSON export is one JSON array: JSON.parse gives the transactions of the CSV export of the same filter', async () => {
    for (const [filter, query] of [[{}, ''], [{ walletId: walletA }, `&walletId=${walletA}`]] as const) {
      const expected = await listAll(query);
      assert.ok(expected.length >= 2, `${query}: more than one row, where JSON Lines stops parsing`);
      const json = await exportOf({ ...filter, format: 'json' });
      const csv = await exportOf({ ...filter, format: 'csv' });
      const rows: View[] = JSON.parse(String(json.file.body));
      assert.ok(Array.isArray(rows), 'one array');
      assert.deepEqual(rows, expected, `${query}: each element the transaction exactly as the API shows it`);
      assert.deepEqual(rows.map(expectedCells), parseCsv(String(csv.file.body)).slice(1), `${query}: the rows of the CSV`);
      assert.equal(json.ready.row_count, rows.length);
      // The brackets and commas are counted in the size shown and sent.
      assert.equal(json.ready.size_bytes, Buffer.byteLength(String(json.file.body), 'utf8'));
      assert.equal(json.file.headers['content-length'], String(json.ready.size_bytes));
    }
  });

  // JSON Lines stays available for readers that take a row at a time (jq -c, pandas lines=True).
  test('a JSON Lines export (jsonl) is one transaction per line, exactly as the API shows it', async () => {
    const expected = await listAll();
    const { file, ready } = await exportOf({ format: 'jsonl' });
    assert.equal(ready.format, 'jsonl');
    assert.equal(ready.row_count, expected.length);
    const text = String(file.body);
    assert.ok(text.endsWith('}\n'), 'every line ends with a newline');
    assert.deepEqual(text.split('\n').slice(0, -1).map((line) => JSON.parse(line)), expected);
    assert.equal(ready.size_bytes, Buffer.byteLength(text, 'utf8'));
  });

  test('the CSV neutralises cells a spreadsheet would run as formulas; JSON keeps the memo as written', async () => {
    const { file } = await exportOf({ format: 'csv', walletId: walletA, type: 'payment' });
    const records = parseCsv(String(file.body));
    const memo = records[0]!.indexOf('memo');
    const shown = new Set(records.slice(1).map((record) => record[memo]));
    for (const formula of ['=HYPERLINK("http://evil.example","click")', '+1+1', '-2+3', '@SUM(A1:A9)', '\t=1']) {
      assert.ok(shown.has(`'${formula}`), `${JSON.stringify(formula)} is neutralised`);
      assert.ok(!shown.has(formula), `${JSON.stringify(formula)} never appears raw`);
    }
    for (const text of ['plain', 'comma, and "quotes"', 'two\nlines', 'crlf\r\ninside', 'café ✓ 日本']) {
      assert.ok(shown.has(text), `${JSON.stringify(text)} round-trips`);
    }
    const json = await exportedJson({ walletId: walletA, type: 'payment' });
    assert.deepEqual(new Set(json.map((view) => view.memo)), new Set(memos));
  });

  test('each filter selects exactly what the transaction list selects with it', async () => {
    const all = await listAll();
    const middle = all[Math.floor(all.length / 2)]!.timestamp as string;
    const cases: Array<[Record<string, string>, string]> = [
      [{ walletId: walletA }, `&walletId=${walletA}`],
      [{ wallet_id: walletB }, `&wallet_id=${walletB}`],
      [{ status: 'blocked' }, '&status=blocked'],
      [{ status: 'pending' }, '&status=pending'],
      [{ type: 'funding' }, '&type=funding'],
      [{ recipient }, `&recipient=${recipient}`],
      [{ from: middle }, `&from=${middle}`],
      [{ to: middle }, `&to=${middle}`],
      [{ walletId: walletB, type: 'payment', status: 'confirmed' }, `&walletId=${walletB}&type=payment&status=confirmed`],
    ];
    for (const [body, query] of cases) {
      const expected = await listAll(query);
      assert.ok(expected.length > 0, `${query} selects something`);
      assert.ok(expected.length < all.length, `${query} leaves something out`);
      assert.deepEqual(await exportedJson(body), expected, query);
    }
  });

  test('an export that selects nothing is ready: CSV with the header alone, JSON [], JSON Lines empty', async () => {
    const csv = await exportOf({ format: 'csv', from: '2001-01-01', to: '2001-01-02' });
    assert.equal(csv.ready.row_count, 0);
    assert.deepEqual(parseCsv(String(csv.file.body)), [COLUMNS]);
    const json = await exportOf({ format: 'json', type: 'escrow_refund' });
    assert.equal(json.ready.row_count, 0);
    assert.equal(json.file.body, '[]');
    assert.deepEqual(JSON.parse(String(json.file.body)), []);
    assert.equal(json.ready.size_bytes, 2);
    assert.equal(json.file.headers['content-length'], '2');
    const jsonl = await exportOf({ format: 'jsonl', type: 'escrow_refund' });
    assert.equal(jsonl.ready.row_count, 0);
    assert.equal(jsonl.ready.size_bytes, 0);
    assert.equal(jsonl.file.body, '');
    assert.equal(jsonl.file.headers['content-length'], '0');
  });

  test('transactions recorded after the request are not in the export', async () => {
    const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'json', walletId: walletA } });
    const before = await listAll(`&walletId=${walletA}`);
    const paid = await t.request('POST', '/v1/payments', { body: { walletId: walletA, to: recipient, amount: '0.01', currency: 'USDC' } });
    assert.equal(paid.status, 200);
    await t.service.jobs.runOnce();
    const ready = await t.request('GET', `/v1/transactions/exports/${created.body.export_id}`);
    assert.equal(ready.body.row_count, before.length);
    const file = await download(t, ready.body.download_url);
    assert.ok(!String(file.body).includes(paid.body.tx_id), 'the later payment is not exported');
  });

  test('the download names its content type and file', async () => {
    const csv = await exportOf({ format: 'csv', type: 'funding' });
    assert.equal(csv.file.headers['content-type'], 'text/csv; charset=utf-8; header=present');
    assert.equal(csv.file.headers['content-disposition'], `attachment; filename="transactions-${csv.created.export_id}.csv"`);
    assert.equal(csv.file.headers['content-length'], String(csv.ready.size_bytes));
    assert.equal(csv.ready.file_name, `transactions-${csv.created.export_id}.csv`);
    // HEAD: the same headers, and the file is not read from storage.
    const { db } = t.service.ctx;
    const query = db.query;
    let reads = 0;
    db.query = ((text: string, params?: unknown[]) => {
      if (text.includes('lo_get')) reads += 1;
      return query.call(db, text, params);
    }) as typeof db.query;
    try {
      const head = await t.service.app.inject({ method: 'HEAD', url: csv.ready.download_url, headers: { authorization: `Bearer ${t.adminKey}` } });
      assert.equal(head.statusCode, 200);
      assert.equal(head.headers['content-length'], String(csv.ready.size_bytes));
      assert.equal(head.headers['content-disposition'], csv.file.headers['content-disposition']);
      assert.equal(head.rawPayload.length, 0);
    } finally {
      db.query = query;
    }
    assert.equal(reads, 0, 'HEAD read none of the file');
    const json = await exportOf({ format: 'json', type: 'funding' });
    assert.equal(json.file.headers['content-type'], 'application/json');
    assert.equal(json.file.headers['content-disposition'], `attachment; filename="transactions-${json.created.export_id}.json"`);
    assert.equal(json.ready.file_name, `transactions-${json.created.export_id}.json`);
    const jsonHead = await t.service.app.inject({ method: 'HEAD', url: json.ready.download_url, headers: { authorization: `Bearer ${t.adminKey}` } });
    assert.equal(jsonHead.statusCode, 200);
    assert.equal(jsonHead.headers['content-type'], 'application/json');
    assert.equal(jsonHead.headers['content-length'], String(json.ready.size_bytes));
    const jsonl = await exportOf({ format: 'jsonl', type: 'funding' });
    assert.equal(jsonl.file.headers['content-type'], 'application/x-ndjson; charset=utf-8');
    assert.equal(jsonl.file.headers['content-disposition'], `attachment; filename="transactions-${jsonl.created.export_id}.jsonl"`);
    assert.equal(jsonl.ready.file_name, `transactions-${jsonl.created.export_id}.jsonl`);
  });

  test('a ready export writes export.ready to the activity feed', async () => {
    const { created, ready } = await exportOf({ format: 'csv', walletId: walletB });
    const events = await t.request('GET', `/v1/events?type=export.ready&walletId=${walletB}`);
    assert.equal(events.status, 200, JSON.stringify(events.body));
    const event = events.body.data.find((e: View) => JSON.stringify(e).includes(created.export_id));
    assert.ok(event, 'export.ready names the export');
    assert.ok(JSON.stringify(event).includes(ready.download_url), 'and its download');
  });

  test('bad filters answer 400 with the field; nothing is created', async () => {
    const cases: Array<[Record<string, unknown>, string]> = [
      [{}, 'format'],
      [{ format: 'xml' }, 'format'],
      [{ format: 'ndjson' }, 'format'],
      [{ format: 'JSON' }, 'format'],
      [{ format: 'csv', from: 'yesterday' }, 'from'],
      [{ format: 'csv', to: '2026-04-01T10:00:00' }, 'to'],
      [{ format: 'csv', from: '2026-04-02', to: '2026-04-01' }, 'to'],
      [{ format: 'csv', status: 'lost' }, 'status'],
      [{ format: 'csv', type: 'gift' }, 'type'],
      [{ format: 'csv', limit: 10 }, 'limit'],
      [{ format: 'csv', walletId: walletA, wallet_id: walletA }, 'wallet_id'],
      [{ format: 'csv', walletId: '' }, 'wallet_id'],
    ];
    const countExports = async () => (await t.service.ctx.db.query<{ n: bigint }>('SELECT count(*)::bigint AS n FROM exports'))[0]!.n;
    const before = await countExports();
    for (const [body, param] of cases) {
      const response = await t.request('POST', '/v1/transactions/export', { body });
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, 'invalid_request', JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    const unknownWallet = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv', walletId: 'wal_nope' } });
    assert.equal(unknownWallet.status, 404);
    assert.equal(unknownWallet.body.error.code, 'wallet_not_found');
    assert.equal(await countExports(), before);
  });

  test('the API\'s schema lists the three formats, and a request for another answers 400 on format', async () => {
    const openapi = await t.request('GET', '/openapi.json', { key: null });
    assert.equal(openapi.status, 200);
    const format = openapi.body.paths['/v1/transactions/export'].post.requestBody.content['application/json'].schema.properties.format;
    assert.deepEqual(format.anyOf.flatMap((option: View) => option.enum), ['csv', 'json', 'jsonl']);
    const refused = await t.request('POST', '/v1/transactions/export', { body: { format: 'ndjson' } });
    assert.equal(refused.status, 400);
    assert.equal(refused.body.error.code, 'invalid_request');
    assert.equal(refused.body.error.param, 'format');
  });

  test('another organisation\'s export answers 404, like a missing one, for the export and its file', async () => {
    const { created } = await exportOf({ format: 'csv' });
    for (const url of [`/v1/transactions/exports/${created.export_id}`, `/v1/transactions/exports/${created.export_id}/download`]) {
      const foreign = await t.request('GET', url, { key: other.adminKey });
      assert.equal(foreign.status, 404, url);
      assert.equal(foreign.body.error.code, 'export_not_found');
      const missing = await t.request('GET', url.replace(created.export_id, 'exp_missing'));
      assert.equal(missing.status, 404);
      assert.equal(missing.body.error.code, 'export_not_found');
    }
    // Nor does the other organisation's export hold our transactions, or our wallet filter work there.
    const theirs = await t.request('POST', '/v1/transactions/export', { key: other.adminKey, body: { format: 'json', walletId: walletA } });
    assert.equal(theirs.status, 404);
    assert.equal(theirs.body.error.code, 'wallet_not_found');
  });

  test('a viewer may export (a read); an agent key may not; no key is refused', async () => {
    const { ready } = await exportOf({ format: 'csv', type: 'funding' }, viewerKey);
    assert.ok(ready.row_count > 0, 'the viewer got the rows');
    const agent = await t.request('POST', '/v1/transactions/export', { key: agentKey, body: { format: 'csv' } });
    assert.equal(agent.status, 403);
    assert.equal(agent.body.error.code, 'insufficient_permissions');
    assert.equal((await t.request('GET', ready.download_url, { key: agentKey })).status, 403);
    assert.equal((await t.request('GET', ready.download_url, { key: null })).status, 401);
    assert.equal((await t.request('POST', '/v1/transactions/export', { key: null, body: { format: 'csv' } })).status, 401);
  });

  test('the download of an export still processing answers 404 with its state', async () => {
    const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv' } });
    const early = await t.request('GET', `/v1/transactions/exports/${created.body.export_id}/download`);
    assert.equal(early.status, 404);
    assert.equal(early.body.error.code, 'export_not_found');
    assert.match(early.body.error.message, /processing/);
    await t.service.jobs.runOnce();
  });

  test(`at most ${PROCESSING_PER_ORG_MAX} exports of an organisation wait at once; the next answers 429`, async () => {
    const ids: string[] = [];
    for (let i = 0; i < PROCESSING_PER_ORG_MAX; i += 1) {
      const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv', type: 'funding' } });
      assert.equal(created.status, 200, JSON.stringify(created.body));
      ids.push(created.body.export_id);
    }
    const refused = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv' } });
    assert.equal(refused.status, 429);
    assert.equal(refused.body.error.code, 'rate_limited');
    assert.ok(refused.headers['retry-after'], 'Retry-After is set');
    // Another organisation is not held up by this one's queue.
    assert.equal((await t.request('POST', '/v1/transactions/export', { key: other.adminKey, body: { format: 'csv' } })).status, 200);
    // Six to build, the other organisation's in its turn (second): two runs of the job.
    await t.service.jobs.runOnce();
    await t.service.jobs.runOnce();
    for (const id of ids) assert.equal((await t.request('GET', `/v1/transactions/exports/${id}`)).body.status, 'ready');
    assert.equal((await t.request('POST', '/v1/transactions/export', { body: { format: 'csv', type: 'funding' } })).status, 200);
    await t.service.jobs.runOnce();
  });

  test(`what an organisation keeps is bounded: ${KEPT_PER_ORG_MAX} exports or ${KEPT_ROWS_PER_ORG_MAX} rows, processing or ready and unexpired`, async () => {
    const org = await t.createOrganization('Hoarding exporter');
    const { db } = t.service.ctx;
    const nowMs = t.service.ctx.clock.nowMs();
    const keep = (rows: number, expiresInMs: number) => db.query(
      `INSERT INTO exports (id, org_id, format, status, filter, estimated_rows, estimated_ready_at, content_oid, row_count, size_bytes,
         created_by, created_at, ready_at, expires_at, updated_at)
       VALUES ($1, $2, 'csv', 'ready', '{}', $3, $4, 1, $3, 0, 'test', $4, $4, $5, $4)`,
      [newId('exp', nowMs), org.orgId, rows, new Date(nowMs), new Date(nowMs + expiresInMs)]);
    const ask = () => t.request('POST', '/v1/transactions/export', { key: org.adminKey, body: { format: 'csv' } });
    try {
      // Files ready and kept, one short of the count; an expired one does not count.
      for (let i = 0; i < KEPT_PER_ORG_MAX - 1; i += 1) await keep(0, 3_600_000);
      await keep(0, -1);
      const last = await ask();
      assert.equal(last.status, 200, JSON.stringify(last.body));
      const refused = await ask();
      assert.equal(refused.status, 429, JSON.stringify(refused.body));
      assert.equal(refused.body.error.code, 'rate_limited');
      assert.match(refused.body.error.message, /keeps/);
      const retryAfterS = Number(refused.headers['retry-after']);
      assert.ok(retryAfterS > 3_000 && retryAfterS <= 3_600, `Retry-After ${retryAfterS}: until the first file kept expires, not 60`);
      await db.query('DELETE FROM exports WHERE org_id = $1', [org.orgId]);
      // A file of every row an organisation may keep: the next export (of its funding) does not fit.
      await fundedWallet(t, '1', 'pol_permissive', org.adminKey);
      await keep(KEPT_ROWS_PER_ORG_MAX, 3_600_000);
      const tooMany = await ask();
      assert.equal(tooMany.status, 429, JSON.stringify(tooMany.body));
      assert.match(tooMany.body.error.message, /rows/);
    } finally {
      await db.query('DELETE FROM exports WHERE org_id = $1', [org.orgId]);
    }
  });

  test('agent-vault export polls, downloads with a progress bar and writes the file', async () => {
    await t.service.app.listen({ port: 0, host: '127.0.0.1' });
    const address = t.service.app.server.address() as { port: number };
    const dir = mkdtempSync(join(tmpdir(), 'av-export-cli-'));
    try {
      let progress = '';
      const out = join(dir, 'spend.csv');
      const line = await runExportCommand(
        { baseUrl: `http://127.0.0.1:${address.port}`, apiKey: viewerKey, format: 'csv', filters: { walletId: walletA }, out, force: false },
        { stderr: { write: (text: string) => { progress += text; }, isTTY: true }, wait: () => t.service.jobs.runOnce() });
      const expected = await listAll(`&walletId=${walletA}`);
      const records = parseCsv(readFileSync(out, 'utf8'));
      assert.deepEqual(records.slice(1).map((record) => record[0]), expected.map((view) => view.tx_id));
      assert.match(line, new RegExp(`wrote .*spend\\.csv: ${expected.length} transactions`));
      assert.match(progress, /\r\x1b\[2K.*building/);
      assert.match(progress, /\[#{30}\] 100%/);
      // JSON: the file written parses as one document.
      const outJson = join(dir, 'spend.json');
      await runExportCommand(
        { baseUrl: `http://127.0.0.1:${address.port}`, apiKey: viewerKey, format: 'json', filters: { walletId: walletA }, out: outJson, force: false },
        { stderr: { write: () => true }, wait: () => t.service.jobs.runOnce() });
      assert.deepEqual(JSON.parse(readFileSync(outJson, 'utf8')), expected);
      // An existing file is kept unless --force; a refusal of the service is reported, not thrown raw.
      writeFileSync(out, 'keep me');
      await assert.rejects(runExportCommand(
        { baseUrl: `http://127.0.0.1:${address.port}`, apiKey: viewerKey, format: 'csv', filters: {}, out, force: false },
        { stderr: { write: () => true }, wait: () => t.service.jobs.runOnce() }), /exists/);
      assert.equal(readFileSync(out, 'utf8'), 'keep me');
      await assert.rejects(runExportCommand(
        { baseUrl: `http://127.0.0.1:${address.port}`, apiKey: viewerKey, format: 'csv', filters: { from: 'soon' }, out: join(dir, 'x.csv'), force: false },
        { stderr: { write: () => true }, wait: () => t.service.jobs.runOnce() }), /400 invalid_request \(from\)/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('agent-vault export reaches a service behind a path prefix (SPEC: every path is appended to the base URL)', async () => {
    await t.service.app.listen({ port: 0, host: '127.0.0.1' }).catch(() => {});
    const servicePort = (t.service.app.server.address() as { port: number }).port;
    // A gateway that serves the API under /vault, as a reverse proxy would.
    const gateway = createServer((request, response) => {
      if (!request.url?.startsWith('/vault/')) {
        response.writeHead(404).end();
        return;
      }
      const forwarded = httpRequest({ host: '127.0.0.1', port: servicePort, method: request.method, path: request.url.slice('/vault'.length),
        headers: request.headers }, (answer) => {
        response.writeHead(answer.statusCode!, answer.headers);
        answer.pipe(response);
      });
      request.pipe(forwarded);
    });
    await new Promise<void>((resolve) => gateway.listen(0, '127.0.0.1', resolve));
    const dir = mkdtempSync(join(tmpdir(), 'av-export-cli-'));
    try {
      const out = join(dir, 'behind.csv');
      const line = await runExportCommand(
        { baseUrl: `http://127.0.0.1:${(gateway.address() as AddressInfo).port}/vault`, apiKey: viewerKey, format: 'csv', filters: { walletId: walletA }, out, force: false },
        { stderr: { write: () => true }, wait: () => t.service.jobs.runOnce() });
      assert.match(line, /wrote .*behind\.csv/);
      assert.equal(parseCsv(readFileSync(out, 'utf8')).length - 1, (await listAll(`&walletId=${walletA}`)).length);
    } finally {
      gateway.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('agent-vault export told a page that is not the API (a login page at that URL) says so, in its own words', async () => {
    const page = createServer((_request, response) => {
      response.setHeader('content-type', 'text/html');
      response.end('<html>login</html>');
    });
    await new Promise<void>((resolve) => page.listen(0, '127.0.0.1', resolve));
    try {
      await assert.rejects(runExportCommand(
        { baseUrl: `http://127.0.0.1:${(page.address() as AddressInfo).port}`, apiKey: viewerKey, format: 'csv', filters: {}, out: null, force: false },
        { stderr: { write: () => true }, wait: async () => {} }),
      (error: Error) => error instanceof ExportCommandError && /did not answer as the Agent Vault API \(HTTP 200, text\/html\)/.test(error.message));
    } finally {
      page.close();
    }
  });

  test('agent-vault export writes only a plain file name of the service\'s into the current directory', async () => {
    // A service (or whoever answers in its place) naming a file elsewhere.
    const hostile = createServer((request, response) => {
      response.setHeader('content-type', 'application/json');
      if (request.url === '/file') {
        response.end('abc');
        return;
      }
      response.end(JSON.stringify({
        export_id: 'exp_x', status: 'ready', download_url: '/file', file_name: '../escaped.csv', estimated_ready_at: new Date().toISOString(),
        row_count: 1, size_bytes: 3, failure_reason: null,
      }));
    });
    await new Promise<void>((resolve) => hostile.listen(0, '127.0.0.1', resolve));
    const dir = mkdtempSync(join(tmpdir(), 'av-export-cli-'));
    const cwd = process.cwd();
    try {
      mkdirSync(join(dir, 'here'));
      process.chdir(join(dir, 'here'));
      await assert.rejects(runExportCommand(
        { baseUrl: `http://127.0.0.1:${(hostile.address() as AddressInfo).port}`, apiKey: viewerKey, format: 'csv', filters: {}, out: null, force: false },
        { stderr: { write: () => true }, wait: async () => {} }), /file name/);
      assert.equal(existsSync(join(dir, 'escaped.csv')), false, 'nothing written outside the current directory');
    } finally {
      process.chdir(cwd);
      hostile.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('transaction exports over time and through failures', () => {
  let t: TestService;
  before(async () => {
    t = await startTestService();
    await fundedWallet(t, '10');
  });
  after(async () => { await closeDeletingFiles(t); });

  const advance = async (seconds: number) => {
    const response = await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds } });
    assert.equal(response.status, 200, JSON.stringify(response.body));
  };
  const largeObjectExists = async (oid: number) =>
    (await t.service.ctx.db.query('SELECT 1 FROM pg_largeobject_metadata WHERE oid = $1', [oid])).length === 1;
  const contentOid = async (exportId: string) =>
    (await t.service.ctx.db.query<{ content_oid: number | null }>('SELECT content_oid FROM exports WHERE id = $1', [exportId]))[0]!.content_oid;

  test('a ready export expires after 24 hours: its file is deleted; its record goes after 30 days', async () => {
    const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv' } });
    const id = created.body.export_id;
    await t.service.jobs.runOnce();
    const oid = (await contentOid(id))!;
    assert.ok(await largeObjectExists(oid), 'the file is stored');
    await advance(24 * 3_600 - 60);
    assert.equal((await t.request('GET', `/v1/transactions/exports/${id}/download`)).status, 200);

    await advance(61);
    // Expired at once, before the job has run.
    const expired = await t.request('GET', `/v1/transactions/exports/${id}`);
    assert.equal(expired.body.status, 'expired');
    assert.equal(expired.body.download_url, null);
    const download = await t.request('GET', `/v1/transactions/exports/${id}/download`);
    assert.equal(download.status, 404);
    assert.match(download.body.error.message, /expired/);
    await t.service.jobs.runOnce();
    assert.equal(await largeObjectExists(oid), true, 'kept an hour for a download begun before the expiry');
    await advance(3_600);
    await t.service.jobs.runOnce();
    assert.equal(await largeObjectExists(oid), false, 'the job deleted the file an hour after');
    assert.equal((await t.request('GET', `/v1/transactions/exports/${id}`)).body.status, 'expired');

    await advance(30 * 86_400); // its record is kept 30 days
    await t.service.jobs.runOnce();
    const gone = await t.request('GET', `/v1/transactions/exports/${id}`);
    assert.equal(gone.status, 404);
    assert.equal(gone.body.error.code, 'export_not_found');
  });

  test('agent-vault export tells the time left by the service\'s estimate, whatever the service\'s clock says', async () => {
    await advance(86_400);
    await t.service.app.listen({ port: 0, host: '127.0.0.1' });
    const { port } = t.service.app.server.address() as AddressInfo;
    const dir = mkdtempSync(join(tmpdir(), 'av-export-cli-'));
    try {
      let progress = '';
      await runExportCommand(
        { baseUrl: `http://127.0.0.1:${port}`, apiKey: t.adminKey, format: 'csv', filters: {}, out: join(dir, 'later.csv'), force: false },
        { stderr: { write: (text: string) => { progress += text; }, isTTY: true }, wait: () => t.service.jobs.runOnce() });
      assert.match(progress, /building/);
      const told = [...progress.matchAll(/ready in about (\d+) s/g)].map((match) => Number(match[1]));
      assert.ok(told.every((seconds) => seconds < 600), `time left as the service estimated it, not a day: ${told.join(', ')}`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('a build interrupted by a crash is taken up again once its lease runs out, its partial file deleted', async () => {
    const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'json' } });
    const id = created.body.export_id;
    // A worker claims the export, writes part of the file, and dies.
    const claimed = await claimExport(t.service.ctx.db, t.service.ctx.clock.nowMs());
    assert.equal(claimed?.id, id);
    const writer = new ContentWriter(t.service.ctx.db, claimed!.content_oid!);
    await writer.write('{"half": "a line');
    await writer.close();
    await t.service.jobs.runOnce();
    assert.equal((await t.request('GET', `/v1/transactions/exports/${id}`)).body.status, 'processing', 'the lease still holds');

    await advance(BUILD_LEASE_MS / 1000 + 1);
    await t.service.jobs.runOnce();
    const ready = await t.request('GET', `/v1/transactions/exports/${id}`);
    assert.equal(ready.body.status, 'ready');
    assert.equal(await largeObjectExists(claimed!.content_oid!), false, 'the partial file is gone');
    const file = await download(t, ready.body.download_url);
    const rows = JSON.parse(String(file.body));
    assert.equal(rows.length, ready.body.row_count);
    assert.ok(rows.length > 0, 'the rebuilt file holds the transactions');
    assert.equal(ready.body.size_bytes, Buffer.byteLength(String(file.body), 'utf8'), 'the size is the rebuilt file\'s alone');
  });

  test(`an export whose build is interrupted ${BUILD_ATTEMPTS_MAX} times ends failed, with a reason`, async () => {
    const created = await t.request('POST', '/v1/transactions/export', { body: { format: 'csv' } });
    const id = created.body.export_id;
    let lastOid = 0;
    for (let attempt = 1; attempt <= BUILD_ATTEMPTS_MAX; attempt += 1) {
      const claimed = await claimExport(t.service.ctx.db, t.service.ctx.clock.nowMs());
      assert.equal(claimed?.attempts, attempt);
      lastOid = claimed!.content_oid!;
      await advance(BUILD_LEASE_MS / 1000 + 1);
    }
    await t.service.jobs.runOnce();
    const failed = await t.request('GET', `/v1/transactions/exports/${id}`);
    assert.equal(failed.body.status, 'failed');
    assert.match(failed.body.failure_reason, /could not be built/);
    assert.equal(failed.body.download_url, null);
    assert.equal(await largeObjectExists(lastOid), false, 'no file is left behind');
    const download = await t.request('GET', `/v1/transactions/exports/${id}/download`);
    assert.equal(download.status, 404);
    assert.match(download.body.error.message, /failed/);
  });

  test('an export id is opaque: a made-up one answers 404', async () => {
    const response = await t.request('GET', `/v1/transactions/exports/${newId('exp', Date.now())}`);
    assert.equal(response.status, 404);
    assert.equal(response.body.error.code, 'export_not_found');
  });

  // A client looking for its exports as it would for any other resource is told how they are
  // read, not that no transaction is called "exports".
  test('GET /v1/transactions/exports (no id) answers 404 saying exports are created, then read by id', async () => {
    for (const [path, param] of [['/v1/transactions/exports', 'tx_id'], ['/v1/transactions/export', 'tx_id'], ['/v1/transactions/exports/', 'export_id']] as const) {
      const response = await t.request('GET', path);
      assert.equal(response.status, 404, path);
      assert.equal(response.body.error.code, 'not_found', path);
      assert.equal(response.body.error.param, param, path);
      assert.match(response.body.error.message,
        /create one with POST \/v1\/transactions\/export, then read it by its id at GET \/v1\/transactions\/exports\/\{export_id\}/, path);
    }
  });

  test('GET /v1/payments/check (the preflight with the wrong method) answers 404 naming POST, not "no payment check"', async () => {
    const response = await t.request('GET', '/v1/payments/check');
    assert.deepEqual([response.status, response.body.error.code, response.body.error.param], [404, 'not_found', 'tx_id']);
    assert.match(response.body.error.message, /^The preflight is POST \/v1\/payments\/check/);
  });

  test(`requests side by side never go over ${PROCESSING_PER_ORG_MAX} processing exports`, async () => {
    const org = await t.createOrganization('Eager exporter');
    const answers = await Promise.all(Array.from({ length: 8 }, () =>
      t.request('POST', '/v1/transactions/export', { key: org.adminKey, body: { format: 'csv' } })));
    assert.deepEqual(answers.map((a) => a.status).sort(), [...Array(PROCESSING_PER_ORG_MAX).fill(200), ...Array(8 - PROCESSING_PER_ORG_MAX).fill(429)]);
    const [stored] = await t.service.ctx.db.query<{ n: number }>('SELECT count(*)::int AS n FROM exports WHERE org_id = $1', [org.orgId]);
    assert.equal(stored!.n, PROCESSING_PER_ORG_MAX, 'as many recorded as accepted');
    await t.service.jobs.runOnce();
  });

  // Last: it leaves builds leased until the clock passes their lease.
  test('organisations take turns: one organisation\'s queue of exports does not hold up another\'s', async () => {
    // Nothing else waits: what earlier tests asked for is built first.
    for (let i = 0; i < 10 && (await t.service.ctx.db.query(`SELECT 1 FROM exports WHERE status = 'processing'`)).length > 0; i += 1) {
      await t.service.jobs.runOnce();
    }
    const [busy, patient] = [await t.createOrganization('Busy exporter'), await t.createOrganization('Patient exporter')];
    const ask = async (key: string) => (await t.request('POST', '/v1/transactions/export', { key, body: { format: 'csv' } })).body.export_id as string;
    const queued = [await ask(busy.adminKey), await ask(busy.adminKey), await ask(busy.adminKey)];
    const late = await ask(patient.adminKey);
    const order: string[] = [];
    for (let i = 0; i < 4; i += 1) order.push((await claimExport(t.service.ctx.db, t.service.ctx.clock.nowMs()))!.id);
    assert.deepEqual(order, [queued[0], late, queued[1], queued[2]], 'the other organisation\'s export goes second, not last');
    await advance(BUILD_LEASE_MS / 1000 + 1);
    await t.service.jobs.runOnce();
    for (const [key, id] of [[busy.adminKey, queued[0]], [patient.adminKey, late]] as const) {
      assert.equal((await t.request('GET', `/v1/transactions/exports/${id}`, { key })).body.status, 'ready');
    }
  });
});

// Before `json` meant one array, it wrote JSON Lines (the format now called `jsonl`). Migration
// 0027 rewrites no row, since processes of the previous release share the database during a
// deploy: an export that release recorded says `json`, with json_array NULL, whether recorded
// before the migration or after it. It must be served, and built, as the JSON Lines its file
// holds or was promised, not as the JSON document `json` now means. Its own service: the test
// puts the schema back as the previous release left it.
describe('exports recorded by the release before jsonl', () => {
  let t: TestService;
  before(async () => {
    t = await startTestService();
    await fundedWallet(t, '10');
  });
  after(async () => { await closeDeletingFiles(t); });

  test('an export built as json before json meant an array still downloads as the JSON Lines its file holds, '
    + 'and one still processing is built as JSON Lines', async () => {
    const { db } = t.service.ctx;
    // A file the previous release built for `json`: JSON Lines, which the `jsonl` writer writes alike.
    const built = await t.request('POST', '/v1/transactions/export', { body: { format: 'jsonl' } });
    assert.equal(built.status, 200, JSON.stringify(built.body));
    const readyId = built.body.export_id as string;
    await t.service.jobs.runOnce();
    // The database as the previous release left it: that export recorded as `json`, migration
    // 0027 not applied.
    const migration = listMigrations().find((m) => m.name === 'export_format_jsonl')!;
    await db.transaction(async (tx) => {
      await tx.query('ALTER TABLE exports DROP COLUMN json_array');
      await tx.query('ALTER TABLE exports DROP CONSTRAINT exports_format_check');
      await tx.query(`UPDATE exports SET format = 'json' WHERE id = $1`, [readyId]);
      await tx.query(`ALTER TABLE exports ADD CONSTRAINT exports_format_check CHECK (format IN ('csv', 'json'))`);
      await tx.query('DELETE FROM schema_migrations WHERE version = $1', [migration.version]);
    });
    assert.deepEqual(await migrate(db), [migration.version]);
    // After the migration, a process of the previous release still takes `format: "json"`, and
    // records it with its own statement, which names no json_array.
    const processingId = newId('exp', t.service.ctx.clock.nowMs());
    await db.query(
      `INSERT INTO exports (id, org_id, format, status, filter, estimated_rows, estimated_ready_at, created_by, created_at, updated_at)
       SELECT $1, org_id, 'json', 'processing', filter, estimated_rows, $2, created_by, $2, $2 FROM exports WHERE id = $3`,
      [processingId, new Date(t.service.ctx.clock.nowMs()), readyId]);
    const stored = await db.query<{ format: string; json_array: boolean | null }>(
      'SELECT format, json_array FROM exports WHERE id = ANY($1::text[])', [[readyId, processingId]]);
    assert.deepEqual(stored.map((row) => ({ ...row })), [{ format: 'json', json_array: null }, { format: 'json', json_array: null }],
      'the rows stay as the previous release recorded them');
    const processing = await t.request('GET', `/v1/transactions/exports/${processingId}`);
    assert.equal(processing.body.format, 'jsonl');
    assert.equal(processing.body.file_name, `transactions-${processingId}.jsonl`);

    await t.service.jobs.runOnce();
    for (const id of [readyId, processingId]) {
      const ready = await t.request('GET', `/v1/transactions/exports/${id}`);
      assert.equal(ready.status, 200, JSON.stringify(ready.body));
      assert.equal(ready.body.status, 'ready', id);
      assert.equal(ready.body.format, 'jsonl', id);
      assert.equal(ready.body.file_name, `transactions-${id}.jsonl`);
      const file = await download(t, ready.body.download_url);
      assert.equal(file.status, 200);
      assert.equal(file.headers['content-type'], 'application/x-ndjson; charset=utf-8');
      assert.equal(file.headers['content-disposition'], `attachment; filename="transactions-${id}.jsonl"`);
      const text = String(file.body);
      assert.ok(text.startsWith('{') && text.endsWith('}\n'), `${id}: JSON Lines, not an array`);
      const lines = text.split('\n').slice(0, -1).map((line) => JSON.parse(line));
      assert.equal(lines.length, ready.body.row_count);
      assert.ok(lines.length > 0);
    }
    const events = await t.request('GET', '/v1/events?type=export.ready');
    const event = events.body.data.find((e: View) => e.details.export_id === processingId);
    assert.equal(event?.details.format, 'jsonl');
    assert.equal(event?.details.file_name, `transactions-${processingId}.jsonl`);
    assert.match(event?.summary, /JSON Lines/);

    // One requested now is the array `json` means.
    const json = await t.request('POST', '/v1/transactions/export', { body: { format: 'json' } });
    await t.service.jobs.runOnce();
    const array = await download(t, `/v1/transactions/exports/${json.body.export_id}/download`);
    assert.equal(array.headers['content-type'], 'application/json');
    assert.ok(Array.isArray(JSON.parse(String(array.body))));
  });
});
