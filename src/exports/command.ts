/**
 * `agent-vault export`: asks a running service for a transaction export over its HTTP API (with
 * an API key, like any client), polls until the file is built, downloads it with a progress
 * bar on stderr (plain ANSI, redrawn in place on a terminal, a few lines otherwise) and writes
 * it locally: first to `<file>.part`, renamed once every byte arrived, so a broken download
 * never leaves a file that looks complete.
 */
import { createWriteStream, existsSync, renameSync, rmSync } from 'node:fs';
import { basename, resolve } from 'node:path';
import { Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';

/** One API call (create, poll) that has not answered by then has failed. */
const REQUEST_TIMEOUT_MS = 30_000;
/** A download that receives nothing for this long has stalled. */
const DOWNLOAD_STALL_MS = 60_000;
export const POLL_INTERVAL_MS = 1_000;
/** The longest the command waits for the service to build an export. */
const BUILD_WAIT_MAX_MS = 60 * 60_000;
const BAR_WIDTH = 30;

export interface ExportCommandOptions {
  /** the service, e.g. http://127.0.0.1:8080 */
  baseUrl: string;
  apiKey: string;
  format: string;
  /** transaction filters, sent as they are: walletId, status, type, recipient, from, to */
  filters: Record<string, string>;
  /** where to write; null = the export's file name in the current directory */
  out: string | null;
  force: boolean;
}

export interface ExportCommandIo {
  stderr: { write(text: string): unknown; isTTY?: boolean };
  /** waits between two polls (tests run the service's jobs instead) */
  wait(ms: number): Promise<void>;
}

/** A failure to report in one line: the service refused, the export failed, the file exists. */
export class ExportCommandError extends Error {}

interface ExportState {
  export_id: string;
  status: 'processing' | 'ready' | 'failed' | 'expired';
  download_url: string | null;
  file_name: string;
  estimated_ready_at: string;
  created_at: string;
  row_count: number | null;
  size_bytes: number | null;
  failure_reason: string | null;
}

/** Runs the whole export; returns the line to print on stdout. */
export async function runExportCommand(options: ExportCommandOptions, io: ExportCommandIo): Promise<string> {
  if (options.out !== null) refuseExisting(options.out, options.force);
  const call = apiCaller(options);
  let state = await call<ExportState>('POST', '/v1/transactions/export', { format: options.format, ...options.filters });
  const out = resolve(options.out ?? plainFileName(state.file_name));
  if (options.out === null) refuseExisting(out, options.force);

  const status = statusLine(io.stderr);
  const startedMs = Date.now();
  // The estimate is on the service's clock, which need not be this machine's (a test clock moved
  // forward, or a clock skewed): what it gives is its distance from the export's creation.
  const estimatedMs = Date.parse(state.estimated_ready_at) - Date.parse(state.created_at);
  while (state.status === 'processing') {
    if (Date.now() - startedMs > BUILD_WAIT_MAX_MS) {
      throw new ExportCommandError(`export ${state.export_id} is still processing after ${BUILD_WAIT_MAX_MS / 60_000} minutes; `
        + `poll GET /v1/transactions/exports/${state.export_id} later`);
    }
    const leftS = Math.max(0, Math.ceil((estimatedMs - (Date.now() - startedMs)) / 1000));
    status.show(`export ${state.export_id}: building${leftS > 0 ? `, ready in about ${leftS} s` : ''}…`);
    await io.wait(POLL_INTERVAL_MS);
    state = await call<ExportState>('GET', `/v1/transactions/exports/${encodeURIComponent(state.export_id)}`);
  }
  if (state.status === 'failed') throw new ExportCommandError(`export ${state.export_id} failed: ${state.failure_reason ?? 'no reason given'}`);
  if (state.status !== 'ready' || state.download_url === null || state.size_bytes === null) {
    throw new ExportCommandError(`export ${state.export_id} is ${state.status}: request a new one`);
  }

  const sizeBytes = state.size_bytes;
  status.show(`export ${state.export_id}: ${bar(0, sizeBytes)}`);
  await download(options, state.download_url, out, sizeBytes, (received) => {
    status.show(`export ${state.export_id}: ${bar(received, sizeBytes)}`, received < sizeBytes);
  });
  status.done();
  return `wrote ${out}: ${state.row_count} transactions, ${sizeBytes} bytes (${state.export_id})`;
}

/**
 * The export's own file name, written to the current directory: only a plain name, never a
 * path (whoever answers in the service's place could otherwise name a file anywhere).
 */
function plainFileName(name: string): string {
  if (name !== basename(name) || name === '' || name === '.' || name === '..' || name.startsWith('.') || name.includes('\\')) {
    throw new ExportCommandError(`the service gave the file name ${JSON.stringify(name)}, which is not a plain file name: choose one with --out`);
  }
  return name;
}

/**
 * An API path under the base URL: appended to its path, so that a service behind a prefix
 * (`https://gateway.example.com/vault`) is reached at `/vault/v1/…` (SPEC: every path is
 * appended to the base URL). The path of a download link the API gave is one of these too.
 */
function apiUrl(baseUrl: string, path: string): URL {
  const url = new URL(baseUrl);
  url.pathname = `${url.pathname.replace(/\/+$/, '')}${path}`;
  url.search = '';
  url.hash = '';
  return url;
}

function refuseExisting(path: string, force: boolean): void {
  if (!force && existsSync(path)) throw new ExportCommandError(`${path} exists: choose another --out or add --force`);
}

/** The service's JSON API with the key; an error answer becomes its code and message. */
function apiCaller(options: ExportCommandOptions) {
  return async <T>(method: string, path: string, body?: unknown): Promise<T> => {
    let response: Response;
    try {
      response = await fetch(apiUrl(options.baseUrl, path), {
        method,
        headers: { authorization: `Bearer ${options.apiKey}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
      });
    } catch (error) {
      throw new ExportCommandError(`cannot reach ${options.baseUrl}: ${(error as Error).message}`);
    }
    let text: string;
    try {
      text = await response.text();
    } catch (error) {
      throw new ExportCommandError(`${method} ${path}: the answer was cut off (${(error as Error).message})`);
    }
    if (!response.ok) throw new ExportCommandError(`${method} ${path}: ${describeError(response.status, text)}`);
    try {
      return JSON.parse(text) as T;
    } catch {
      throw new ExportCommandError(`${method} ${path}: ${options.baseUrl} did not answer as the Agent Vault API `
        + `(HTTP ${response.status}, ${response.headers.get('content-type') ?? 'no content type'})`);
    }
  };
}

function describeError(status: number, text: string): string {
  try {
    const { error } = JSON.parse(text) as { error?: { code?: string; message?: string; param?: string } };
    if (error?.code) return `${status} ${error.code}${error.param ? ` (${error.param})` : ''}: ${error.message ?? ''}`;
  } catch {
    // not the API's error shape: show the status alone
  }
  return `HTTP ${status}`;
}

async function download(
  options: ExportCommandOptions, url: string, out: string, sizeBytes: number, progress: (received: number) => void,
): Promise<void> {
  const abort = new AbortController();
  let stall = setTimeout(() => abort.abort(new Error(`no data for ${DOWNLOAD_STALL_MS / 1000} s`)), DOWNLOAD_STALL_MS);
  const part = `${out}.part`;
  try {
    // The link is a path of the API (src/exports: downloadPath); nothing else gets the key.
    if (!url.startsWith('/')) throw new ExportCommandError(`the service gave the download link ${JSON.stringify(url)}, not a path of its API`);
    const response = await fetch(apiUrl(options.baseUrl, url), {
      headers: { authorization: `Bearer ${options.apiKey}` }, signal: abort.signal,
    });
    if (!response.ok || !response.body) {
      throw new ExportCommandError(`download: ${describeError(response.status, await response.text())}`);
    }
    let received = 0;
    const counter = new Transform({
      transform(chunk: Buffer, _encoding, done) {
        received += chunk.length;
        clearTimeout(stall);
        stall = setTimeout(() => abort.abort(new Error(`no data for ${DOWNLOAD_STALL_MS / 1000} s`)), DOWNLOAD_STALL_MS);
        progress(received);
        done(null, chunk);
      },
    });
    await pipeline(Readable.fromWeb(response.body as import('node:stream/web').ReadableStream), counter, createWriteStream(part, { mode: 0o600 }));
    if (received !== sizeBytes) throw new ExportCommandError(`download ended after ${received} of ${sizeBytes} bytes`);
    renameSync(part, out);
  } catch (error) {
    rmSync(part, { force: true });
    if (error instanceof ExportCommandError) throw error;
    throw new ExportCommandError(`download failed: ${(error as Error).message}`);
  } finally {
    clearTimeout(stall);
  }
}

/** `[##########--------------------]  33%  1.2 MB of 3.6 MB` */
export function bar(received: number, total: number): string {
  const fraction = total === 0 ? 1 : Math.min(1, received / total);
  const filled = Math.round(fraction * BAR_WIDTH);
  return `[${'#'.repeat(filled)}${'-'.repeat(BAR_WIDTH - filled)}] ${String(Math.floor(fraction * 100)).padStart(3)}%  `
    + `${megabytes(received)} of ${megabytes(total)}`;
}

function megabytes(bytes: number): string {
  return `${(bytes / 1_000_000).toFixed(1)} MB`;
}

/**
 * One status line: on a terminal, redrawn in place (carriage return, then erase the line); to
 * a file or pipe, a line per change of phase only, so logs do not fill with bar frames.
 */
function statusLine(stderr: ExportCommandIo['stderr']) {
  let last = '';
  let lastPhase = '';
  let drawn = false;
  const phaseOf = (text: string) => text.replace(/\d+/g, '#');
  return {
    show(text: string, partial = false) {
      if (text === last) return;
      last = text;
      if (stderr.isTTY) {
        stderr.write(`\r\x1b[2K${text}`);
        drawn = true;
      } else if (!partial && phaseOf(text) !== lastPhase) {
        lastPhase = phaseOf(text);
        stderr.write(`${text}\n`);
      }
    },
    done() {
      if (drawn) stderr.write('\n');
    },
  };
}
