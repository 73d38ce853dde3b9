-- An export holds the transactions recorded before its request. A build that read its pages while
-- a transaction with an earlier created_at was still uncommitted (a payment waiting for its
-- vault's lock, which takes its time before) never saw it: on PostgreSQL, an export could miss a
-- row the list shows. Each export now notes, when it is requested, the first transaction id not
-- yet started, and is built only once every transaction before it has ended (docs/exports.md).
ALTER TABLE exports ADD COLUMN build_after_xid BIGINT;
