/**
 * Transaction exports (SPEC "Export", docs/exports.md): a request for every transaction a filter
 * selects, as CSV, one JSON array or JSON Lines. A request records the export `processing` with
 * an estimate; the `exports.build` job streams the rows page by page (keyset on created_at, id,
 * as the transaction lists do) into a large object and marks it `ready` with `export.ready`, or
 * `failed` after BUILD_ATTEMPTS_MAX interrupted builds; `exports.expire` deletes the file
 * EXPORT_TTL_MS after it was ready and the record EXPORT_RECORD_RETENTION_MS after creation.
 */
import { Type } from 'typebox';
import type { Database, Queryable } from '../db/database.ts';
import { lockOrganization } from '../organizations/limits.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { recordEvent } from '../events/events.ts';
import type { Principal } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { newId } from '../ids/ids.ts';
import { filterOf, type ListQuery } from '../transactions/routes.ts';
import type { TransactionStatus, TransactionType } from '../transactions/settlement.ts';
import {
  TransactionStatusSchema, TransactionTypeSchema, listTransactions, transactionConditions, transactionView, type TransactionFilter,
} from '../transactions/views.ts';
import { getWallet } from '../wallets/wallets.ts';
import { CONTENT_TYPES, FILE_EXTENSIONS, FORMAT_NAMES, fileFormatOf, formatWriter, type ExportFormat } from './formats.ts';
import { ContentWriter, deleteContent, readContent } from './storage.ts';

const HOUR_MS = 3_600_000;
const DAY_MS = 24 * HOUR_MS;

/** A ready export can be downloaded this long; then its file is deleted. */
export const EXPORT_TTL_MS = DAY_MS;
/** An export's record (status, counts, failure reason) is kept this long after its creation, then deleted. */
export const EXPORT_RECORD_RETENTION_MS = 30 * DAY_MS;
/** The most rows one export holds; a wider filter is refused at creation (narrow from/to). */
export const EXPORT_ROWS_MAX = 10_000_000;
/**
 * Rows read per query while building: one keyset page. Small enough that a page is garbage
 * before V8's young generation has been collected twice (a bigger one would be promoted to the
 * old generation and grow the heap); large enough that queries stay few (1,000 per million).
 */
export const EXPORT_PAGE_ROWS = 1_000;
/** Exports an organisation may have waiting or building at once. */
export const PROCESSING_PER_ORG_MAX = 5;
/**
 * What an organisation may hold in storage at once, counting exports processing and files ready
 * and not yet expired (kept 24 h): files, and their rows (20,000,000 rows is about 13 GB of CSV).
 * The processing limit alone let a read-only key fill the database, five files at a time.
 */
export const KEPT_PER_ORG_MAX = 50;
export const KEPT_ROWS_PER_ORG_MAX = 20_000_000;
/** A build holds its export this long without renewing (it renews after every page). */
export const BUILD_LEASE_MS = 60_000;
/** Builds an export may start; interrupted that many times, it fails. */
export const BUILD_ATTEMPTS_MAX = 3;
/** After a failed build, the next attempt waits this long times the attempts made. */
const RETRY_DELAY_MS = 10_000;
/** Rows a build writes per second, measured by `npm run bench:export` (docs/exports.md), rounded down. */
const ROWS_PER_SECOND_ESTIMATE = 25_000;
/** Until the build job picks a new export up (it runs every second), plus margin. */
const PICKUP_DELAY_MS = 2_000;
/** Exports one run of the build job takes on, so that a queue never keeps a run going for ever. */
const BUILDS_PER_RUN_MAX = 5;
const EXPIRE_BATCH_MAX = 100;

export const FAILURE_REASON_ATTEMPTS =
  `The export could not be built in ${BUILD_ATTEMPTS_MAX} attempts. Request a new export; if that fails too, contact support with this export id.`;

export type ExportStatus = 'processing' | 'ready' | 'failed' | 'expired';

/** The filters as stored on the export and shown in its view (times as ISO 8601). */
interface StoredFilter {
  wallet_id: string | null;
  status: TransactionStatus | null;
  type: TransactionType | null;
  recipient: string | null;
  from: string | null;
  to: string | null;
}

