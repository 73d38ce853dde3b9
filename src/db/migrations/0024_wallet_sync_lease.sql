-- One sync of a wallet's vault to its database state at a time (src/wallets/wallets.ts
-- syncWalletToChain): the sync holding the lease, a random token, and until when. Two syncs at
-- once could each send what the other undid (a freeze that lands after an unfreeze's sync found
-- nothing to do), and leave the vault frozen on chain under an active, `ready` wallet.
ALTER TABLE wallets ADD COLUMN sync_holder TEXT;
ALTER TABLE wallets ADD COLUMN sync_lease_until TIMESTAMPTZ;
