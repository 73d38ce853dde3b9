/**
 * The transactional outbox: every state change writes its event row in the same database
 * transaction as the change. The activity feed and webhook deliveries read from here.
 */
import { inBatches } from '../db/batches.ts';
import type { Queryable } from '../db/database.ts';
import { Params } from '../db/params.ts';
import { newId } from '../ids/ids.ts';

export const EVENT_TYPES = [
  'transaction.completed', 'transaction.blocked', 'transaction.pending', 'transaction.failed', 'transaction.awaiting_approval',
  'wallet.created', 'wallet.funded', 'wallet.withdrawn', 'wallet.frozen', 'wallet.unfrozen', 'wallet.archived',
  'balance.low', 'policy.created', 'policy.updated', 'policy.deleted', 'policy.expired',
  'escrow.created', 'escrow.completed', 'escrow.released', 'escrow.refunded', 'escrow.disputed', 'escrow.resolved',
  'escrow.release_failed', 'escrow.dispute_failed', 'escrow.resolve_failed', 'org.deposit_confirmed', 'export.ready', 'alert.raised',
] as const;
export type EventType = (typeof EVENT_TYPES)[number];

/** Events are kept this long (SPEC: 90 days), then the `events.retention` job deletes them. */
export const EVENT_RETENTION_MS = 90 * 24 * 3600 * 1000;
const RETENTION_BATCH = 5_000;
const RETENTION_RUN_MS = 20_000;

/**
 * Deletes the events older than the retention, 5,000 per statement, until none is left or the
 * run has taken 20 s (src/db/batches.ts). Returns how many went.
 */
export async function deleteExpiredEvents(q: Queryable, nowMs: number, options: { batch?: number } = {}): Promise<number> {
  return inBatches(async (batch) => (await q.query<{ n: number }>(
    `WITH gone AS (DELETE FROM events WHERE id IN (SELECT id FROM events WHERE created_at < $1 LIMIT $2) RETURNING 1)
     SELECT count(*)::int AS n FROM gone`,
    [new Date(nowMs - EVENT_RETENTION_MS), batch]))[0]!.n, { batch: options.batch ?? RETENTION_BATCH, budgetMs: RETENTION_RUN_MS });
}
export type Severity = 'info' | 'warning' | 'critical';

const WARNING: ReadonlySet<EventType> = new Set<EventType>([
  'balance.low', 'transaction.blocked', 'escrow.disputed', 'policy.expired', 'transaction.failed', 'alert.raised',
  // a completion's release or a dispute did not land: the escrow is locked again and its timeout runs on;
  // an arbiter's decision did not land: the escrow is disputed again, to be decided again
  'escrow.release_failed', 'escrow.dispute_failed', 'escrow.resolve_failed',
  // an operator has to act (approve or reject) before it expires
  'transaction.awaiting_approval',
]);

/** SPEC.md's severities; `critical` for a manual freeze and a refund decided by dispute. */
export function severityOf(type: EventType, payload: Record<string, unknown>): Severity {
  if (type === 'wallet.frozen') return payload.reason === 'policy_expired' ? 'warning' : 'critical';
  if (type === 'escrow.refunded' && payload.after_dispute === true) return 'critical';
  return WARNING.has(type) ? 'warning' : 'info';
}

export interface NewEvent {
  orgId: string;
  type: EventType;
  walletId?: string | null;
  /** another vault of the same organisation it concerns (an escrow's receiving vault): its feed shows it too */
  relatedWalletId?: string | null;
  summary: string;
  /** snake_case fields delivered with the event (`event`, `id` and `timestamp` are added) */
  payload: Record<string, unknown>;
}

export interface EventRecord {
  id: string;
  type: EventType;
  createdAt: Date;
}

export async function recordEvent(tx: Queryable, nowMs: number, event: NewEvent): Promise<EventRecord> {
  return (await recordEvents(tx, nowMs, [event]))[0]!;
}

/** Writes several events in one statement. */
export async function recordEvents(tx: Queryable, nowMs: number, events: readonly NewEvent[]): Promise<EventRecord[]> {
  if (events.length === 0) return [];
  const params = new Params();
  const insert = recordEventsSql(params, nowMs, events);
  await tx.query(insert.sql, params.values);
  return insert.records;
}

/** The INSERT of several events, its placeholders taken from `params` (a part of a larger statement). */
export function recordEventsSql(params: Params, nowMs: number, events: readonly NewEvent[]): { sql: string; records: EventRecord[] } {
  const createdAt = new Date(nowMs);
  const records = events.map((event) => ({ id: newId('evt', nowMs), type: event.type, createdAt }));
  const column = (type: string, pick: (e: NewEvent) => unknown) => params.array(type, events.map(pick));
  const sql = `INSERT INTO events (id, org_id, type, wallet_id, related_wallet_id, severity, summary, payload, created_at)
     SELECT r.*, ${params.add(createdAt)}::timestamptz FROM unnest(${params.array('text', records.map((r) => r.id))},
       ${column('text', (e) => e.orgId)}, ${column('text', (e) => e.type)}, ${column('text', (e) => e.walletId ?? null)},
       ${column('text', (e) => (e.relatedWalletId && e.relatedWalletId !== e.walletId ? e.relatedWalletId : null))},
       ${column('text', (e) => severityOf(e.type, e.payload))}, ${column('text', (e) => e.summary)},
       ${column('jsonb', (e) => JSON.stringify(e.payload))}) AS r(id, org_id, type, wallet_id, related_wallet_id, severity, summary, payload)`;
  return { sql, records };
}
