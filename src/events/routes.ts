/**
 * The activity feed (SPEC.md "Events", DESIGN §8): the organisation's stored events, newest
 * first, filtered by type, vault, severity and a date range at most 90 days back.
 */
import { Type } from 'typebox';
import { invalidRequest } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { PageQuery, PageFilter, pageOf, parsePageRequest, toPage, walletIdOf, walletIdQuery } from '../http/pagination.ts';
import { parseTimeBound } from '../transactions/routes.ts';
import { getWallet } from '../wallets/wallets.ts';
import { EVENT_RETENTION_MS, EVENT_TYPES, type EventType, type Severity } from './events.ts';


export const EventView = Type.Object({
  event_id: Type.String(),
  type: Type.String(),
  wallet_id: Type.Union([Type.String(), Type.Null()], { description: 'the vault it concerns, if any' }),
  severity: Type.Union([Type.Literal('info'), Type.Literal('warning'), Type.Literal('critical')]),
  summary: Type.String(),
  details: Type.Record(Type.String(), Type.Unknown(), { description: 'the payload webhooks deliver' }),
  timestamp: Type.String({ description: 'ISO 8601 with milliseconds' }),
});

interface EventRow {
  id: string;
  type: string;
  wallet_id: string | null;
  severity: Severity;
  summary: string;
  payload: Record<string, unknown>;
  created_at: Date;
}

export function eventView(row: EventRow) {
  return {
    event_id: row.id, type: row.type, wallet_id: row.wallet_id, severity: row.severity, summary: row.summary,
    details: row.payload, timestamp: row.created_at.toISOString(),
  };
}

export function eventRoutes(app: App, ctx: AppContext): void {
  app.get('/v1/events', {
    config: { permission: 'read' },
    schema: {
      tags: ['Events'], summary: 'The activity feed: your organisation\'s events of the last 90 days, newest first',
      querystring: Type.Object({
        ...PageQuery,
        type: Type.Optional(Type.String({ maxLength: 1000, description: 'an event name, or several separated by commas' })),
        ...walletIdQuery(),
        severity: Type.Optional(Type.Union([Type.Literal('info'), Type.Literal('warning'), Type.Literal('critical')])),
        from: Type.Optional(Type.String({ maxLength: 40, description: 'ISO 8601, inclusive; an earlier one starts 90 days back, where the feed ends' })),
        to: Type.Optional(Type.String({ maxLength: 40, description: 'ISO 8601, exclusive' })),
      }, { additionalProperties: false }),
      response: { 200: pageOf(EventView) },
    },
  }, async (request) => {
    const { orgId } = principalOf(request);
    const query = request.query;
    const page = parsePageRequest(query);
    const nowMs = ctx.clock.nowMs();
    const oldest = new Date(nowMs - EVENT_RETENTION_MS);
    const asked = query.from === undefined ? oldest : parseTimeBound('from', query.from);
    // Nothing older is kept: an earlier `from` (a client's "90 days ago", read a moment before
    // this clock) starts at the horizon rather than being refused.
    const from = asked < oldest ? oldest : asked;
    const where = new PageFilter().where((p) => `org_id = ${p}`, orgId).where((p) => `created_at >= ${p}`, from);
    if (query.to !== undefined) {
      const to = parseTimeBound('to', query.to);
      // Against the `from` given; without one, a `to` older than the horizon is an empty page.
      if (query.from !== undefined && to <= asked) throw invalidRequest('to', 'to must be later than from (from is inclusive, to exclusive).');
      where.where((p) => `created_at < ${p}`, to);
    }
    if (query.type !== undefined) {
      // Each name once: at most every event type, however long the list.
      const types = [...new Set(query.type.split(',').map((type) => type.trim()).filter(Boolean))];
      const unknown = types.find((type) => !(EVENT_TYPES as readonly string[]).includes(type));
      if (!types.length || unknown !== undefined) {
        throw invalidRequest('type', `type is one or more of ${EVENT_TYPES.join(', ')}${unknown ? ` (not "${unknown}")` : ''}.`);
      }
      where.where((p) => `type = ANY(${p}::text[])`, types as EventType[]);
    }
    if (query.severity !== undefined) {
      where.where((p) => `severity = ${p}`, query.severity);
      // The rare ones, as a literal too: a generic plan can then read their own index (migration 0047).
      if (query.severity !== 'info') where.whereSql(`severity <> 'info'`);
    }
    const columns = 'id, type, wallet_id, severity, summary, payload, created_at';
    const walletId = walletIdOf(query);
    if (walletId === undefined) {
      const { sql, params } = where.page(page);
      return toPage(await ctx.db.query<EventRow>(`SELECT ${columns} FROM events ${sql}`, params), page, eventView);
    }
    // A vault not in the organisation is 404, as for the transactions: not an empty feed.
    await getWallet(ctx.db, orgId, walletId);
    // Its events, and those of another of its organisation's vaults that name it (an escrow
    // between the two): two pages, each read in its index's order, merged. Both filters hold the
    // same parameters in the same order; related_wallet_id never equals wallet_id.
    const own = where.copy().where((p) => `wallet_id = ${p}`, walletId).page(page);
    const related = where.where((p) => `related_wallet_id = ${p}`, walletId).page(page);
    const rows = await ctx.db.query<EventRow>(
      `SELECT * FROM ((SELECT ${columns} FROM events ${own.sql}) UNION ALL (SELECT ${columns} FROM events ${related.sql})) AS e
       ORDER BY created_at DESC, id DESC LIMIT ${page.limit + 1}`, own.params);
    return toPage(rows, page, eventView);
  });
}
