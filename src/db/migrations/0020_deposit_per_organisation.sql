-- One chain transaction may pay several organisations' reserves (an exchange's batched payout):
-- each organisation's part is a deposit of its own, indexed once per organisation.
ALTER TABLE deposits DROP CONSTRAINT deposits_tx_signature_key;
ALTER TABLE deposits ADD CONSTRAINT deposits_org_signature UNIQUE (org_id, tx_signature);
