/**
 * Retention jobs delete in bounded statements (each one's locks, WAL and time stay small) and
 * repeat them until nothing is left, so that they keep up with whatever the service writes in a
 * day, within a time budget per run so that a large backlog is worked off over several runs.
 */

/**
 * Runs `step` with `batch` (it touches at most that many rows and answers how many it did) until
 * a step touches fewer, or `budgetMs` has passed since the first (the step in hand finishes).
 * Answers the rows touched in all.
 */
export async function inBatches(step: (batch: number) => Promise<number>, options: { batch: number; budgetMs: number }): Promise<number> {
  const startedMs = performance.now();
  let total = 0;
  for (;;) {
    const touched = await step(options.batch);
    total += touched;
    if (touched < options.batch || performance.now() - startedMs >= options.budgetMs) return total;
  }
}
