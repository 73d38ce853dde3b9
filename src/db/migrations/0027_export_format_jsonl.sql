-- Export formats (docs/exports.md "Formats"): `json` becomes one JSON array, and JSON Lines, what
-- `json` wrote until now, becomes the format `jsonl`. The format is the only record of what an
-- export's file holds (its content type and file name are derived from it), so the exports
-- recorded as `json` before this are JSON Lines and become `jsonl`: a ready one keeps serving its
-- file as application/x-ndjson named .jsonl, and one still processing is built as the JSON Lines
-- (and the .jsonl file name) it was promised. Failed and expired ones too, so that the history
-- says what they were.
ALTER TABLE exports DROP CONSTRAINT exports_format_check;
UPDATE exports SET format = 'jsonl' WHERE format = 'json';
ALTER TABLE exports ADD CONSTRAINT exports_format_check CHECK (format IN ('csv', 'json', 'jsonl'));
