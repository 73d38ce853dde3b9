/**
 * Pay: the hot path. Every spending rule the program enforces on chain, each with the exact
 * error it returns, and the balances proving nothing moved when it refused.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  concat,
  createBench,
  DAY_S,
  expectError,
  expectOk,
  expectProgramError,
  NO_LIMIT,
  program,
  SYSTEM_PROGRAM,
  u64,
  USDC,
  withAddress,
  withData,
  withoutSigner,
  withoutWritable,
} from './setup.ts';

const Account = { operator: 0, vault: 1, vaultToken: 2, policy: 3, mint: 4, recipient: 5, recipientToken: 6, system: 7, token: 8, ata: 9 };

async function bench(limits: { maxPerTx?: bigint; maxPerDay?: bigint; expiry?: bigint } = {}) {
  const b = await createBench();
  const org = await b.createOrg('org-pay', limits);
  const v = await b.createVault(org, 'agent-1', 100n * USDC);
  const recipient = await b.keypair();
  return { b, org, v, recipient };
}

async function payData(amount: bigint, memo: Uint8Array): Promise<Uint8Array> {
  return concat([program.Tag.Pay], u64(amount), new Uint8Array(32), [memo.length], memo);
}

describe('Pay succeeds', () => {
  // The guarantee: a pay moves exactly the amount, creates a missing recipient ATA at the
  // operator's expense, and counts the payment in the vault's day bucket.
  test('to a new recipient (its ATA is created) and then to the existing ATA', async (t) => {
    const { b, v, recipient } = await bench();
    const recipientToken = await program.findAssociatedTokenAddress(recipient.address, b.mint);
    const operatorLamports = b.lamports(b.operator.address);

    const createCu = expectOk(await b.send([await b.payInstruction(v, recipient.address, 5n * USDC)]));
    assert.equal(b.tokens(recipientToken), 5n * USDC);
    assert.equal(b.tokens(v.vaultToken), 95n * USDC);
    assert.ok(b.lamports(b.operator.address) < operatorLamports - b.svm.minimumBalanceForRentExemption(165n) + 1n);

    const payCu = expectOk(await b.send([await b.payInstruction(v, recipient.address, 7n * USDC, { memo: new TextEncoder().encode('invoice 42') })]));
    assert.equal(b.tokens(recipientToken), 12n * USDC);
    assert.equal(b.tokens(v.vaultToken), 88n * USDC);
    const vault = b.vault(v.vault);
    assert.equal(vault.daySpent, 12n * USDC);
    assert.equal(vault.paymentCount, 2n);
    assert.equal(vault.dayStart, b.now() - (b.now() % DAY_S));
    t.diagnostic(`Pay CU: ${payCu} (recipient ATA exists), ${createCu} (creates the recipient ATA)`);
  });

  test('to another vault of the organisation', async () => {
    const { b, org, v } = await bench();
    const other = await b.createVault(org, 'agent-2', 0n);
    expectOk(await b.send([await b.payInstruction(v, other.vault, 3n * USDC, { recipientToken: other.vaultToken })]));
    assert.equal(b.tokens(other.vaultToken), 3n * USDC);
    assert.equal(b.tokens(v.vaultToken), 97n * USDC);
  });

  test('with a memo of exactly 128 bytes, and the whole balance', async () => {
    const { b, v, recipient } = await bench();
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 100n * USDC, { memo: new Uint8Array(128).fill(65) })]));
    assert.equal(b.tokens(v.vaultToken), 0n);
  });

  // The guarantee: lamports sent to a recipient's future ATA address cannot block payments to it.
  test('when someone pre-funded the recipient ATA address with lamports', async () => {
    const { b, v, recipient } = await bench();
    const recipientToken = await program.findAssociatedTokenAddress(recipient.address, b.mint);
    b.setAccount(recipientToken, new Uint8Array(0), SYSTEM_PROGRAM, 1_000n);
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 2n * USDC)]));
    assert.equal(b.tokens(recipientToken), 2n * USDC);
  });

  // The guarantee: one SetPolicy governs every attached vault from the next transaction.
  test('a policy update changes the limits of every attached vault', async () => {
    const { b, org, v, recipient } = await bench({ maxPerTx: 10n * USDC });
    const v2 = await b.createVault(org, 'agent-2', 100n * USDC);
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 10n * USDC)]));
    expectOk(await b.send([await b.payInstruction(v2, recipient.address, 10n * USDC)]));

    expectOk(await b.send([b.setPolicyInstruction(org, { maxPerTx: 4n * USDC })]));
    assert.equal(b.policyAccount(org.policy).revision, 2n);
    for (const vault of [v, v2]) {
      expectProgramError(await b.send([await b.payInstruction(vault, recipient.address, 5n * USDC)]), 'OverMaxPerTx');
      expectOk(await b.send([await b.payInstruction(vault, recipient.address, 4n * USDC)]));
    }
    assert.equal(b.tokens(v.vaultToken), 86n * USDC);
    assert.equal(b.tokens(v2.vaultToken), 86n * USDC);
  });
});

describe('Pay refuses a spend outside the rules', () => {
  test('over the balance: InsufficientFunds, checked before any transfer', async () => {
    const { b, v, recipient } = await bench();
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 100n * USDC + 1n)]), 'InsufficientFunds');
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
    assert.equal(b.vault(v.vault).paymentCount, 0n);
  });

  test('a frozen vault: VaultFrozen, and paying again once unfrozen', async () => {
    const { b, v, recipient } = await bench();
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'freeze' })]));
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC)]), 'VaultFrozen');
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'unfreeze' })]));
    expectOk(await b.send([await b.payInstruction(v, recipient.address, USDC)]));
  });

  test('over max per transaction: OverMaxPerTx (the limit itself is allowed)', async () => {
    const { b, v, recipient } = await bench({ maxPerTx: 5n * USDC });
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 5n * USDC + 1n)]), 'OverMaxPerTx');
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 5n * USDC)]));
  });

  test('a zero max per transaction refuses every pay', async () => {
    const { b, v, recipient } = await bench({ maxPerTx: 0n });
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 1n)]), 'OverMaxPerTx');
  });

  // The guarantee: the daily cap counts UTC days and resets at midnight UTC.
  test('over the daily cap: OverDailyCap, then allowed again on the next UTC day', async () => {
    const { b, v, recipient } = await bench({ maxPerDay: 10n * USDC });
    const midnight = b.now() - (b.now() % DAY_S);
    b.setTime(midnight + DAY_S - 10n); // 23:59:50
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 6n * USDC)]));
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 4n * USDC)]));
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 1n)]), 'OverDailyCap');
    assert.equal(b.tokens(v.vaultToken), 90n * USDC);

    b.setTime(midnight + DAY_S); // 00:00:00 the next day
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 10n * USDC)]));
    const vault = b.vault(v.vault);
    assert.equal(vault.dayStart, midnight + DAY_S);
    assert.equal(vault.daySpent, 10n * USDC);
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 1n)]), 'OverDailyCap');
  });

  // Validators' timestamps can go back; a day already spent must not be spent again.
  test('a clock gone back to the day before keeps counting the later day', async () => {
    const { b, v, recipient } = await bench({ maxPerDay: 10n * USDC });
    const midnight = b.now() - (b.now() % DAY_S);
    b.setTime(midnight + DAY_S + 5n); // 00:00:05 the next day
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 10n * USDC)]));
    b.setTime(midnight + DAY_S - 5n); // back to 23:59:55 the day before
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 1n)]), 'OverDailyCap');
    const vault = b.vault(v.vault);
    assert.equal(vault.dayStart, midnight + DAY_S);
    assert.equal(vault.daySpent, 10n * USDC);
    assert.equal(b.tokens(v.vaultToken), 90n * USDC);
  });

  test('an expired policy: PolicyExpired from the expiry second on', async () => {
    const { b, v, recipient } = await bench();
    const expiry = b.now() + 100n;
    expectOk(await b.send([b.setPolicyInstruction(v.org, { expiry })]));
    b.setTime(expiry - 1n);
    expectOk(await b.send([await b.payInstruction(v, recipient.address, USDC)]));
    b.setTime(expiry);
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC)]), 'PolicyExpired');
  });

  test('a zero amount: InvalidAmount', async () => {
    const { b, v, recipient } = await bench();
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 0n)]), 'InvalidAmount');
  });

  test('a memo over 128 bytes: MemoTooLong; a memo length that disagrees with the data: InvalidInstruction', async () => {
    const { b, v, recipient } = await bench();
    const pay = await b.payInstruction(v, recipient.address, USDC);
    expectProgramError(await b.send([withData(pay, await payData(USDC, new Uint8Array(129)))]), 'MemoTooLong');
    const truncated = (await payData(USDC, new Uint8Array(10))).subarray(0, 50);
    expectProgramError(await b.send([withData(pay, truncated)]), 'InvalidInstruction');
  });
});

describe('Pay refuses accounts that are not the vault\'s own', () => {
  test('wrong signer: Unauthorized', async () => {
    const { b, v, recipient } = await bench();
    const intruder = await b.keypair();
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC, { operator: intruder })]), 'Unauthorized');
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
  });

  test('missing signature: MissingSigner', async () => {
    const { b, v, recipient } = await bench();
    const payer = await b.keypair();
    const pay = withoutSigner(await b.payInstruction(v, recipient.address, USDC), Account.operator);
    expectProgramError(await b.send([pay], payer), 'MissingSigner');
  });

  test('a read-only vault: NotWritable', async () => {
    const { b, v, recipient } = await bench();
    expectProgramError(await b.send([withoutWritable(await b.payInstruction(v, recipient.address, USDC), Account.vault)]), 'NotWritable');
  });

  test('paying the vault itself: DuplicateAccount', async () => {
    const { b, v } = await bench();
    expectProgramError(await b.send([await b.payInstruction(v, v.vault, USDC, { recipientToken: v.vaultToken })]), 'DuplicateAccount');
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
  });

  test('a policy other than the vault\'s: PolicyMismatch', async () => {
    const { b, org, v, recipient } = await bench();
    const other = await b.orgAddresses(org.orgId, 'other');
    expectOk(await b.send([b.setPolicyInstruction(other)]));
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.policy, other.policy);
    expectProgramError(await b.send([pay]), 'PolicyMismatch');
  });

  test('another mint: InvalidMint', async () => {
    const { b, v, recipient } = await bench();
    const otherMint = await b.createMint();
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.mint, otherMint);
    expectProgramError(await b.send([pay]), 'InvalidMint');
  });

  test('a foreign source token account: InvalidTokenAccount', async () => {
    const { b, v, recipient } = await bench();
    const foreign = await b.tokenAccount(b.operator.address);
    await b.mintTo(foreign, 50n * USDC);
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.vaultToken, foreign);
    expectProgramError(await b.send([pay]), 'InvalidTokenAccount');
    assert.equal(b.tokens(foreign), 50n * USDC);
  });

  test('a recipient token account owned by someone else: InvalidTokenAccount', async () => {
    const { b, v, recipient } = await bench();
    const someoneElses = await b.tokenAccount(b.operator.address);
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC, { recipientToken: someoneElses })]), 'InvalidTokenAccount');
  });

  // The guarantee: money paid to one of the program's accounts (a vault, a reserve) lands where
  // the program can move it again, its ATA. Anyone can make another token account naming a vault
  // as its owner; paid there, the money would stay for good.
  test('to a vault or a reserve, a token account of theirs other than the ATA: InvalidTokenAccount, nothing moved', async () => {
    const { b, org, v } = await bench();
    const other = await b.createVault(org, 'agent-2', 0n);
    const anyone = await b.keypair();
    for (const owner of [other.vault, org.reserve]) {
      const stray = await b.strayTokenAccount(owner, anyone);
      expectProgramError(await b.send([await b.payInstruction(v, owner, USDC, { recipientToken: stray })]), 'InvalidTokenAccount');
      assert.equal(b.tokens(stray), 0n);
    }
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
    assert.equal(b.vault(v.vault).paymentCount, 0n);
  });

  // Any other recipient is paid at any token account of theirs for the mint: deriving its ATA on
  // every payment would cost the hot path ~1,500 CU for a rule the recipient's own key can live with.
  test('to a recipient that is not the program\'s, a token account of theirs other than the ATA is paid', async () => {
    const { b, v, recipient } = await bench();
    const theirs = await b.strayTokenAccount(recipient.address, await b.keypair());
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 2n * USDC, { recipientToken: theirs })]));
    assert.equal(b.tokens(theirs), 2n * USDC);
    assert.equal(b.tokens(v.vaultToken), 98n * USDC);
  });

  test('a recipient token account of another mint: InvalidTokenAccount', async () => {
    const { b, v, recipient } = await bench();
    const otherMint = await b.createMint();
    const otherToken = await b.tokenAccount(recipient.address, otherMint);
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC, { recipientToken: otherToken })]), 'InvalidTokenAccount');
  });

  test('a missing recipient token account that is not the recipient\'s ATA: InvalidTokenAccount', async () => {
    const { b, v, recipient } = await bench();
    const notAnAta = (await b.keypair()).address;
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC, { recipientToken: notAnAta })]), 'InvalidTokenAccount');
  });

  test('a frozen recipient token account: the Token program refuses (AccountFrozen)', async () => {
    const { b, v, recipient } = await bench();
    const recipientToken = await b.tokenAccount(recipient.address);
    await b.freezeTokenAccount(recipientToken);
    expectError(await b.send([await b.payInstruction(v, recipient.address, USDC)]), { InstructionError: [0, { Custom: 17 }] });
    assert.equal(b.tokens(v.vaultToken), 100n * USDC);
  });

  test('program accounts that are not System, Token and ATA: InvalidProgramId', async () => {
    const { b, v, recipient } = await bench();
    const pay = await b.payInstruction(v, recipient.address, USDC);
    const impostor = (await b.keypair()).address;
    for (const index of [Account.system, Account.token, Account.ata]) {
      expectProgramError(await b.send([withAddress(pay, index, impostor)]), 'InvalidProgramId');
    }
  });

  // The guarantee: only an account at the vault's PDA, with its canonical bump, is a vault.
  test('a vault with a wrong stored bump: InvalidPda', async () => {
    const { b, v, recipient } = await bench();
    b.forge(v.vault, (data) => { data[2] = data[2]! - 1; });
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC)]), 'InvalidPda');
  });

  test('a copy of a vault at another address: InvalidPda', async () => {
    const { b, v, recipient } = await bench();
    const copy = (await b.keypair()).address;
    b.setAccount(copy, b.data(v.vault)!, b.programId);
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.vault, copy);
    expectProgramError(await b.send([pay]), 'InvalidPda');
  });

  test('vault state not owned by the program: InvalidAccountOwner', async () => {
    const { b, v, recipient } = await bench();
    const copy = (await b.keypair()).address;
    b.setAccount(copy, b.data(v.vault)!, SYSTEM_PROGRAM);
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.vault, copy);
    expectProgramError(await b.send([pay]), 'InvalidAccountOwner');
  });

  test('another kind of program account as the vault (the reserve): InvalidAccountData', async () => {
    const { b, v, recipient } = await bench();
    const pay = withAddress(await b.payInstruction(v, recipient.address, USDC), Account.vault, v.org.reserve);
    expectProgramError(await b.send([pay]), 'InvalidAccountData');
  });

  test('a policy account not owned by the program: InvalidAccountOwner', async () => {
    const { b, v, recipient } = await bench();
    b.forge(v.org.policy, () => {}, SYSTEM_PROGRAM);
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, USDC)]), 'InvalidAccountOwner');
  });

  test('limits are read from the policy account at each pay (NONE = no limit)', async () => {
    const { b, v, recipient } = await bench({ maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT });
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 100n * USDC)]));
  });
});
