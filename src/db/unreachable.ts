/**
 * Whether an error says that PostgreSQL is down or cannot be reached: a request answers 503
 * (src/http/app.ts dependencyDown) and a command says it in one line (src/cli.ts). A module of
 * its own, so that the CLI reads it without loading the service.
 */

/**
 * PostgreSQL's codes: a connection failed or was refused (class 08, but not 08P01, a protocol
 * violation, which a statement with the wrong number of parameters raises), terminated by an
 * administrator, crash, starting up or shutting down, too many connections; and, for a new
 * connection, a database that no longer exists (3D000) or a login refused (28000, 28P01).
 */
const DOWN_CODES = new Set(['08000', '08001', '08003', '08004', '08006', '57P01', '57P02', '57P03', '53300', '3D000', '28000', '28P01']);
/** 55000 (object not in prerequisite state) means down only when it is a database closed to connections. */
const CLOSED_TO_CONNECTIONS = /is not currently accepting connections/;
/** node-postgres' own errors for a connection lost or never made (one that does not answer: a timeout). */
const CONNECTION_MESSAGE = /^(Connection terminated|timeout exceeded when trying to connect|Client has encountered a connection error)/;

/** The error itself, not its causes (the callers walk those). */
export function postgresUnreachable(error: { code?: unknown; message?: unknown }): boolean {
  const { code, message } = error;
  if (typeof code === 'string' && DOWN_CODES.has(code)) return true;
  if (code === '55000' && typeof message === 'string' && CLOSED_TO_CONNECTIONS.test(message)) return true;
  return typeof message === 'string' && CONNECTION_MESSAGE.test(message);
}
