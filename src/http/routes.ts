/**
 * Every route of the API, registered in one visible list.
 */
import type { App } from './app.ts';
import type { AppContext } from './context.ts';
import { apiKeyRoutes } from '../api-keys/routes.ts';
import { organizationRoutes } from '../organizations/routes.ts';
import { policyRoutes } from '../policies/routes.ts';
import { recipientRoutes } from '../recipients/routes.ts';
import { testHelperRoutes } from '../test-helpers/routes.ts';
import { paymentRoutes } from '../payments/routes.ts';
import { escrowRoutes } from '../escrow/routes.ts';
import { eventRoutes } from '../events/routes.ts';
import { exportRoutes } from '../exports/routes.ts';
import { alertRoutes } from '../automation/routes.ts';
import { transactionRoutes } from '../transactions/routes.ts';
import { verifierRoutes } from '../verifiers/routes.ts';
import { walletRoutes } from '../wallets/routes.ts';
import { webhookRoutes } from '../webhooks/routes.ts';

export function registerRoutes(app: App, ctx: AppContext): void {
  organizationRoutes(app, ctx);
  apiKeyRoutes(app, ctx);
  policyRoutes(app, ctx);
  walletRoutes(app, ctx);
  recipientRoutes(app, ctx);
  paymentRoutes(app, ctx);
  escrowRoutes(app, ctx);
  eventRoutes(app, ctx);
  alertRoutes(app, ctx);
  transactionRoutes(app, ctx);
  exportRoutes(app, ctx);
  verifierRoutes(app, ctx);
  webhookRoutes(app, ctx);
  testHelperRoutes(app, ctx);
}
