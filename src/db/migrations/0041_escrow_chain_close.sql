-- An escrow's two chain accounts (its PDA and its USDC token account) were never closed: the
-- operator key paid their rent (~0.005 SOL) at the escrow's creation and never had it back, so a
-- tenant opening tiny escrows in a loop drained the key every organisation's payments need. The
-- escrows.close job now closes them once the escrow is released, refunded or resolved (the
-- program's EscrowClose, docs/program.md), the rent back to the operator key (docs/operations.md,
-- "The operator key's SOL"). Per escrow: when its accounts were found gone; the claim of the run
-- closing it (one short statement, no lock held across the chain); the last close sent and its
-- last valid block height, so that a run taking over a lapsed claim sends nothing while that close
-- can still land; and the program's error when it refused the close (an older program that does
-- not know the instruction, USDC sent to the escrow's token account), which is not tried again.
ALTER TABLE escrows ADD COLUMN chain_closed_at TIMESTAMPTZ;
ALTER TABLE escrows ADD COLUMN chain_close_claimed_until TIMESTAMPTZ;
ALTER TABLE escrows ADD COLUMN chain_close_signature TEXT;
ALTER TABLE escrows ADD COLUMN chain_close_valid_height BIGINT;
ALTER TABLE escrows ADD COLUMN chain_close_refused TEXT;
-- The job's query: settled escrows still open on chain, the longest settled first.
CREATE INDEX escrows_to_close ON escrows (settled_at, id)
  WHERE status IN ('released', 'refunded', 'resolved') AND chain_closed_at IS NULL AND chain_close_refused IS NULL;
