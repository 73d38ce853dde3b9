/**
 * Policies: the spending rules attached to vaults. Each one is a row of the organisation and an
 * account on chain (`["policy", org:policy]`) holding what the program enforces alone
 * (max per transaction, a daily cap, expiry); the rest is checked by the service.
 *
 * The database decides first: a change is effective for the next payment the moment it
 * commits. The policy account is then brought to the row's limits, outside any database
 * transaction. A row whose account may lag is `chain_status = 'pending'`; it becomes `ready`
 * only when a writer of the current revision has read the account back holding exactly the
 * row's limits. Whoever finds the account differing from the row (another write landed later)
 * raises the revision and marks the row pending again, so a write that lost a race never leaves
 * a `ready` row over stale limits. The `policies.sync` job finishes rows left pending.
 */
import { address, type Signature } from '@solana/kit';
import { Type } from 'typebox';
import { assertActingKeyLive } from '../api-keys/api-keys.ts';
import type { PolicyLimits } from '../chain/program.ts';
import type { Queryable } from '../db/database.ts';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import { recordEvent } from '../events/events.ts';
import type { AppContext } from '../http/context.ts';
import { PageFilter, toPage, type PageRequest } from '../http/pagination.ts';
import { newId } from '../ids/ids.ts';
import { formatUsdc } from '../money/money.ts';
import { assertBelowCount, lockOrganization } from '../organizations/limits.ts';
import { EXPIRY_MARGIN_BLOCKS } from '../transactions/settlement.ts';
import { diffFields, eventChanges, type Changes, type PolicyFields } from './fields.ts';
import { chainLimitsOf, type PolicyRules } from './presets.ts';

export interface PolicyRow {
  org_id: string;
  id: string;
  name: string;
  is_preset: boolean;
  max_per_tx: bigint | null;
  max_per_day: bigint | null;
  max_per_month: bigint | null;
  velocity_cap: number | null;
  allowed_recipients: string[];
  blocked_categories: string[];
  require_co_sign: bigint | null;
  expiry: Date | null;
  chain_address: string;
  chain_status: 'pending' | 'ready';
  revision: number;
  /** SetPolicy writes sent whose outcome is not known yet: the row is not ready while any may land */
  unsettled_writes: UnsettledWrite[];
  created_at: Date;
  updated_at: Date;
  deleted_at: Date | null;
}

interface PolicyWithCount extends PolicyRow {
  wallet_count: bigint;
}

/** Who made a change: the organisation and the API key (audit entries name the key). */
export interface Actor {
  orgId: string;
  keyId: string;
}

type Ctx = Pick<AppContext, 'db' | 'clock' | 'chain' | 'log' | 'config'>;

/** What `rulesOf` reads, of a policy joined as `p` (the recording of payments reads it with the vaults). */
export const RULE_COLUMNS = `p.max_per_tx, p.max_per_day, p.max_per_month, p.velocity_cap, p.allowed_recipients,
  p.blocked_categories, p.require_co_sign, p.expiry`;
export type RuleColumns = Pick<PolicyRow,
  'max_per_tx' | 'max_per_day' | 'max_per_month' | 'velocity_cap' | 'allowed_recipients' | 'blocked_categories' | 'require_co_sign' | 'expiry'>;
const COLUMNS = `p.org_id, p.id, p.name, p.is_preset, ${RULE_COLUMNS}, p.chain_address, p.chain_status, p.revision,
  p.unsettled_writes, p.created_at, p.updated_at, p.deleted_at`;
/** Vaults attached: archived ones are frozen for good and do not hold a policy in use. */
const WALLET_COUNT = `(SELECT count(*) FROM wallets w
  WHERE w.org_id = p.org_id AND w.policy_id = p.id AND w.status <> 'archived') AS wallet_count`;

// ---------------------------------------------------------------------------------------------
// Reading

/**
 * The organisation's policy, null when missing or deleted (`includeDeleted`: also a deleted one,
 * which archived wallets and past payments still name). `lock: 'share'` keeps it from being
 * deleted until the caller's transaction ends (attach a wallet under it); `'update'` is for
 * changing it.
 */
