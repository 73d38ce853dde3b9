-- Where a webhook's leased range of events starts (its position when the lease was taken).
-- A lapsed lease's events are recorded from there: re-enabling a webhook moves its position past
-- the leased range, and reading from the position then found none of them, so a dead worker's
-- batch was never delivered nor logged.
ALTER TABLE webhooks ADD COLUMN lease_from_xact xid8;
ALTER TABLE webhooks ADD COLUMN lease_from_event_id TEXT;
