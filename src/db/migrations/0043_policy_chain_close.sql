-- A deleted policy's chain account was never closed: the operator key paid its rent (~0.0017 SOL
-- on a cluster) at SetPolicy and never had it back, so a tenant creating and deleting policies
-- in a loop drained the key every organisation's payments need. The policies.close job now
-- closes the account of a deleted policy once no vault can spend under it any more (the
-- program's PolicyClose, docs/program.md; the conditions in docs/policies.md), the rent back to
-- the operator key (docs/operations.md, "The operator key's SOL"). As for escrows (migration
-- 0041), per policy: when its account was found gone (or found never created); the claim of the
-- run closing it (one short statement, no lock held across the chain); the last close sent and
-- its last valid block height, so that a run taking over a lapsed claim sends nothing while that
-- close can still land; and the program's error when it refused the close (an older program that
-- does not know the instruction), which is not tried again.
ALTER TABLE policies ADD COLUMN chain_closed_at TIMESTAMPTZ;
ALTER TABLE policies ADD COLUMN chain_close_claimed_until TIMESTAMPTZ;
ALTER TABLE policies ADD COLUMN chain_close_signature TEXT;
ALTER TABLE policies ADD COLUMN chain_close_valid_height BIGINT;
ALTER TABLE policies ADD COLUMN chain_close_refused TEXT;
-- The job's query: deleted policies still open on chain, the longest deleted first.
CREATE INDEX policies_to_close ON policies (deleted_at, org_id, id)
  WHERE deleted_at IS NOT NULL AND NOT is_preset AND chain_closed_at IS NULL AND chain_close_refused IS NULL;