export async function findPolicy(
  q: Queryable, orgId: string, policyId: string, options: { lock?: 'share' | 'update'; includeDeleted?: boolean } = {},
): Promise<PolicyRow | null> {
  const lock = options.lock === 'share' ? 'FOR SHARE' : options.lock === 'update' ? 'FOR UPDATE' : '';
  const rows = await q.query<PolicyRow>(
    `SELECT ${COLUMNS} FROM policies p WHERE p.org_id = $1 AND p.id = $2 ${options.includeDeleted ? '' : 'AND p.deleted_at IS NULL'} ${lock}`,
    [orgId, policyId]);
  return rows[0] ?? null;
}

export function policyNotFound(policyId: string): ServiceError {
  return new ServiceError('policy_not_found', `No policy ${policyId} in your organisation.`, { param: 'policy_id' });
}

export function rulesOf(row: RuleColumns): PolicyRules {
  return {
    maxPerTx: row.max_per_tx,
    maxPerDay: row.max_per_day,
    maxPerMonth: row.max_per_month,
    velocityCap: row.velocity_cap,
    allowedRecipients: row.allowed_recipients,
    blockedCategories: row.blocked_categories,
    requireCoSign: row.require_co_sign,
    expiry: row.expiry,
  };
}

function fieldsOf(row: PolicyRow): PolicyFields {
  return { name: row.name, ...rulesOf(row) };
}

const usdcOrNull = (micro: bigint | null): string | null => (micro === null ? null : formatUsdc(micro));
const AmountOrNull = Type.Union([Type.String({ description: 'decimal USDC' }), Type.Null()], { description: 'decimal USDC; null = no limit' });

/** What a wallet shows of its policy. */
export const PolicySummary = Type.Object({
  policy_id: Type.String(),
  name: Type.String(),
  max_per_tx: AmountOrNull,
  max_per_day: AmountOrNull,
  max_per_month: AmountOrNull,
});

export function policySummary(row: PolicyRow) {
  return {
    policy_id: row.id,
    name: row.name,
    max_per_tx: usdcOrNull(row.max_per_tx),
    max_per_day: usdcOrNull(row.max_per_day),
    max_per_month: usdcOrNull(row.max_per_month),
  };
}

export const PolicyView = Type.Object({
  policy_id: Type.String(),
  name: Type.String(),
  max_per_tx: AmountOrNull,
  max_per_day: AmountOrNull,
  max_per_month: AmountOrNull,
  velocity_cap: Type.Union([Type.Integer(), Type.Null()], { description: 'payments per rolling hour; null = no limit' }),
  allowed_recipients: Type.Array(Type.String(), { description: 'empty = any recipient' }),
  blocked_categories: Type.Array(Type.String()),
  require_co_sign: Type.Union([Type.String(), Type.Null()], { description: 'payments above it wait for an approval; null = never' }),
  expiry: Type.Union([Type.String(), Type.Null()], { description: 'ISO 8601; null = never' }),
  wallet_count: Type.Integer({ description: 'wallets attached, archived ones excluded' }),
  is_preset: Type.Boolean(),
  chain_address: Type.String({ description: 'the policy account on chain' }),
  created_at: Type.String(),
  updated_at: Type.String(),
});

export function policyView(row: PolicyRow, walletCount: number | bigint) {
  return {
    ...policySummary(row),
    velocity_cap: row.velocity_cap,
    allowed_recipients: row.allowed_recipients,
    blocked_categories: row.blocked_categories,
    require_co_sign: usdcOrNull(row.require_co_sign),
    expiry: row.expiry?.toISOString() ?? null,
    wallet_count: Number(walletCount),
    is_preset: row.is_preset,
    chain_address: row.chain_address,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
  };
}

export type PolicyViewBody = ReturnType<typeof policyView>;

export async function getPolicyView(q: Queryable, orgId: string, policyId: string): Promise<PolicyViewBody> {
  const rows = await q.query<PolicyWithCount>(
    `SELECT ${COLUMNS}, ${WALLET_COUNT} FROM policies p WHERE p.org_id = $1 AND p.id = $2 AND p.deleted_at IS NULL`,
    [orgId, policyId]);
  if (!rows[0]) throw policyNotFound(policyId);
  return policyView(rows[0], rows[0].wallet_count);
}

/**
 * Bytes of recipient and category lists one page of policies carries at most (it then ends
 * early, `has_more` true): a policy may list 1,000 domains of up to 253 characters, about 260 KB,
 * so 100 of them would be 26 MB. A page always holds at least one policy.
 */
