/**
 * The two file formats of a transaction export (docs/exports.md), as pure functions of the
 * transaction view: CSV (RFC 4180, one column per view field, nested objects flattened) and
 * JSON Lines (one view object per line). Both are written a row at a time, so an export of any
 * size is built in constant memory.
 */
import { TransactionView, type transactionView } from '../transactions/views.ts';

export type ExportFormat = 'csv' | 'json';
export type TransactionViewValue = ReturnType<typeof transactionView>;

export const CONTENT_TYPES: Record<ExportFormat, string> = {
  csv: 'text/csv; charset=utf-8; header=present',
  json: 'application/x-ndjson; charset=utf-8',
};
export const FILE_EXTENSIONS: Record<ExportFormat, string> = { csv: 'csv', json: 'jsonl' };

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

/** What opens the file (the CSV header; JSON Lines has none) and what each row becomes. */
export function formatWriter(format: ExportFormat): { head: string; row: (view: TransactionViewValue) => string } {
  return format === 'csv' ? { head: csvHeader(), row: csvRecord } : { head: '', row: jsonLine };
}
