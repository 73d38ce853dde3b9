import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { ManualClock } from '../clock/clock.ts';
import { createRpcHandler, type RpcHandler } from './rpc.ts';
import { LocalValidator } from './validator.ts';

describe('JSON-RPC handler errors', () => {
  let validator: LocalValidator;
  let handler: RpcHandler;
  const call = async (body: unknown): Promise<any> => JSON.parse(await handler.handle(typeof body === 'string' ? body : JSON.stringify(body)));

  before(async () => {
    validator = await LocalValidator.open({ slotMs: 0, clock: new ManualClock(1_750_000_000_000), programSoPath: null });
    handler = createRpcHandler(validator);
  });
  after(() => validator.close());

  it('answers parse errors, invalid requests, unknown methods and bad params with their codes', async () => {
    assert.equal((await call('{')).error.code, -32700);
    assert.equal((await call({ id: 1, method: 'getSlot' })).error.code, -32600);
    assert.equal((await call([])).error.code, -32600);
    assert.deepEqual(await call({ jsonrpc: '2.0', id: 7, method: 'getBlockProduction' }),
      { jsonrpc: '2.0', id: 7, error: { code: -32601, message: 'Method not found' } });
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'getBalance', params: ['zzz'] })).error.code, -32602);
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'getSlot', params: [{ commitment: 'soon' }] })).error.code, -32602);
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'sendTransaction', params: ['AAAA', { encoding: 'base64' }] })).error.code, -32602);
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'agentVault_mintUsdc', params: [validator.authority, '1.5'] })).error.code, -32602);
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'getSignatureStatuses', params: [Array(257).fill('x')] })).error.code, -32602);
    // Not a signature: refused as a node refuses it, not answered as an unknown transaction.
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'getSignatureStatuses', params: [['not-a-signature']] })).error.code, -32602);
    assert.equal((await call({ jsonrpc: '2.0', id: 1, method: 'getTransaction', params: [validator.authority] })).error.code, -32602);
    assert.equal(await handler.handle(JSON.stringify({ jsonrpc: '2.0', method: 'getSlot' })), '', 'notifications get no answer');
  });

  it('bounds what one answer weighs: a batch past the bound answers the rest with errors, unrun; accounts past theirs are refused', async () => {
    const bounded = createRpcHandler(validator, { limits: { responseBytes: 2_000, multipleAccountsDataBytes: 1_000 } });
    const balance = (id: number) => ({ jsonrpc: '2.0', id, method: 'getBalance', params: [validator.authority] });
    const batch = JSON.parse(await bounded.handle(JSON.stringify(Array.from({ length: 100 }, (_, i) => balance(i)))));
    assert.equal(batch.length, 100, 'every request answered');
    const answered = batch.filter((r: any) => r.result).length;
    assert.ok(answered > 5 && answered < 50, `${answered} answered before the bound`);
    assert.ok(batch.slice(answered).every((r: any) => r.error?.code === -32603 && /not run/.test(r.error.message)));
    assert.deepEqual(batch.map((r: any) => r.id), Array.from({ length: 100 }, (_, i) => i), 'in order, each with its id');
    const notification = { jsonrpc: '2.0', method: 'getSlot' };
    const tail = JSON.parse(await bounded.handle(JSON.stringify([...Array.from({ length: 60 }, (_, i) => balance(i)), notification, notification])));
    assert.equal(tail.length, 60, 'notifications past the bound get no answer either');
    const mint = validator.usdcMint; // 82 bytes of data: 13 of them pass 1,000
    const accounts = createRpcHandler(validator, { limits: { multipleAccountsDataBytes: 1_000 } });
    const many = JSON.parse(await accounts.handle(JSON.stringify({
      jsonrpc: '2.0', id: 1, method: 'getMultipleAccounts', params: [Array(13).fill(mint), { encoding: 'base64' }],
    })));
    assert.equal(many.error?.code, -32602, JSON.stringify(many).slice(0, 200));
    const fewer = JSON.parse(await accounts.handle(JSON.stringify({
      jsonrpc: '2.0', id: 1, method: 'getMultipleAccounts', params: [Array(12).fill(mint), { encoding: 'base64' }],
    })));
    assert.equal(fewer.result.value.length, 12);
    const sliced = JSON.parse(await accounts.handle(JSON.stringify({
      jsonrpc: '2.0', id: 1, method: 'getMultipleAccounts', params: [Array(13).fill(mint), { encoding: 'base64', dataSlice: { offset: 0, length: 0 } }],
    })));
    assert.equal(sliced.result?.value.length, 13, 'a zero-length slice weighs nothing');
  });

  it('accepts commitment parameters and answers with a context slot', async () => {
    const response = await call({ jsonrpc: '2.0', id: 'a', method: 'getBalance', params: [validator.authority, { commitment: 'confirmed' }] });
    assert.equal(response.id, 'a');
    assert.equal(typeof response.result.context.slot, 'number');
    const statuses = await call({ jsonrpc: '2.0', id: 1, method: 'getSignatureStatuses', params: [['1111111111111111111111111111111111111111111111111111111111111111'], { searchTransactionHistory: true }] });
    assert.deepEqual(statuses.result.value, [null]);
  });

  it('sets the time forward only, through agentVault_setTime', async () => {
    const clock = new ManualClock(1_750_000_000_000);
    const v = await LocalValidator.open({ slotMs: 0, clock, programSoPath: null });
    try {
      const h = createRpcHandler(v);
      const forward = JSON.parse(await h.handle(JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'agentVault_setTime', params: [1_760_000_000_000] })));
      assert.equal(forward.result.unixTimestamp, 1_760_000_000);
      const back = JSON.parse(await h.handle(JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'agentVault_setTime', params: [1_700_000_000_000] })));
      assert.equal(back.result.unixTimestamp, 1_760_000_000);
      assert.equal(clock.nowMs(), 1_760_000_000_000);
    } finally {
      await v.close();
    }
  });
});