export const POLICY_PAGE_BYTES_MAX = 4 * 1024 * 1024;

/** The organisation's policies, presets included, newest first. */
export async function listPolicies(q: Queryable, orgId: string, page: PageRequest) {
  const { sql, params } = new PageFilter('p').where((p) => `p.org_id = ${p}`, orgId).whereSql('p.deleted_at IS NULL').page(page);
  // The page's policies with the bytes of the lists before each. Those within the bound are
  // read, and the first past it, which only tells that there is more: the page ends before it.
  const rows = await q.query<PolicyWithCount & { fits: boolean }>(
    `WITH page AS (
       SELECT p.org_id, p.id, p.created_at,
              COALESCE(sum(octet_length(p.allowed_recipients::text) + octet_length(p.blocked_categories::text))
                OVER (ORDER BY p.created_at DESC, p.id DESC ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
       FROM (SELECT p.org_id, p.id FROM policies p ${sql}) listed JOIN policies p ON p.org_id = listed.org_id AND p.id = listed.id
     ), shown AS (
       SELECT org_id, id, bytes_before FROM page WHERE bytes_before < ${POLICY_PAGE_BYTES_MAX}
       UNION ALL
       (SELECT org_id, id, bytes_before FROM page WHERE bytes_before >= ${POLICY_PAGE_BYTES_MAX} ORDER BY created_at DESC, id DESC LIMIT 1)
     )
     SELECT ${COLUMNS}, ${WALLET_COUNT}, shown.bytes_before < ${POLICY_PAGE_BYTES_MAX} AS fits
     FROM shown JOIN policies p ON p.org_id = shown.org_id AND p.id = shown.id
     ORDER BY p.created_at DESC, p.id DESC`, params);
  const cut = rows.findIndex((row) => !row.fits);
  const shown = cut < 0 || cut >= page.limit ? rows : rows.slice(0, cut + 1);
  return toPage(shown, cut < 0 || cut >= page.limit ? page : { ...page, limit: cut }, (row) => policyView(row, row.wallet_count));
}

export const AuditEntryView = Type.Object({
  timestamp: Type.String(),
  changed_by: Type.String({ description: 'the id of the API key that made the change' }),
  changes: Type.Record(Type.String(), Type.Object({ from: Type.Unknown(), to: Type.Unknown() }),
    { description: 'keyed by snake_case field, values formatted as the policy object shows them' }),
});

/** The policy's changes, oldest first (the cursor moves forward in time). */
/**
 * Bytes of changes one audit page carries at most (it then ends early, `has_more` true): an
 * entry replacing both lists of 1,000 domains weighs about 500 KB, so 100 of them would be 50 MB.
 * A page always holds at least one entry.
 */
export const AUDIT_PAGE_BYTES_MAX = 4 * 1024 * 1024;

export async function policyAuditLog(q: Queryable, orgId: string, policyId: string, page: PageRequest) {
  if (!await findPolicy(q, orgId, policyId)) throw policyNotFound(policyId);
  const after = page.after ? 'AND (created_at, id) > ($3, $4)' : '';
  const params = page.after ? [orgId, policyId, page.after.createdAt, page.after.id] : [orgId, policyId];
  // The entries of the page with the bytes of those before each; the changes of an entry past
  // the byte bound are not sent (null): it only tells that there is more.
  const rows = await q.query<{ id: string; changed_by: string; changes: Changes | null; created_at: Date }>(
    `SELECT s.id, s.changed_by, s.created_at, CASE WHEN s.bytes_before < ${AUDIT_PAGE_BYTES_MAX} THEN a.changes END AS changes
     FROM (SELECT id, changed_by, created_at,
                  COALESCE(sum(octet_length(changes::text)) OVER (ORDER BY created_at, id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                    AS bytes_before
           FROM policy_audit WHERE org_id = $1 AND policy_id = $2 ${after}
           ORDER BY created_at, id LIMIT ${page.limit + 1}) s
     JOIN policy_audit a ON a.id = s.id
     ORDER BY s.created_at, s.id`, params);
  const fit = rows.findIndex((row) => row.changes === null);
  const shown = fit < 0 || fit >= page.limit ? rows : rows.slice(0, fit + 1);
  return toPage(shown, fit < 0 || fit >= page.limit ? page : { ...page, limit: fit }, (row) => ({
    timestamp: row.created_at.toISOString(), changed_by: row.changed_by, changes: row.changes!,
  }));
}

