-- Payments: the resolved recipient and category, co-sign approvals, and the spend that counts
-- toward a vault's policy windows.
ALTER TABLE transactions ADD COLUMN recipient_address TEXT;
ALTER TABLE transactions ADD COLUMN category TEXT;
-- {required, status: awaiting|approved|rejected|expired, expires_at, decided_by, decided_at}
ALTER TABLE transactions ADD COLUMN approval JSONB;
ALTER TABLE transactions ADD COLUMN approval_expires_at TIMESTAMPTZ;
-- when the amount started counting toward the policy windows (ms of the service clock);
-- NULL when it does not count (blocked, awaiting approval, failed, or not a spend)
ALTER TABLE transactions ADD COLUMN spend_at_ms BIGINT;
CREATE INDEX transactions_wallet_spend ON transactions (wallet_id, spend_at_ms) WHERE spend_at_ms IS NOT NULL;
CREATE INDEX transactions_awaiting_approval ON transactions (approval_expires_at) WHERE approval_expires_at IS NOT NULL AND status = 'pending';

-- A vault's spend in each policy window, kept incrementally (src/payments/spend-state.ts): a
-- payment adds itself once; a spend is taken out once, when its window moves past it.
CREATE TABLE spend_windows (
  wallet_id                TEXT PRIMARY KEY REFERENCES wallets (id),
  day_sum                  BIGINT NOT NULL DEFAULT 0 CHECK (day_sum >= 0),
  day_count                INTEGER NOT NULL DEFAULT 0 CHECK (day_count >= 0),
  day_removed_through_ms   BIGINT NOT NULL DEFAULT 0,
  hour_sum                 BIGINT NOT NULL DEFAULT 0 CHECK (hour_sum >= 0),
  hour_count               INTEGER NOT NULL DEFAULT 0 CHECK (hour_count >= 0),
  hour_removed_through_ms  BIGINT NOT NULL DEFAULT 0,
  month_key                TEXT NOT NULL DEFAULT '',
  month_sum                BIGINT NOT NULL DEFAULT 0 CHECK (month_sum >= 0)
);
