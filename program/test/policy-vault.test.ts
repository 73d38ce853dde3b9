/**
 * Policies (SetPolicy) and vaults (CreateVault, UpdateVault): who may create and change them,
 * and that the accounts are the PDAs they claim to be.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  createBench,
  expectOk,
  expectProgramError,
  NO_LIMIT,
  program,
  SYSTEM_PROGRAM,
  USDC,
  withAddress,
  withData,
  withoutSigner,
  withoutWritable,
} from './setup.ts';

const SetPolicyAccounts = { operator: 0, policy: 1, system: 2 };
const CreateVaultAccounts = { operator: 0, reserve: 1, vault: 2, vaultToken: 3, policy: 4, mint: 5, system: 6, token: 7, ata: 8 };
const UpdateVaultAccounts = { operator: 0, vault: 1, policy: 2 };

describe('SetPolicy', () => {
  test('creates a policy, then overwrites its limits and bumps its revision', async (t) => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const cu = expectOk(await b.send([b.setPolicyInstruction(org, { maxPerTx: 5n * USDC, maxPerDay: 50n * USDC, expiry: 1_900_000_000n })]));
    t.diagnostic(`SetPolicy CU (create): ${cu}`);
    let policy = b.policyAccount(org.policy);
    assert.equal(policy.authority, b.operator.address);
    assert.deepEqual(policy.policyKey, org.policyKey);
    assert.equal(policy.maxPerTx, 5n * USDC);
    assert.equal(policy.maxPerDay, 50n * USDC);
    assert.equal(policy.expiry, 1_900_000_000n);
    assert.equal(policy.revision, 1n);
    assert.equal(policy.bump, (await program.findPolicyPda(b.programId, org.policyKey)).bump);
    assert.equal(b.owner(org.policy), b.programId);

    expectOk(await b.send([b.setPolicyInstruction(org, { maxPerTx: 0n })]));
    policy = b.policyAccount(org.policy);
    assert.equal(policy.maxPerTx, 0n);
    assert.equal(policy.maxPerDay, NO_LIMIT);
    assert.equal(policy.expiry, 0n);
    assert.equal(policy.revision, 2n);
  });

  test('an update by another operator: Unauthorized, and the limits stay', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    expectOk(await b.send([b.setPolicyInstruction(org, { maxPerTx: 5n })]));
    const intruder = await b.keypair();
    expectProgramError(await b.send([b.setPolicyInstruction(org, { maxPerTx: NO_LIMIT }, intruder)]), 'Unauthorized');
    assert.equal(b.policyAccount(org.policy).maxPerTx, 5n);
    assert.equal(b.policyAccount(org.policy).revision, 1n);
  });

  test('a policy address that is not the PDA of the key: InvalidPda (creating and updating)', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1', 'a');
    const other = await b.orgAddresses('org-1', 'b');
    expectProgramError(await b.send([withAddress(b.setPolicyInstruction(org), SetPolicyAccounts.policy, other.policy)]), 'InvalidPda');
    expectOk(await b.send([b.setPolicyInstruction(other)]));
    expectProgramError(await b.send([withAddress(b.setPolicyInstruction(org), SetPolicyAccounts.policy, other.policy)]), 'InvalidPda');
  });

  test('missing signature, read-only policy, wrong system program, wrong data length', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    const payer = await b.keypair();
    expectProgramError(await b.send([withoutSigner(b.setPolicyInstruction(org), SetPolicyAccounts.operator)], payer), 'MissingSigner');
    expectProgramError(await b.send([withoutWritable(b.setPolicyInstruction(org), SetPolicyAccounts.policy)]), 'NotWritable');
    expectProgramError(await b.send([withAddress(b.setPolicyInstruction(org), SetPolicyAccounts.system, (await b.keypair()).address)]), 'InvalidProgramId');
    expectProgramError(await b.send([withData(b.setPolicyInstruction(org), b.setPolicyInstruction(org).data!.subarray(0, 56))]), 'InvalidInstruction');
  });

  test('another kind of program account in the policy\'s place: InvalidAccountData', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    expectProgramError(await b.send([withAddress(b.setPolicyInstruction(org), SetPolicyAccounts.policy, org.reserve)]), 'InvalidAccountData');
  });

  test('succeeds when the policy address was pre-funded with lamports', async () => {
    const b = await createBench();
    const org = await b.orgAddresses('org-1');
    b.setAccount(org.policy, new Uint8Array(0), SYSTEM_PROGRAM, 1n);
    expectOk(await b.send([b.setPolicyInstruction(org)]));
    assert.equal(b.policyAccount(org.policy).revision, 1n);
  });
});

describe('CreateVault', () => {
  test('creates the vault PDA and its ATA, inheriting the reserve\'s authority and mint', async (t) => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    const cu = expectOk(await b.send([b.createVaultInstruction(v)]));
    t.diagnostic(`CreateVault CU: ${cu}`);
    const vault = b.vault(v.vault);
    assert.equal(vault.authority, b.operator.address);
    assert.deepEqual(vault.org, org.org);
    assert.deepEqual(vault.agent, v.agent);
    assert.equal(vault.reserve, org.reserve);
    assert.equal(vault.policy, org.policy);
    assert.equal(vault.mint, b.mint);
    assert.equal(vault.tokenAccount, v.vaultToken);
    assert.equal(vault.frozen, false);
    assert.equal(vault.dayStart, 0n);
    assert.equal(vault.daySpent, 0n);
    assert.equal(vault.paymentCount, 0n);
    assert.equal(vault.bump, (await program.findVaultPda(b.programId, org.org, v.agent)).bump);
    assert.equal(b.owner(v.vaultToken), program.TOKEN_PROGRAM);
    expectProgramError(await b.send([b.createVaultInstruction(v)]), 'AlreadyInitialized');
  });

  test('by another operator: Unauthorized; missing signature: MissingSigner', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    const intruder = await b.keypair();
    expectProgramError(await b.send([b.createVaultInstruction(v, intruder)]), 'Unauthorized');
    expectProgramError(await b.send([withoutSigner(b.createVaultInstruction(v), CreateVaultAccounts.operator)], intruder), 'MissingSigner');
    assert.equal(b.data(v.vault), null);
  });

  test('with a policy of another authority: Unauthorized', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const intruder = await b.keypair();
    const theirs = await b.orgAddresses('org-1', 'theirs');
    expectOk(await b.send([b.setPolicyInstruction(theirs, {}, intruder)], intruder));
    const v = await b.vaultAddresses(org, 'agent-1');
    expectProgramError(await b.send([withAddress(b.createVaultInstruction(v), CreateVaultAccounts.policy, theirs.policy)]), 'Unauthorized');
  });

  test('with a mint other than the reserve\'s: InvalidMint', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    const otherMint = await b.createMint();
    const ix = withAddress(withAddress(b.createVaultInstruction(v), CreateVaultAccounts.mint, otherMint),
      CreateVaultAccounts.vaultToken, await program.findAssociatedTokenAddress(v.vault, otherMint));
    expectProgramError(await b.send([ix]), 'InvalidMint');
  });

  test('a vault address that is not the PDA of (org, agent): InvalidPda', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    const w = await b.vaultAddresses(org, 'agent-2');
    const ix = withAddress(withAddress(b.createVaultInstruction(v), CreateVaultAccounts.vault, w.vault), CreateVaultAccounts.vaultToken, w.vaultToken);
    expectProgramError(await b.send([ix]), 'InvalidPda');
  });

  test('the reserve of another organisation: InvalidPda', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const other = await b.createOrg('org-2', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    expectProgramError(await b.send([withAddress(b.createVaultInstruction(v), CreateVaultAccounts.reserve, other.reserve)]), 'InvalidPda');
  });

  test('a token account that is not the vault\'s ATA: InvalidTokenAccount; the vault twice: DuplicateAccount', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    expectProgramError(await b.send([withAddress(b.createVaultInstruction(v), CreateVaultAccounts.vaultToken, org.reserveToken)]), 'InvalidTokenAccount');
    expectProgramError(await b.send([withAddress(b.createVaultInstruction(v), CreateVaultAccounts.vaultToken, v.vault)]), 'DuplicateAccount');
  });

  test('a reserve that is not the program\'s: InvalidAccountOwner', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 0n);
    const v = await b.vaultAddresses(org, 'agent-1');
    b.forge(org.reserve, () => {}, SYSTEM_PROGRAM);
    expectProgramError(await b.send([b.createVaultInstruction(v)]), 'InvalidAccountOwner');
  });

  test('succeeds when the vault address was pre-funded and its ATA pre-created', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-1', {}, 100n * USDC);
    const v = await b.vaultAddresses(org, 'agent-1');
    b.setAccount(v.vault, new Uint8Array(0), SYSTEM_PROGRAM, 1_000n);
    await b.tokenAccount(v.vault);
    expectOk(await b.send([b.createVaultInstruction(v), b.fundInstruction(v, USDC)]));
    assert.equal(b.tokens(v.vaultToken), USDC);
  });
});

describe('UpdateVault', () => {
  async function bench() {
    const b = await createBench();
    const org = await b.createOrg('org-1', { maxPerTx: 10n * USDC });
    const v = await b.createVault(org, 'agent-1', 50n * USDC);
    const update = (u: program.VaultUpdate, operator = b.operator) => program.updateVault(b.programId, { operator, vault: v.vault }, u);
    return { b, org, v, update };
  }

  test('freezes, unfreezes and attaches another policy that then governs the vault', async () => {
    const { b, org, v, update } = await bench();
    expectOk(await b.send([update({ op: 'freeze' })]));
    assert.equal(b.vault(v.vault).frozen, true);
    expectOk(await b.send([update({ op: 'unfreeze' })]));
    assert.equal(b.vault(v.vault).frozen, false);

    const recipient = await b.keypair();
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 20n * USDC)]), 'OverMaxPerTx');
    const generous = await b.orgAddresses(org.orgId, 'generous');
    expectOk(await b.send([b.setPolicyInstruction(generous, { maxPerTx: 30n * USDC })]));
    expectOk(await b.send([update({ op: 'attach_policy', policy: generous.policy })]));
    assert.equal(b.vault(v.vault).policy, generous.policy);
    // The old policy no longer matches the vault.
    expectProgramError(await b.send([await b.payInstruction(v, recipient.address, 20n * USDC)]), 'PolicyMismatch');
    const withNewPolicy = { ...v, org: { ...org, policy: generous.policy } };
    expectOk(await b.send([await b.payInstruction(withNewPolicy, recipient.address, 20n * USDC)]));
  });

  test('by another operator: Unauthorized; missing signature: MissingSigner; read-only vault: NotWritable', async () => {
    const { b, v, update } = await bench();
    const intruder = await b.keypair();
    expectProgramError(await b.send([update({ op: 'freeze' }, intruder)]), 'Unauthorized');
    expectProgramError(await b.send([withoutSigner(update({ op: 'freeze' }), UpdateVaultAccounts.operator)], intruder), 'MissingSigner');
    expectProgramError(await b.send([withoutWritable(update({ op: 'freeze' }), UpdateVaultAccounts.vault)]), 'NotWritable');
    assert.equal(b.vault(v.vault).frozen, false);
  });

  test('attaching a policy of another authority: Unauthorized; not a policy: InvalidAccountData', async () => {
    const { b, org, update } = await bench();
    const intruder = await b.keypair();
    const theirs = await b.orgAddresses(org.orgId, 'theirs');
    expectOk(await b.send([b.setPolicyInstruction(theirs, {}, intruder)], intruder));
    expectProgramError(await b.send([update({ op: 'attach_policy', policy: theirs.policy })]), 'Unauthorized');
    expectProgramError(await b.send([update({ op: 'attach_policy', policy: org.reserve })]), 'InvalidAccountData');
  });

  test('an unknown op or attach without a policy account: InvalidInstruction', async () => {
    const { b, update } = await bench();
    const freeze = update({ op: 'freeze' });
    expectProgramError(await b.send([withData(freeze, new Uint8Array([program.Tag.UpdateVault, 3]))]), 'InvalidInstruction');
    expectProgramError(await b.send([withData(freeze, new Uint8Array([program.Tag.UpdateVault, program.VaultOp.AttachPolicy]))]), 'InvalidInstruction');
  });
});