// ---------------------------------------------------------------------------------------------
// Changing

/** How long a writer holds a pending policy before another may take it over. */
const CLAIM_MS = 60_000;
/** After a failed write the policy waits this long before the job tries again. */
const RETRY_DELAY_MS = 10_000;
/** One setPolicy round trip; a slot is ~400 ms. */
const CHAIN_TIMEOUT_MS = 5_000;
/** Writes of one sync: each pass rewrites the row's current limits after a lost race. */
const SYNC_PASSES_MAX = 3;

/**
 * The time of a change: the service clock, but strictly after the policy's previous change, so
 * its audit entries are chronological by timestamp even when two land in one millisecond.
 */
function changeTimeMs(ctx: Ctx, previous: PolicyRow | null): number {
  const nowMs = ctx.clock.nowMs();
  return previous ? Math.max(nowMs, previous.updated_at.getTime() + 1) : nowMs;
}

/** Every change of a policy writes its audit row last, its locks held: a key revoked while it waited changes nothing. */
async function writeAudit(tx: Queryable, atMs: number, actor: Actor, policyId: string, changes: Changes): Promise<void> {
  await assertActingKeyLive(tx, actor.orgId, actor.keyId);
  await tx.query(
    `INSERT INTO policy_audit (id, org_id, policy_id, changed_by, changes, created_at) VALUES ($1, $2, $3, $4, $5, $6)`,
    [newId('aud', atMs), actor.orgId, policyId, actor.keyId, JSON.stringify(changes), new Date(atMs)]);
}

function assertMutable(row: PolicyRow): void {
  if (row.is_preset) {
    throw new ServiceError('policy_immutable', `${row.id} is a preset and cannot be changed or deleted: clone it first.`,
      { policy_id: row.id });
  }
}

async function insertPolicy(
  ctx: Ctx, tx: Queryable, actor: Actor, fields: PolicyFields, clonedFrom: string | null,
): Promise<{ policyId: string; claimedUntil: Date }> {
  await lockOrganization(tx, actor.orgId);
  await assertBelowCount(tx, actor.orgId, {
    // A deleted policy counts until its chain account is closed (policies.close): the bound is on
    // the accounts whose rent the operator key pays, which deleting alone does not give back.
    noun: 'policies',
    countSql: `SELECT count(*)::int AS n FROM policies WHERE org_id = $1 AND NOT is_preset
                 AND (deleted_at IS NULL OR (chain_closed_at IS NULL AND chain_close_refused IS NULL))`,
    max: ctx.config.policiesPerOrgMax,
    advice: 'delete policies no vault uses (a deleted policy counts until its account on chain is closed, 10 minutes after '
      + 'the deletion at the earliest: docs/policies.md), or ask the operator (AGENT_VAULT_POLICIES_PER_ORG_MAX).',
  });
  const atMs = ctx.clock.nowMs();
  const policyId = newId('pol', atMs);
  const chainAddress = await ctx.chain.policyAddress(actor.orgId, policyId);
  const claimedUntil = new Date(atMs + CLAIM_MS);
  await tx.query(
    `INSERT INTO policies (org_id, id, name, is_preset, max_per_tx, max_per_day, max_per_month, velocity_cap,
       allowed_recipients, blocked_categories, require_co_sign, expiry, chain_address, chain_status, revision,
       chain_claimed_until, created_at, updated_at)
     VALUES ($1, $2, $3, FALSE, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'pending', 1, $13, $14, $14)`,
    [actor.orgId, policyId, fields.name, fields.maxPerTx, fields.maxPerDay, fields.maxPerMonth, fields.velocityCap,
      JSON.stringify(fields.allowedRecipients), JSON.stringify(fields.blockedCategories), fields.requireCoSign,
      fields.expiry, chainAddress, claimedUntil, new Date(atMs)]);
  const changes = diffFields(null, fields);
  await writeAudit(tx, atMs, actor, policyId, changes);
  await recordEvent(tx, atMs, {
    orgId: actor.orgId, type: 'policy.created',
    summary: clonedFrom ? `Policy ${fields.name} created from ${clonedFrom}` : `Policy ${fields.name} created`,
    payload: { policy_id: policyId, changes: eventChanges(changes), changed_by: actor.keyId, revision: 1, ...(clonedFrom ? { cloned_from: clonedFrom } : {}) },
  });
  return { policyId, claimedUntil };
}

