-- A chain transaction's signed bytes, kept while it is pending: the reconciler sends them again
-- when the chain has not seen its signature and its blockhash is still valid (a process stopped
-- between recording and sending, or the embedded validator's unsealed slot lost with it).
-- Cleared when the transaction settles. Nullable without a default: no table rewrite.
ALTER TABLE transactions ADD COLUMN wire TEXT;
