-- The service's foundation: organisations, API keys, the service clock, idempotency, events,
-- policies, wallets and the transaction index. Every business row belongs to an organisation.
-- Times are business times written by the service clock, never now().

CREATE TABLE service_clock (
  id         BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (id),
  offset_ms  BIGINT NOT NULL DEFAULT 0
);
INSERT INTO service_clock (id, offset_ms) VALUES (TRUE, 0);

CREATE TABLE organizations (
  id                     TEXT PRIMARY KEY,
  name                   TEXT NOT NULL,
  is_default             BOOLEAN NOT NULL DEFAULT FALSE,
  reserve_address        TEXT NOT NULL,
  reserve_token_address  TEXT NOT NULL,
  -- micro-USDC the service may allocate: confirmed deposits - funding + withdrawals (index of the chain)
  reserve_balance        BIGINT NOT NULL DEFAULT 0 CHECK (reserve_balance >= 0),
  -- 'pending' until the reserve account exists on chain, then 'ready'
  chain_status           TEXT NOT NULL DEFAULT 'pending',
  created_at             TIMESTAMPTZ NOT NULL
);
CREATE UNIQUE INDEX organizations_one_default ON organizations (is_default) WHERE is_default;

CREATE TABLE api_keys (
  id            TEXT PRIMARY KEY,
  org_id        TEXT NOT NULL REFERENCES organizations (id),
  name          TEXT NOT NULL,
  role          TEXT NOT NULL CHECK (role IN ('admin', 'operator', 'agent', 'viewer', 'arbiter')),
  -- sha256 of the whole key, hex; the key itself is never stored
  key_hash      TEXT NOT NULL UNIQUE,
  prefix        TEXT NOT NULL,
  last4         TEXT NOT NULL,
  created_at    TIMESTAMPTZ NOT NULL,
  last_used_at  TIMESTAMPTZ,
  revoked_at    TIMESTAMPTZ
);
CREATE INDEX api_keys_org_page ON api_keys (org_id, created_at DESC, id DESC);

CREATE TABLE idempotency_keys (
  org_id           TEXT NOT NULL REFERENCES organizations (id),
  key              TEXT NOT NULL,
  -- which operation and a hash of its parameters: the same key with other parameters is a conflict
  request_hash     TEXT NOT NULL,
  -- 'running' while the first request is in flight, then 'done'
  state            TEXT NOT NULL,
  response_status  INTEGER,
  response_body    JSONB,
  created_at       TIMESTAMPTZ NOT NULL,
  expires_at       TIMESTAMPTZ NOT NULL,
  PRIMARY KEY (org_id, key)
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);