export async function createPolicy(ctx: Ctx, actor: Actor, fields: PolicyFields): Promise<PolicyViewBody> {
  const { policyId, claimedUntil } = await ctx.db.transaction((tx) => insertPolicy(ctx, tx, actor, fields, null));
  await syncAfterChange(ctx, actor.orgId, policyId, claimedUntil);
  return getPolicyView(ctx.db, actor.orgId, policyId);
}

/**
 * A new editable policy with the source's rules (a preset's too) and the overrides. The
 * source's expiry is inherited only while it is still ahead.
 */
export async function clonePolicy(
  ctx: Ctx, actor: Actor, sourceId: string, overrides: Partial<PolicyFields> & { name: string },
): Promise<PolicyViewBody> {
  const { policyId, claimedUntil } = await ctx.db.transaction(async (tx) => {
    const source = await findPolicy(tx, actor.orgId, sourceId);
    if (!source) throw policyNotFound(sourceId);
    const fields = { ...fieldsOf(source), ...overrides };
    if (fields.expiry && fields.expiry.getTime() <= ctx.clock.nowMs()) {
      throw invalidRequest('expiry', `The expiry of ${sourceId} has passed: send a new expiry, or null for none.`);
    }
    return insertPolicy(ctx, tx, actor, fields, sourceId);
  });
  await syncAfterChange(ctx, actor.orgId, policyId, claimedUntil);
  return getPolicyView(ctx.db, actor.orgId, policyId);
}

/** Both lists are already free of duplicates (fields.ts drops them). */
function sameMembers(a: readonly string[], b: readonly string[]): boolean {
  const members = new Set(a);
  return a.length === b.length && b.every((item) => members.has(item));
}

/**
 * Applies the sent fields. A request that changes nothing writes nothing (no audit entry, no
 * event, no chain write) and answers the policy as it is; reordering a list is no change.
 */
export async function updatePolicy(
  ctx: Ctx, actor: Actor, policyId: string, patch: Partial<PolicyFields>,
): Promise<PolicyViewBody> {
  const claimedUntil = await ctx.db.transaction(async (tx) => {
    const row = await findPolicy(tx, actor.orgId, policyId, { lock: 'update' });
    if (!row) throw policyNotFound(policyId);
    assertMutable(row);
    const before = fieldsOf(row);
    const after = { ...before, ...patch };
    // The two lists are sets (order means nothing to the engine): the same members in another
    // order are no change, so they keep their stored order and write no audit entry or event.
    if (sameMembers(before.allowedRecipients, after.allowedRecipients)) after.allowedRecipients = before.allowedRecipients;
    if (sameMembers(before.blockedCategories, after.blockedCategories)) after.blockedCategories = before.blockedCategories;
    const changes = diffFields(before, after);
    if (Object.keys(changes).length === 0) return null;
    const atMs = changeTimeMs(ctx, row);
    const claimed = new Date(atMs + CLAIM_MS);
    const [{ revision }] = await tx.query<{ revision: number }>(
      `UPDATE policies SET name = $3, max_per_tx = $4, max_per_day = $5, max_per_month = $6, velocity_cap = $7,
         allowed_recipients = $8, blocked_categories = $9, require_co_sign = $10, expiry = $11, updated_at = $12,
         chain_status = 'pending', revision = revision + 1, chain_claimed_until = $13,
         expired_at = CASE WHEN expiry IS DISTINCT FROM $11 THEN NULL ELSE expired_at END
       WHERE org_id = $1 AND id = $2 RETURNING revision`,
      [actor.orgId, policyId, after.name, after.maxPerTx, after.maxPerDay, after.maxPerMonth, after.velocityCap,
        JSON.stringify(after.allowedRecipients), JSON.stringify(after.blockedCategories), after.requireCoSign, after.expiry,
        new Date(atMs), claimed]) as [{ revision: number }];
    await writeAudit(tx, atMs, actor, policyId, changes);
    await recordEvent(tx, atMs, {
      orgId: actor.orgId, type: 'policy.updated',
      summary: `Policy ${after.name} updated: ${Object.keys(changes).join(', ')}`,
      payload: { policy_id: policyId, changes: eventChanges(changes), changed_by: actor.keyId, revision },
    });
    return claimed;
  });
  if (claimedUntil) await syncAfterChange(ctx, actor.orgId, policyId, claimedUntil);
  return getPolicyView(ctx.db, actor.orgId, policyId);
}