export interface ExportRow {
  id: string;
  org_id: string;
  /** as requested; read it through fileFormatOf, which knows what a `json` of the previous release holds */
  format: ExportFormat;
  /** TRUE on every export this code records; NULL on one the previous release recorded (migration 0027) */
  json_array: boolean | null;
  status: ExportStatus;
  filter: StoredFilter;
  estimated_rows: bigint;
  estimated_ready_at: Date;
  attempts: number;
  lease_until: Date | null;
  content_oid: number | null;
  row_count: bigint | null;
  size_bytes: bigint | null;
  failure_reason: string | null;
  created_by: string;
  created_at: Date;
  ready_at: Date | null;
  expires_at: Date | null;
  updated_at: Date;
  /** when its latest build began (organisations take turns: claimExport) */
  build_started_at: Date | null;
}

// ---------------------------------------------------------------------------------------------
// The view

const StringOrNull = Type.Union([Type.String(), Type.Null()]);
const IntegerOrNull = Type.Union([Type.Integer(), Type.Null()]);

export const ExportFormatSchema = Type.Union([Type.Literal('csv'), Type.Literal('json'), Type.Literal('jsonl')], {
  description: '`csv` (RFC 4180, header row), `json` (one JSON array of transaction objects) or `jsonl` '
    + '(JSON Lines: one transaction object per line)',
});

export const ExportView = Type.Object({
  export_id: Type.String(),
  status: Type.Union([Type.Literal('processing'), Type.Literal('ready'), Type.Literal('failed'), Type.Literal('expired')]),
  format: ExportFormatSchema,
  filters: Type.Object({
    wallet_id: StringOrNull,
    status: Type.Union([TransactionStatusSchema, Type.Null()]),
    type: Type.Union([TransactionTypeSchema, Type.Null()]),
    recipient: StringOrNull,
    from: Type.Union([Type.String(), Type.Null()], { description: 'inclusive' }),
    to: Type.Union([Type.String(), Type.Null()], { description: 'exclusive; transactions recorded after the export was requested are never included' }),
  }),
  download_url: Type.Union([Type.String(), Type.Null()], {
    description: 'path of the download, relative to the API\'s base URL (send the API key); null unless ready',
  }),
  file_name: Type.String(),
  estimated_ready_at: Type.String(),
  row_count: Type.Union([Type.Integer(), Type.Null()], { description: 'null until ready' }),
  size_bytes: IntegerOrNull,
  failure_reason: Type.Union([Type.String(), Type.Null()], { description: 'why a failed export failed' }),
  created_at: Type.String(),
  ready_at: StringOrNull,
  expires_at: Type.Union([Type.String(), Type.Null()], { description: 'the file is deleted then' }),
});

export function downloadPath(exportId: string): string {
  return `/v1/transactions/exports/${exportId}/download`;
}

export function fileNameOf(row: Pick<ExportRow, 'id' | 'format' | 'json_array'>): string {
  return `transactions-${row.id}.${FILE_EXTENSIONS[fileFormatOf(row)]}`;
}

/** A ready export past its expiry is `expired` at once, even before the job has deleted its file. */
function statusAt(row: ExportRow, nowMs: number): ExportStatus {
  return row.status === 'ready' && row.expires_at !== null && row.expires_at.getTime() <= nowMs ? 'expired' : row.status;
}

export function exportView(row: ExportRow, nowMs: number) {
  const status = statusAt(row, nowMs);
  return {
    export_id: row.id,
    status,
    format: fileFormatOf(row),
    filters: { ...row.filter },
    download_url: status === 'ready' ? downloadPath(row.id) : null,
    file_name: fileNameOf(row),
    estimated_ready_at: row.estimated_ready_at.toISOString(),
    row_count: row.row_count === null ? null : Number(row.row_count),
    size_bytes: row.size_bytes === null ? null : Number(row.size_bytes),
    failure_reason: row.status === 'failed' ? row.failure_reason : null,
    created_at: row.created_at.toISOString(),
    ready_at: row.ready_at?.toISOString() ?? null,
    expires_at: row.expires_at?.toISOString() ?? null,
  };
}

function exportNotFound(exportId: string, why = ''): ServiceError {
  return new ServiceError('export_not_found', `No export ${exportId} in your organisation${why}.`, { param: 'export_id' });
}

