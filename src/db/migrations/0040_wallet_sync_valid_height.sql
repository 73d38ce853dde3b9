-- A wallet sync's lease (90 s of the service clock) was all that kept a second sync from taking
-- the wallet over while a vault update the first had sent could still land. A transaction lands
-- until its last valid block height, which the service clock does not measure: slots longer
-- than 400 ms, or a test clock moved forward, let the lease lapse first, and the second sync
-- read the vault before the first's update landed and marked the wallet ready (a freeze landing
-- after it, say). Each send now notes its signature and last valid block height; a takeover
-- also waits until the chain has its outcome or is past that height (docs/wallets.md, "The
-- chain follows the database").
ALTER TABLE wallets ADD COLUMN sync_signature TEXT;
ALTER TABLE wallets ADD COLUMN sync_valid_height BIGINT;
