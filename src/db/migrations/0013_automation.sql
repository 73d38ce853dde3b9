-- Events, wallet states and automation (docs/events.md, docs/wallets.md "Status", docs/automation.md).

-- The activity feed filters by vault and by type within an organisation.
CREATE INDEX events_wallet_page ON events (org_id, wallet_id, created_at DESC, id DESC) WHERE wallet_id IS NOT NULL;
CREATE INDEX events_type_page ON events (org_id, type, created_at DESC, id DESC);
CREATE INDEX events_retention ON events (created_at);

-- Per-vault low-balance threshold (balance.low), and the "fire once per crossing" latches of
-- auto-topup and balance.low: set when the automation acted, cleared when the balance is back.
ALTER TABLE wallets ADD COLUMN low_balance_threshold BIGINT;
ALTER TABLE wallets ADD COLUMN topup_fired_at TIMESTAMPTZ;
ALTER TABLE wallets ADD COLUMN low_balance_fired_at TIMESTAMPTZ;
-- the inactivity alert fired for the inactivity that began at last_transaction_at (or creation)
ALTER TABLE wallets ADD COLUMN inactivity_alerted_at TIMESTAMPTZ;
ALTER TABLE wallets ADD COLUMN velocity_alerted_at TIMESTAMPTZ;
CREATE INDEX wallets_topup_due ON wallets (org_id) WHERE auto_topup_enabled AND topup_fired_at IS NULL;
CREATE INDEX wallets_low_balance ON wallets (org_id) WHERE low_balance_threshold IS NOT NULL;

-- A policy's expiry acted on once: attached vaults frozen, policy.expired written.
ALTER TABLE policies ADD COLUMN expired_at TIMESTAMPTZ;
CREATE INDEX policies_expiry_due ON policies (expiry) WHERE expiry IS NOT NULL AND expired_at IS NULL AND deleted_at IS NULL;

-- Alert settings per organisation (GET/PUT /v1/alerts); a missing row means the defaults.
CREATE TABLE alert_settings (
  org_id                     TEXT PRIMARY KEY REFERENCES organizations (id),
  policy_violation_enabled   BOOLEAN NOT NULL DEFAULT TRUE,
  inactivity_hours           INTEGER,
  velocity_per_hour          INTEGER,
  large_transaction_amount   BIGINT,
  updated_at                 TIMESTAMPTZ NOT NULL
);