/**
 * Soft-deletes a policy no live wallet uses; it then answers 404. The row stays (archived
 * wallets and past transactions name it); its account on chain is closed later by the
 * policies.close job (src/policies/close.ts), once nothing can need it, its rent back to the
 * operator key.
 */
export async function deletePolicy(ctx: Ctx, actor: Actor, policyId: string): Promise<PolicyViewBody> {
  return ctx.db.transaction(async (tx) => {
    const row = await findPolicy(tx, actor.orgId, policyId, { lock: 'update' });
    if (!row) throw policyNotFound(policyId);
    assertMutable(row);
    const [{ count }] = await tx.query<{ count: bigint }>(
      `SELECT count(*) FROM wallets WHERE org_id = $1 AND policy_id = $2 AND status <> 'archived'`,
      [actor.orgId, policyId]) as [{ count: bigint }];
    if (count > 0n) {
      throw new ServiceError('policy_in_use',
        `${policyId} is attached to ${count} wallet(s): attach them to another policy (or archive them) first.`,
        { policy_id: policyId, wallet_count: Number(count) });
    }
    const atMs = changeTimeMs(ctx, row);
    await tx.query('UPDATE policies SET deleted_at = $3, updated_at = $3 WHERE org_id = $1 AND id = $2',
      [actor.orgId, policyId, new Date(atMs)]);
    await writeAudit(tx, atMs, actor, policyId, { deleted_at: { from: null, to: new Date(atMs).toISOString() } });
    await recordEvent(tx, atMs, {
      orgId: actor.orgId, type: 'policy.deleted',
      summary: `Policy ${row.name} deleted`,
      payload: { policy_id: policyId, name: row.name, changed_by: actor.keyId, revision: row.revision },
    });
    return policyView(row, 0);
  });
}

// ---------------------------------------------------------------------------------------------
// The chain catches up with the database

/** The limits the program enforces are the same in both. */
export function sameLimits(a: PolicyLimits, b: PolicyLimits): boolean {
  return a.maxPerTx === b.maxPerTx && a.maxPerDay === b.maxPerDay && a.expiry === b.expiry;
}

export type SyncResult = 'ready' | 'pending' | 'gone';

/**
 * Writes the row's limits to the policy account unless it already holds them, reads it back,
 * and marks the row `ready` if its revision is still the one written and the account equals
 * its limits. If the account differs from the row's current limits, some other write landed
 * after this one: the row goes back to pending under a new revision (so no concurrent writer
 * can mark it ready on an older reading) and this sync writes again, up to SYNC_PASSES_MAX.
 */
