/**
 * The parameters of a statement put together from parts that different modules write (a
 * data-modifying CTE each): every part numbers its placeholders after the parts before it.
 */
export class Params {
  readonly values: unknown[] = [];

  /** The placeholder of `value`: `$n`. */
  add(value: unknown): string {
    this.values.push(value);
    return `$${this.values.length}`;
  }

  /** The placeholder of an array of `type` (one column of the rows given to unnest): `$n::type[]`. */
  array(type: string, values: readonly unknown[]): string {
    return `${this.add(values)}::${type}[]`;
  }
}
