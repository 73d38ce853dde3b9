/**
 * The checks every transport must pass (HTTP and in-process): the validator seen through a real
 * @solana/kit client. Each transport's test file runs this suite against its own setup.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import {
  generateKeyPairSigner,
  isSolanaError,
  lamports,
  SOLANA_ERROR__JSON_RPC__METHOD_NOT_FOUND,
  SOLANA_ERROR__JSON_RPC__SERVER_ERROR_SEND_TRANSACTION_PREFLIGHT_FAILURE,
  type Address,
  type KeyPairSigner,
} from '@solana/kit';
import type { ManualClock } from '../clock/clock.ts';
import {
  confirmed,
  createAtaIdempotent,
  decodeClockSysvar,
  eventually,
  signedTransaction,
  transferSol,
  transferToken,
  type TestRpc,
} from './testing.ts';
import { CLOCK_SYSVAR, type LocalValidator } from './validator.ts';

export interface SuiteContext {
  rpc: TestRpc;
  validator: LocalValidator;
  clock: ManualClock;
  close(): Promise<void>;
}

export function describeRpcSuite(name: string, setup: () => Promise<SuiteContext>): void {
  describe(name, () => {
    let ctx: SuiteContext;
    let payer: KeyPairSigner;

    before(async () => {
      ctx = await setup();
      payer = await generateKeyPairSigner();
      const signature = await ctx.rpc.requestAirdrop(payer.address, lamports(10_000_000_000n)).send();
      await confirmed(ctx.rpc, signature);
    });
    after(() => ctx.close());

    it('answers getHealth, getVersion and getGenesisHash like a node', async () => {
      assert.equal(await ctx.rpc.getHealth().send(), 'ok');
      assert.equal(typeof (await ctx.rpc.getVersion().send())['solana-core'], 'string');
      assert.equal(await ctx.rpc.getGenesisHash().send(), ctx.validator.genesisHash);
    });

    it('advances slots on its own and reports block height within the blockhash window', async () => {
      const first = await ctx.rpc.getSlot().send();
      const later = await eventually(async () => {
        const slot = await ctx.rpc.getSlot().send();
        return slot >= first + 2n ? slot : null;
      }, 'two more slots');
      assert.ok(later > first);
      const heightBefore = await ctx.rpc.getBlockHeight().send();
      const { value, context } = await ctx.rpc.getLatestBlockhash().send();
      const heightAfter = await ctx.rpc.getBlockHeight().send();
      assert.match(value.blockhash, /^[1-9A-HJ-NP-Za-km-z]{32,44}$/);
      assert.ok(value.lastValidBlockHeight >= heightBefore + 150n && value.lastValidBlockHeight <= heightAfter + 150n);
      assert.ok(context.slot >= later);
    });

    // Guarantee: a SOL transfer is confirmed through getSignatureStatuses and its effect is readable.
    it('confirms a SOL transfer and shows the balances, fee and logs', async () => {
      const recipient = (await generateKeyPairSigner()).address;
      const before = (await ctx.rpc.getBalance(payer.address).send()).value;
      const { wire, signature } = await signedTransaction(ctx.rpc, payer, [transferSol(payer, recipient, 1_000_000_000n)]);
      assert.equal(await ctx.rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send(), signature);
      const status = await confirmed(ctx.rpc, signature);
      assert.equal(status.err, null);
      assert.deepEqual(status.status, { Ok: null });
      assert.equal(status.confirmationStatus, 'finalized');
      assert.equal((await ctx.rpc.getBalance(recipient).send()).value, 1_000_000_000n);
      assert.equal((await ctx.rpc.getBalance(payer.address).send()).value, before - 1_000_000_000n - 5_000n);
      const tx = await ctx.rpc.getTransaction(signature, { encoding: 'json', maxSupportedTransactionVersion: 0 }).send();
      assert.ok(tx && tx.meta);
      assert.equal(tx.slot, status.slot);
      assert.equal(tx.meta.fee, 5_000n);
      assert.equal(tx.meta.err, null);
      assert.equal(tx.meta.preBalances[0], before);
      assert.ok(tx.meta.logMessages?.some((line) => line.includes('11111111111111111111111111111111 success')));
      assert.equal(tx.transaction.signatures[0], signature);
      assert.equal(typeof tx.blockTime, 'bigint');
      const base64 = await ctx.rpc.getTransaction(signature, { encoding: 'base64', maxSupportedTransactionVersion: 0 }).send();
      assert.equal(base64?.transaction[0], wire);
    });

    // Guarantee: local USDC minted by the cheatcode moves with a real SPL Token transfer.
    it('mints local USDC by cheatcode and confirms an SPL token transfer', async () => {
      const info = await ctx.rpc.agentVault_getInfo().send();
      assert.equal(info.usdcMint, ctx.validator.usdcMint);
      const mintSignature = await ctx.rpc.agentVault_mintUsdc(payer.address, '5000000').send();
      assert.equal((await confirmed(ctx.rpc, mintSignature)).err, null);
      const source = await ctx.validator.associatedTokenAddress(payer.address);
      const recipient = (await generateKeyPairSigner()).address;
      const destination = await ctx.validator.associatedTokenAddress(recipient);
      const { wire, signature } = await signedTransaction(ctx.rpc, payer, [
        createAtaIdempotent(payer, destination, recipient, info.usdcMint),
        transferToken(source, destination, payer, 1_250_000n),
      ]);
      await ctx.rpc.sendTransaction(wire, { encoding: 'base64' }).send();
      assert.equal((await confirmed(ctx.rpc, signature)).err, null);
      const from = (await ctx.rpc.getTokenAccountBalance(source).send()).value;
      const to = (await ctx.rpc.getTokenAccountBalance(destination).send()).value;
      assert.deepEqual([from.amount, from.decimals, from.uiAmountString], ['3750000', 6, '3.75']);
      assert.deepEqual([to.amount, to.uiAmountString], ['1250000', '1.25']);
      const account = (await ctx.rpc.getAccountInfo(destination, { encoding: 'base64' }).send()).value;
      assert.equal(account?.owner, 'TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA');
      assert.equal(account?.space, 165n);
      const many = (await ctx.rpc.getMultipleAccounts([source, recipient as Address], { encoding: 'base64' }).send()).value;
      assert.equal(many.length, 2);
      assert.ok(many[0]);
      assert.equal(many[1], null);
      // jsonParsed, as a cluster answers it: the token account and the mint parsed; an account of
      // another program falls back to base64.
      const parsed = (await ctx.rpc.getAccountInfo(destination, { encoding: 'jsonParsed' }).send()).value;
      assert.deepEqual(parsed?.data, {
        program: 'spl-token', space: 165n,
        parsed: {
          type: 'account',
          info: {
            isNative: false, mint: info.usdcMint, owner: recipient, state: 'initialized',
            tokenAmount: { amount: '1250000', decimals: 6, uiAmount: 1.25, uiAmountString: '1.25' },
          },
        },
      });
      const mint = (await ctx.rpc.getAccountInfo(info.usdcMint, { encoding: 'jsonParsed' }).send()).value;
      const mintInfo = (mint?.data as { parsed: { type: string; info: Record<string, unknown> } }).parsed;
      assert.equal(mintInfo.type, 'mint');
      assert.deepEqual([mintInfo.info.decimals, mintInfo.info.isInitialized, mintInfo.info.freezeAuthority], [6, true, null]);
      assert.match(String(mintInfo.info.supply), /^\d+$/);
      assert.ok(BigInt(String(mintInfo.info.supply)) >= 5_000_000n, 'the supply counts what was minted');
      const system = (await ctx.rpc.getAccountInfo(payer.address, { encoding: 'jsonParsed' }).send()).value;
      assert.deepEqual(system?.data, ['', 'base64']);
    });

    it('refuses an unknown method with -32601', async () => {
      const unknown = ctx.rpc as unknown as { getBlockProduction(): { send(): Promise<unknown> } };
      await assert.rejects(unknown.getBlockProduction().send(), (error: unknown) =>
        isSolanaError(error, SOLANA_ERROR__JSON_RPC__METHOD_NOT_FOUND));
    });

    // Guarantee: without skipPreflight a failing transaction is refused at once, like a real node.
    it('returns the preflight failure (-32002) with the simulation', async () => {
      const poor = await generateKeyPairSigner();
      await confirmed(ctx.rpc, await ctx.rpc.requestAirdrop(poor.address, lamports(1_000_000n)).send());
      const { wire } = await signedTransaction(ctx.rpc, poor, [transferSol(poor, payer.address, 5_000_000n)]);
      await assert.rejects(ctx.rpc.sendTransaction(wire, { encoding: 'base64' }).send(), (error: unknown) => {
        assert.ok(isSolanaError(error, SOLANA_ERROR__JSON_RPC__SERVER_ERROR_SEND_TRANSACTION_PREFLIGHT_FAILURE));
        assert.ok(Array.isArray((error.context as { logs?: unknown }).logs));
        return true;
      });
      const simulated = (await ctx.rpc.simulateTransaction(wire, { encoding: 'base64' }).send()).value;
      assert.deepEqual(simulated.err, { InstructionError: [0n, { Custom: 1n }] });
    });

    // Guarantee: a resent signature executes once.
    it('executes a re-sent transaction only once', async () => {
      const recipient = (await generateKeyPairSigner()).address;
      const { wire, signature } = await signedTransaction(ctx.rpc, payer, [transferSol(payer, recipient, 2_000_000n)]);
      const sends = await Promise.all([1, 2, 3].map(() =>
        ctx.rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send()));
      assert.deepEqual(sends, [signature, signature, signature]);
      await confirmed(ctx.rpc, signature);
      assert.equal(await ctx.rpc.sendTransaction(wire, { encoding: 'base64', skipPreflight: true }).send(), signature);
      const slot = await ctx.rpc.getSlot().send();
      await eventually(async () => ((await ctx.rpc.getSlot().send()) > slot + 1n ? true : null), 'two slots');
      assert.equal((await ctx.rpc.getBalance(recipient).send()).value, 2_000_000n);
    });

    // Guarantee: the program sees the service clock through the Clock sysvar.
    it('moves the Clock sysvar with the service clock', async () => {
      const target = ctx.clock.nowMs() + 3_600_000;
      ctx.clock.set(target);
      const clock = await eventually(async () => {
        const account = (await ctx.rpc.getAccountInfo(CLOCK_SYSVAR, { encoding: 'base64' }).send()).value;
        if (!account) return null;
        const decoded = decodeClockSysvar(Buffer.from(account.data[0], 'base64'));
        return decoded.unixTimestamp === BigInt(Math.floor(target / 1000)) ? decoded : null;
      }, 'the Clock sysvar to follow the clock');
      assert.ok(clock.slot > 0n);
    });
  });
}
