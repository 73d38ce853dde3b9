-- A payment may not go to one of the service's own accounts (a vault or a reserve, of any
-- organisation): the chain would credit it while no index does (docs/payments.md). These
-- indexes answer that question for every payment.
CREATE INDEX wallets_chain_address ON wallets (chain_address);
CREATE INDEX organizations_reserve_address ON organizations (reserve_address);