// ---------------------------------------------------------------------------------------------
// Creation

export interface NewExport extends ListQuery {
  format: ExportFormat;
}

/**
 * The filter a build reads: the request's, bounded above by the moment of the request, so that
 * what an export holds does not depend on when the worker got to it.
 */
function buildFilter(row: Pick<ExportRow, 'filter' | 'created_at'>): TransactionFilter {
  const { filter } = row;
  const snapshotEnd = new Date(row.created_at.getTime() + 1);
  const requestedTo = filter.to === null ? null : new Date(filter.to);
  const built: TransactionFilter = { to: requestedTo !== null && requestedTo < snapshotEnd ? requestedTo : snapshotEnd };
  if (filter.wallet_id !== null) built.walletId = filter.wallet_id;
  if (filter.status !== null) built.status = filter.status;
  if (filter.type !== null) built.type = filter.type;
  if (filter.recipient !== null) built.recipient = filter.recipient;
  if (filter.from !== null) built.from = new Date(filter.from);
  return built;
}

/**
 * How many transactions the filter selects, counted up to `cap` (a bounded scan): the
 * conditions of listTransactions, which the build pages through.
 */
async function countTransactions(q: Queryable, orgId: string, filter: TransactionFilter, cap: number): Promise<number> {
  const { sql, params } = transactionConditions(orgId, filter).filter();
  const [row] = await q.query<{ n: bigint }>(
    `SELECT count(*)::bigint AS n FROM (SELECT 1 FROM transactions ${sql} LIMIT ${cap}) AS selected`, params);
  return Number(row?.n ?? 0n);
}

export async function createExport(ctx: AppContext, principal: Principal, input: NewExport): Promise<ExportRow> {
  const { format, ...query } = input;
  const filter = filterOf(query);
  if (filter.walletId !== undefined) await getWallet(ctx.db, principal.orgId, filter.walletId);
  const nowMs = ctx.clock.nowMs();
  const createdAt = new Date(nowMs);
  const stored: StoredFilter = {
    wallet_id: filter.walletId ?? null,
    status: filter.status ?? null,
    type: filter.type ?? null,
    recipient: filter.recipient ?? null,
    from: filter.from?.toISOString() ?? null,
    to: filter.to?.toISOString() ?? null,
  };
  // The quota first: a request it refuses costs no count of the organisation's transactions.
  await assertBelowQuota(ctx.db, principal.orgId, nowMs, 0);
  const rows = await countTransactions(ctx.db, principal.orgId, buildFilter({ filter: stored, created_at: createdAt }), EXPORT_ROWS_MAX + 1);
  if (rows > EXPORT_ROWS_MAX) {
    throw invalidRequest('from', `The filter selects more than ${EXPORT_ROWS_MAX} transactions: narrow it with from and to, and export in parts.`);
  }
  const estimatedReadyAt = new Date(nowMs + PICKUP_DELAY_MS + Math.ceil((rows / ROWS_PER_SECOND_ESTIMATE) * 1000));
  return ctx.db.transaction(async (tx) => {
    // Again, with the organisation's row locked (as every count per organisation is:
    // src/organizations/limits.ts), so that requests side by side cannot both pass it.
    await lockOrganization(tx, principal.orgId);
    await assertBelowQuota(tx, principal.orgId, nowMs, rows);
    const [row] = await tx.query<ExportRow>(
      `INSERT INTO exports (id, org_id, format, json_array, status, filter, estimated_rows, estimated_ready_at, created_by, created_at, updated_at)
       VALUES ($1, $2, $3, TRUE, 'processing', $4, $5, $6, $7, $8, $8)
       RETURNING *`,
      [newId('exp', nowMs), principal.orgId, format, JSON.stringify(stored), rows, estimatedReadyAt, principal.keyId, createdAt]);
    return row!;
  });
}

