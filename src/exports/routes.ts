/**
 * Transaction export endpoints (SPEC "Export", docs/exports.md): request an export, poll it,
 * download its file. All three need the `read` permission: an export holds nothing a key that
 * may list transactions could not page through itself.
 */
import { Readable } from 'node:stream';
import { Type } from 'typebox';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { exportsAreReadById } from '../transactions/routes.ts';
import { TransactionStatusSchema, TransactionTypeSchema } from '../transactions/views.ts';
import { ExportFormatSchema, ExportView, createExport, exportView, getExport, openDownload } from './exports.ts';
import { CONTENT_TYPES } from './formats.ts';

const TIME_MAX_CHARS = 40;
const ExportParams = Type.Object({ export_id: Type.String({ maxLength: 64 }) });

export function exportRoutes(app: App, ctx: AppContext): void {
  app.post('/v1/transactions/export', {
    config: { permission: 'read' },
    schema: {
      tags: ['Transactions'], summary: 'Export the transactions a filter selects, as CSV, JSON or JSON Lines',
      description: 'Answers at once with `status: processing`; poll `GET /v1/transactions/exports/{export_id}` until it is '
        + '`ready`, then download `download_url`. The filters are those of `GET /v1/transactions`; transactions recorded '
        + 'after the request are not included. An unknown `walletId` answers 404 `wallet_not_found`.',
      body: Type.Object({
        format: ExportFormatSchema,
        walletId: Type.Optional(Type.String({ minLength: 1, maxLength: 64, description: 'also `wallet_id`' })),
        status: Type.Optional(TransactionStatusSchema),
        type: Type.Optional(TransactionTypeSchema),
        recipient: Type.Optional(Type.String({ minLength: 1, maxLength: 256, description: 'an address exactly, a domain in any case' })),
        from: Type.Optional(Type.String({ maxLength: TIME_MAX_CHARS, description: 'ISO 8601, inclusive' })),
        to: Type.Optional(Type.String({ maxLength: TIME_MAX_CHARS, description: 'ISO 8601, exclusive' })),
      }, { additionalProperties: false }),
      response: { 200: ExportView },
    },
  }, async (request) => exportView(await createExport(ctx, principalOf(request), request.body), ctx.clock.nowMs()));

  app.get('/v1/transactions/exports/:export_id', {
    // `GET /v1/transactions/exports/` (no id) is a client trying to list them, as without the slash.
    config: { permission: 'read', emptyParam: () => exportsAreReadById('export_id') },
    schema: {
      tags: ['Transactions'], summary: 'An export: poll it until `status` is `ready` (or `failed`)',
      params: ExportParams, response: { 200: ExportView },
    },
  }, async (request) => {
    return exportView(await getExport(ctx.db, principalOf(request).orgId, request.params.export_id), ctx.clock.nowMs());
  });

  app.get('/v1/transactions/exports/:export_id/download', {
    config: { permission: 'read' },
    schema: {
      tags: ['Transactions'], summary: 'The file of a ready export',
      description: 'An export that is not ready (processing, failed or expired) answers 404 `export_not_found`, '
        + 'with its state in the message.',
      produces: [CONTENT_TYPES.csv, CONTENT_TYPES.json, CONTENT_TYPES.jsonl],
      params: ExportParams,
    },
  }, async (request, reply) => {
    const download = await openDownload(ctx.db, principalOf(request).orgId, request.params.export_id, ctx.clock.nowMs());
    return reply
      .header('Content-Type', download.contentType)
      .header('Content-Disposition', `attachment; filename="${download.fileName}"`)
      .header('Content-Length', String(download.sizeBytes))
      .header('Cache-Control', 'private, no-store')
      .header('X-Content-Type-Options', 'nosniff')
      // HEAD, which Fastify answers with this handler and then drains the stream it is given, gets
      // the headers (Content-Length the file's) and an empty stream: the file is not read.
      .send(Readable.from(request.method === 'HEAD' ? [] : download.content));
  });
}
