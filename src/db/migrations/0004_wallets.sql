-- Wallets: when the vault account first existed on chain (wallet.created is written then); the
-- vaults whose chain state still has to catch up with the database; tag filters.
ALTER TABLE wallets ADD COLUMN provisioned_at TIMESTAMPTZ;
CREATE INDEX wallets_chain_pending ON wallets (chain_status) WHERE chain_status = 'pending';
CREATE INDEX wallets_tags ON wallets USING GIN (tags);
