-- The instant a payment's (or an escrow's a2a_send's) attestation hash commits to, read just
-- before it was signed: shown in the transaction view so that the hash can be checked from it.
-- Earlier rows have none.
ALTER TABLE transactions ADD COLUMN attested_at TIMESTAMPTZ;
