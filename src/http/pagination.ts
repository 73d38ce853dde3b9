/**
 * Keyset pagination shared by every list: newest first on (created_at, id), an opaque cursor
 * naming the last row seen, `limit` 1..100 (default 20). Stable under concurrent inserts: a
 * row created after the first page never shifts the pages that follow.
 */
import { Type } from 'typebox';
import { invalidRequest } from '../errors/errors.ts';
import { patternString } from './fields.ts';

export const PAGE_LIMIT_DEFAULT = 20;
export const PAGE_LIMIT_MAX = 100;

/** Query fields every list accepts. Limit is a string in the query and checked here. */
export const PageQuery = {
  limit: Type.Optional(patternString(`^(${PAGE_LIMIT_MAX}|[1-9][0-9]?)$`, `must be an integer from 1 to ${PAGE_LIMIT_MAX}`, {
    description: `1..${PAGE_LIMIT_MAX}, default ${PAGE_LIMIT_DEFAULT}`,
  })),
  cursor: Type.Optional(Type.String({ description: 'next_cursor of the previous page', maxLength: 200 })),
};

/** A list's vault filter, `walletId`, also accepted as `wallet_id` (SPEC's spelling), not both. */
export const walletIdQuery = (description?: string) => ({
  walletId: Type.Optional(Type.String({ minLength: 1, maxLength: 64, ...(description ? { description } : {}) })),
  wallet_id: Type.Optional(Type.String({ minLength: 1, maxLength: 64, description: 'alias of walletId' })),
});

export function walletIdOf(query: { walletId?: string; wallet_id?: string }): string | undefined {
  if (query.walletId !== undefined && query.wallet_id !== undefined) {
    throw invalidRequest('wallet_id', 'Give walletId or wallet_id, not both.');
  }
  return query.walletId ?? query.wallet_id;
}

export function pageOf<T extends ReturnType<typeof Type.Object>>(item: T) {
  return Type.Object({
    data: Type.Array(item),
    has_more: Type.Boolean(),
    next_cursor: Type.Union([Type.String(), Type.Null()], { description: 'the `cursor` of the next page; null on the last page (`has_more` false)' }),
  });
}

export interface PageRequest {
  limit: number;
  after: { createdAt: Date; id: string } | null;
}

export function parsePageRequest(query: { limit?: string; cursor?: string }): PageRequest {
  let limit = PAGE_LIMIT_DEFAULT;
  if (query.limit !== undefined) {
    if (!/^\d{1,3}$/.test(query.limit) || Number(query.limit) < 1 || Number(query.limit) > PAGE_LIMIT_MAX) {
      throw invalidRequest('limit', `limit must be an integer from 1 to ${PAGE_LIMIT_MAX}`);
    }
    limit = Number(query.limit);
  }
  return { limit, after: query.cursor === undefined ? null : decodeCursor(query.cursor) };
}

/**
 * The last millisecond of the year 9999: a later instant is written with a sign and six year
 * digits (`+010000-…`), which PGlite refuses.
 */
export const DATE_MS_MAX = Date.UTC(9999, 11, 31, 23, 59, 59, 999);
/** The first millisecond of the year 1: PostgreSQL has no year 0 (`0000-…` is refused). */
export const DATE_MS_MIN = new Date(0).setUTCFullYear(1, 0, 1);

function decodeCursor(cursor: string): { createdAt: Date; id: string } {
  try {
    const [ms, id] = JSON.parse(Buffer.from(cursor, 'base64url').toString('utf8')) as [unknown, unknown];
    // An instant every row's created_at can be: from 1970 to the end of the year 9999.
    if (typeof ms === 'number' && Number.isSafeInteger(ms) && ms >= 0 && ms <= DATE_MS_MAX && typeof id === 'string' && id.length <= 64 && !id.includes('\u0000')) {
      return { createdAt: new Date(ms), id };
    }
  } catch {
    // falls through to the error below
  }
  throw invalidRequest('cursor', 'cursor is not one this API returned');
}

export function encodeCursor(row: { created_at: Date; id: string }): string {
  return Buffer.from(JSON.stringify([row.created_at.getTime(), row.id]), 'utf8').toString('base64url');
}

/**
 * The filters of a list and the page's place in it: `page()` gives the `WHERE … ORDER BY …
 * LIMIT …` of a keyset page (newest first, `created_at DESC, id DESC`, one row more than the
 * limit so toPage can tell whether there is more) and its parameters. Every list of the API
 * goes through here.
 */
export class PageFilter {
  readonly #params: unknown[] = [];
  readonly #conditions: string[] = [];
  #prefix: string;

  /** `table`: the alias the columns are qualified with, when the query joins. */
  constructor(table = '') {
    this.#prefix = table ? `${table}.` : '';
  }

  /** A condition on a value; `sql` is given the value's placeholder (it may use it twice). */
  where(sql: (param: string) => string, value: unknown): this {
    this.#params.push(value);
    this.#conditions.push(sql(`$${this.#params.length}`));
    return this;
  }

  /** Another filter with the same conditions and parameters, to add to apart. */
  copy(): PageFilter {
    const copy = new PageFilter();
    copy.#prefix = this.#prefix;
    copy.#params.push(...this.#params);
    copy.#conditions.push(...this.#conditions);
    return copy;
  }

  /** A condition without a value. */
  whereSql(sql: string): this {
    this.#conditions.push(sql);
    return this;
  }

  /** The conditions alone, as a WHERE clause. */
  filter(): { sql: string; params: unknown[] } {
    return { sql: `WHERE ${this.#conditions.length ? this.#conditions.join(' AND ') : 'TRUE'}`, params: [...this.#params] };
  }

  page(page: PageRequest): { sql: string; params: unknown[] } {
    const p = this.#prefix;
    const params = [...this.#params];
    const conditions = [...this.#conditions];
    if (page.after) {
      params.push(page.after.createdAt, page.after.id);
      conditions.push(`(${p}created_at, ${p}id) < ($${params.length - 1}, $${params.length})`);
    }
    return {
      sql: `WHERE ${conditions.length ? conditions.join(' AND ') : 'TRUE'} ORDER BY ${p}created_at DESC, ${p}id DESC LIMIT ${page.limit + 1}`,
      params,
    };
  }
}

export function toPage<Row extends { created_at: Date; id: string }, Item>(
  rows: Row[], page: PageRequest, toItem: (row: Row) => Item,
): { data: Item[]; has_more: boolean; next_cursor: string | null } {
  const hasMore = rows.length > page.limit;
  const shown = hasMore ? rows.slice(0, page.limit) : rows;
  const last = shown[shown.length - 1];
  return { data: shown.map(toItem), has_more: hasMore, next_cursor: hasMore && last ? encodeCursor(last) : null };
}
