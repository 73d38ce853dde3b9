-- An escrow's move in flight (its creation, a release, a refund, a dispute, an arbiter's
-- decision) was known by its signature alone. A chain that did not keep it (the embedded
-- validator of a process that died before saving its slot, a cluster node that dropped it) was
-- learned of only when its blockhash had expired: the move then failed, and a release lost that
-- way near the escrow's expiry ended in a refund although the completion had been accepted. The
-- signed bytes are kept while the move is in flight, and the escrows.tick job sends them again
-- while they can still land (docs/escrow.md, "Moves in flight").
ALTER TABLE escrows ADD COLUMN closing_wire TEXT;
