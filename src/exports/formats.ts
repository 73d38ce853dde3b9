/**
 * The three file formats of a transaction export (docs/exports.md), as pure functions of the
 * transaction view: CSV (RFC 4180, one column per view field, nested objects flattened), JSON
 * (one array of view objects) and JSON Lines (one view object per line). All are written a row
 * at a time, so an export of any size is built in constant memory.
 */
import { TransactionView, type transactionView } from '../transactions/views.ts';

export type ExportFormat = 'csv' | 'json' | 'jsonl';
export type TransactionViewValue = ReturnType<typeof transactionView>;

export const CONTENT_TYPES: Record<ExportFormat, string> = {
  csv: 'text/csv; charset=utf-8; header=present',
  // JSON is UTF-8 by definition (RFC 8259), and application/json defines no charset parameter.
  json: 'application/json',
  jsonl: 'application/x-ndjson; charset=utf-8',
};
export const FILE_EXTENSIONS: Record<ExportFormat, string> = { csv: 'csv', json: 'json', jsonl: 'jsonl' };
/** The format as the export.ready event's summary names it. */
export const FORMAT_NAMES: Record<ExportFormat, string> = { csv: 'CSV', json: 'JSON', jsonl: 'JSON Lines' };

/** An export's format as its row records it (src/exports/exports.ts ExportRow). */
export interface RecordedFormat {
  format: ExportFormat;
  /** TRUE on every export recorded since `json` means one array; NULL on those recorded before. */
  json_array: boolean | null;
}

/**
 * What an export's file holds, or will hold once built: the one answer for everything that
 * depends on it (the writer a build uses, the content type and file name of the download, the
 * view's and the export.ready event's `format`). It is the recorded format, except that `json`
 * recorded by code from before `json` meant an array (json_array NULL) is JSON Lines, which that
 * code wrote and promised. Such rows keep `json` (migration 0027 rewrites none): a process of the
 * previous release, sharing the database during a deploy, reads and records them as it always
 * did.
 */
export function fileFormatOf(row: RecordedFormat): ExportFormat {
  return row.format === 'json' && row.json_array !== true ? 'jsonl' : row.format;
}

type Cell = string | number | boolean | null | undefined;

interface Column {
  name: string;
  field: string;
  /** the property of an object-valued field (violation, approval) this column shows */
  part?: string;
}

interface SchemaNode {
  type?: string;
  properties?: Record<string, SchemaNode>;
  anyOf?: SchemaNode[];
}

/**
 * The CSV columns, derived from the transaction view's schema: a field the view gains becomes a
 * column without anyone remembering to add it here. An object-valued field (`violation`,
 * `approval`) becomes one column per property, `violation_rule`, `approval_status`, …, because
 * a spreadsheet filters and sums columns, not JSON inside a cell.
 */
function columnsOf(schema: SchemaNode): Column[] {
  const columns: Column[] = [];
  for (const [field, node] of Object.entries(schema.properties ?? {})) {
    const object = (node.anyOf ?? [node]).find((option) => option.type === 'object');
    if (object?.properties) {
      for (const part of Object.keys(object.properties)) columns.push({ name: `${field}_${part}`, field, part });
    } else {
      columns.push({ name: field, field });
    }
  }
  return columns;
}

const COLUMNS: readonly Column[] = columnsOf(TransactionView as unknown as SchemaNode);
export const CSV_COLUMNS: readonly string[] = COLUMNS.map((column) => column.name);

/**
 * A spreadsheet runs a cell that starts with one of these as a formula (CSV injection,
 * OWASP): `=`, `+`, `-`, `@`, and tab and carriage return, which some spreadsheets skip before
 * looking. Such a cell gets a leading apostrophe, which spreadsheets show as text.
 */
const FORMULA_START = /^[=+\-@\t\r]/;

/** One CSV field: neutralised against formulas, then quoted per RFC 4180 when it must be. */
export function csvCell(value: Cell): string {
  if (value === null || value === undefined) return '';
  let text = String(value);
  if (FORMULA_START.test(text)) text = `'${text}`;
  return /[",\r\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

/** RFC 4180 ends every record, the last one included, with CRLF. */
const RECORD_END = '\r\n';

export function csvHeader(): string {
  return CSV_COLUMNS.map(csvCell).join(',') + RECORD_END;
}

export function csvRecord(view: TransactionViewValue): string {
  const record = view as unknown as Record<string, Cell | Record<string, Cell>>;
  return COLUMNS.map(({ field, part }) => {
    const value = record[field];
    if (part === undefined) return csvCell(value as Cell);
    return csvCell(value === null || value === undefined ? null : (value as Record<string, Cell>)[part]);
  }).join(',') + RECORD_END;
}

/** JSON Lines: the view exactly as the API returns it, one object per line, no neutralisation. */
export function jsonLine(view: TransactionViewValue): string {
  return `${JSON.stringify(view)}\n`;
}

/**
 * One element of the JSON array: the view as the API returns it, on a line of its own (so that
 * line tools can still look into the file), preceded by the comma that separates it from the
 * element before, which only the first has not.
 */
export function jsonArrayElement(view: TransactionViewValue, index: number): string {
  return `${index === 0 ? '\n' : ',\n'}${JSON.stringify(view)}`;
}

/**
 * How a file is written a row at a time: what opens it, what each row becomes given its position
 * (0 for the first), and what closes it given how many rows there were. A file is `head`, the
 * rows in order, then `tail`: every byte of it, brackets and commas too, goes through the same
 * writer, so the size it reports is the file's.
 */
export interface FormatWriter {
  head: string;
  row(view: TransactionViewValue, index: number): string;
  tail(rowCount: number): string;
}

const NOTHING = (): string => '';

const WRITERS: Record<ExportFormat, FormatWriter> = {
  csv: { head: csvHeader(), row: csvRecord, tail: NOTHING },
  // `[` … `]`: an empty export is `[]`, one with rows `[\n{…},\n{…}\n]`.
  json: { head: '[', row: jsonArrayElement, tail: (rowCount) => (rowCount === 0 ? ']' : '\n]') },
  jsonl: { head: '', row: jsonLine, tail: NOTHING },
};

export function formatWriter(format: ExportFormat): FormatWriter {
  return WRITERS[format];
}
