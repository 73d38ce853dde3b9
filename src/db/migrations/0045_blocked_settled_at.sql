-- A spend the policy blocked is recorded already final, but its settled_at was left empty
-- (a co-signature rejected or expired set it): the rows recorded so, settled when recorded.
UPDATE transactions SET settled_at = created_at WHERE status = 'blocked' AND settled_at IS NULL;
