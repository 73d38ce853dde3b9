-- The wallets.automation job settles the auto-topups it sent without waiting (docs/automation.md,
-- "Auto-topup") at the start of every run, every second: only they are read, not every pending
-- row (payments in flight, payments awaiting their co-signature for up to a day).
CREATE INDEX transactions_pending_topups ON transactions (created_at)
  WHERE status = 'pending' AND type = 'funding' AND memo = 'auto-topup';
