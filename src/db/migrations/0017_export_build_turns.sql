-- Exports are built organisations in turn (docs/exports.md "Building"): a claim takes the oldest
-- export of the organisation whose last build began longest ago, which this column records.
ALTER TABLE exports ADD COLUMN build_started_at TIMESTAMPTZ;
UPDATE exports SET build_started_at = updated_at WHERE attempts > 0;
CREATE INDEX exports_org_build_started ON exports (org_id, build_started_at);
