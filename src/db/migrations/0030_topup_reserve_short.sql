-- An auto-topup the reserve could not cover (docs/automation.md, "Auto-topup"): its latch is
-- taken with its balance.low, and this says it was taken for that reason, so that the
-- wallets.automation job tries the topup again as soon as the reserve holds its amount (an
-- operator's deposit). Before, the latch held until the vault's balance came back by itself,
-- which a vault waiting for its topup never does: it stayed below its trigger for good.
-- Read only while topup_fired_at is set: every latch the job takes writes it (the time of the
-- shortfall, or NULL for a funding), so a value left behind by whatever re-armed the latch since
-- (migration 0018's trigger, an expired funding, auto-topup set again) says nothing.
ALTER TABLE wallets ADD COLUMN topup_reserve_short_at TIMESTAMPTZ;
-- The job looks for such vaults every second: only they are read.
CREATE INDEX wallets_topup_reserve_short ON wallets (org_id)
  WHERE auto_topup_enabled AND topup_reserve_short_at IS NOT NULL AND topup_fired_at IS NOT NULL;
