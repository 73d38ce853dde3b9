-- A vault may have at most 100 payments awaiting their co-signature (docs/payments.md,
-- "Co-signature"): a payment about to wait counts its vault's, through this index of the
-- awaiting rows only (a busy vault's other payments are not read).
CREATE INDEX transactions_awaiting_by_wallet ON transactions (wallet_id) WHERE approval_expires_at IS NOT NULL AND status = 'pending';
