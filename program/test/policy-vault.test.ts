/**
 * Policies (SetPolicy) and vaults (CreateVault, UpdateVault): who may create and change them,
 * and that the accounts are the PDAs they claim to be.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { AccountRole, type Address, type Instruction } from '@solana/kit';
import {
  concat,
  createBench,
  expectOk,
  expectProgramError,
  NO_LIMIT,
  program,
  signerMeta,
  SYSTEM_PROGRAM,
  u32,
  u64,
  USDC,
  withAddress,
  withData,
  withoutSigner,
  withoutWritable,
} from './setup.ts';

const SetPolicyAccounts = { operator: 0, policy: 1, system: 2 };
const CreateVaultAccounts = { operator: 0, reserve: 1, vault: 2, vaultToken: 3, policy: 4, mint: 5, system: 6, token: 7, ata: 8 };
const UpdateVaultAccounts = { operator: 0, vault: 1, policy: 2 };
const PolicyCloseAccounts = { operator: 0, policy: 1 };

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

describe('PolicyClose', () => {
  /** An organisation whose vault (funded) is attached to a second policy, `extra`, the one closed. */
  async function bench() {
    const b = await createBench();
    const org = await b.createOrg('org-1');
    const extra = await b.orgAddresses(org.orgId, 'extra');
    expectOk(await b.send([b.setPolicyInstruction(extra, { maxPerTx: 10n * USDC })]));
    const v = await b.createVault(org, 'agent-1', 50n * USDC);
    return { b, org, extra, v };
  }
  /** The policy account and the operator's lamports, to show a refusal changed nothing. */
  const snapshot = (b: Awaited<ReturnType<typeof bench>>['b'], policy: Address) => ({
    lamports: b.lamports(policy), owner: b.owner(policy), data: b.data(policy), operator: b.lamports(b.operator.address),
  });

  // The guarantee: the account goes, and every lamport it held (the rent the operator paid at
  // SetPolicy) is the operator's again, to the lamport.
  test('closes the policy\'s account: it no longer exists and the operator has every lamport it held', async (t) => {
    const { b, extra } = await bench();
    const rent = b.lamports(extra.policy);
    assert.ok(rent >= b.svm.minimumBalanceForRentExemption(112n), 'the account held its rent');
    const operatorBefore = b.lamports(b.operator.address);
    // Another key pays the fee: the operator's balance then moves by the account's lamports alone.
    const cu = expectOk(await b.send([b.policyCloseInstruction(extra)], await b.keypair()));
    t.diagnostic(`PolicyClose CU: ${cu}`);
    assert.equal(b.lamports(b.operator.address), operatorBefore + rent);
    assert.equal(b.data(extra.policy), null);
    assert.equal(b.lamports(extra.policy), 0n);
  });

  test('a signer that is not the policy\'s authority: Unauthorized; missing signature: MissingSigner; nothing changed', async () => {
    const { b, extra } = await bench();
    const before = snapshot(b, extra.policy);
    const intruder = await b.keypair();
    expectProgramError(await b.send([b.policyCloseInstruction(extra, intruder)], intruder), 'Unauthorized');
    const payer = await b.keypair();
    expectProgramError(await b.send([withoutSigner(b.policyCloseInstruction(extra), PolicyCloseAccounts.operator)], payer), 'MissingSigner');
    assert.deepEqual(snapshot(b, extra.policy), before);
    assert.equal(b.policyAccount(extra.policy).maxPerTx, 10n * USDC);
  });

  test('not a policy: another kind of program account InvalidAccountData, another program\'s InvalidAccountOwner, not the PDA of its key InvalidPda; read-only NotWritable', async () => {
    const { b, org, extra, v } = await bench();
    // Another key pays the fees: the operator's lamports then show that nothing moved.
    const payer = await b.keypair();
    const before = [snapshot(b, extra.policy), snapshot(b, org.reserve), snapshot(b, v.vault)];
    expectProgramError(await b.send([withAddress(b.policyCloseInstruction(extra), PolicyCloseAccounts.policy, org.reserve)], payer), 'InvalidAccountData');
    expectProgramError(await b.send([withAddress(b.policyCloseInstruction(extra), PolicyCloseAccounts.policy, v.vault)], payer), 'InvalidAccountData');
    expectProgramError(await b.send([withAddress(b.policyCloseInstruction(extra), PolicyCloseAccounts.policy, (await b.keypair()).address)], payer), 'InvalidAccountOwner');
    expectProgramError(await b.send([withAddress(b.policyCloseInstruction(extra), PolicyCloseAccounts.policy, v.vaultToken)], payer), 'InvalidAccountOwner');
    // A policy's bytes at an address its key does not derive.
    const forged = (await b.keypair()).address;
    b.setAccount(forged, b.data(extra.policy)!, b.programId);
    expectProgramError(await b.send([withAddress(b.policyCloseInstruction(extra), PolicyCloseAccounts.policy, forged)], payer), 'InvalidPda');
    for (const index of [PolicyCloseAccounts.operator, PolicyCloseAccounts.policy]) {
      expectProgramError(await b.send([withoutWritable(b.policyCloseInstruction(extra), index)], payer), 'NotWritable');
    }
    expectProgramError(await b.send([withData(b.policyCloseInstruction(extra), new Uint8Array([program.Tag.PolicyClose, 0]))], payer), 'InvalidInstruction');
    assert.deepEqual([snapshot(b, extra.policy), snapshot(b, org.reserve), snapshot(b, v.vault)], before);
  });

  // The guarantee: a vault still naming a closed policy can spend nothing: its Pay (and
  // EscrowCreate, the same spending rules) is refused by the program, not a panic, and nothing moves.
  test('a vault still attached to the closed policy: Pay and EscrowCreate fail with InvalidAccountOwner, nothing moved; closing again InvalidAccountOwner', async () => {
    const { b, extra, v } = await bench();
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'attach_policy', policy: extra.policy })]));
    const onExtra = { ...v, org: { ...v.org, policy: extra.policy } };
    const recipient = await b.keypair();
    expectOk(await b.send([await b.payInstruction(onExtra, recipient.address, 1n * USDC)]));
    expectOk(await b.send([b.policyCloseInstruction(extra)]));
    const vaultBefore = b.data(v.vault);
    const tokensBefore = b.tokens(v.vaultToken);
    const operatorBefore = b.lamports(b.operator.address);
    const pay = await b.send([await b.payInstruction(onExtra, recipient.address, 1n * USDC)]);
    expectProgramError(pay, 'InvalidAccountOwner');
    const e = await b.escrowAddresses('esc-1');
    const lock = await b.send([program.escrowCreate(b.programId, {
      operator: b.operator, vault: v.vault, vaultToken: v.vaultToken, policy: extra.policy, mint: b.mint,
      escrow: e.escrow, escrowToken: e.escrowToken, receiver: recipient.address, arbiter: (await b.keypair()).address,
    }, { escrowKey: e.escrowKey, amount: 1n * USDC, taskHash: new Uint8Array(32), expiresAt: 4_000_000_000n })]);
    expectProgramError(lock, 'InvalidAccountOwner');
    assert.deepEqual(b.data(v.vault), vaultBefore, 'the vault\'s counters unchanged');
    assert.equal(b.tokens(v.vaultToken), tokensBefore);
    assert.equal(b.tokens(await program.findAssociatedTokenAddress(recipient.address, b.mint)), 1n * USDC, 'only the payment before the close');
    assert.equal(b.data(e.escrow), null);
    // Only the fees of the two refused transactions, which the operator paid.
    assert.ok(b.lamports(b.operator.address) < operatorBefore && operatorBefore - b.lamports(b.operator.address) <= 20_000n);
    expectProgramError(await b.send([b.policyCloseInstruction(extra)]), 'InvalidAccountOwner');
    // Another policy attached: the vault spends again.
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'attach_policy', policy: v.org.policy })]));
    expectOk(await b.send([await b.payInstruction(v, recipient.address, 1n * USDC)]));
  });

  // What happens to the address afterwards: nothing keeps it, so SetPolicy with the same key
  // creates the policy anew (revision 1, the operator paying its rent again). The service never
  // writes a deleted policy again (docs/policies.md).
  test('SetPolicy with the same key after the close creates the account anew, at revision 1', async () => {
    const { b, extra } = await bench();
    expectOk(await b.send([b.setPolicyInstruction(extra, { maxPerTx: 7n })]));
    assert.equal(b.policyAccount(extra.policy).revision, 2n);
    expectOk(await b.send([b.policyCloseInstruction(extra)]));
    expectOk(await b.send([b.setPolicyInstruction(extra, { maxPerTx: 3n })]));
    const policy = b.policyAccount(extra.policy);
    assert.equal(policy.revision, 1n);
    assert.equal(policy.maxPerTx, 3n);
    assert.equal(policy.authority, b.operator.address);
  });

  // The guarantee: a policy is a vault's only while its authority is the vault's. Once closed,
  // its address is free and its key public (SetPolicy's data): anyone may create a policy there,
  // with limits of their choosing, and the vaults still naming it must not spend under those.
  test('created again at the address by another key: the vaults still naming it are refused (PolicyMismatch), nothing moved', async () => {
    const { b, extra, v } = await bench();
    expectOk(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'attach_policy', policy: extra.policy })]));
    const onExtra = { ...v, org: { ...v.org, policy: extra.policy } };
    const recipient = await b.keypair();
    expectProgramError(await b.send([await b.payInstruction(onExtra, recipient.address, 20n * USDC)]), 'OverMaxPerTx');
    expectOk(await b.send([b.policyCloseInstruction(extra)]));
    const squatter = await b.keypair();
    expectOk(await b.send([b.setPolicyInstruction(extra, { maxPerTx: NO_LIMIT, maxPerDay: NO_LIMIT }, squatter)], squatter));
    assert.equal(b.policyAccount(extra.policy).authority, squatter.address);
    const vaultBefore = b.data(v.vault);
    expectProgramError(await b.send([await b.payInstruction(onExtra, recipient.address, 20n * USDC)]), 'PolicyMismatch');
    const e = await b.escrowAddresses('esc-squat');
    expectProgramError(await b.send([b.escrowCreateInstruction(onExtra, e, {
      receiver: recipient.address, arbiter: (await b.keypair()).address, amount: 20n * USDC, expiresAt: b.now() + 3_600n,
    })]), 'PolicyMismatch');
    assert.equal(b.tokens(v.vaultToken), 50n * USDC);
    assert.deepEqual(b.data(v.vault), vaultBefore, 'the vault\'s counters unchanged');
    assert.equal(b.data(e.escrow), null);
  });

  // The guarantee: a closed policy cannot be brought back as a policy by lamports sent to its
  // address later in the same transaction, which keep the account alive.
  test('an account given its rent again in the closing transaction is zeroed: no policy, and SetPolicy refuses it', async () => {
    const { b, extra, v } = await bench();
    const revive: Instruction = {
      programAddress: program.SYSTEM_PROGRAM,
      accounts: [signerMeta(b.operator), { address: extra.policy, role: AccountRole.WRITABLE }],
      data: concat(u32(2), u64(b.svm.minimumBalanceForRentExemption(112n))), // System Transfer
    };
    expectOk(await b.send([b.policyCloseInstruction(extra), revive]));
    assert.deepEqual(b.data(extra.policy), new Uint8Array(112), 'alive, every byte zero');
    assert.equal(b.owner(extra.policy), b.programId);
    expectProgramError(await b.send([b.policyCloseInstruction(extra)]), 'InvalidAccountData');
    expectProgramError(await b.send([b.setPolicyInstruction(extra)]), 'InvalidAccountData');
    expectProgramError(await b.send([program.updateVault(b.programId, { operator: b.operator, vault: v.vault }, { op: 'attach_policy', policy: extra.policy })]), 'InvalidAccountData');
  });
});
