-- A wallet whose vault sync the chain refuses, or that fails, is tried again by the wallets.sync
-- job later and later (docs/wallets.md, "The chain follows the database"): how many syncs of it
-- have failed in a row, and when the job may try the next. Before, a refused sync changed nothing
-- the job's query looked at (`ORDER BY updated_at LIMIT 50`), so 50 wallets the chain keeps
-- refusing (a vault under an organisation another key set up first) were taken first on every
-- run and no other wallet synced again.
ALTER TABLE wallets ADD COLUMN sync_failures INTEGER NOT NULL DEFAULT 0;
ALTER TABLE wallets ADD COLUMN sync_retry_at TIMESTAMPTZ;
-- The job's order: the wallet due longest, by its retry time or, never failed since it became
-- pending, its last change. wallets_chain_pending (0004) stays: it finds the pending rows, this
-- one reads them in that order without a sort.
CREATE INDEX wallets_sync_due ON wallets ((COALESCE(sync_retry_at, updated_at)), id) WHERE chain_status = 'pending';
