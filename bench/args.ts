/** A benchmark's numeric option: a positive integer, or the run stops before it starts, saying which. */
export function positiveInteger(name: string, text: string | undefined): number {
  const value = Number(text);
  if (!Number.isInteger(value) || value <= 0) throw new Error(`--${name} must be a positive integer, got ${text}`);
  return value;
}
