-- A vault is shown `policy_violation` from a payment its policy blocked until its next accepted
-- payment or a change of its policy (docs/wallets.md "Status").
ALTER TABLE wallets ADD COLUMN policy_violation_at TIMESTAMPTZ;
