-- Every account of the service is refused as a payment's recipient, not only vaults and
-- reserves: their token accounts, policy accounts and escrows' accounts too (docs/payments.md).
-- Paid, such an account would hold the money where no index sees it and nothing can move it.
-- These indexes answer that question for every payment.
CREATE INDEX wallets_token_address ON wallets (token_address);
CREATE INDEX organizations_reserve_token_address ON organizations (reserve_token_address);
CREATE INDEX policies_chain_address ON policies (chain_address);
CREATE INDEX escrows_chain_address ON escrows (chain_address);
CREATE INDEX escrows_token_address ON escrows (token_address);
