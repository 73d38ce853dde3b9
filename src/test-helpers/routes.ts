/**
 * Test helpers (DESIGN §9), only with the local validator and AGENT_VAULT_TEST_HELPERS on;
 * otherwise every route here answers 404 like any unknown route.
 */
import { Type } from 'typebox';
import { ServiceError, invalidRequest } from '../errors/errors.ts';
import type { App } from '../http/app.ts';
import { amountField } from '../http/fields.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { formatUsdc, parseUsdc } from '../money/money.ts';
import { depositTestUsdc } from '../organizations/deposits.ts';
import { getOrganization } from '../organizations/organizations.ts';

/** One advance moves time by at most a year: a typo must not push the clock decades ahead. */
const CLOCK_ADVANCE_MAX_SECONDS = 366 * 24 * 3600;
/**
 * Nor may advances add up to more than a century: past the year 9999 PostgreSQL has no timestamp,
 * and a clock that never moves back would leave every write failing for good.
 */
const CLOCK_OFFSET_MAX_YEARS = 100;
const CLOCK_OFFSET_MAX_MS = CLOCK_OFFSET_MAX_YEARS * 366 * 24 * 3600 * 1000;

const ClockView = Type.Object({
  now: Type.String({ description: 'the service clock, ISO 8601 with milliseconds' }),
  offset_seconds: Type.Number({ description: 'how far the service clock is ahead of wall time' }),
});

export function testHelperRoutes(app: App, ctx: AppContext): void {
  // Off: not registered at all, so they answer 404 like any unknown route, before auth or validation.
  // Unset, they are on whenever the chain is a local validator (its cheat codes answer): the
  // embedded one, or `agent-vault validator` at AGENT_VAULT_RPC_URL.
  if (ctx.cheatcodes === null || ctx.config.testHelpers === false) return;
  const clockView = () => ({
    now: new Date(ctx.clock.nowMs()).toISOString(),
    offset_seconds: ctx.clock.offsetMs / 1000,
  });

  app.post('/v1/test_helpers/deposits', {
    config: { permission: 'test_helpers' },
    schema: {
      tags: ['Test helpers'],
      summary: 'Mint local USDC into your reserve (local validator only)',
      body: Type.Object({ amount: amountField() }, { additionalProperties: false }),
      response: {
        200: Type.Object({
          deposit_id: Type.String(), amount: Type.String(), status: Type.String(), tx_signature: Type.String(),
          on_chain_slot: Type.Union([Type.Integer(), Type.Null()]), org_balance: Type.String(), created_at: Type.String(),
        }),
      },
    },
  }, async (request) => {
    const amount = parseUsdc(request.body.amount);
    if (amount === null) throw new ServiceError('invalid_amount', 'amount must be a positive decimal string of USDC.', { param: 'amount' });
    const { orgId } = principalOf(request);
    const deposit = await depositTestUsdc(ctx, orgId, amount);
    const org = await getOrganization(ctx.db, orgId);
    return {
      deposit_id: deposit.id, amount: formatUsdc(deposit.amount), status: deposit.status, tx_signature: deposit.tx_signature,
      on_chain_slot: deposit.on_chain_slot === null ? null : Number(deposit.on_chain_slot),
      org_balance: formatUsdc(org!.reserve_balance), created_at: deposit.created_at.toISOString(),
    };
  });

  app.get('/v1/test_helpers/clock', {
    config: { permission: 'read' },
    schema: { tags: ['Test helpers'], summary: 'The service clock', response: { 200: ClockView } },
  }, async () => clockView());

  app.post('/v1/test_helpers/clock/advance', {
    config: { permission: 'test_helpers' },
    // The service clock is every organisation's: only the default (bootstrap) organisation, the
    // one running the service, may move it. Refused before the body is validated, as a missing
    // permission is: a key that may not move it learns nothing of its request's validity.
    preValidation: async (request) => {
      const org = await getOrganization(ctx.db, principalOf(request).orgId);
      if (!org?.is_default) {
        throw new ServiceError('insufficient_permissions',
          'The service clock is shared by every organisation: only keys of the default organisation may move it.');
      }
    },
    schema: {
      tags: ['Test helpers'],
      summary: 'Move the service clock (and the chain\'s clock) forward',
      body: Type.Object({
        seconds: Type.Integer({
          minimum: 1, maximum: CLOCK_ADVANCE_MAX_SECONDS,
          description: `at most a year (${CLOCK_ADVANCE_MAX_SECONDS}) at a time, and ${CLOCK_OFFSET_MAX_YEARS} years ahead of the wall clock in all`,
        }),
      }, { additionalProperties: false }),
      response: { 200: ClockView },
    },
  }, async (request) => {
    const { seconds } = request.body;
    if (await ctx.clock.advanceBy(seconds, CLOCK_OFFSET_MAX_MS) === null) {
      await ctx.clock.refresh();
      throw invalidRequest('seconds', `The service clock runs at most ${CLOCK_OFFSET_MAX_YEARS} years ahead of the wall clock, `
        + `and is ${Math.floor(ctx.clock.offsetMs / 1000)} s ahead already: this advance would pass that.`);
    }
    // A standalone validator keeps its own clock: tell it. The embedded one reads ctx.clock.
    if (!ctx.validator && ctx.cheatcodes) await ctx.cheatcodes.agentVault_setTime(ctx.clock.nowMs()).send();
    return clockView();
  });
}
