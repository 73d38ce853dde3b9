-- Which request holds a running key's lease: a random token written when the key is claimed or
-- taken over. A request writes its record's id, and its answer, only while it still holds the
-- lease, so a first request that resumes after a retry took its key over records nothing.
ALTER TABLE idempotency_keys ADD COLUMN lease_holder TEXT;
