-- Policies whose account on chain has to catch up with the database (chain_status 'pending')
-- are claimed for a bounded time by whoever writes them: the request that made the change, or
-- the policies.sync job. A lease, because no row lock may be held across a chain round trip.
ALTER TABLE policies ADD COLUMN chain_claimed_until TIMESTAMPTZ;
CREATE INDEX policies_chain_pending ON policies (chain_claimed_until NULLS FIRST, updated_at)
  WHERE chain_status = 'pending' AND deleted_at IS NULL;
