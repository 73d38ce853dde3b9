-- A running key is leased: a request cut off by a crash stops blocking its key when the lease
-- ends. The record the first request committed is named on the key, in the same database
-- transaction, so a retry answers with it instead of doing the work again.
ALTER TABLE idempotency_keys ADD COLUMN lease_until TIMESTAMPTZ;
ALTER TABLE idempotency_keys ADD COLUMN resource_id TEXT;
