/**
 * Alert settings of the organisation (`GET/PUT /v1/alerts`): which alerts raise `alert.raised`
 * events (the activity feed, and webhooks subscribed to them). docs/automation.md.
 */
import { Type } from 'typebox';
import { amountOf } from '../http/fields.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { formatUsdc } from '../money/money.ts';
import { alertSettingsOf, saveAlertSettings, type AlertSettings } from './automation.ts';

const AlertsView = Type.Object({
  policy_violation: Type.Boolean({ description: 'an alert for every payment the policy blocks (on by default)' }),
  inactivity_hours: Type.Union([Type.Integer(), Type.Null()], { description: 'alert once when an active vault has had no transaction for this long' }),
  velocity_per_hour: Type.Union([Type.Integer(), Type.Null()], { description: 'alert when a vault makes more payments than this in an hour' }),
  large_transaction_above: Type.Union([Type.String(), Type.Null()], { description: 'alert for each confirmed payment above this amount' }),
  balance_low: Type.String({ description: 'per vault: PATCH /v1/wallets/{id} lowBalanceThreshold' }),
});

function alertsView(settings: AlertSettings) {
  return {
    policy_violation: settings.policyViolation,
    inactivity_hours: settings.inactivityHours,
    velocity_per_hour: settings.velocityPerHour,
    large_transaction_above: settings.largeTransactionAmount === null ? null : formatUsdc(settings.largeTransactionAmount),
    balance_low: 'per vault: lowBalanceThreshold',
  };
}

export function alertRoutes(app: App, ctx: AppContext): void {
  app.get('/v1/alerts', {
    config: { permission: 'read' },
    schema: { tags: ['Events'], summary: 'The organisation\'s alert settings', response: { 200: AlertsView } },
  }, async (request) => alertsView(await alertSettingsOf(ctx.db, principalOf(request).orgId)));

  app.put('/v1/alerts', {
    config: { permission: 'write' },
    schema: {
      tags: ['Events'], summary: 'Set the alert settings (every field; null turns an alert off)',
      body: Type.Object({
        policyViolation: Type.Boolean(),
        inactivityHours: Type.Union([Type.Integer({ minimum: 1, maximum: 24 * 365 }), Type.Null()]),
        velocityPerHour: Type.Union([Type.Integer({ minimum: 1, maximum: 1_000_000 }), Type.Null()]),
        largeTransactionAbove: Type.Union([Type.String(), Type.Null()]),
      }, { additionalProperties: false }),
      response: { 200: AlertsView },
    },
  }, async (request) => {
    const { orgId } = principalOf(request);
    const body = request.body;
    const large = body.largeTransactionAbove === null ? null : amountOf(body.largeTransactionAbove, 'large_transaction_above');
    return alertsView(await saveAlertSettings(ctx.db, ctx.clock.nowMs(), orgId, {
      policyViolation: body.policyViolation, inactivityHours: body.inactivityHours, velocityPerHour: body.velocityPerHour,
      largeTransactionAmount: large,
    }));
  });
}
