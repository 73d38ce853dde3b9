-- The automation job re-arms its latches every second: only the latched vaults are read.
CREATE INDEX wallets_topup_latched ON wallets (id) WHERE topup_fired_at IS NOT NULL;
CREATE INDEX wallets_low_balance_latched ON wallets (id) WHERE low_balance_fired_at IS NOT NULL;
