/**
 * Each operation's `operationId` in the OpenAPI document: the name a generated client gives the
 * method (`client.createPayment(…)`). Stable once published: renaming one breaks those clients
 * (CHANGELOG). Keyed by the method and the route as Fastify writes it.
 */
export const OPERATION_IDS: Readonly<Record<string, string>> = {
  'GET /v1/organization': 'getOrganization',

  'POST /v1/api-keys': 'createApiKey',
  'GET /v1/api-keys': 'listApiKeys',
  'GET /v1/api-keys/:api_key_id': 'getApiKey',
  'DELETE /v1/api-keys/:api_key_id': 'revokeApiKey',

  'POST /v1/policies': 'createPolicy',
  'GET /v1/policies': 'listPolicies',
  'GET /v1/policies/:policy_id': 'getPolicy',
  'PATCH /v1/policies/:policy_id': 'updatePolicy',
  'DELETE /v1/policies/:policy_id': 'deletePolicy',
  'POST /v1/policies/:policy_id/clone': 'clonePolicy',
  'GET /v1/policies/:policy_id/audit-log': 'listPolicyChanges',

  'POST /v1/wallets': 'createWallet',
  'GET /v1/wallets': 'listWallets',
  'GET /v1/wallets/:wallet_id': 'getWallet',
  'PATCH /v1/wallets/:wallet_id': 'updateWallet',
  'DELETE /v1/wallets/:wallet_id': 'archiveWallet',
  'POST /v1/wallets/:wallet_id/rotate-token': 'rotateSessionToken',
  'PUT /v1/wallets/:wallet_id/auto-topup': 'setAutoTopup',
  'POST /v1/wallets/:wallet_id/fund': 'fundWallet',
  'POST /v1/wallets/fund-batch': 'fundWallets',
  'POST /v1/wallets/:wallet_id/withdraw': 'withdrawFromWallet',
  'POST /v1/wallets/:wallet_id/pay': 'payFromWallet',
  'GET /v1/wallets/:wallet_id/transactions': 'listWalletTransactions',

  'POST /v1/payments': 'createPayment',
  'POST /v1/payments/check': 'checkPayment',
  'GET /v1/payments/:tx_id': 'getPayment',
  'POST /v1/payments/:tx_id/approve': 'approvePayment',
  'POST /v1/payments/:tx_id/reject': 'rejectPayment',

  'POST /v1/payments/a2a': 'createEscrow',
  'GET /v1/payments/a2a': 'listEscrows',
  'GET /v1/payments/a2a/:escrow_id': 'getEscrow',
  'POST /v1/payments/a2a/:escrow_id/complete': 'completeEscrow',
  'POST /v1/payments/a2a/:escrow_id/dispute': 'disputeEscrow',
  'POST /v1/payments/a2a/:escrow_id/decline': 'declineEscrow',
  'POST /v1/payments/a2a/:escrow_id/resolve': 'resolveEscrow',

  'POST /v1/verifiers': 'createVerifier',
  'GET /v1/verifiers': 'listVerifiers',
  'GET /v1/verifiers/:verifier_id': 'getVerifier',
  'POST /v1/verifiers/:verifier_id/rotate-secret': 'rotateVerifierSecret',
  'DELETE /v1/verifiers/:verifier_id': 'revokeVerifier',

  'POST /v1/recipients': 'createRecipient',
  'GET /v1/recipients': 'listRecipients',
  'GET /v1/recipients/:recipient_id': 'getRecipient',
  'PATCH /v1/recipients/:recipient_id': 'updateRecipient',
  'DELETE /v1/recipients/:recipient_id': 'deleteRecipient',

  'GET /v1/transactions': 'listTransactions',
  'GET /v1/transactions/:tx_id': 'getTransaction',
  'POST /v1/transactions/export': 'createExport',
  'GET /v1/transactions/exports/:export_id': 'getExport',
  'GET /v1/transactions/exports/:export_id/download': 'downloadExport',

  'GET /v1/events': 'listEvents',
  'GET /v1/alerts': 'getAlertSettings',
  'PUT /v1/alerts': 'setAlertSettings',

  'POST /v1/webhooks': 'createWebhook',
  'GET /v1/webhooks': 'listWebhooks',
  'GET /v1/webhooks/:webhook_id': 'getWebhook',
  'PATCH /v1/webhooks/:webhook_id': 'updateWebhook',
  'DELETE /v1/webhooks/:webhook_id': 'deleteWebhook',
  'POST /v1/webhooks/:webhook_id/rotate-secret': 'rotateWebhookSecret',
  'POST /v1/webhooks/:webhook_id/test': 'testWebhook',
  'GET /v1/webhooks/:webhook_id/deliveries': 'listWebhookDeliveries',

  'POST /v1/test_helpers/deposits': 'createTestDeposit',
  'GET /v1/test_helpers/clock': 'getTestClock',
  'POST /v1/test_helpers/clock/advance': 'advanceTestClock',
};
