-- balance.low is told by the wallets.automation job, once a second. A fall below the threshold
-- that a credit undid before the job looked (a payment, then a funding or a refund within the
-- second) went untold. The write that crosses notes the balance it left; the job tells a noted
-- crossing even when the balance is back (docs/automation.md, "balance.low").
ALTER TABLE wallets ADD COLUMN low_balance_crossed_balance BIGINT;

CREATE FUNCTION wallets_note_low_balance() RETURNS TRIGGER LANGUAGE plpgsql AS $$
BEGIN
  NEW.low_balance_crossed_balance := NEW.balance;
  RETURN NEW;
END $$;

-- Only vaults with a threshold, only the write from at-or-above to below, and only the first
-- such write before the job tells it: the payment path of other vaults pays nothing for this.
CREATE TRIGGER wallets_note_low_balance BEFORE UPDATE OF balance ON wallets
  FOR EACH ROW WHEN (NEW.low_balance_threshold IS NOT NULL AND NEW.low_balance_fired_at IS NULL
    AND NEW.low_balance_crossed_balance IS NULL
    AND OLD.balance >= NEW.low_balance_threshold AND NEW.balance < NEW.low_balance_threshold)
  EXECUTE FUNCTION wallets_note_low_balance();
