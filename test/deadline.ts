/**
 * Whether a piece of work ends before a deadline far beyond what it should take: a test proves
 * with it that something does not hang (waits for a limit it should not wait for), never how fast
 * it is. Resolves `work`'s value, or `null` when the deadline came first; a rejection passes through.
 */
export async function beforeDeadline<T>(work: Promise<T>, deadlineMs: number): Promise<T | null> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([work, new Promise<null>((resolve) => { timer = setTimeout(resolve, deadlineMs, null); })]);
  } finally {
    clearTimeout(timer);
  }
}
