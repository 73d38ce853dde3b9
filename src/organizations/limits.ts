/**
 * Counts of things an organisation may have (SPEC leaves them open; docs/decisions.md): each is
 * checked in the creating transaction with the organisation's row locked, so that creations side
 * by side count one after the other and cannot both take the last place.
 */
import type { Queryable } from '../db/database.ts';
import { ServiceError } from '../errors/errors.ts';

/** Locks the organisation's row (as a funding does) for the rest of the transaction. */
export async function lockOrganization(tx: Queryable, orgId: string): Promise<void> {
  await tx.query('SELECT id FROM organizations WHERE id = $1 FOR NO KEY UPDATE', [orgId]);
}

/**
 * Refuses (`invalid_request`, with `advice`) when the organisation already has `max` of `what`,
 * as `countSql` counts them (`$1` is the organisation). Call after lockOrganization, in the
 * transaction that creates the next one.
 */
export async function assertBelowCount(
  tx: Queryable, orgId: string, what: { noun: string; countSql: string; max: number; advice: string },
): Promise<void> {
  const [row] = await tx.query<{ n: number }>(what.countSql, [orgId]);
  if (row!.n >= what.max) {
    throw new ServiceError('invalid_request', `Your organisation has reached its limit of ${what.max} ${what.noun}: ${what.advice}`);
  }
}
