-- The recipient directory (docs/recipients.md): per organisation, a domain names a chain address
-- and, optionally, the category its payments count under. Deleting is soft: payments already
-- made keep pointing at a row that still exists, and the domain becomes free again.
CREATE TABLE recipients (
  org_id      TEXT NOT NULL REFERENCES organizations (id),
  id          TEXT NOT NULL,
  -- stored lowercase, so lookups and uniqueness are case-insensitive without lower() everywhere
  domain      TEXT NOT NULL CHECK (domain = lower(domain) AND length(domain) <= 253),
  -- base58 of a 32-byte key, case-sensitive
  address     TEXT NOT NULL CHECK (length(address) BETWEEN 32 AND 44),
  category    TEXT CHECK (category ~ '^[a-z0-9_.-]{1,64}$'),
  label       TEXT CHECK (length(label) <= 200),
  created_at  TIMESTAMPTZ NOT NULL,
  updated_at  TIMESTAMPTZ NOT NULL,
  deleted_at  TIMESTAMPTZ,
  PRIMARY KEY (org_id, id)
);
-- One live entry per domain: a payment to a domain must resolve to exactly one address.
CREATE UNIQUE INDEX recipients_domain ON recipients (org_id, domain) WHERE deleted_at IS NULL;
-- A payment to a bare address finds that address's category through this one.
CREATE INDEX recipients_address ON recipients (org_id, address, created_at, id) WHERE deleted_at IS NULL;
CREATE INDEX recipients_org_page ON recipients (org_id, created_at DESC, id DESC) WHERE deleted_at IS NULL;
