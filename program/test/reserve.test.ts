/**
 * An organisation's reserve (InitReserve) and the moves inside the organisation (Fund,
 * Withdraw), plus what the entrypoint refuses before any instruction runs.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  createBench,
  expectOk,
  expectProgramError,
  program,
  SYSTEM_PROGRAM,
  TOKEN_PROGRAM,
  USDC,
  withAddress,
  withData,
  withoutSigner,
  withoutWritable,
} from './setup.ts';

const Init = { operator: 0, reserve: 1, reserveToken: 2, mint: 3, system: 4, token: 5, ata: 6 };
const FundAccounts = { operator: 0, reserve: 1, reserveToken: 2, vault: 3, vaultToken: 4, token: 5 };
const WithdrawAccounts = { operator: 0, vault: 1, vaultToken: 2, reserve: 3, reserveToken: 4, token: 5 };

describe('InitReserve', () => {
  // The guarantee: the reserve is a program-owned PDA at its canonical bump, owned by the
  // operator that signed, holding USDC in its own ATA.
  test('creates the reserve state and its token account', async (t) => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const cu = expectOk(await b.send([b.initReserveInstruction(org)]));
    t.diagnostic(`InitReserve CU: ${cu}`);
    const reserve = program.decodeReserve(b.data(org.reserve)!);
    assert.equal(reserve.authority, b.operator.address);
    assert.deepEqual(reserve.org, org.org);
    assert.equal(reserve.mint, b.mint);
    assert.equal(reserve.tokenAccount, org.reserveToken);
    assert.equal(reserve.bump, (await program.findReservePda(b.programId, org.org)).bump);
    assert.equal(b.owner(org.reserve), b.programId);
    assert.equal(b.lamports(org.reserve), b.svm.minimumBalanceForRentExemption(136n));
    assert.equal(b.tokens(org.reserveToken), 0n);
    assert.equal(b.owner(org.reserveToken), TOKEN_PROGRAM);
  });

  test('a second InitReserve: AlreadyInitialized', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    expectOk(await b.send([b.initReserveInstruction(org)]));
    expectProgramError(await b.send([b.initReserveInstruction(org)]), 'AlreadyInitialized');
    const intruder = await b.keypair();
    expectProgramError(await b.send([b.initReserveInstruction(org, intruder)]), 'AlreadyInitialized');
    assert.equal(program.decodeReserve(b.data(org.reserve)!).authority, b.operator.address);
  });

  // The guarantee: neither lamports sent to the future reserve address nor its ATA created in
  // advance by someone else can block an organisation's creation.
  test('succeeds when the reserve address was pre-funded and its ATA pre-created', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    b.setAccount(org.reserve, new Uint8Array(0), SYSTEM_PROGRAM, 1_000n);
    await b.tokenAccount(org.reserve);
    expectOk(await b.send([b.initReserveInstruction(org)]));
    assert.equal(b.lamports(org.reserve), b.svm.minimumBalanceForRentExemption(136n));
    assert.equal(program.decodeReserve(b.data(org.reserve)!).tokenAccount, org.reserveToken);

    // Already rent-exempt: no top-up, only allocate and assign.
    const rich = await b.orgAddresses('org-2');
    b.setAccount(rich.reserve, new Uint8Array(0), SYSTEM_PROGRAM, 10_000_000n);
    expectOk(await b.send([b.initReserveInstruction(rich)]));
    assert.equal(b.lamports(rich.reserve), 10_000_000n);
    assert.equal(program.decodeReserve(b.data(rich.reserve)!).authority, b.operator.address);
  });

  test('missing signature: MissingSigner; read-only reserve: NotWritable', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const payer = await b.keypair();
    expectProgramError(await b.send([withoutSigner(b.initReserveInstruction(org), Init.operator)], payer), 'MissingSigner');
    expectProgramError(await b.send([withoutWritable(b.initReserveInstruction(org), Init.reserve)]), 'NotWritable');
  });

  test('a reserve address that is not the PDA of the org: InvalidPda', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const other = await b.orgAddresses('org-2');
    const ix = withAddress(withAddress(b.initReserveInstruction(org), Init.reserve, other.reserve), Init.reserveToken, other.reserveToken);
    expectProgramError(await b.send([ix]), 'InvalidPda');
  });

  test('a token account that is not the reserve\'s ATA: InvalidTokenAccount', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const foreign = await b.tokenAccount(b.operator.address);
    expectProgramError(await b.send([withAddress(b.initReserveInstruction(org), Init.reserveToken, foreign)]), 'InvalidTokenAccount');
    const notYetCreated = await program.findAssociatedTokenAddress(org.reserve, await b.createMint());
    expectProgramError(await b.send([withAddress(b.initReserveInstruction(org), Init.reserveToken, notYetCreated)]), 'InvalidTokenAccount');
  });

  test('a mint that is not an SPL Token mint: InvalidMint', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const tokenAccount = await b.tokenAccount(b.operator.address);
    const wallet = (await b.keypair()).address;
    for (const notAMint of [tokenAccount, wallet]) {
      const reserveToken = await program.findAssociatedTokenAddress(org.reserve, notAMint);
      const ix = withAddress(withAddress(b.initReserveInstruction(org), Init.mint, notAMint), Init.reserveToken, reserveToken);
      expectProgramError(await b.send([ix]), 'InvalidMint');
    }
  });

  test('program accounts that are not System, Token and ATA: InvalidProgramId', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const impostor = (await b.keypair()).address;
    for (const index of [Init.system, Init.token, Init.ata]) {
      expectProgramError(await b.send([withAddress(b.initReserveInstruction(org), index, impostor)]), 'InvalidProgramId');
    }
  });

  test('the reserve as its own token account: DuplicateAccount', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    expectProgramError(await b.send([withAddress(b.initReserveInstruction(org), Init.reserveToken, org.reserve)]), 'DuplicateAccount');
  });
});

describe('Fund and Withdraw', () => {
  async function bench() {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 1_000n * USDC);
    const v = await b.createVault(org, 'agent-1', 0n);
    return { b, org, v };
  }

  test('move USDC from the reserve to the vault and back', async (t) => {
    const { b, org, v } = await bench();
    const fundCu = expectOk(await b.send([b.fundInstruction(v, 300n * USDC)]));
    assert.equal(b.tokens(org.reserveToken), 700n * USDC);
    assert.equal(b.tokens(v.vaultToken), 300n * USDC);
    const withdrawCu = expectOk(await b.send([b.withdrawInstruction(v, 120n * USDC)]));
    assert.equal(b.tokens(org.reserveToken), 820n * USDC);
    assert.equal(b.tokens(v.vaultToken), 180n * USDC);
    // Moves inside the organisation are not spends.
    assert.equal(b.vault(v.vault).paymentCount, 0n);
    assert.equal(b.vault(v.vault).daySpent, 0n);
    t.diagnostic(`Fund CU: ${fundCu}; Withdraw CU: ${withdrawCu}`);
  });

  test('are allowed on a frozen vault', async () => {
    const { b, v } = await bench();
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'freeze' })]));
    expectOk(await b.send([b.fundInstruction(v, 10n * USDC)]));
    expectOk(await b.send([b.withdrawInstruction(v, 10n * USDC)]));
  });

  test('overdraw: InsufficientFunds, nothing moves', async () => {
    const { b, org, v } = await bench();
    expectProgramError(await b.send([b.fundInstruction(v, 1_000n * USDC + 1n)]), 'InsufficientFunds');
    expectOk(await b.send([b.fundInstruction(v, 5n * USDC)]));
    expectProgramError(await b.send([b.withdrawInstruction(v, 5n * USDC + 1n)]), 'InsufficientFunds');
    assert.equal(b.tokens(org.reserveToken), 995n * USDC);
    assert.equal(b.tokens(v.vaultToken), 5n * USDC);
  });

  test('a zero amount: InvalidAmount; wrong data length: InvalidInstruction', async () => {
    const { b, v } = await bench();
    expectProgramError(await b.send([b.fundInstruction(v, 0n)]), 'InvalidAmount');
    expectProgramError(await b.send([b.withdrawInstruction(v, 0n)]), 'InvalidAmount');
    expectProgramError(await b.send([withData(b.fundInstruction(v, 1n), new Uint8Array([program.Tag.Fund, 1]))]), 'InvalidInstruction');
  });

  test('wrong signer: Unauthorized; missing signature: MissingSigner', async () => {
    const { b, org, v } = await bench();
    const intruder = await b.keypair();
    expectProgramError(await b.send([b.fundInstruction(v, USDC, intruder)]), 'Unauthorized');
    expectProgramError(await b.send([b.withdrawInstruction(v, USDC, intruder)]), 'Unauthorized');
    expectProgramError(await b.send([withoutSigner(b.fundInstruction(v, USDC), FundAccounts.operator)], intruder), 'MissingSigner');
    expectProgramError(await b.send([withoutSigner(b.withdrawInstruction(v, USDC), WithdrawAccounts.operator)], intruder), 'MissingSigner');
    assert.equal(b.tokens(org.reserveToken), 1_000n * USDC);
  });

  test('a vault of another organisation: InvalidAccountData', async () => {
    const { b, v } = await bench();
    const otherOrg = await b.createOrg('org-2', {}, 0n);
    const otherVault = await b.createVault(otherOrg, 'agent-9', 0n);
    const fund = withAddress(withAddress(b.fundInstruction(v, USDC), FundAccounts.vault, otherVault.vault), FundAccounts.vaultToken, otherVault.vaultToken);
    expectProgramError(await b.send([fund]), 'InvalidAccountData');
  });

  test('foreign token accounts: InvalidTokenAccount', async () => {
    const { b, org, v } = await bench();
    const foreign = await b.tokenAccount(b.operator.address);
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.vaultToken, foreign)]), 'InvalidTokenAccount');
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.reserveToken, foreign)]), 'InvalidTokenAccount');
    expectProgramError(await b.send([withAddress(b.withdrawInstruction(v, USDC), WithdrawAccounts.reserveToken, foreign)]), 'InvalidTokenAccount');
    assert.equal(b.tokens(org.reserveToken), 1_000n * USDC);
    assert.equal(b.tokens(foreign), 0n);
  });

  test('the same token account as source and destination: DuplicateAccount', async () => {
    const { b, org, v } = await bench();
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.vaultToken, org.reserveToken)]), 'DuplicateAccount');
  });

  test('state accounts of the wrong kind, owner, address or bump', async () => {
    const { b, org, v } = await bench();
    // The vault where the reserve belongs (wrong discriminator and size).
    const swapped = withAddress(withAddress(b.fundInstruction(v, USDC), FundAccounts.reserve, v.vault), FundAccounts.vault, org.reserve);
    expectProgramError(await b.send([swapped]), 'InvalidAccountData');
    // A copy of the reserve at an address that is not its PDA.
    const copy = (await b.keypair()).address;
    b.setAccount(copy, b.data(org.reserve)!, b.programId);
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.reserve, copy)]), 'InvalidPda');
    // The same bytes owned by another program.
    b.setAccount(copy, b.data(org.reserve)!, TOKEN_PROGRAM);
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.reserve, copy)]), 'InvalidAccountOwner');
    // The reserve's stored bump changed.
    b.forge(org.reserve, (data) => { data[2] = data[2]! ^ 1; });
    expectProgramError(await b.send([b.fundInstruction(v, USDC)]), 'InvalidPda');
  });

  test('a token program that is not SPL Token: InvalidProgramId; a read-only token account: NotWritable', async () => {
    const { b, v } = await bench();
    const impostor = (await b.keypair()).address;
    expectProgramError(await b.send([withAddress(b.fundInstruction(v, USDC), FundAccounts.token, impostor)]), 'InvalidProgramId');
    expectProgramError(await b.send([withoutWritable(b.withdrawInstruction(v, USDC), WithdrawAccounts.vaultToken)]), 'NotWritable');
  });
});

describe('the entrypoint', () => {
  test('an unknown tag or empty data: InvalidInstruction', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const ix = b.initReserveInstruction(org);
    // The first tag no instruction has.
    expectProgramError(await b.send([withData(ix, new Uint8Array([Math.max(...Object.values(program.Tag)) + 1]))]), 'InvalidInstruction');
    expectProgramError(await b.send([withData(ix, new Uint8Array([255, 0, 0]))]), 'InvalidInstruction');
    expectProgramError(await b.send([withData(ix, new Uint8Array(0))]), 'InvalidInstruction');
  });

  test('too few accounts: InvalidInstruction', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const ix = b.initReserveInstruction(org);
    expectProgramError(await b.send([{ ...ix, accounts: ix.accounts!.slice(0, 6) }]), 'InvalidInstruction');
  });
});