export async function syncPolicyToChain(ctx: Ctx, orgId: string, policyId: string): Promise<SyncResult> {
  for (let pass = 0; pass < SYNC_PASSES_MAX; pass += 1) {
    const row = await findPolicy(ctx.db, orgId, policyId);
    if (!row) return 'gone';
    if (row.chain_status === 'ready') return 'ready';
    const want = chainLimitsOf(rulesOf(row));
    const account = address(row.chain_address);
    let onChain = await ctx.chain.getPolicy(account);
    // Any key may create a policy account at its address first (it derives from the ids alone):
    // limits that key can change at will are no limits, so it is never marked ready.
    if (onChain && onChain.authority !== ctx.chain.operator.address) {
      throw new Error(`policy ${policyId}'s account ${account} on chain was created by another key (${onChain.authority}), not the operator`);
    }
    // Earlier writes whose outcome their writers never learned: settled now if the chain knows
    // them or they can no longer land. One that still may keeps the row from being marked ready
    // (it could land after this sync's reading), but does not stop this write: the account
    // follows the newest limits meanwhile, and a later pass writes them again if it lands.
    const stillUnsettled = await settleWrites(ctx, orgId, policyId, row.unsettled_writes);
    if (!onChain || !sameLimits(onChain, want)) {
      const prepared = await ctx.chain.prepare([await ctx.chain.setPolicyIx(orgId, policyId, want)]);
      // Deleted meanwhile: nothing is sent (the policies.close job may close its account, and a
      // write landing after that would create it again).
      if (!await noteWrite(ctx.db, orgId, policyId, { signature: prepared.signature, valid_height: String(prepared.lastValidBlockHeight) })) return 'gone';
      await ctx.chain.submit(prepared);
      const outcome = await ctx.chain.waitForOutcome(prepared.signature, CHAIN_TIMEOUT_MS);
      // Its outcome is known: it can no longer land later.
      await forgetWrites(ctx.db, orgId, policyId, [prepared.signature]);
      if (outcome.err) throw new Error(`setting policy ${policyId} on chain failed: ${outcome.err.name}`);
      onChain = await ctx.chain.getPolicy(account);
    }
    const read = onChain;
    const result = await ctx.db.transaction(async (tx): Promise<SyncResult | null> => {
      const current = await findPolicy(tx, orgId, policyId, { lock: 'update' });
      if (!current) return 'gone';
      if (read && sameLimits(read, chainLimitsOf(rulesOf(current)))) {
        if (current.revision !== row.revision) return 'pending';
        // A write that may still land (this reading's or one noted meanwhile): not ready yet;
        // the job comes back once it has landed or can no longer.
        if (stillUnsettled || current.unsettled_writes.length > 0) return 'pending';
        await tx.query(`UPDATE policies SET chain_status = 'ready' WHERE org_id = $1 AND id = $2`, [orgId, policyId]);
        return 'ready';
      }
      await tx.query(`UPDATE policies SET chain_status = 'pending', revision = revision + 1 WHERE org_id = $1 AND id = $2`,
        [orgId, policyId]);
      return null;
    });
    if (result) return result;
  }
  return 'pending';
}

/** A SetPolicy sent whose outcome its writer has not learned yet (policies.unsettled_writes). */
export interface UnsettledWrite {
  signature: string;
  /** its last valid block height, as a decimal string (JSON has no u64) */
  valid_height: string;
}

/**
 * Notes a write before it is sent; false (and nothing noted) when the policy is deleted: a
 * deleted policy is never written again, so that the policies.close job, which waits for every
 * noted write, knows them all.
 */
async function noteWrite(db: Queryable, orgId: string, policyId: string, write: UnsettledWrite): Promise<boolean> {
  const rows = await db.query(
    `UPDATE policies SET unsettled_writes = unsettled_writes || $3::jsonb WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL RETURNING id`,
    [orgId, policyId, JSON.stringify([write])]);
  return rows.length > 0;
}

/** Forgets writes whose outcome is known, or that can no longer land. */
async function forgetWrites(db: Queryable, orgId: string, policyId: string, signatures: readonly string[]): Promise<void> {
  if (signatures.length === 0) return;
  await db.query(
    `UPDATE policies SET unsettled_writes = COALESCE((SELECT jsonb_agg(w) FROM jsonb_array_elements(unsettled_writes) w
       WHERE NOT (w->>'signature' = ANY($3::text[]))), '[]'::jsonb) WHERE org_id = $1 AND id = $2`,
    [orgId, policyId, signatures]);
}

/**
 * Settles the noted writes the chain knows, or that are past their last valid height (with the
 * reconciler's margin); answers whether any may still land.
 */
async function settleWrites(ctx: Ctx, orgId: string, policyId: string, writes: readonly UnsettledWrite[]): Promise<boolean> {
  if (writes.length === 0) return false;
  const recent = writes.slice(-STATUS_BATCH_MAX);
  // The height before the statuses, as reconcilePending reads them.
  const height = await ctx.chain.getBlockHeight();
  const outcomes = await ctx.chain.getOutcomes(recent.map((write) => write.signature as Signature));
  const settled = recent.filter((write, i) => outcomes[i] !== null || height > BigInt(write.valid_height) + EXPIRY_MARGIN_BLOCKS)
    .map((write) => write.signature);
  // Older than the batch asked: long expired (at most one write a pass, three passes a sync).
  settled.push(...writes.slice(0, -STATUS_BATCH_MAX).map((write) => write.signature));
  await forgetWrites(ctx.db, orgId, policyId, settled);
  return settled.length < writes.length;
}

/** Signatures asked about in one call. */
const STATUS_BATCH_MAX = 100;

