/**
 * GET /v1/organization: the caller's organisation and its reserve.
 */
import { Type } from 'typebox';
import { formatUsdc } from '../money/money.ts';
import type { App } from '../http/app.ts';
import { principalOf } from '../http/auth.ts';
import type { AppContext } from '../http/context.ts';
import { getOrganization } from './organizations.ts';

export const OrganizationView = Type.Object({
  org_id: Type.String(),
  name: Type.String(),
  reserve: Type.Object({
    chain_address: Type.Union([Type.String(), Type.Null()], {
      description: 'the reserve account (program-derived address); null until the reserve is set up on chain',
    }),
    token_account: Type.Union([Type.String(), Type.Null()], {
      description: 'its USDC token account: send USDC here to deposit; null until the reserve is set up on chain',
    }),
    usdc_balance: Type.String({ description: 'USDC available to fund vaults' }),
  }),
  created_at: Type.String(),
});

export function organizationRoutes(app: App, ctx: AppContext): void {
  app.get('/v1/organization', {
    config: { permission: 'read' },
    schema: { tags: ['Organization'], summary: 'Your organisation and its USDC reserve', response: { 200: OrganizationView } },
  }, async (request) => {
    const org = await getOrganization(ctx.db, principalOf(request).orgId);
    if (!org) throw new Error('authenticated organisation missing');
    return {
      org_id: org.id,
      name: org.name,
      reserve: {
        // Shown once the service has set the reserve up and checked it is its own (organizations.ts):
        // the owner's address leads to its token account as surely as the account's own does.
        chain_address: org.chain_status === 'ready' ? org.reserve_address : null,
        token_account: org.chain_status === 'ready' ? org.reserve_token_address : null,
        usdc_balance: formatUsdc(org.reserve_balance),
      },
      created_at: org.created_at.toISOString(),
    };
  });
}
