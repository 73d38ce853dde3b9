-- Deposits anyone sends to an organisation's reserve token account, found on chain by the
-- deposit detector (src/organizations/deposit-detector.ts) and indexed once.
ALTER TABLE organizations
  -- the newest signature of the reserve token account handled by the detector; every older one is handled too
  ADD COLUMN deposit_cursor TEXT,
  -- a scan too long for one run continues below this signature at the next run
  ADD COLUMN deposit_scan_before TEXT,
  -- a detector holds the organisation until then (a lease, so no lock is held across chain calls);
  -- after the run it is set to when the run ended, so the least recently scanned go first
  ADD COLUMN deposit_claimed_until TIMESTAMPTZ;
CREATE INDEX organizations_deposit_claims ON organizations (deposit_claimed_until NULLS FIRST, id) WHERE chain_status = 'ready';