/** The organisation's exports processing, and what it keeps, leave room for one more of `rows` rows. */
async function assertBelowQuota(q: Queryable, orgId: string, nowMs: number, rows: number): Promise<void> {
  const [held] = await q.query<{ processing: bigint; kept: bigint; kept_rows: bigint; first_expiry: Date | null }>(
    `SELECT count(*) FILTER (WHERE status = 'processing')::bigint AS processing, count(*)::bigint AS kept,
            COALESCE(sum(COALESCE(row_count, estimated_rows)), 0)::bigint AS kept_rows,
            min(expires_at) FILTER (WHERE status = 'ready') AS first_expiry
     FROM exports WHERE org_id = $1 AND (status = 'processing' OR (status = 'ready' AND expires_at > $2))`,
    [orgId, new Date(nowMs)]);
  if (Number(held?.processing ?? 0n) >= PROCESSING_PER_ORG_MAX) {
    throw new ServiceError('rate_limited',
      `Your organisation already has ${PROCESSING_PER_ORG_MAX} exports processing: wait until one is ready, then ask again.`);
  }
  if (Number(held?.kept ?? 0n) >= KEPT_PER_ORG_MAX || Number(held?.kept_rows ?? 0n) + rows > KEPT_ROWS_PER_ORG_MAX) {
    const refusal = new ServiceError('rate_limited',
      `Your organisation keeps ${KEPT_PER_ORG_MAX} exports or ${KEPT_ROWS_PER_ORG_MAX} rows of them at most (processing, or ready `
      + 'and not yet expired): a file is kept 24 hours after it is ready, then frees its place. Retry-After says when the first does.');
    // Until the first file kept expires (the job deletes it within a minute after); a quota held
    // by exports processing frees up sooner.
    if (held?.first_expiry) refusal.retryAfterS = Math.max(1, Math.ceil((held.first_expiry.getTime() - nowMs) / 1000));
    throw refusal;
  }
}

/** One export of the organisation; another organisation's answers exactly like a missing one. */
export async function getExport(q: Queryable, orgId: string, exportId: string): Promise<ExportRow> {
  const rows = await q.query<ExportRow>('SELECT * FROM exports WHERE org_id = $1 AND id = $2', [orgId, exportId]);
  if (!rows[0]) throw exportNotFound(exportId);
  return rows[0];
}

export interface ExportDownload {
  fileName: string;
  contentType: string;
  sizeBytes: number;
  content: AsyncGenerator<Buffer>;
}

/** The file of a ready export; any other state answers export_not_found with the reason. */
export async function openDownload(db: Database, orgId: string, exportId: string, nowMs: number): Promise<ExportDownload> {
  const row = await getExport(db, orgId, exportId);
  const status = statusAt(row, nowMs);
  if (status !== 'ready' || row.content_oid === null || row.size_bytes === null) {
    throw exportNotFound(exportId, status === 'processing' ? ' with a file yet: it is still processing'
      : status === 'failed' ? ' with a file: it failed' : ' with a file: it has expired');
  }
  return {
    fileName: fileNameOf(row),
    contentType: CONTENT_TYPES[fileFormatOf(row)],
    sizeBytes: Number(row.size_bytes),
    content: readContent(db, row.content_oid, Number(row.size_bytes)),
  };
}

// ---------------------------------------------------------------------------------------------
// Building (the exports.build job)

/** The build no longer holds its export: its lease ran out and another build took over. */
class LeaseLost extends Error {}

/**
 * Takes an export waiting for a build, organisations in turn: the oldest export of the
 * organisation whose last build began longest ago (or never), so that one organisation's queue
 * of large exports does not hold up another's. Gives it a lease and a fresh large object,
 * deleting what an interrupted build left. One that used up its attempts fails instead
 * (returned too, with status `failed`). Null when nothing waits.
 */
export async function claimExport(db: Database, nowMs: number): Promise<ExportRow | null> {
  return db.transaction(async (tx) => {
    const [due] = await tx.query<ExportRow>(
      `SELECT e.* FROM exports e
       WHERE e.status = 'processing' AND (e.lease_until IS NULL OR e.lease_until <= $1)
       ORDER BY (SELECT max(b.build_started_at) FROM exports b WHERE b.org_id = e.org_id) NULLS FIRST, e.created_at, e.id
       LIMIT 1 FOR UPDATE OF e SKIP LOCKED`, [new Date(nowMs)]);
    if (!due) return null;
    if (due.content_oid !== null) await deleteContent(tx, [due.content_oid]);
    if (due.attempts >= BUILD_ATTEMPTS_MAX) {
      const [failed] = await tx.query<ExportRow>(
        `UPDATE exports SET status = 'failed', failure_reason = $2, content_oid = NULL, lease_until = NULL, updated_at = $3
         WHERE id = $1 RETURNING *`, [due.id, FAILURE_REASON_ATTEMPTS, new Date(nowMs)]);
      return failed!;
    }
    const [claimed] = await tx.query<ExportRow>(
      `UPDATE exports SET attempts = attempts + 1, lease_until = $2, content_oid = lo_create(0), updated_at = $3, build_started_at = $3
       WHERE id = $1 RETURNING *`, [due.id, new Date(nowMs + BUILD_LEASE_MS), new Date(nowMs)]);
    return claimed!;
  });
}

