-- Each escrow is a chain account (and its token account) whose rent the operator key pays
-- until the escrows.close job closes them; an organisation opening escrows in a loop (the
-- longest timeout is 30 days) drained the key every organisation's payments need. Creating an
-- escrow now counts the organisation's escrows whose accounts are open (AGENT_VAULT_OPEN_ESCROWS_PER_ORG_MAX,
-- docs/decisions.md "Counts per organisation"): this index keeps that count to the open ones.
CREATE INDEX escrows_open_accounts ON escrows (org_id) WHERE chain_closed_at IS NULL AND status <> 'failed';
