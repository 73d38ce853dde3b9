-- The filters of GET /v1/transactions and of exports (recipient, type, status), each an index
-- range scan in the list's order. Without them a filter matching few rows (a rare recipient, the
-- withdrawals among millions of payments) walked every transaction of the organisation before
-- answering a page of one. Payments, most rows, are left out of the type and status indexes:
-- filtering on what most rows are is the organisation's own index with a filter, and cheap.
CREATE INDEX transactions_org_recipient ON transactions (org_id, recipient, created_at DESC, id DESC);
CREATE INDEX transactions_org_type ON transactions (org_id, type, created_at DESC, id DESC) WHERE type <> 'payment';
CREATE INDEX transactions_org_status ON transactions (org_id, status, created_at DESC, id DESC) WHERE status NOT IN ('confirmed', 'pending');
