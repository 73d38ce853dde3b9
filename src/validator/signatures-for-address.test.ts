import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { generateKeyPairSigner, lamports, type Address, type KeyPairSigner, type Signature, type TokenBalance } from '@solana/kit';
import { ManualClock } from '../clock/clock.ts';
import { createInProcessRpc } from './in-process.ts';
import { createRpcHandler } from './rpc.ts';
import { confirmed, createAtaIdempotent, signedTransaction, transferSol, transferToken, type TestRpc } from './testing.ts';
import { LocalValidator, TOKEN_PROGRAM } from './validator.ts';

const START_MS = 1_750_000_000_000;

/** Sends one SOL transfer and waits for its status. */
async function sendTransfer(rpc: TestRpc, payer: KeyPairSigner, to: Address, amount: bigint): Promise<Signature> {
  const { wire, signature } = await signedTransaction(rpc, payer, [transferSol(payer, to, amount)]);
  await rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send();
  await confirmed(rpc, signature);
  return signature;
}

describe('getSignaturesForAddress', () => {
  let validator: LocalValidator;
  let rpc: TestRpc;
  let payer: KeyPairSigner;
  let recipient: Address;
  /** The recipient's transfers, oldest first. */
  const sent: Signature[] = [];

  before(async () => {
    validator = await LocalValidator.open({ slotMs: 0, clock: new ManualClock(START_MS), programSoPath: null });
    rpc = createInProcessRpc(validator) as TestRpc;
    payer = await generateKeyPairSigner();
    recipient = (await generateKeyPairSigner()).address;
    await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(10_000_000_000n)).send());
    for (let i = 1; i <= 5; i++) sent.push(await sendTransfer(rpc, payer, recipient, BigInt(i) * 1_000_000n));
  });
  after(() => validator.close());

  // Guarantee: the answer has Solana's shape and order, so @solana/kit's typed call reads it.
  it('lists the transactions that loaded an address, newest first, shaped like Solana', async () => {
    const found = await rpc.getSignaturesForAddress(recipient).send();
    assert.deepEqual(found.map((item) => item.signature), [...sent].reverse());
    const statuses = (await rpc.getSignatureStatuses([sent[4]!]).send()).value;
    const tx = await rpc.getTransaction(sent[4]!, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
    assert.deepEqual(found[0], {
      signature: sent[4], slot: statuses[0]!.slot, err: null, memo: null, blockTime: tx!.blockTime, confirmationStatus: 'finalized',
    });
    // Every account key counts, the fee payer and the programs too.
    const byPayer = await rpc.getSignaturesForAddress(payer.address, { limit: 5 }).send();
    assert.deepEqual(byPayer.map((item) => item.signature), [...sent].reverse());
    assert.ok((await rpc.getSignaturesForAddress('11111111111111111111111111111111' as Address, { limit: 1 }).send()).length === 1);
    assert.deepEqual(await rpc.getSignaturesForAddress((await generateKeyPairSigner()).address).send(), []);
  });

  it('pages with before, stops at until (both excluded) and honours limit', async () => {
    const page = async (config: Parameters<TestRpc['getSignaturesForAddress']>[1]): Promise<Signature[]> =>
      (await rpc.getSignaturesForAddress(recipient, config).send()).map((item) => item.signature);
    assert.deepEqual(await page({ limit: 2 }), [sent[4], sent[3]]);
    assert.deepEqual(await page({ limit: 2, before: sent[3] }), [sent[2], sent[1]]);
    assert.deepEqual(await page({ until: sent[2] }), [sent[4], sent[3]]);
    assert.deepEqual(await page({ before: sent[4], until: sent[1], commitment: 'confirmed' }), [sent[3], sent[2]]);
    assert.deepEqual(await page({ before: sent[0] }), []);
    // As on Solana: an unknown `before` gives nothing, an unknown `until` bounds nothing.
    const unknown = '1'.repeat(64) as Signature;
    assert.deepEqual(await page({ before: unknown }), []);
    assert.deepEqual(await page({ until: unknown }), [...sent].reverse());
  });

  // Guarantee: a failed transaction that charged a fee is listed, with its error, as on a cluster.
  it('lists failed transactions with their error', async () => {
    const poor = await generateKeyPairSigner();
    await confirmed(rpc, await rpc.requestAirdrop(poor.address, lamports(1_000_000n)).send());
    const { wire, signature } = await signedTransaction(rpc, poor, [transferSol(poor, recipient, 50_000_000n)]);
    await rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send();
    assert.ok((await confirmed(rpc, signature)).err);
    const [newest] = await rpc.getSignaturesForAddress(recipient, { limit: 1 }).send();
    assert.equal(newest?.signature, signature);
    assert.deepEqual(newest?.err, { InstructionError: [0n, { Custom: 1n }] });
  });

  it('refuses bad parameters like a node (-32602)', async () => {
    const handler = createRpcHandler(validator);
    const call = async (params: unknown[]): Promise<any> =>
      JSON.parse(await handler.handle(JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'getSignaturesForAddress', params })));
    for (const params of [
      [], ['not an address'], [recipient, { limit: 0 }], [recipient, { limit: 1001 }], [recipient, { limit: 1.5 }],
      [recipient, { before: 'zz' }], [recipient, { until: recipient }], [recipient, { commitment: 'processed' }],
    ]) {
      assert.equal((await call(params)).error?.code, -32602, JSON.stringify(params));
    }
    assert.equal((await call([recipient, { limit: 1000 }])).result.length, 6);
  });

  // Guarantee: getTransaction reports token balances as Solana does, so a USDC delta can be read from it.
  it('reports pre and post token balances in getTransaction', async () => {
    await confirmed(rpc, await rpc.agentVault_mintUsdc(payer.address, '3000000').send());
    const source = await validator.associatedTokenAddress(payer.address);
    const destination = await validator.associatedTokenAddress(recipient);
    const { wire, signature } = await signedTransaction(rpc, payer, [
      createAtaIdempotent(payer, destination, recipient, validator.usdcMint),
      transferToken(source, destination, payer, 1_250_000n),
    ]);
    await rpc.sendTransaction(wire, { encoding: 'base64' }).send();
    await confirmed(rpc, signature);
    const tx = await rpc.getTransaction(signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
    const keys = tx!.transaction.message.accountKeys;
    const balance = (list: readonly TokenBalance[] | undefined, account: Address) =>
      list?.find((b) => keys[b.accountIndex] === account);
    assert.deepEqual(balance(tx!.meta!.preTokenBalances, source), {
      accountIndex: keys.indexOf(source), mint: validator.usdcMint, owner: payer.address, programId: TOKEN_PROGRAM,
      uiTokenAmount: { amount: '3000000', decimals: 6, uiAmount: 3, uiAmountString: '3' },
    });
    assert.equal(balance(tx!.meta!.postTokenBalances, source)?.uiTokenAmount.amount, '1750000');
    assert.equal(balance(tx!.meta!.preTokenBalances, destination), undefined, 'created by this transaction');
    assert.deepEqual(balance(tx!.meta!.postTokenBalances, destination)?.uiTokenAmount,
      { amount: '1250000', decimals: 6, uiAmount: 1.25, uiAmountString: '1.25' });
    assert.equal(balance(tx!.meta!.postTokenBalances, destination)?.owner, recipient);
    assert.equal(tx!.meta!.postTokenBalances?.length, 2, 'only token accounts, never the programs');
    // The token account's own history: created and credited by the transfer.
    const history = await rpc.getSignaturesForAddress(destination).send();
    assert.deepEqual(history.map((item) => item.signature), [signature]);
  });
});

