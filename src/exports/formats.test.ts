/**
 * The export formats as pure functions: RFC 4180 quoting, formula neutralisation, the column
 * set (every field of the transaction view, nested objects flattened), the JSON array, JSON Lines.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { CSV_COLUMNS, csvCell, csvHeader, csvRecord, fileFormatOf, formatWriter, jsonLine, type ExportFormat } from './formats.ts';
import { transactionView } from '../transactions/views.ts';
import type { TransactionRow } from '../transactions/settlement.ts';

test('a cell is quoted only when it holds a comma, a quote or a line break; quotes are doubled', () => {
  assert.equal(csvCell('plain'), 'plain');
  assert.equal(csvCell('a,b'), '"a,b"');
  assert.equal(csvCell('say "hi"'), '"say ""hi"""');
  assert.equal(csvCell('line 1\nline 2'), '"line 1\nline 2"');
  assert.equal(csvCell('line 1\r\nline 2'), '"line 1\r\nline 2"');
  assert.equal(csvCell(null), '');
  assert.equal(csvCell(true), 'true');
  assert.equal(csvCell(42), '42');
  assert.equal(csvCell('café ✓'), 'café ✓');
});

test('a cell a spreadsheet would run as a formula starts with an apostrophe instead', () => {
  assert.equal(csvCell('=1+1'), '\'=1+1');
  assert.equal(csvCell('+1'), '\'+1');
  assert.equal(csvCell('-1'), '\'-1');
  assert.equal(csvCell('@SUM(A1:A2)'), '\'@SUM(A1:A2)');
  assert.equal(csvCell('\t=1'), '\'\t=1');
  assert.equal(csvCell('=HYPERLINK("http://x","y")'), '"\'=HYPERLINK(""http://x"",""y"")"');
  // Only the first character matters: an amount or a time is left alone.
  assert.equal(csvCell('12.50'), '12.50');
  assert.equal(csvCell('2026-04-01T00:00:00.000Z'), '2026-04-01T00:00:00.000Z');
  assert.equal(csvCell('a=b'), 'a=b');
});

test('the columns are every field of the transaction view, violation and approval flattened', () => {
  assert.deepEqual([...CSV_COLUMNS], [
    'tx_id', 'wallet_id', 'type', 'recipient', 'amount', 'currency', 'status', 'tx_signature', 'on_chain_slot', 'policy_id',
    'policy_triggered', 'violation_rule', 'violation_limit', 'violation_attempted', 'memo', 'agent_attestation_hash',
    'explorer_url', 'explorer_url_alt', 'failure_reason', 'approval_required', 'approval_status', 'approval_expires_at',
    'approval_decided_by', 'approval_decided_at', 'timestamp', 'settled_at', 'category', 'attested_at', 'escrow_id', 'batch_id',
  ]);
  assert.equal(csvHeader(), `${CSV_COLUMNS.join(',')}\r\n`);
});

test('a record has one cell per column, amounts as decimal strings, times in ISO 8601, CRLF at the end', () => {
  const createdAt = new Date('2026-04-01T10:00:00.123Z');
  const row = {
    id: 'tx_1', org_id: 'org_1', wallet_id: 'wal_1', type: 'payment', status: 'blocked', amount: 2_500_000n, currency: 'USDC',
    recipient: 'api.example.com', policy_id: 'pol_1', policy_triggered: true,
    violation: { rule: 'max_per_tx', limit: '1.00', attempted: '2.50' }, memo: 'x, "y"', category: 'api', attested_at: null, attestation_hash: null,
    tx_signature: null, last_valid_block_height: null, on_chain_slot: null, failure_reason: null, batch_id: null,
    escrow_id: null, created_at: createdAt, updated_at: createdAt, settled_at: createdAt,
  } satisfies TransactionRow;
  const view = transactionView(row, { validator: null, config: { rpcUrl: null } });
  assert.equal(csvRecord(view),
    'tx_1,wal_1,payment,api.example.com,2.50,USDC,blocked,,,pol_1,true,max_per_tx,1.00,2.50,"x, ""y""",,,,,,,,,,'
    + '2026-04-01T10:00:00.123Z,2026-04-01T10:00:00.123Z,api,,,\r\n');
  assert.deepEqual(JSON.parse(jsonLine(view)), view);
  assert.ok(jsonLine(view).endsWith('}\n') && !jsonLine(view).slice(0, -1).includes('\n'), 'one line per transaction');
});

/** A payment's view as the API shows it; `memo` holds text that JSON must escape. */
function paymentView(id: string, memo: string) {
  const createdAt = new Date('2026-04-01T10:00:00.123Z');
  const row = {
    id, org_id: 'org_1', wallet_id: 'wal_1', type: 'payment', status: 'confirmed', amount: 1_250_000n, currency: 'USDC',
    recipient: 'api.example.com', policy_id: 'pol_1', policy_triggered: false, violation: null, memo, category: null,
    attested_at: null, attestation_hash: null, tx_signature: null, last_valid_block_height: null, on_chain_slot: null,
    failure_reason: null, batch_id: null, escrow_id: null, created_at: createdAt, updated_at: createdAt, settled_at: createdAt,
  } satisfies TransactionRow;
  return transactionView(row, { validator: null, config: { rpcUrl: null } });
}

/** The whole file, written as a build writes it: head, each row with its position, tail. */
function fileOf(format: ExportFormat, views: ReturnType<typeof paymentView>[]): string {
  const writer = formatWriter(format);
  return writer.head + views.map((view, index) => writer.row(view, index)).join('') + writer.tail(views.length);
}

// The guarantee behind `format: "json"`: what a developer downloads is one JSON document that
// JSON.parse reads whole, whatever the number of rows (two rows of JSON Lines are not one).
test('a JSON file is one array that JSON.parse reads: [] when empty, the views in order otherwise', () => {
  assert.equal(fileOf('json', []), '[]');
  assert.deepEqual(JSON.parse(fileOf('json', [])), []);
  const views = [paymentView('tx_1', 'one'), paymentView('tx_2', 'two\nlines, "quoted" ]'), paymentView('tx_3', '[{')];
  for (let n = 1; n <= views.length; n += 1) {
    assert.deepEqual(JSON.parse(fileOf('json', views.slice(0, n))), views.slice(0, n), `${n} rows`);
  }
  // One element per line, so that line tools still see one transaction per line.
  assert.equal(fileOf('json', views).split('\n').length, views.length + 2);
});

test('a JSON Lines file is one view per line, each ending with a newline; empty when there are none', () => {
  assert.equal(fileOf('jsonl', []), '');
  const views = [paymentView('tx_1', 'one'), paymentView('tx_2', 'two\nlines')];
  const text = fileOf('jsonl', views);
  assert.ok(text.endsWith('}\n'));
  assert.deepEqual(text.split('\n').slice(0, -1).map((line) => JSON.parse(line)), views);
});

// A `json` export recorded by the release before `jsonl` (json_array NULL: migration 0027 leaves
// its row as it was) holds JSON Lines; one recorded since holds the array `json` means.
test('the file format of an export: json recorded before json meant an array is JSON Lines; the rest are as recorded', () => {
  assert.equal(fileFormatOf({ format: 'json', json_array: null }), 'jsonl');
  assert.equal(fileFormatOf({ format: 'json', json_array: true }), 'json');
  for (const format of ['csv', 'jsonl'] as const) {
    assert.equal(fileFormatOf({ format, json_array: null }), format);
    assert.equal(fileFormatOf({ format, json_array: true }), format);
  }
});