/**
 * After a change has committed: the request writes the chain itself, so the change holds on
 * chain when the response is sent. A failure does not undo the change; the row stays pending
 * and the job retries it after RETRY_DELAY_MS.
 */
async function syncAfterChange(ctx: Ctx, orgId: string, policyId: string, claimedUntil: Date): Promise<void> {
  let failed = false;
  try {
    await syncPolicyToChain(ctx, orgId, policyId);
  } catch (error) {
    failed = true;
    ctx.log.warn({ err: error, policyId }, 'policy chain write did not finish; policies.sync will retry');
    await markPendingAfterFailure(ctx, orgId, policyId);
  } finally {
    await releaseClaim(ctx, orgId, policyId, claimedUntil, failed);
  }
}

/**
 * A write whose outcome is unknown may still land: a new revision keeps any concurrent writer
 * from marking the row ready on a reading taken before it.
 */
async function markPendingAfterFailure(ctx: Ctx, orgId: string, policyId: string): Promise<void> {
  try {
    await ctx.db.query(`UPDATE policies SET chain_status = 'pending', revision = revision + 1 WHERE org_id = $1 AND id = $2`,
      [orgId, policyId]);
  } catch (error) {
    ctx.log.warn({ err: error, policyId }, 'could not mark the policy pending');
  }
}

/** Frees the claim (compare-and-set: a claim taken over by someone else is theirs); after a failure, holds it a while as a back-off. */
async function releaseClaim(ctx: Ctx, orgId: string, policyId: string, claimedUntil: Date, failed: boolean): Promise<void> {
  const next = failed ? new Date(ctx.clock.nowMs() + RETRY_DELAY_MS) : null;
  try {
    await ctx.db.query('UPDATE policies SET chain_claimed_until = $4 WHERE org_id = $1 AND id = $2 AND chain_claimed_until = $3',
      [orgId, policyId, claimedUntil, next]);
  } catch (error) {
    ctx.log.warn({ err: error, policyId }, 'could not release the policy claim; it expires by itself');
  }
}

export interface PolicySyncLimits {
  /** Policies claimed by one run. */
  batchMax: number;
  /** A run starts no new write after this, so it ends within the job's timeout. */
  runBudgetMs: number;
}

export const POLICY_SYNC_LIMITS: Readonly<PolicySyncLimits> = { batchMax: 50, runBudgetMs: 10_000 };

/**
 * The `policies.sync` job: claims a bounded batch of pending policies whose claim is free (FOR
 * UPDATE SKIP LOCKED over the lease column, one short statement) and writes each to the chain.
 * The one query of this feature across organisations: the job works for all of them.
 */
export async function syncPendingPolicies(ctx: Ctx, limits: PolicySyncLimits = POLICY_SYNC_LIMITS): Promise<number> {
  const nowMs = ctx.clock.nowMs();
  const claimedUntil = new Date(nowMs + CLAIM_MS);
  const claimed = await ctx.db.query<{ org_id: string; id: string }>(
    `UPDATE policies SET chain_claimed_until = $2
     WHERE (org_id, id) IN (
       SELECT org_id, id FROM policies
       WHERE chain_status = 'pending' AND deleted_at IS NULL AND (chain_claimed_until IS NULL OR chain_claimed_until <= $1)
       ORDER BY chain_claimed_until NULLS FIRST, updated_at LIMIT $3
       FOR UPDATE SKIP LOCKED)
     RETURNING org_id, id`,
    [new Date(nowMs), claimedUntil, limits.batchMax]);
  const deadlineMs = performance.now() + limits.runBudgetMs;
  let ready = 0;
  for (const policy of claimed) {
    if (performance.now() > deadlineMs) {
      await releaseClaim(ctx, policy.org_id, policy.id, claimedUntil, false);
      continue;
    }
    let failed = false;
    try {
      if (await syncPolicyToChain(ctx, policy.org_id, policy.id) === 'ready') ready += 1;
    } catch (error) {
      failed = true;
      ctx.log.warn({ err: error, policyId: policy.id }, 'policy chain sync failed; retrying later');
      await markPendingAfterFailure(ctx, policy.org_id, policy.id);
    } finally {
      await releaseClaim(ctx, policy.org_id, policy.id, claimedUntil, failed);
    }
  }
  return ready;
}