describe('getSignaturesForAddress after a restart', () => {
  let root: string;
  before(() => { root = mkdtempSync(join(tmpdir(), 'agent-vault-address-index-')); });
  after(() => rmSync(root, { recursive: true, force: true }));

  // Guarantee: the address index and token balances survive a restart (rebuilt from the segments).
  it('answers the same after the validator reopens its data dir', async () => {
    const dataDir = join(root, 'restart');
    const clock = new ManualClock(START_MS);
    let validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    let rpc = createInProcessRpc(validator) as TestRpc;
    const payer = await generateKeyPairSigner();
    const recipient = (await generateKeyPairSigner()).address;
    await confirmed(rpc, await rpc.requestAirdrop(payer.address, lamports(2_000_000_000n)).send());
    const sent = [await sendTransfer(rpc, payer, recipient, 1_000_000n), await sendTransfer(rpc, payer, recipient, 2_000_000n)];
    const mint = await rpc.agentVault_mintUsdc(recipient, '4000000').send();
    await confirmed(rpc, mint);
    const before = await rpc.getSignaturesForAddress(recipient).send();
    assert.deepEqual(before.map((item) => item.signature), [mint, ...[...sent].reverse()]);
    const tokenBefore = (await rpc.getTransaction(mint, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send())!.meta!;
    await validator.close();

    validator = await LocalValidator.open({ dataDir, slotMs: 20, clock, programSoPath: null });
    rpc = createInProcessRpc(validator) as TestRpc;
    try {
      assert.deepEqual(await rpc.getSignaturesForAddress(recipient).send(), before);
      assert.deepEqual(await rpc.getSignaturesForAddress(recipient, { until: sent[0] }).send(), before.slice(0, 2));
      const tokenAfter = (await rpc.getTransaction(mint, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send())!.meta!;
      assert.deepEqual(tokenAfter.postTokenBalances, tokenBefore.postTokenBalances);
      assert.equal(tokenAfter.postTokenBalances?.[0]?.uiTokenAmount.amount, '4000000');
      // New transactions join the rebuilt index on top.
      const later = await sendTransfer(rpc, payer, recipient, 3_000_000n);
      assert.deepEqual((await rpc.getSignaturesForAddress(recipient, { limit: 2 }).send()).map((item) => item.signature), [later, mint]);
    } finally {
      await validator.close();
    }
  });
});
