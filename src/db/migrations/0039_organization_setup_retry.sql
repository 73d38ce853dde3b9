-- An organisation whose setup on chain did not land (`agent-vault org create` killed half way,
-- a setup that landed after its wait, an operator key without SOL) stayed `pending`, its money
-- moves refused, until some service process restarted. The organizations.setup job now tries
-- it again, later and later after each failure (docs/operations.md, "An organisation stays
-- pending").
ALTER TABLE organizations ADD COLUMN setup_failures INTEGER NOT NULL DEFAULT 0;
ALTER TABLE organizations ADD COLUMN setup_retry_at TIMESTAMPTZ;
