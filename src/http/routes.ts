/**
 * Every route of the API, registered in one visible list.
 */
import type { App } from './app.ts';
import type { AppContext } from './context.ts';
import { apiKeyRoutes } from '../api-keys/routes.ts';
import { organizationRoutes } from '../organizations/routes.ts';
import { policyRoutes } from '../policies/routes.ts';
import { testHelperRoutes } from '../test-helpers/routes.ts';
import { transactionRoutes } from '../transactions/routes.ts';
import { walletRoutes } from '../wallets/routes.ts';

export function registerRoutes(app: App, ctx: AppContext): void {
  organizationRoutes(app, ctx);
  apiKeyRoutes(app, ctx);
  policyRoutes(app, ctx);
  walletRoutes(app, ctx);
  transactionRoutes(app, ctx);
  testHelperRoutes(app, ctx);
}
