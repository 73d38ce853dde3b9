-- Export formats (docs/exports.md "Formats"): `json` becomes one JSON array, and JSON Lines, what
-- `json` wrote until now, becomes the format `jsonl`. Like every migration this one only adds
-- (docs/operations.md "Migrations"): during a deploy, processes of the previous release share
-- the database with the new ones and keep reading and recording exports as they did. Relabelling
-- the existing `json` rows `jsonl` would break them: a previous-release process answering for
-- one fails (its schema has no `jsonl`), and one still taking `format: "json"` after the
-- migration would record JSON Lines under a `json` that now means an array.
--
-- So no row is rewritten. The new code sets json_array TRUE on every export it records; the
-- previous release, naming no such column, leaves it NULL, before this migration and after it.
-- A `json` export with json_array NULL is therefore JSON Lines, and everything that depends on
-- the format reads it through fileFormatOf (src/exports/formats.ts), which answers `jsonl` for
-- it: a ready one serves its file as application/x-ndjson named .jsonl, and one still processing
-- is built as the JSON Lines it was promised. The column has no default: a default of TRUE would
-- mark the previous release's rows as arrays.
ALTER TABLE exports DROP CONSTRAINT exports_format_check;
ALTER TABLE exports ADD CONSTRAINT exports_format_check CHECK (format IN ('csv', 'json', 'jsonl'));
ALTER TABLE exports ADD COLUMN json_array BOOLEAN;
