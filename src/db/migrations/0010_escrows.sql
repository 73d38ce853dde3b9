-- Agent-to-agent escrow (docs/escrow.md). The requester's organisation owns the escrow; the
-- receiving vault may belong to another organisation of this service, which sees it too.
CREATE TABLE escrows (
  id                    TEXT PRIMARY KEY,
  org_id                TEXT NOT NULL REFERENCES organizations (id),
  from_wallet_id        TEXT NOT NULL REFERENCES wallets (id),
  -- as the request named the receiver: a vault id or a chain address
  to_wallet             TEXT NOT NULL,
  -- the owner of the receiving token account (the vault's chain address, or any address)
  receiver_address      TEXT NOT NULL,
  to_wallet_id          TEXT REFERENCES wallets (id),
  receiver_org_id       TEXT REFERENCES organizations (id),
  amount                BIGINT NOT NULL CHECK (amount > 0),
  -- locked, completed, released, refunded, disputed, resolved, failed
  status                TEXT NOT NULL,
  -- a chain transaction moving the escrow on is in flight: create, release, refund, dispute, resolve
  closing               TEXT,
  closing_signature     TEXT,
  closing_valid_height  BIGINT,
  chain_address         TEXT NOT NULL,
  token_address         TEXT NOT NULL,
  task_description      TEXT NOT NULL,
  task_hash             TEXT NOT NULL,
  expected_output_hash  TEXT,
  verifier_id           TEXT,
  proof_type            TEXT,
  output_url            TEXT,
  completed_at          TIMESTAMPTZ,
  -- {raised_by_org, raised_by_key, reason, evidence, raised_at}
  dispute               JSONB,
  -- {to_receiver, to_sender, decided_by, decided_at}
  resolution            JSONB,
  lock_signature        TEXT,
  settle_signature      TEXT,
  expires_at            TIMESTAMPTZ NOT NULL,
  created_at            TIMESTAMPTZ NOT NULL,
  updated_at            TIMESTAMPTZ NOT NULL,
  settled_at            TIMESTAMPTZ
);
CREATE INDEX escrows_org_page ON escrows (org_id, created_at DESC, id DESC);
CREATE INDEX escrows_receiver_page ON escrows (receiver_org_id, created_at DESC, id DESC) WHERE receiver_org_id IS NOT NULL;
CREATE INDEX escrows_from_wallet ON escrows (from_wallet_id);
CREATE INDEX escrows_to_wallet ON escrows (to_wallet_id) WHERE to_wallet_id IS NOT NULL;
CREATE INDEX escrows_due ON escrows (expires_at) WHERE status = 'locked';
CREATE INDEX escrows_closing ON escrows (updated_at) WHERE closing IS NOT NULL;

ALTER TABLE transactions ADD COLUMN escrow_id TEXT;
CREATE INDEX transactions_escrow ON transactions (escrow_id) WHERE escrow_id IS NOT NULL;
