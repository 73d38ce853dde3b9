/**
 * Helpers for what runs real processes (the end-to-end tests and the benchmarks): a free port,
 * a service's health, and a stop that never hangs.
 */
import type { ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';

/** A TCP port free on 127.0.0.1 right now. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

/**
 * Sends `signal` (SIGTERM by default) and resolves with the exit code; a process still running
 * after `killAfterMs` is SIGKILLed. One that already exited answers at once.
 */
export function stopProcess(
  child: ChildProcess, options: { signal?: NodeJS.Signals; killAfterMs?: number } = {},
): Promise<number | null> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve(child.exitCode);
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill('SIGKILL'), options.killAfterMs ?? 20_000);
    child.once('exit', (code) => {
      clearTimeout(timer);
      resolve(code);
    });
    child.kill(options.signal ?? 'SIGTERM');
  });
}

/** Polls `GET /healthz` until it answers 200; throws if the process exits or `timeoutMs` passes. */
export async function waitForHealth(
  baseUrl: string, child: ChildProcess, options: { timeoutMs: number; output?: () => string },
): Promise<void> {
  const deadlineMs = Date.now() + options.timeoutMs;
  const output = () => (options.output ? `:\n${options.output()}` : '');
  while (Date.now() < deadlineMs) {
    if (child.exitCode !== null) throw new Error(`the service exited (${child.exitCode})${output()}`);
    try {
      if ((await fetch(`${baseUrl}/healthz`, { signal: AbortSignal.timeout(2_000) })).ok) return;
    } catch {
      // not listening yet
    }
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
  throw new Error(`the service did not become healthy${output()}`);
}
