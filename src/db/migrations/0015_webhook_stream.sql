-- Webhook deliveries read from the events table in transaction order (docs/webhooks.md
-- "Fan-out"), instead of a row per subscribed webhook inserted by a trigger in every
-- event-writing transaction.
--
-- Every event records the id of the transaction that wrote it. Events of transactions with an
-- id below the xmin of a fresh snapshot (pg_snapshot_xmin(pg_current_snapshot())) are final:
-- every such transaction has committed or rolled back, and any later one gets a larger id. A
-- webhook's position (stream_xact, stream_event_id) says which events it has been given; the
-- dispatcher takes the ones after it and below the horizon, in (xact, id) order.
-- Events written before this migration have no transaction id: their deliveries were queued
-- by the trigger dropped below.
ALTER TABLE events ADD COLUMN xact xid8;
ALTER TABLE events ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
CREATE INDEX events_stream ON events (org_id, xact, id);

ALTER TABLE webhooks
  -- the events at or before this position have their delivery (or were not for this webhook);
  -- a new webhook starts at its own transaction: it receives the events written after it
  ADD COLUMN stream_xact       xid8 NOT NULL DEFAULT pg_current_xact_id(),
  ADD COLUMN stream_event_id   TEXT NOT NULL DEFAULT '',
  -- a worker sending the events after the position up to this one (the lease), until it expires
  ADD COLUMN lease_xact        xid8,
  ADD COLUMN lease_event_id    TEXT,
  ADD COLUMN lease_expires_at  TIMESTAMPTZ,
  ADD CHECK ((lease_xact IS NULL) = (lease_event_id IS NULL) AND (lease_xact IS NULL) = (lease_expires_at IS NULL));

DROP TRIGGER events_webhook_fan_out ON events;
DROP FUNCTION webhooks_fan_out();
DROP FUNCTION webhook_delivery_id(TIMESTAMPTZ);
