import type { App } from '../http/app.ts';
import type { AppContext } from '../http/context.ts';

// Routes of this feature are being written (issue 3); registered from src/http/routes.ts.
export function policyRoutes(_app: App, _ctx: AppContext): void {}
