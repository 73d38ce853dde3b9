-- The wallets.automation job runs every second. It found the vaults due for a topup or a
-- balance.low by reading every vault with auto-topup or a low-balance threshold (the partial
-- indexes of migration 0013 hold all of them): its cost grew with the fleet, not with what
-- happens to it. Now the write that makes a vault due marks it — a balance written below a
-- trigger or threshold, a threshold or auto-topup set, a latch re-armed, a vault unfrozen or
-- provisioned — and the job reads only marked vaults, through a small partial index, and clears
-- the mark of those no longer due (docs/automation.md, "How the job finds due vaults").
ALTER TABLE wallets ADD COLUMN automation_due BOOLEAN NOT NULL DEFAULT FALSE;

CREATE FUNCTION wallets_mark_automation_due() RETURNS TRIGGER LANGUAGE plpgsql AS $$
BEGIN
  NEW.automation_due := TRUE;
  RETURN NEW;
END $$;

-- The two conditions are the job's own (src/automation/automation.ts, LOW_BALANCE_DUE and
-- TOPUP_DUE): keep them the same. BEFORE triggers of a row fire in the order of their names, so
-- this one sees the crossing wallets_note_low_balance notes and the latches
-- wallets_rearm_automation re-arms in the same write. Its WHEN is all a payment of a vault that
-- is not due pays, and the mark, once set, is not written again until the job clears it: a
-- balance update that leaves it as it was stays a HOT update.
CREATE TRIGGER wallets_set_automation_due BEFORE INSERT OR UPDATE ON wallets
  FOR EACH ROW WHEN (NOT NEW.automation_due AND (
    (NEW.low_balance_threshold IS NOT NULL AND NEW.low_balance_fired_at IS NULL AND NEW.status <> 'archived'
      AND (NEW.balance < NEW.low_balance_threshold OR NEW.low_balance_crossed_balance IS NOT NULL))
    OR (NEW.auto_topup_enabled AND NEW.topup_fired_at IS NULL AND NEW.status = 'active' AND NEW.provisioned_at IS NOT NULL
      AND NEW.balance < NEW.auto_topup_trigger_below)))
  EXECUTE FUNCTION wallets_mark_automation_due();

-- Vaults due now are marked.
UPDATE wallets SET automation_due = TRUE
 WHERE (low_balance_threshold IS NOT NULL AND low_balance_fired_at IS NULL AND status <> 'archived'
     AND (balance < low_balance_threshold OR low_balance_crossed_balance IS NOT NULL))
    OR (auto_topup_enabled AND topup_fired_at IS NULL AND status = 'active' AND provisioned_at IS NOT NULL
     AND balance < auto_topup_trigger_below);

CREATE INDEX wallets_automation_due ON wallets (id) WHERE automation_due;
-- Only the job's scans read these; every vault with auto-topup or a threshold was in them.
DROP INDEX wallets_topup_due;
DROP INDEX wallets_low_balance;
