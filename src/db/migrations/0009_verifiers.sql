-- Verifiers (docs/verifiers.md): trusted third parties an organisation registers; an escrow that
-- names one accepts a `webhook_callback` completion proof only when it is signed with that
-- verifier's secret. The secret is stored as is, not hashed: the service must compute the HMAC
-- with it to check a proof. Revoking keeps the row (escrows name it) and erases the secrets.
CREATE TABLE verifiers (
  org_id                      TEXT NOT NULL REFERENCES organizations (id),
  id                          TEXT NOT NULL,
  name                        TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
  url                         TEXT CHECK (length(url) <= 2048),
  signing_secret              TEXT,
  -- the secret before the last rotation, which still verifies until previous_secret_expires_at
  previous_signing_secret     TEXT,
  previous_secret_expires_at  TIMESTAMPTZ,
  secret_rotated_at           TIMESTAMPTZ,
  created_at                  TIMESTAMPTZ NOT NULL,
  revoked_at                  TIMESTAMPTZ,
  PRIMARY KEY (org_id, id),
  CHECK ((revoked_at IS NULL) = (signing_secret IS NOT NULL)),
  CHECK ((previous_signing_secret IS NULL) = (previous_secret_expires_at IS NULL))
);
CREATE INDEX verifiers_org_page ON verifiers (org_id, created_at DESC, id DESC);
