-- An escrow between two vaults of one organisation writes one event per move, under the paying
-- vault; the receiving vault's feed (GET /v1/events?walletId=) did not show it. The event also
-- names the receiving vault, and the feed's vault filter matches either (docs/events.md).
ALTER TABLE events ADD COLUMN related_wallet_id TEXT;
CREATE INDEX events_related_wallet_page ON events (org_id, related_wallet_id, created_at DESC, id DESC)
  WHERE related_wallet_id IS NOT NULL;

-- The events already written for such escrows (kept 90 days).
UPDATE events e SET related_wallet_id = x.to_wallet_id
FROM escrows x
WHERE e.type IN ('escrow.created', 'escrow.completed', 'escrow.released', 'escrow.refunded', 'escrow.disputed', 'escrow.resolved')
  AND e.payload->>'escrow_id' = x.id AND e.org_id = x.org_id AND e.wallet_id = x.from_wallet_id
  AND x.to_wallet_id IS NOT NULL AND x.to_wallet_id <> x.from_wallet_id
  AND (x.receiver_org_id IS NULL OR x.receiver_org_id = x.org_id);
