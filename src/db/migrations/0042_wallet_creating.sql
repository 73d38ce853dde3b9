-- Two requests creating the same agent's vault at once, without an idempotency key, were both
-- answered 200 with the same wallet: the second took the first's row, not yet on chain, for a
-- retry of an interrupted creation and resumed it. A creation now holds its row until it answers
-- (or, should its process die, until this time passes): another request for the same agent meanwhile
-- is told the agent has a wallet (409 wallet_agent_id_conflict); a retry after the answer (a 503
-- while the vault could not be created) still resumes it.
ALTER TABLE wallets ADD COLUMN creating_until TIMESTAMPTZ;