/** Renews the lease; throws LeaseLost when this build is no longer the export's. */
async function renewLease(ctx: AppContext, row: ExportRow): Promise<void> {
  const nowMs = ctx.clock.nowMs();
  const renewed = await ctx.db.query(
    `UPDATE exports SET lease_until = $3 WHERE id = $1 AND status = 'processing' AND attempts = $2 RETURNING id`,
    [row.id, row.attempts, new Date(nowMs + BUILD_LEASE_MS)]);
  if (renewed.length === 0) throw new LeaseLost(`export ${row.id}: attempt ${row.attempts} lost its lease`);
}

/**
 * Writes every selected transaction into the claimed export's large object, newest first, one
 * keyset page at a time (memory: one page and one chunk), then the format's tail (a JSON array's
 * `]`), then marks it ready and writes `export.ready` in the same transaction.
 */
export async function buildExport(ctx: AppContext, row: ExportRow): Promise<ExportRow | null> {
  if (row.content_oid === null) throw new Error(`export ${row.id} was not claimed`);
  const writer = new ContentWriter(ctx.db, row.content_oid);
  const fileFormat = fileFormatOf(row);
  const format = formatWriter(fileFormat);
  const filter = buildFilter(row);
  await writer.write(format.head);
  let rowCount = 0;
  let after: { createdAt: Date; id: string } | null = null;
  for (;;) {
    // Read once the previous page is written, not ahead: a page read ahead would stay alive
    // through the rendering of this one, long enough to be promoted (see EXPORT_PAGE_ROWS).
    const page = await listTransactions(ctx.db, row.org_id, filter, { limit: EXPORT_PAGE_ROWS, after });
    const shown = page.length > EXPORT_PAGE_ROWS ? page.slice(0, EXPORT_PAGE_ROWS) : page;
    for (const transaction of shown) {
      await writer.write(format.row(transactionView(transaction, ctx), rowCount));
      rowCount += 1;
    }
    if (page.length <= EXPORT_PAGE_ROWS) break;
    const last = shown[shown.length - 1]!;
    after = { createdAt: last.created_at, id: last.id };
    // Requests waiting on the event loop go before the next page (a page renders without a pause).
    await new Promise((resolve) => setImmediate(resolve));
    await renewLease(ctx, row);
  }
  await writer.write(format.tail(rowCount));
  const sizeBytes = await writer.close();
  return ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const [ready] = await tx.query<ExportRow>(
      `UPDATE exports SET status = 'ready', row_count = $3, size_bytes = $4, ready_at = $5, expires_at = $6,
         lease_until = NULL, updated_at = $5
       WHERE id = $1 AND status = 'processing' AND attempts = $2 RETURNING *`,
      [row.id, row.attempts, rowCount, sizeBytes, new Date(nowMs), new Date(nowMs + EXPORT_TTL_MS)]);
    if (!ready) throw new LeaseLost(`export ${row.id}: attempt ${row.attempts} finished after losing its lease`);
    const view = exportView(ready, nowMs);
    await recordEvent(tx, nowMs, {
      orgId: row.org_id,
      type: 'export.ready',
      walletId: row.filter.wallet_id,
      summary: `Export ${row.id} is ready: ${rowCount} transactions (${FORMAT_NAMES[fileFormat]}, ${sizeBytes} bytes)`,
      payload: {
        export_id: view.export_id, format: view.format, row_count: view.row_count, size_bytes: view.size_bytes,
        download_url: view.download_url, file_name: view.file_name, expires_at: view.expires_at,
      },
    });
    return ready;
  });
}

