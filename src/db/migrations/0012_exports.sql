-- Transaction exports (docs/exports.md): a request, built by the `exports.build` job into a
-- PostgreSQL large object, downloadable until expires_at, then deleted by `exports.expire`.
CREATE TABLE exports (
  id                  TEXT PRIMARY KEY,
  org_id              TEXT NOT NULL REFERENCES organizations (id),
  format              TEXT NOT NULL CHECK (format IN ('csv', 'json')),
  -- processing → ready → expired, or processing → failed
  status              TEXT NOT NULL CHECK (status IN ('processing', 'ready', 'failed', 'expired')),
  -- the transaction filters as requested, normalised: wallet_id, status, type, recipient, from, to (ISO)
  filter              JSONB NOT NULL,
  -- rows counted when requested (the estimate's basis), and when the build should be done
  estimated_rows      BIGINT NOT NULL,
  estimated_ready_at  TIMESTAMPTZ NOT NULL,
  -- builds started; a build holds the export until lease_until and renews it as it goes, so
  -- one interrupted by a crash is taken up again once its lease has run out
  attempts            INTEGER NOT NULL DEFAULT 0,
  lease_until         TIMESTAMPTZ,
  -- the file (a large object); NULL before a build starts and once deleted
  content_oid         OID,
  row_count           BIGINT,
  size_bytes          BIGINT,
  failure_reason      TEXT,
  -- the API key that asked for it
  created_by          TEXT NOT NULL,
  created_at          TIMESTAMPTZ NOT NULL,
  ready_at            TIMESTAMPTZ,
  expires_at          TIMESTAMPTZ,
  updated_at          TIMESTAMPTZ NOT NULL,
  CHECK (status <> 'ready' OR (content_oid IS NOT NULL AND row_count IS NOT NULL AND expires_at IS NOT NULL))
);
CREATE INDEX exports_org_page ON exports (org_id, created_at DESC, id DESC);
CREATE INDEX exports_due ON exports (created_at, id) WHERE status = 'processing';
CREATE INDEX exports_expiry ON exports (expires_at) WHERE status = 'ready';
CREATE INDEX exports_retention ON exports (created_at);
