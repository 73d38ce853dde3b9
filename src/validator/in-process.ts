/**
 * The local validator as a @solana/kit RPC without a network hop, for the embedded mode: the
 * transport hands kit's request object to the handler and returns its response object.
 */
import { createSolanaRpcFromTransport, type Rpc, type RpcTransport, type SolanaRpcApi } from '@solana/kit';
import { createRpcHandler } from './rpc.ts';
import type { LocalValidator } from './validator.ts';

export function createInProcessTransport(validator: LocalValidator): RpcTransport {
  const handler = createRpcHandler(validator);
  return (async ({ payload, signal }: { payload: unknown; signal?: AbortSignal }) => {
    signal?.throwIfAborted();
    return handler.handlePayload(payload);
  }) as RpcTransport;
}

export function createInProcessRpc(validator: LocalValidator): Rpc<SolanaRpcApi> {
  return createSolanaRpcFromTransport(createInProcessTransport(validator));
}
