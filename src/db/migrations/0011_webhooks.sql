-- Webhooks (docs/webhooks.md): the endpoints an organisation registers, one delivery per
-- (webhook, event) it subscribes to, and every attempt of every delivery (the delivery log).

CREATE TABLE webhooks (
  id                          TEXT PRIMARY KEY,
  org_id                      TEXT NOT NULL REFERENCES organizations (id),
  url                         TEXT NOT NULL CHECK (length(url) <= 2048),
  -- event names, or the one element '*' for every event
  events                      TEXT[] NOT NULL CHECK (cardinality(events) >= 1),
  -- active: delivering. degraded: a delivery failed a whole run of attempts; deliveries are
  -- paused, new events still queue (paused). disabled: by an operator; new events do not queue.
  status                      TEXT NOT NULL CHECK (status IN ('active', 'degraded', 'disabled')),
  -- stored as is, not hashed: every delivery is signed with it (HMAC needs the secret itself)
  signing_secret              TEXT NOT NULL,
  -- the secret before the last rotation; deliveries carry its signature too until it expires
  previous_signing_secret     TEXT,
  previous_secret_expires_at  TIMESTAMPTZ,
  secret_rotated_at           TIMESTAMPTZ,
  degraded_at                 TIMESTAMPTZ,
  created_at                  TIMESTAMPTZ NOT NULL,
  updated_at                  TIMESTAMPTZ NOT NULL,
  CHECK ((previous_signing_secret IS NULL) = (previous_secret_expires_at IS NULL))
);
CREATE INDEX webhooks_org_page ON webhooks (org_id, created_at DESC, id DESC);

CREATE TABLE webhook_deliveries (
  id                TEXT PRIMARY KEY,
  org_id            TEXT NOT NULL,
  webhook_id        TEXT NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
  -- an events row, or the synthetic event of a test ping (never stored in events)
  event_id          TEXT NOT NULL,
  event_type        TEXT NOT NULL,
  event_created_at  TIMESTAMPTZ NOT NULL,
  -- pending: the next attempt is due at next_attempt_at (a claimed attempt moves it to when the
  -- attempt after it is due: the claim is the lease); paused: waits for the webhook to be
  -- active again; delivered: a 2xx came back; failed: given up (expired unsent, or a ping)
  status            TEXT NOT NULL CHECK (status IN ('pending', 'paused', 'delivered', 'failed')),
  -- attempts started, ever; the number of the latest attempt
  attempts          INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
  -- attempts started before the current run of five (a re-enabled webhook starts a new run)
  run_start         INTEGER NOT NULL DEFAULT 0 CHECK (run_start >= 0 AND run_start <= attempts),
  next_attempt_at   TIMESTAMPTZ,
  created_at        TIMESTAMPTZ NOT NULL,
  updated_at        TIMESTAMPTZ NOT NULL,
  delivered_at      TIMESTAMPTZ,
  -- why a failed delivery was given up: 'expired' (undelivered for 30 days), 'event_missing', 'ping_failed'
  failure_reason    TEXT,
  UNIQUE (webhook_id, event_id),
  CHECK (status <> 'pending' OR next_attempt_at IS NOT NULL OR event_type = 'ping')
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_page ON webhook_deliveries (webhook_id, created_at DESC, id DESC);
CREATE INDEX webhook_deliveries_paused ON webhook_deliveries (webhook_id) WHERE status = 'paused';
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status IN ('delivered', 'failed');
CREATE INDEX webhook_deliveries_unsent ON webhook_deliveries (created_at) WHERE status IN ('pending', 'paused');

CREATE TABLE webhook_attempts (
  delivery_id       TEXT NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
  -- the primary key is the guarantee that no attempt is ever made twice
  attempt           INTEGER NOT NULL CHECK (attempt >= 1),
  attempted_at      TIMESTAMPTZ NOT NULL,
  -- null while in flight; 'lost' when the worker stopped before recording what happened
  outcome           TEXT CHECK (outcome IN ('succeeded', 'failed', 'lost')),
  finished_at       TIMESTAMPTZ,
  status_code       INTEGER,
  latency_ms        INTEGER,
  error             TEXT,
  response_excerpt  TEXT,
  -- when the attempt after this one is due should this one fail; null after the last of a run
  next_attempt_at   TIMESTAMPTZ,
  PRIMARY KEY (delivery_id, attempt)
);

-- The fan-out: each event row creates its deliveries in the transaction that writes it, so an
-- event is queued for every subscribed webhook exactly when it commits, whatever the order in
-- which concurrent transactions commit, and never when it rolls back (docs/webhooks.md
-- "Fan-out"). Disabled webhooks queue nothing; degraded ones queue paused deliveries.
CREATE FUNCTION webhook_delivery_id(at TIMESTAMPTZ) RETURNS TEXT LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  -- the alphabet and layout of src/ids/ids.ts: 10 characters of milliseconds, 16 random
  alphabet CONSTANT TEXT := '0123456789abcdefghjkmnpqrstvwxyz';
  ms BIGINT := floor(extract(epoch FROM at) * 1000);
  id TEXT := '';
BEGIN
  FOR i IN 1..10 LOOP
    id := substr(alphabet, (ms % 32)::INTEGER + 1, 1) || id;
    ms := ms / 32;
  END LOOP;
  FOR i IN 1..16 LOOP
    id := id || substr(alphabet, floor(random() * 32)::INTEGER + 1, 1);
  END LOOP;
  RETURN 'dlv_' || id;
END $$;

CREATE FUNCTION webhooks_fan_out() RETURNS TRIGGER LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO webhook_deliveries
    (id, org_id, webhook_id, event_id, event_type, event_created_at, status, next_attempt_at, created_at, updated_at)
  SELECT webhook_delivery_id(NEW.created_at), NEW.org_id, w.id, NEW.id, NEW.type, NEW.created_at,
         CASE WHEN w.status = 'active' THEN 'pending' ELSE 'paused' END,
         CASE WHEN w.status = 'active' THEN NEW.created_at END,
         NEW.created_at, NEW.created_at
  FROM webhooks w
  WHERE w.org_id = NEW.org_id AND w.status <> 'disabled' AND ('*' = ANY (w.events) OR NEW.type = ANY (w.events))
  ON CONFLICT (webhook_id, event_id) DO NOTHING;
  RETURN NULL;
END $$;

CREATE TRIGGER events_webhook_fan_out AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION webhooks_fan_out();
