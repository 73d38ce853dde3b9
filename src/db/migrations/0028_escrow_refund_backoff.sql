-- An expired escrow's timeout refund that the chain refuses is tried again later and later
-- (docs/escrow.md, "Timeout"): how many refunds of it have failed, and when the next may be sent.
-- Before, a refusal that repeats (the escrow no longer locked on chain, say) was sent again every
-- second, each time a failed escrow_refund row and a fee, and a hundred such escrows took every
-- place of the refunding job's batch.
ALTER TABLE escrows ADD COLUMN refund_failures INTEGER NOT NULL DEFAULT 0;
ALTER TABLE escrows ADD COLUMN refund_retry_at TIMESTAMPTZ;
