/**
 * JSON text with u64 values written as plain integers. Solana's RPC returns lamports, amounts
 * and rent epochs as JSON numbers that can exceed 2^53; @solana/kit parses them as bigint, so
 * they must be written exactly (JSON.stringify rejects bigint and loses precision on numbers).
 */
export function stringifyJson(value: unknown): string {
  switch (typeof value) {
    case 'bigint':
      return value.toString();
    case 'string':
      return JSON.stringify(value);
    case 'number':
      return Number.isFinite(value) ? String(value) : 'null';
    case 'boolean':
      return value ? 'true' : 'false';
    case 'object': {
      if (value === null) return 'null';
      if (Array.isArray(value)) {
        let out = '[';
        for (let i = 0; i < value.length; i++) {
          if (i > 0) out += ',';
          const item: unknown = value[i];
          out += item === undefined || typeof item === 'function' ? 'null' : stringifyJson(item);
        }
        return `${out}]`;
      }
      let out = '{';
      let first = true;
      for (const key of Object.keys(value)) {
        const item: unknown = (value as Record<string, unknown>)[key];
        if (item === undefined || typeof item === 'function') continue;
        if (!first) out += ',';
        first = false;
        out += `${JSON.stringify(key)}:${stringifyJson(item)}`;
      }
      return `${out}}`;
    }
    default:
      return 'null';
  }
}
