/**
 * Escrow: create (a spend under the vault's policy), release, refund, dispute, resolve, close.
 * Each transition is tested from every state it must refuse, with balances proving conservation:
 * vault + escrow + receiver always add up to what the vault held.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { AccountRole, type Instruction, type KeyPairSigner } from '@solana/kit';
import {
  concat,
  createBench,
  DAY_S,
  expectOk,
  expectProgramError,
  program,
  signerMeta,
  u32,
  u64,
  U64_MAX,
  USDC,
  withAddress,
  withoutSigner,
  withoutWritable,
  type AgentVault,
  type Bench,
  type EscrowAddresses,
  type PolicyLimitsInput,
} from './setup.ts';

const Create = { operator: 0, vault: 1, vaultToken: 2, policy: 3, mint: 4, escrow: 5, escrowToken: 6, receiver: 7, arbiter: 8 };
const Release = { operator: 0, escrow: 1, escrowToken: 2, mint: 3, receiver: 4, receiverToken: 5 };
const Refund = { signer: 0, escrow: 1, escrowToken: 2, fromVault: 3, vaultToken: 4 };
const Resolve = { arbiter: 0, escrow: 1, escrowToken: 2, mint: 3, receiver: 4, receiverToken: 5, fromVault: 6, vaultToken: 7 };
const Close = { operator: 0, escrow: 1, escrowToken: 2, token: 3 };

const HOUR_S = 3_600n;

interface EscrowBench {
  b: Bench;
  v: AgentVault;
  e: EscrowAddresses;
  receiver: KeyPairSigner;
  arbiter: KeyPairSigner;
  expiresAt: bigint;
  create(amount?: bigint): ReturnType<Bench['send']>;
}

async function escrowBench(limits: PolicyLimitsInput = {}, vaultAmount = 100n * USDC, reserveAmount = 1_000n * USDC): Promise<EscrowBench> {
  const b = await createBench();
  const org = await b.createOrg('org-escrow', limits, reserveAmount);
  const v = await b.createVault(org, 'agent-1', vaultAmount);
  const receiver = await b.keypair();
  const arbiter = await b.keypair();
  const e = await b.escrowAddresses('escrow-1');
  const expiresAt = b.now() + HOUR_S;
  return {
    b, v, e, receiver, arbiter, expiresAt,
    create: (amount = 40n * USDC) => b.send([b.escrowCreateInstruction(v, e, { receiver: receiver.address, arbiter: arbiter.address, amount, expiresAt })]),
  };
}

async function receiverToken(s: EscrowBench): Promise<bigint> {
  return s.b.tokens(await program.findAssociatedTokenAddress(s.receiver.address, s.b.mint));
}

describe('EscrowCreate', () => {
  // The guarantee: creating an escrow locks the amount out of the vault, counts as a spend of
  // the day, and records everything needed to settle it.
  test('locks the amount in the escrow\'s token account', async (t) => {
    const s = await escrowBench();
    const cu = expectOk(await s.create(40n * USDC));
    t.diagnostic(`EscrowCreate CU: ${cu}`);
    assert.equal(s.b.tokens(s.v.vaultToken), 60n * USDC);
    assert.equal(s.b.tokens(s.e.escrowToken), 40n * USDC);
    const escrow = s.b.escrow(s.e.escrow);
    assert.equal(escrow.state, program.EscrowState.Locked);
    assert.equal(escrow.authority, s.b.operator.address);
    assert.equal(escrow.fromVault, s.v.vault);
    assert.equal(escrow.receiver, s.receiver.address);
    assert.equal(escrow.arbiter, s.arbiter.address);
    assert.equal(escrow.mint, s.b.mint);
    assert.equal(escrow.tokenAccount, s.e.escrowToken);
    assert.deepEqual(escrow.escrowKey, s.e.escrowKey);
    assert.deepEqual(escrow.taskHash, new Uint8Array(32).fill(9));
    assert.equal(escrow.amount, 40n * USDC);
    assert.equal(escrow.createdAt, s.b.now());
    assert.equal(escrow.expiresAt, s.expiresAt);
    assert.equal(escrow.bump, (await program.findEscrowPda(s.b.programId, s.e.escrowKey)).bump);
    const vault = s.b.vault(s.v.vault);
    assert.equal(vault.daySpent, 40n * USDC);
    assert.equal(vault.paymentCount, 1n);
  });

  test('a second create of the same escrow: AlreadyInitialized', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectProgramError(await s.create(), 'AlreadyInitialized');
    assert.equal(s.b.tokens(s.v.vaultToken), 60n * USDC);
  });

  test('an expiry not in the future: InvalidExpiry', async () => {
    const s = await escrowBench();
    const ix = s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.receiver.address, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.b.now() });
    expectProgramError(await s.b.send([ix]), 'InvalidExpiry');
  });

  test('the spending rules apply: frozen, max per tx, daily cap, expired policy, balance', async () => {
    const s = await escrowBench({ maxPerTx: 30n * USDC, maxPerDay: 50n * USDC });
    expectProgramError(await s.create(31n * USDC), 'OverMaxPerTx');
    expectOk(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, 30n * USDC)]));
    expectProgramError(await s.create(21n * USDC), 'OverDailyCap');
    expectOk(await s.b.send([program.updateVault(s.b.programId, { operator: s.b.operator, vault: s.v.vault }, { op: 'freeze' })]));
    expectProgramError(await s.create(USDC), 'VaultFrozen');
    expectOk(await s.b.send([program.updateVault(s.b.programId, { operator: s.b.operator, vault: s.v.vault }, { op: 'unfreeze' })]));
    expectProgramError(await s.create(0n), 'InvalidAmount');

    const rich = await escrowBench();
    expectProgramError(await rich.create(100n * USDC + 1n), 'InsufficientFunds');
    expectOk(await rich.b.send([rich.b.setPolicyInstruction(rich.v.org, { expiry: rich.b.now() })]));
    expectProgramError(await rich.create(USDC), 'PolicyExpired');
    assert.equal(rich.b.tokens(rich.v.vaultToken), 100n * USDC);
  });

  test('wrong signer: Unauthorized; missing signature: MissingSigner', async () => {
    const s = await escrowBench();
    const intruder = await s.b.keypair();
    const ix = s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.receiver.address, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.expiresAt, operator: intruder });
    expectProgramError(await s.b.send([ix]), 'Unauthorized');
    const unsigned = withoutSigner(s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.receiver.address, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.expiresAt }), Create.operator);
    expectProgramError(await s.b.send([unsigned], intruder), 'MissingSigner');
  });

  test('an escrow address that is not the PDA of the key: InvalidPda', async () => {
    const s = await escrowBench();
    const other = await s.b.escrowAddresses('escrow-2');
    const ix = s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.receiver.address, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.expiresAt });
    expectProgramError(await s.b.send([withAddress(withAddress(ix, Create.escrow, other.escrow), Create.escrowToken, other.escrowToken)]), 'InvalidPda');
  });

  test('an escrow token account that is not the escrow\'s ATA: InvalidTokenAccount', async () => {
    const s = await escrowBench();
    const foreign = await s.b.tokenAccount(s.b.operator.address);
    const ix = s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.receiver.address, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.expiresAt });
    expectProgramError(await s.b.send([withAddress(ix, Create.escrowToken, foreign)]), 'InvalidTokenAccount');
  });

  test('the vault as its own receiver: DuplicateAccount', async () => {
    const s = await escrowBench();
    const ix = s.b.escrowCreateInstruction(s.v, s.e, { receiver: s.v.vault, arbiter: s.arbiter.address, amount: USDC, expiresAt: s.expiresAt });
    expectProgramError(await s.b.send([ix]), 'DuplicateAccount');
  });

  // The guarantee: lamports sent to a future escrow address cannot block its creation.
  test('succeeds when the escrow address was pre-funded with lamports', async () => {
    const s = await escrowBench();
    s.b.setAccount(s.e.escrow, new Uint8Array(0), program.SYSTEM_PROGRAM, 5_000n);
    expectOk(await s.create());
    assert.equal(s.b.escrow(s.e.escrow).state, program.EscrowState.Locked);
    assert.ok(s.b.lamports(s.e.escrow) >= s.b.svm.minimumBalanceForRentExemption(304n));
  });
});

describe('EscrowRelease', () => {
  test('pays the receiver (creating its ATA) before expiry; a second release: InvalidEscrowState', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    assert.equal(await receiverToken(s), 40n * USDC);
    assert.equal(s.b.tokens(s.e.escrowToken), 0n);
    const escrow = s.b.escrow(s.e.escrow);
    assert.equal(escrow.state, program.EscrowState.Released);
    assert.equal(escrow.releasedAmount, 40n * USDC);
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]), 'InvalidEscrowState');
    assert.equal(await receiverToken(s), 40n * USDC);
  });

  test('at or after expiry: EscrowExpired', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    s.b.setTime(s.expiresAt);
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]), 'EscrowExpired');
  });

  test('after a refund: InvalidEscrowState', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v, s.arbiter)]));
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]), 'InvalidEscrowState');
    assert.equal(await receiverToken(s), 0n);
  });

  test('wrong signer: Unauthorized (the arbiter cannot release either); missing signature: MissingSigner', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const intruder = await s.b.keypair();
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address, intruder)]), 'Unauthorized');
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address, s.arbiter)]), 'Unauthorized');
    const unsigned = withoutSigner(await s.b.escrowReleaseInstruction(s.e, s.receiver.address), Release.operator);
    expectProgramError(await s.b.send([unsigned], intruder), 'MissingSigner');
  });

  test('to someone other than the recorded receiver: InvalidAccountData', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const thief = await s.b.keypair();
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, thief.address)]), 'InvalidAccountData');
    // Only the token account swapped: it is not the receiver's.
    const thiefToken = await s.b.tokenAccount(thief.address);
    const ix = withAddress(await s.b.escrowReleaseInstruction(s.e, s.receiver.address), Release.receiverToken, thiefToken);
    expectProgramError(await s.b.send([ix]), 'InvalidTokenAccount');
    assert.equal(s.b.tokens(s.e.escrowToken), 40n * USDC);
  });

  test('a foreign escrow token account: InvalidTokenAccount; another mint: InvalidMint', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const foreign = await s.b.tokenAccount(s.b.operator.address);
    await s.b.mintTo(foreign, 40n * USDC);
    const release = await s.b.escrowReleaseInstruction(s.e, s.receiver.address);
    expectProgramError(await s.b.send([withAddress(release, Release.escrowToken, foreign)]), 'InvalidTokenAccount');
    const otherMint = await s.b.createMint();
    expectProgramError(await s.b.send([withAddress(release, Release.mint, otherMint)]), 'InvalidMint');
  });

  test('an escrow with a wrong stored bump: InvalidPda; not the program\'s: InvalidAccountOwner', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const release = await s.b.escrowReleaseInstruction(s.e, s.receiver.address);
    s.b.forge(s.e.escrow, (data) => { data[2] = (data[2]! + 1) % 256; });
    expectProgramError(await s.b.send([release]), 'InvalidPda');
    s.b.forge(s.e.escrow, (data) => { data[2] = (data[2]! + 255) % 256; }, program.SYSTEM_PROGRAM);
    expectProgramError(await s.b.send([release]), 'InvalidAccountOwner');
  });
});

describe('EscrowRefund', () => {
  // The guarantee: the operator cannot take escrowed money back early; only time or the arbiter can.
  test('by the operator before expiry: EscrowNotExpired; after expiry it refunds the vault', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]), 'EscrowNotExpired');
    s.b.setTime(s.expiresAt - 1n);
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]), 'EscrowNotExpired');
    s.b.setTime(s.expiresAt);
    expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]));
    assert.equal(s.b.tokens(s.v.vaultToken), 100n * USDC);
    assert.equal(s.b.tokens(s.e.escrowToken), 0n);
    const escrow = s.b.escrow(s.e.escrow);
    assert.equal(escrow.state, program.EscrowState.Refunded);
    assert.equal(escrow.refundedAmount, 40n * USDC);
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]), 'InvalidEscrowState');
  });

  test('by the arbiter at any time, giving the day\'s allowance back when still the same UTC day', async () => {
    const s = await escrowBench({ maxPerDay: 50n * USDC });
    expectOk(await s.create(40n * USDC));
    expectProgramError(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, 11n * USDC)]), 'OverDailyCap');
    expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v, s.arbiter)]));
    assert.equal(s.b.vault(s.v.vault).daySpent, 0n);
    expectOk(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, 50n * USDC)]));
    assert.equal(s.b.tokens(s.v.vaultToken), 50n * USDC);
  });

  test('on a later UTC day the refund leaves the new day\'s spending alone', async () => {
    const s = await escrowBench();
    expectOk(await s.create(40n * USDC));
    const midnight = s.b.now() - (s.b.now() % DAY_S);
    s.b.setTime(midnight + DAY_S + 60n);
    expectOk(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, 5n * USDC)]));
    expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]));
    assert.equal(s.b.vault(s.v.vault).daySpent, 5n * USDC);
    assert.equal(s.b.tokens(s.v.vaultToken), 95n * USDC);
  });

  test('by anyone else: Unauthorized; after release: InvalidEscrowState', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    s.b.setTime(s.expiresAt + 1n);
    const intruder = await s.b.keypair();
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v, intruder)]), 'Unauthorized');
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v, s.receiver)]), 'Unauthorized');

    const t = await escrowBench();
    expectOk(await t.create());
    expectOk(await t.b.send([await t.b.escrowReleaseInstruction(t.e, t.receiver.address)]));
    expectProgramError(await t.b.send([t.b.escrowRefundInstruction(t.e, t.v, t.arbiter)]), 'InvalidEscrowState');
  });

  test('missing signature: MissingSigner', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const payer = await s.b.keypair();
    expectProgramError(await s.b.send([withoutSigner(s.b.escrowRefundInstruction(s.e, s.v, s.arbiter), Refund.signer)], payer), 'MissingSigner');
  });

  test('to another vault or another token account: InvalidAccountData, InvalidTokenAccount', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const other = await s.b.createVault(s.v.org, 'agent-2', 0n);
    const refund = s.b.escrowRefundInstruction(s.e, s.v, s.arbiter);
    expectProgramError(await s.b.send([withAddress(withAddress(refund, Refund.fromVault, other.vault), Refund.vaultToken, other.vaultToken)]), 'InvalidAccountData');
    expectProgramError(await s.b.send([withAddress(refund, Refund.vaultToken, other.vaultToken)]), 'InvalidTokenAccount');
    expectProgramError(await s.b.send([withAddress(refund, Refund.vaultToken, s.e.escrowToken)]), 'DuplicateAccount');
    assert.equal(s.b.tokens(s.e.escrowToken), 40n * USDC);
  });
});

describe('EscrowDispute and EscrowResolve', () => {
  test('a disputed escrow: release and operator refund refused, the arbiter splits it', async (t) => {
    const s = await escrowBench();
    expectOk(await s.create(40n * USDC));
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    assert.equal(s.b.escrow(s.e.escrow).state, program.EscrowState.Disputed);
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]), 'InvalidEscrowState');
    s.b.setTime(s.expiresAt + 1n);
    expectProgramError(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]), 'InvalidEscrowState');

    const cu = expectOk(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, { toReceiver: 25n * USDC, toSender: 15n * USDC })]));
    t.diagnostic(`EscrowResolve CU (creates the receiver ATA): ${cu}`);
    assert.equal(await receiverToken(s), 25n * USDC);
    assert.equal(s.b.tokens(s.v.vaultToken), 75n * USDC);
    assert.equal(s.b.tokens(s.e.escrowToken), 0n);
    const escrow = s.b.escrow(s.e.escrow);
    assert.equal(escrow.state, program.EscrowState.Resolved);
    assert.equal(escrow.releasedAmount, 25n * USDC);
    assert.equal(escrow.refundedAmount, 15n * USDC);
    expectProgramError(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, { toReceiver: 40n * USDC, toSender: 0n })]), 'InvalidEscrowState');
  });

  test('the arbiter may refund a disputed escrow in full', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v, s.arbiter)]));
    assert.equal(s.b.tokens(s.v.vaultToken), 100n * USDC);
  });

  test('all to one side: the other transfer is skipped', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    expectOk(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, { toReceiver: 0n, toSender: 40n * USDC })]));
    assert.equal(s.b.tokens(s.v.vaultToken), 100n * USDC);
    assert.equal(await receiverToken(s), 0n);
  });

  test('an invalid split: InvalidSplit; a split that overflows u64: ArithmeticOverflow', async () => {
    const s = await escrowBench();
    expectOk(await s.create(40n * USDC));
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    const resolve = (toReceiver: bigint, toSender: bigint) => s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, { toReceiver, toSender });
    expectProgramError(await s.b.send([await resolve(30n * USDC, 5n * USDC)]), 'InvalidSplit');
    expectProgramError(await s.b.send([await resolve(40n * USDC, 1n)]), 'InvalidSplit');
    // Wrapping arithmetic would make U64_MAX + (40 USDC + 1) equal 40 USDC.
    expectProgramError(await s.b.send([await resolve(U64_MAX, 40n * USDC + 1n)]), 'ArithmeticOverflow');
    assert.equal(s.b.tokens(s.e.escrowToken), 40n * USDC);
  });

  test('resolve by anyone but the arbiter (even the operator): Unauthorized; on a locked escrow: InvalidEscrowState', async () => {
    const s = await escrowBench();
    expectOk(await s.create(40n * USDC));
    const split = { toReceiver: 20n * USDC, toSender: 20n * USDC };
    expectProgramError(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, split)]), 'InvalidEscrowState');
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    expectProgramError(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.b.operator, split)]), 'Unauthorized');
    const payer = await s.b.keypair();
    const unsigned = withoutSigner(await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, split), Resolve.arbiter);
    expectProgramError(await s.b.send([unsigned], payer), 'MissingSigner');
  });

  test('dispute: only the operator, only a locked escrow before expiry', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectProgramError(await s.b.send([s.b.escrowDisputeInstruction(s.e, s.arbiter)]), 'Unauthorized');
    const payer = await s.b.keypair();
    expectProgramError(await s.b.send([withoutSigner(s.b.escrowDisputeInstruction(s.e), 0)], payer), 'MissingSigner');
    s.b.setTime(s.expiresAt);
    expectProgramError(await s.b.send([s.b.escrowDisputeInstruction(s.e)]), 'EscrowExpired');
    s.b.setTime(s.expiresAt - 1n);
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    expectProgramError(await s.b.send([s.b.escrowDisputeInstruction(s.e)]), 'InvalidEscrowState');
  });

  test('resolve to a receiver or vault other than the recorded ones: InvalidAccountData', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    const split = { toReceiver: 20n * USDC, toSender: 20n * USDC };
    const thief = await s.b.keypair();
    expectProgramError(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, thief.address, s.arbiter, split)]), 'InvalidAccountData');
    const other = await s.b.createVault(s.v.org, 'agent-2', 0n);
    expectProgramError(await s.b.send([await s.b.escrowResolveInstruction(s.e, other, s.receiver.address, s.arbiter, split)]), 'InvalidAccountData');
    const resolve = await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, split);
    expectProgramError(await s.b.send([withAddress(resolve, Resolve.vaultToken, other.vaultToken)]), 'InvalidTokenAccount');
    expectProgramError(await s.b.send([withAddress(resolve, Resolve.fromVault, s.receiver.address)]), 'DuplicateAccount');
  });

  // The guarantee: a vault receiving an escrow is paid at its ATA, where the program can move the
  // money again; the arbiter, not the operator, picks the receiver's token account at a resolve.
  test('a vault as receiver: released or resolved to a token account of it other than its ATA, InvalidTokenAccount; nothing moved', async () => {
    const b = await createBench();
    const org = await b.createOrg('org-escrow');
    const v = await b.createVault(org, 'agent-1', 100n * USDC);
    const receiver = await b.createVault(org, 'agent-2', 0n);
    const arbiter = await b.keypair();
    const stray = await b.strayTokenAccount(receiver.vault, await b.keypair());
    const released = await b.escrowAddresses('escrow-released');
    const disputed = await b.escrowAddresses('escrow-disputed');
    for (const e of [released, disputed]) {
      expectOk(await b.send([b.escrowCreateInstruction(v, e, { receiver: receiver.vault, arbiter: arbiter.address, amount: 10n * USDC, expiresAt: b.now() + HOUR_S })]));
    }
    const release = await b.escrowReleaseInstruction(released, receiver.vault);
    expectProgramError(await b.send([withAddress(release, Release.receiverToken, stray)]), 'InvalidTokenAccount');
    expectOk(await b.send([b.escrowDisputeInstruction(disputed)]));
    const resolve = await b.escrowResolveInstruction(disputed, v, receiver.vault, arbiter, { toReceiver: 10n * USDC, toSender: 0n });
    expectProgramError(await b.send([withAddress(resolve, Resolve.receiverToken, stray)], arbiter), 'InvalidTokenAccount');
    assert.equal(b.tokens(stray), 0n);
    assert.equal(b.tokens(released.escrowToken), 10n * USDC);
    assert.equal(b.tokens(disputed.escrowToken), 10n * USDC);
    // At its ATA both are paid.
    expectOk(await b.send([release]));
    expectOk(await b.send([resolve], arbiter));
    assert.equal(b.tokens(receiver.vaultToken), 20n * USDC);
  });
});

describe('EscrowClose', () => {
  /** Lamports, owner and data of the escrow's two accounts and the operator's lamports, to show a refusal changed nothing. */
  function snapshot(s: EscrowBench) {
    return [s.e.escrow, s.e.escrowToken].map((account) => ({
      lamports: s.b.lamports(account), owner: s.b.owner(account), data: s.b.data(account),
    })).concat([{ lamports: s.b.lamports(s.b.operator.address), owner: null, data: null }]);
  }

  /** The close, its fee paid by another key: the operator's balance then moves by the accounts' lamports alone. */
  async function close(s: EscrowBench, operator = s.b.operator) {
    return s.b.send([s.b.escrowCloseInstruction(s.e, operator)], await s.b.keypair());
  }

  // The guarantee: a settled escrow's two accounts go, and every lamport they held (the rent the
  // operator paid at creation) is the operator's again, to the lamport.
  test('a released, a refunded and a resolved escrow: both accounts removed, their lamports to the operator', async (t) => {
    const settle: Record<string, (s: EscrowBench) => Promise<void>> = {
      released: async (s) => { expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)])); },
      refunded: async (s) => {
        s.b.setTime(s.expiresAt);
        expectOk(await s.b.send([s.b.escrowRefundInstruction(s.e, s.v)]));
      },
      resolved: async (s) => {
        expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
        expectOk(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter,
          { toReceiver: 25n * USDC, toSender: 15n * USDC })]));
      },
    };
    for (const [state, settled] of Object.entries(settle)) {
      const s = await escrowBench();
      expectOk(await s.create());
      await settled(s);
      assert.equal(s.b.escrow(s.e.escrow).state, program.EscrowState[state === 'released' ? 'Released' : state === 'refunded' ? 'Refunded' : 'Resolved']);
      const rent = s.b.lamports(s.e.escrow) + s.b.lamports(s.e.escrowToken);
      assert.ok(rent >= s.b.svm.minimumBalanceForRentExemption(304n) + s.b.svm.minimumBalanceForRentExemption(165n), `${state}: both accounts held their rent`);
      const operatorBefore = s.b.lamports(s.b.operator.address);
      const cu = expectOk(await close(s));
      t.diagnostic(`EscrowClose CU (${state}): ${cu}`);
      assert.equal(s.b.lamports(s.b.operator.address), operatorBefore + rent, `${state}: the operator has both accounts' lamports`);
      for (const account of [s.e.escrow, s.e.escrowToken]) {
        assert.equal(s.b.data(account), null, `${state}: ${account} no longer exists`);
        assert.equal(s.b.lamports(account), 0n);
      }
    }
  });

  test('a locked and a disputed escrow: InvalidEscrowState, nothing changed', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    const locked = snapshot(s);
    expectProgramError(await close(s), 'InvalidEscrowState');
    assert.deepEqual(snapshot(s), locked);
    // Past its expiry it is still locked until refunded: money the operator could still refund.
    s.b.setTime(s.expiresAt + 1n);
    expectProgramError(await close(s), 'InvalidEscrowState');
    assert.deepEqual(snapshot(s), locked);

    const d = await escrowBench();
    expectOk(await d.create());
    expectOk(await d.b.send([d.b.escrowDisputeInstruction(d.e)]));
    const disputed = snapshot(d);
    expectProgramError(await close(d), 'InvalidEscrowState');
    assert.deepEqual(snapshot(d), disputed);
    assert.equal(d.b.tokens(d.e.escrowToken), 40n * USDC);
  });

  // The guarantee: only the key that opened the escrow (and paid its rent) takes the rent back.
  test('a signer that is not the escrow\'s authority (the arbiter, the receiver, anyone): Unauthorized; missing signature: MissingSigner', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    const before = snapshot(s);
    for (const intruder of [s.arbiter, s.receiver, await s.b.keypair()]) {
      expectProgramError(await close(s, intruder), 'Unauthorized');
    }
    const payer = await s.b.keypair();
    expectProgramError(await s.b.send([withoutSigner(s.b.escrowCloseInstruction(s.e), Close.operator)], payer), 'MissingSigner');
    assert.deepEqual(snapshot(s), before);
  });

  test('closing twice: the second finds no escrow (InvalidAccountOwner) and changes nothing', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    expectOk(await close(s));
    const operatorAfter = s.b.lamports(s.b.operator.address);
    expectProgramError(await close(s), 'InvalidAccountOwner');
    assert.equal(s.b.lamports(s.b.operator.address), operatorAfter);
    assert.equal(s.b.data(s.e.escrow), null);
    assert.equal(s.b.data(s.e.escrowToken), null);
  });

  test('USDC in the escrow\'s token account: TokenAccountNotEmpty; another token account: InvalidTokenAccount', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    const foreign = await s.b.tokenAccount(s.b.operator.address);
    expectProgramError(await s.b.send([withAddress(s.b.escrowCloseInstruction(s.e), Close.escrowToken, foreign)]), 'InvalidTokenAccount');
    // Anyone can send USDC to the escrow's token account; it is never swept to the operator.
    await s.b.mintTo(s.e.escrowToken, 1n);
    const before = snapshot(s);
    expectProgramError(await close(s), 'TokenAccountNotEmpty');
    assert.deepEqual(snapshot(s), before);
  });

  test('accounts read-only, another token program, another program\'s account: NotWritable, InvalidProgramId, InvalidAccountOwner', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    // Another fee payer: the fee payer is writable whatever the instruction says.
    const payer = await s.b.keypair();
    for (const index of [Close.operator, Close.escrow, Close.escrowToken]) {
      expectProgramError(await s.b.send([withoutWritable(s.b.escrowCloseInstruction(s.e), index)], payer), 'NotWritable');
    }
    expectProgramError(await s.b.send([withAddress(s.b.escrowCloseInstruction(s.e), Close.token, program.SYSTEM_PROGRAM)]), 'InvalidProgramId');
    const vaultAsEscrow = withAddress(s.b.escrowCloseInstruction(s.e), Close.escrow, s.v.vault);
    expectProgramError(await s.b.send([vaultAsEscrow]), 'InvalidAccountData');
    const receiverAsEscrow = withAddress(s.b.escrowCloseInstruction(s.e), Close.escrow, s.receiver.address);
    expectProgramError(await s.b.send([receiverAsEscrow]), 'InvalidAccountOwner');
    assert.equal(s.b.escrow(s.e.escrow).state, program.EscrowState.Released);
  });

  // The guarantee: a closed escrow cannot be brought back as an escrow, even by lamports sent to
  // its address later in the same transaction, which keep the account alive.
  test('an account given its rent again in the closing transaction is zeroed: no escrow, not creatable again', async () => {
    const s = await escrowBench();
    expectOk(await s.create());
    expectOk(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]));
    const revive: Instruction = {
      programAddress: program.SYSTEM_PROGRAM,
      accounts: [signerMeta(s.b.operator), { address: s.e.escrow, role: AccountRole.WRITABLE }],
      data: concat(u32(2), u64(s.b.svm.minimumBalanceForRentExemption(304n))), // System Transfer
    };
    expectOk(await s.b.send([s.b.escrowCloseInstruction(s.e), revive]));
    assert.deepEqual(s.b.data(s.e.escrow), new Uint8Array(304), 'alive, every byte zero');
    assert.equal(s.b.owner(s.e.escrow), s.b.programId);
    assert.equal(s.b.data(s.e.escrowToken), null);
    expectProgramError(await s.b.send([s.b.escrowCloseInstruction(s.e)]), 'InvalidAccountData');
    expectProgramError(await s.b.send([await s.b.escrowReleaseInstruction(s.e, s.receiver.address)]), 'InvalidAccountData');
    expectProgramError(await s.create(), 'AlreadyInitialized');
  });
});