/**
 * After a build threw: the export waits RETRY_DELAY_MS × attempts for its next attempt (its
 * partial file is deleted when that starts), or fails once the attempts are used up.
 */
async function releaseAfterFailure(ctx: AppContext, row: ExportRow): Promise<void> {
  await ctx.db.transaction(async (tx) => {
    const nowMs = ctx.clock.nowMs();
    const [current] = await tx.query<ExportRow>(
      `SELECT * FROM exports WHERE id = $1 AND status = 'processing' AND attempts = $2 FOR UPDATE`, [row.id, row.attempts]);
    if (!current) return;
    if (current.attempts < BUILD_ATTEMPTS_MAX) {
      await tx.query('UPDATE exports SET lease_until = $2, updated_at = $3 WHERE id = $1',
        [row.id, new Date(nowMs + RETRY_DELAY_MS * current.attempts), new Date(nowMs)]);
      return;
    }
    if (current.content_oid !== null) await deleteContent(tx, [current.content_oid]);
    await tx.query(
      `UPDATE exports SET status = 'failed', failure_reason = $2, content_oid = NULL, lease_until = NULL, updated_at = $3
       WHERE id = $1`, [row.id, FAILURE_REASON_ATTEMPTS, new Date(nowMs)]);
  });
}

/** The exports.build job: builds what waits, a few exports per run. */
export async function buildDueExports(ctx: AppContext): Promise<void> {
  for (let built = 0; built < BUILDS_PER_RUN_MAX; built += 1) {
    const row = await claimExport(ctx.db, ctx.clock.nowMs());
    if (row === null) return;
    if (row.status !== 'processing') continue;
    try {
      await buildExport(ctx, row);
    } catch (error) {
      if (error instanceof LeaseLost) {
        ctx.log.warn({ export_id: row.id, attempt: row.attempts }, 'export build lost its lease to another build');
        continue;
      }
      ctx.log.error({ err: error, export_id: row.id, attempt: row.attempts }, 'export build failed');
      await releaseAfterFailure(ctx, row);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Expiry (the exports.expire job)

/** How long a file outlives its export's expiry, for a download begun before it. */
const DOWNLOAD_GRACE_MS = 60 * 60 * 1000;

/**
 * Deletes the files of exports past expires_at (the export becomes `expired`) an hour after it,
 * then the records of exports older than the retention; a bounded batch of each. Returns how
 * many of each.
 */
export async function expireExports(db: Database, nowMs: number): Promise<{ expired: number; deleted: number }> {
  const now = new Date(nowMs);
  const expired = await db.transaction(async (tx) => {
    // Downloads are refused from expires_at on; a download begun before it is read to its end
    // (its chunks are separate reads), so the file stays an hour longer.
    const due = await tx.query<{ id: string; content_oid: number | null }>(
      `SELECT id, content_oid FROM exports WHERE status = 'ready' AND expires_at <= $1
       ORDER BY expires_at LIMIT ${EXPIRE_BATCH_MAX} FOR UPDATE SKIP LOCKED`, [new Date(nowMs - DOWNLOAD_GRACE_MS)]);
    await deleteContent(tx, due.flatMap((row) => (row.content_oid === null ? [] : [row.content_oid])));
    if (due.length) {
      await tx.query(`UPDATE exports SET status = 'expired', content_oid = NULL, updated_at = $2 WHERE id = ANY($1::text[])`,
        [due.map((row) => row.id), now]);
    }
    return due.length;
  });
  const deleted = await db.transaction(async (tx) => {
    const old = await tx.query<{ id: string; content_oid: number | null }>(
      `SELECT id, content_oid FROM exports WHERE created_at < $1 AND status <> 'processing'
       ORDER BY created_at LIMIT ${EXPIRE_BATCH_MAX} FOR UPDATE SKIP LOCKED`, [new Date(nowMs - EXPORT_RECORD_RETENTION_MS)]);
    await deleteContent(tx, old.flatMap((row) => (row.content_oid === null ? [] : [row.content_oid])));
    if (old.length) await tx.query('DELETE FROM exports WHERE id = ANY($1::text[])', [old.map((row) => row.id)]);
    return old.length;
  });
  return { expired, deleted };
}
