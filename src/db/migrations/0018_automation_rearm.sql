-- Automation latches re-arm the moment a vault's balance is back at or above its trigger
-- (docs/automation.md): set by the wallets.automation job when it fires, they are cleared by
-- whatever write brings the balance back — a topup or funding confirmed, a payment refunded, an
-- escrow released — not only when the job next looks. Otherwise a credit followed by a payment
-- between two ticks left the latch set with the balance below again, and nothing fired again.
CREATE FUNCTION wallets_rearm_automation() RETURNS TRIGGER LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.topup_fired_at IS NOT NULL AND NEW.balance >= COALESCE(NEW.auto_topup_trigger_below, 0) THEN
    NEW.topup_fired_at := NULL;
  END IF;
  IF NEW.low_balance_fired_at IS NOT NULL AND NEW.balance >= COALESCE(NEW.low_balance_threshold, 0) THEN
    NEW.low_balance_fired_at := NULL;
  END IF;
  RETURN NEW;
END $$;

CREATE TRIGGER wallets_rearm_automation BEFORE UPDATE OF balance ON wallets
  FOR EACH ROW WHEN (NEW.topup_fired_at IS NOT NULL OR NEW.low_balance_fired_at IS NOT NULL)
  EXECUTE FUNCTION wallets_rearm_automation();

-- Latches already back (the job cleared them on its ticks until now) are cleared once here.
UPDATE wallets SET topup_fired_at = NULL WHERE topup_fired_at IS NOT NULL AND balance >= COALESCE(auto_topup_trigger_below, 0);
UPDATE wallets SET low_balance_fired_at = NULL WHERE low_balance_fired_at IS NOT NULL AND balance >= COALESCE(low_balance_threshold, 0);
-- The job no longer scans for latched vaults (migration 0014's indexes served that scan).
DROP INDEX wallets_topup_latched;
DROP INDEX wallets_low_balance_latched;
