/**
 * Which PostgreSQL failures say the database is down or unreachable: a request then answers 503
 * (and may be retried), a command one line; anything else stays a fault of ours (500, a stack).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { dependencyDown } from '../http/app.ts';
import { postgresUnreachable } from './unreachable.ts';

const failure = (code: string | undefined, message: string) => Object.assign(new Error(message), code === undefined ? {} : { code });

test('a database closed to connections, dropped, refusing the login or not answering is down; other failures are not', () => {
  const down = [
    failure('55000', 'database "agent_vault" is not currently accepting connections'),
    failure('3D000', 'database "agent_vault" does not exist'),
    failure('28P01', 'password authentication failed for user "agent_vault"'),
    failure('28000', 'no pg_hba.conf entry for host "10.0.0.5"'),
    failure('57P01', 'terminating connection due to administrator command'),
    failure(undefined, 'Connection terminated due to connection timeout'),
  ];
  for (const error of down) {
    assert.equal(postgresUnreachable(error), true, error.message);
    // Wrapped as a cause too (a job's error around the driver's).
    assert.equal(dependencyDown(new Error('a job failed', { cause: error })), true, error.message);
  }
  const ours = [
    failure('55000', 'cannot execute this in the current state'),
    failure('08P01', 'bind message supplies 1 parameters, but prepared statement "" requires 2'),
    failure('23505', 'duplicate key value violates unique constraint "wallets_pkey"'),
    failure(undefined, 'Cannot read properties of undefined'),
  ];
  for (const error of ours) assert.equal(dependencyDown(error), false, error.message);
});
