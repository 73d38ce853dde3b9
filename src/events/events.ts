/**
 * The transactional outbox: every state change writes its event row in the same database
 * transaction as the change. The activity feed and webhook deliveries read from here.
 */
import type { Queryable } from '../db/database.ts';
import { newId } from '../ids/ids.ts';

export const EVENT_TYPES = [
  'transaction.completed', 'transaction.blocked', 'transaction.pending', 'transaction.failed',
  'wallet.created', 'wallet.funded', 'wallet.withdrawn', 'wallet.frozen', 'wallet.unfrozen', 'wallet.archived',
  'balance.low', 'policy.created', 'policy.updated', 'policy.deleted', 'policy.expired',
  'escrow.created', 'escrow.completed', 'escrow.released', 'escrow.refunded', 'escrow.disputed',
  'org.deposit_confirmed', 'export.ready',
] as const;
export type EventType = (typeof EVENT_TYPES)[number];
export type Severity = 'info' | 'warning' | 'critical';

const WARNING: ReadonlySet<EventType> = new Set<EventType>([
  'balance.low', 'transaction.blocked', 'escrow.disputed', 'policy.expired', 'transaction.failed',
]);

/** SPEC.md's severities; `critical` for a manual freeze and a refund decided by dispute. */
export function severityOf(type: EventType, payload: Record<string, unknown>): Severity {
  if (type === 'wallet.frozen' && payload.reason !== 'policy_expired') return 'critical';
  if (type === 'escrow.refunded' && payload.after_dispute === true) return 'critical';
  return WARNING.has(type) ? 'warning' : 'info';
}

export interface NewEvent {
  orgId: string;
  type: EventType;
  walletId?: string | null;
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
  const id = newId('evt', nowMs);
  const createdAt = new Date(nowMs);
  await tx.query(
    `INSERT INTO events (id, org_id, type, wallet_id, severity, summary, payload, created_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
    [id, event.orgId, event.type, event.walletId ?? null, severityOf(event.type, event.payload), event.summary,
      JSON.stringify(event.payload), createdAt],
  );
  return { id, type: event.type, createdAt };
}
