import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it } from 'node:test';
import { createSolanaRpc, generateKeyPairSigner, lamports } from '@solana/kit';
import { encodeBase58 } from '../chain/base58.ts';
import { ManualClock } from '../clock/clock.ts';
import { startRpcServer, MAX_REQUEST_BODY_BYTES, type RpcServer } from './http.ts';
import { describeRpcSuite } from './rpc-suite.ts';
import { confirmed, eventually, signedTransaction, transferSol, type TestRpc } from './testing.ts';
import { LocalValidator } from './validator.ts';

describeRpcSuite('local validator over HTTP (@solana/kit createSolanaRpc)', async () => {
  const clock = new ManualClock(1_750_000_000_000);
  const validator = await LocalValidator.open({ slotMs: 20, clock, programSoPath: null });
  const server = await startRpcServer(validator, { port: 0 });
  return {
    rpc: createSolanaRpc(server.url) as unknown as TestRpc,
    validator,
    clock,
    close: async () => {
      await server.close();
      await validator.close();
    },
  };
});

describe('local validator slots over HTTP', () => {
  let validator: LocalValidator;
  let server: RpcServer;
  let rpc: TestRpc;
  const clock = new ManualClock(1_750_000_000_000);

  before(async () => {
    validator = await LocalValidator.open({ slotMs: 200, clock, programSoPath: null });
    server = await startRpcServer(validator, { port: 0 });
    rpc = createSolanaRpc(server.url) as unknown as TestRpc;
  });
  after(async () => {
    await server.close();
    await validator.close();
  });

  // Guarantee: transactions execute in the slot they were sent in, and show only once it ended.
  it('lands two transactions sent within one slot in the same slot', async () => {
    const payer = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000_000n)).send());
    for (let attempt = 0; ; attempt++) {
      const a = await signedTransaction(rpc, payer, [transferSol(payer, (await generateKeyPairSigner()).address, 1_000_000n)]);
      const b = await signedTransaction(rpc, payer, [transferSol(payer, (await generateKeyPairSigner()).address, 1_000_000n)]);
      const slotBefore = validator.slot;
      await rpc.sendTransaction(a.wire, { encoding: 'base64', skipPreflight: true }).send();
      await rpc.sendTransaction(b.wire, { encoding: 'base64', skipPreflight: true }).send();
      // Neither shows before its slot ends.
      assert.deepEqual((await rpc.getSignatureStatuses([a.signature, b.signature]).send()).value, [null, null]);
      const sentWithinOneSlot = validator.slot === slotBefore;
      const [statusA, statusB] = [await confirmed(rpc, a.signature), await confirmed(rpc, b.signature)];
      if (!sentWithinOneSlot) {
        assert.ok(attempt < 5, 'a slot boundary fell between the two sends five times in a row');
        continue;
      }
      assert.equal(statusA.slot, statusB.slot);
      assert.equal(statusA.slot, BigInt(slotBefore));
      break;
    }
  });

  it('answers batches in order and refuses oversized bodies', async () => {
    const response = await fetch(server.url, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify([
        { jsonrpc: '2.0', id: 1, method: 'getHealth' },
        { jsonrpc: '2.0', id: 2, method: 'nope' },
        { jsonrpc: '2.0', id: 3, method: 'getBalance', params: ['not-an-address'] },
      ]),
    });
    const body = await response.json() as { id: number; result?: unknown; error?: { code: number } }[];
    assert.deepEqual(body.map((r) => [r.id, r.result ?? r.error?.code]), [[1, 'ok'], [2, -32601], [3, -32602]]);

    const json = { 'content-type': 'application/json' };
    const parse = await (await fetch(server.url, { method: 'POST', headers: json, body: '{"jsonrpc":' })).json() as { error: { code: number } };
    assert.equal(parse.error.code, -32700);

    const big = await fetch(server.url, { method: 'POST', headers: json, body: 'x'.repeat(MAX_REQUEST_BODY_BYTES + 1) });
    assert.equal(big.status, 413);
  });

  // Guarantee: a web page the developer has open cannot call the cheatcodes (mint, set the clock).
  it('answers JSON only, and on loopback only requests that name loopback', async () => {
    const setTime = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'agentVault_setTime', params: [4_000_000_000_000] });
    const before = clock.nowMs();
    // What a page may send without a CORS preflight: text/plain, or a form.
    for (const contentType of ['text/plain;charset=UTF-8', 'application/x-www-form-urlencoded', 'multipart/form-data; boundary=x']) {
      const refused = await fetch(server.url, { method: 'POST', headers: { 'content-type': contentType }, body: setTime });
      assert.equal(refused.status, 415, contentType);
    }
    // A page's own name rebound to 127.0.0.1 (DNS rebinding): its Host is still its name.
    const rebound = await new Promise<number>((resolve, reject) => {
      const request = httpRequest(server.url, { method: 'POST', headers: { host: 'attacker.example:8899', 'content-type': 'application/json' } },
        (response) => { response.resume(); resolve(response.statusCode!); });
      request.on('error', reject);
      request.end(setTime);
    });
    assert.equal(rebound, 403);
    assert.equal(clock.nowMs(), before, 'the clock did not move');
    const health = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'getHealth' });
    for (const contentType of ['application/json', 'application/json; charset=utf-8', 'Application/JSON']) {
      const answered = await fetch(server.url, { method: 'POST', headers: { 'content-type': contentType }, body: health });
      assert.equal(answered.status, 200, contentType);
    }
  });

  it('writes u64 values above 2^53 exactly', async () => {
    const response = await fetch(server.url, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'getBalance', params: [validator.authority] }),
    });
    const text = await response.text();
    const lamportsText = /"value":(\d+)/.exec(text)?.[1];
    assert.equal(lamportsText, validator.getBalance(validator.authority).toString());
    assert.ok(BigInt(lamportsText!) > BigInt(Number.MAX_SAFE_INTEGER));
  });

  it('takes a transaction in base58, sendTransaction\'s default encoding', async () => {
    const payer = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000_000n)).send());
    const { wire, signature } = await signedTransaction(rpc, payer, [transferSol(payer, (await generateKeyPairSigner()).address, 1_000_000n)]);
    const text = encodeBase58(Buffer.from(wire, 'base64'));
    assert.ok(text.length > 128, 'longer than an address');
    const response = await fetch(server.url, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'sendTransaction', params: [text, { skipPreflight: true }] }),
    });
    assert.deepEqual(await response.json(), { jsonrpc: '2.0', id: 1, result: signature });
    assert.equal((await confirmed(rpc, signature)).err, null);
  });

  // Guarantee: a transaction whose blockhash the chain never issued never lands (as on a cluster).
  it('drops a transaction on an unknown blockhash and refuses it in preflight', async () => {
    const payer = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(1_000_000_000n)).send());
    const bogus = { blockhash: '4uQeVj5tqViQh7yWWGStvkEG1Zmhx6uasJtWCJziofM', lastValidBlockHeight: 1n };
    const { wire, signature } = await signedTransaction(rpc, payer, [transferSol(payer, payer.address, 1n)], bogus);
    await assert.rejects(rpc.sendTransaction(wire, { encoding: 'base64' }).send(), /simulation failed|Blockhash/i);
    await rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send();
    const slot = validator.slot;
    await eventually(async () => (validator.slot > slot + 1 ? true : null), 'two slots');
    assert.equal((await rpc.getSignatureStatuses([signature]).send()).value[0], null);
  });
});
