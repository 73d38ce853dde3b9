-- A policy's SetPolicy whose outcome its writer never learned (a confirmation timeout, a process
-- that died after sending) may still land for its blockhash's lifetime, after a newer write was
-- read back and the row marked ready: the account would then hold the older limits for good.
-- Each write is noted here before it is sent, until its outcome is known or it can no longer
-- land; the row is marked ready only when none is left (docs/policies.md).
ALTER TABLE policies ADD COLUMN unsettled_writes JSONB NOT NULL DEFAULT '[]';