CREATE TABLE events (
  id          TEXT PRIMARY KEY,
  org_id      TEXT NOT NULL REFERENCES organizations (id),
  type        TEXT NOT NULL,
  wallet_id   TEXT,
  severity    TEXT NOT NULL CHECK (severity IN ('info', 'warning', 'critical')),
  summary     TEXT NOT NULL,
  payload     JSONB NOT NULL,
  created_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX events_org_page ON events (org_id, created_at DESC, id DESC);

CREATE TABLE policies (
  org_id              TEXT NOT NULL REFERENCES organizations (id),
  id                  TEXT NOT NULL,
  name                TEXT NOT NULL,
  is_preset           BOOLEAN NOT NULL DEFAULT FALSE,
  max_per_tx          BIGINT,
  max_per_day         BIGINT,
  max_per_month       BIGINT,
  velocity_cap        INTEGER,
  allowed_recipients  JSONB NOT NULL DEFAULT '[]',
  blocked_categories  JSONB NOT NULL DEFAULT '[]',
  require_co_sign     BIGINT,
  expiry              TIMESTAMPTZ,
  chain_address       TEXT NOT NULL,
  -- 'pending' until the policy account holds this revision's limits, then 'ready'
  chain_status        TEXT NOT NULL DEFAULT 'pending',
  revision            INTEGER NOT NULL DEFAULT 1,
  created_at          TIMESTAMPTZ NOT NULL,
  updated_at          TIMESTAMPTZ NOT NULL,
  deleted_at          TIMESTAMPTZ,
  PRIMARY KEY (org_id, id)
);
CREATE INDEX policies_org_page ON policies (org_id, created_at DESC, id DESC);

CREATE TABLE policy_audit (
  id          TEXT PRIMARY KEY,
  org_id      TEXT NOT NULL,
  policy_id   TEXT NOT NULL,
  changed_by  TEXT NOT NULL,
  changes     JSONB NOT NULL,
  created_at  TIMESTAMPTZ NOT NULL,
  FOREIGN KEY (org_id, policy_id) REFERENCES policies (org_id, id)
);
CREATE INDEX policy_audit_policy ON policy_audit (org_id, policy_id, created_at, id);

CREATE TABLE wallets (
  id                    TEXT PRIMARY KEY,
  org_id                TEXT NOT NULL REFERENCES organizations (id),
  agent_id              TEXT NOT NULL,
  label                 TEXT NOT NULL,
  policy_id             TEXT NOT NULL,
  tags                  TEXT[] NOT NULL DEFAULT '{}',
  -- 'active' | 'frozen' | 'archived' (idle, unfunded, policy_violation are derived on read)
  status                TEXT NOT NULL,
  chain_address         TEXT NOT NULL,
  token_address         TEXT NOT NULL,
  -- micro-USDC, the index of the vault's token account; never negative
  balance               BIGINT NOT NULL DEFAULT 0 CHECK (balance >= 0),
  chain_status          TEXT NOT NULL DEFAULT 'pending',
  session_public_key    TEXT,
  session_expires_at    TIMESTAMPTZ,
  auto_topup_enabled    BOOLEAN NOT NULL DEFAULT FALSE,
  auto_topup_trigger_below BIGINT,
  auto_topup_amount     BIGINT,
  created_at            TIMESTAMPTZ NOT NULL,
  updated_at            TIMESTAMPTZ NOT NULL,
  last_transaction_at   TIMESTAMPTZ,
  archived_at           TIMESTAMPTZ,
  -- a vault's address is derived from (organisation, agent): an agent id is never reused
  UNIQUE (org_id, agent_id),
  FOREIGN KEY (org_id, policy_id) REFERENCES policies (org_id, id)
);
CREATE INDEX wallets_org_page ON wallets (org_id, created_at DESC, id DESC);
CREATE INDEX wallets_policy ON wallets (org_id, policy_id) WHERE status <> 'archived';

CREATE TABLE transactions (
  id                      TEXT PRIMARY KEY,
  org_id                  TEXT NOT NULL REFERENCES organizations (id),
  wallet_id               TEXT REFERENCES wallets (id),
  -- payment | funding | withdrawal | a2a_send | a2a_receive | escrow_lock | escrow_release | escrow_refund | deposit
  type                    TEXT NOT NULL,
  -- pending | confirmed | blocked | failed
  status                  TEXT NOT NULL,
  amount                  BIGINT NOT NULL CHECK (amount > 0),
  currency                TEXT NOT NULL DEFAULT 'USDC',
  recipient               TEXT,
  policy_id               TEXT,
  policy_triggered        BOOLEAN NOT NULL DEFAULT FALSE,
  violation               JSONB,
  memo                    TEXT,
  attestation_hash        TEXT,
  tx_signature            TEXT,
  last_valid_block_height BIGINT,
  on_chain_slot           BIGINT,
  failure_reason          TEXT,
  -- a batch of fundings settles in one chain transaction
  batch_id                TEXT,
  created_at              TIMESTAMPTZ NOT NULL,
  updated_at              TIMESTAMPTZ NOT NULL,
  settled_at              TIMESTAMPTZ
);
CREATE INDEX transactions_org_page ON transactions (org_id, created_at DESC, id DESC);
CREATE INDEX transactions_wallet_page ON transactions (wallet_id, created_at DESC, id DESC);
CREATE INDEX transactions_pending ON transactions (status, created_at) WHERE status = 'pending';
CREATE INDEX transactions_signature ON transactions (tx_signature);

CREATE TABLE deposits (
  id             TEXT PRIMARY KEY,
  org_id         TEXT NOT NULL REFERENCES organizations (id),
  amount         BIGINT NOT NULL CHECK (amount > 0),
  tx_signature   TEXT NOT NULL UNIQUE,
  on_chain_slot  BIGINT,
  status         TEXT NOT NULL,
  created_at     TIMESTAMPTZ NOT NULL
);
CREATE INDEX deposits_org_page ON deposits (org_id, created_at DESC, id DESC);