describe('u64 limits', () => {
  // The guarantee: the daily counter never wraps. Resolving in the sender's favour returns the
  // money without returning the day's allowance, so the same tokens can be counted twice; with
  // amounts near u64::MAX the sum overflows and the program says so instead of wrapping to a
  // small number that would pass any cap.
  test('a day bucket that would pass u64::MAX: ArithmeticOverflow', async () => {
    const half = 1n << 63n;
    const s = await escrowBench({}, half, half);
    expectOk(await s.create(half));
    expectOk(await s.b.send([s.b.escrowDisputeInstruction(s.e)]));
    expectOk(await s.b.send([await s.b.escrowResolveInstruction(s.e, s.v, s.receiver.address, s.arbiter, { toReceiver: 0n, toSender: half })]));
    assert.equal(s.b.tokens(s.v.vaultToken), half);
    assert.equal(s.b.vault(s.v.vault).daySpent, half);
    expectProgramError(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, half)]), 'ArithmeticOverflow');
    expectOk(await s.b.send([await s.b.payInstruction(s.v, s.receiver.address, half - 1n)]));
    assert.equal(s.b.vault(s.v.vault).daySpent, U64_MAX);
  });

  test('amounts up to u64::MAX encode and move', async () => {
    const s = await escrowBench({}, 0n, U64_MAX);
    expectOk(await s.b.send([s.b.fundInstruction(s.v, U64_MAX)]));
    assert.equal(s.b.tokens(s.v.vaultToken), U64_MAX);
    expectOk(await s.create(U64_MAX));
    assert.equal(s.b.tokens(s.e.escrowToken), U64_MAX);
    assert.equal(s.b.vault(s.v.vault).daySpent, U64_MAX);
  });
});
