-- A test ping whose process stopped before its outcome was recorded stayed `pending` for the 30
-- days deliveries are kept. The dispatcher fails pings left pending for a minute
-- (docs/webhooks.md, "Test ping"); this index finds them without reading the delivery log.
CREATE INDEX webhook_deliveries_pending_pings ON webhook_deliveries (created_at)
  WHERE event_type = 'ping' AND status = 'pending';
