/**
 * Every route of the API, registered in one visible list.
 */
import type { App } from './app.ts';
import type { AppContext } from './context.ts';
import { organizationRoutes } from '../organizations/routes.ts';

export function registerRoutes(app: App, ctx: AppContext): void {
  organizationRoutes(app, ctx);
}
