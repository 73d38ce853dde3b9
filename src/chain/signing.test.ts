import assert from 'node:assert/strict';
import { test } from 'node:test';
import fc from 'fast-check';
import {
  AccountRole,
  appendTransactionMessageInstructions,
  createTransactionMessage,
  generateKeyPairSigner,
  getBase64EncodedWireTransaction,
  getSignatureFromTransaction,
  pipe,
  setTransactionMessageFeePayerSigner,
  setTransactionMessageLifetimeUsingBlockhash,
  signTransactionMessageWithSigners,
  type Address,
  type Blockhash,
  type Instruction,
  type KeyPairSigner,
} from '@solana/kit';
import { referenceMemoIx } from './client.ts';
import * as program from './program.ts';
import { FastSigner } from './signing.ts';

const operator = await generateKeyPairSigner();
const arbiter = await generateKeyPairSigner();
const keys: Address[] = await Promise.all(Array.from({ length: 40 }, async () => (await generateKeyPairSigner()).address));
const blockhash = keys[39] as unknown as Blockhash;
const signer = new FastSigner([operator, arbiter]);

function messageOf(instructions: Instruction[], version: 0 | 'legacy' = 0, feePayer: KeyPairSigner = operator) {
  return pipe(
    createTransactionMessage({ version }),
    (m) => setTransactionMessageFeePayerSigner(feePayer, m),
    (m) => setTransactionMessageLifetimeUsingBlockhash({ blockhash, lastValidBlockHeight: 1_000n }, m),
    (m) => appendTransactionMessageInstructions(instructions, m),
  );
}

/** What @solana/kit itself makes of the message: the reference the fast path must equal byte for byte. */
async function kitSigned(message: ReturnType<typeof messageOf>) {
  const signed = await signTransactionMessageWithSigners(message);
  return { signature: getSignatureFromTransaction(signed), wire: getBase64EncodedWireTransaction(signed) };
}

const payIx = (amount: bigint, recipient = keys[4]!) => program.pay(keys[10]!, {
  operator, vault: keys[0]!, vaultToken: keys[1]!, policy: keys[2]!, mint: keys[3]!, recipient, recipientToken: keys[5]!,
}, { amount, attestation: new Uint8Array(32).fill(7) });

test('a pay transaction is signed to exactly the bytes and signature @solana/kit makes', async () => {
  for (const amount of [1n, 10_000n, 2n ** 63n - 1n]) {
    const message = messageOf([referenceMemoIx(`tx_${amount}`), payIx(amount)]);
    assert.deepEqual(signer.sign(message), await kitSigned(message), `amount ${amount}`);
  }
});

test('a transaction with a second signer (the arbiter) and a legacy message are identical to kit\'s too', async () => {
  const resolve = program.escrowResolve(keys[10]!, {
    arbiter, escrow: keys[6]!, escrowToken: keys[7]!, mint: keys[3]!, receiver: keys[8]!, receiverToken: keys[9]!,
    fromVault: keys[0]!, vaultToken: keys[1]!,
  }, { toReceiver: 5n, toSender: 7n });
  const twoSigners = messageOf([resolve]);
  const fast = signer.sign(twoSigners);
  assert.ok(fast, 'both signers are the fast signer\'s own');
  assert.deepEqual(fast, await kitSigned(twoSigners));
  const legacy = messageOf([referenceMemoIx('tx_legacy'), payIx(5n)], 'legacy');
  assert.deepEqual(signer.sign(legacy), await kitSigned(legacy));
  const longData = messageOf([{ programAddress: keys[10]!, accounts: [], data: new Uint8Array(300).fill(9) }]);
  assert.deepEqual(signer.sign(longData), await kitSigned(longData), 'a length of two compact-u16 bytes');
});

test('a message needing a signer the fast signer does not hold is left to kit (null)', async () => {
  const stranger = await generateKeyPairSigner();
  assert.equal(signer.sign(messageOf([referenceMemoIx('tx_x')], 0, stranger)), null);
  const withStranger: Instruction = {
    programAddress: keys[10]!, accounts: [{ address: stranger.address, role: AccountRole.READONLY_SIGNER, signer: stranger } as never],
    data: new Uint8Array([1]),
  };
  assert.equal(signer.sign(messageOf([withStranger])), null);
});

test('any message of our shape: random accounts, roles and data lengths (compact-u16 past 127) match kit', async () => {
  const role = fc.constantFrom(AccountRole.READONLY, AccountRole.WRITABLE);
  const instruction = fc.record({
    program: fc.integer({ min: 20, max: 24 }),
    accounts: fc.array(fc.record({ key: fc.integer({ min: 0, max: 19 }), role }), { maxLength: 12 }),
    data: fc.uint8Array({ maxLength: 300, size: 'max' }),
  });
  await fc.assert(fc.asyncProperty(fc.array(instruction, { minLength: 1, maxLength: 3 }), fc.constantFrom<0 | 'legacy'>(0, 'legacy'),
    async (specs, version) => {
      const instructions: Instruction[] = specs.map((spec) => ({
        programAddress: keys[spec.program]!,
        accounts: spec.accounts.map((account) => ({ address: keys[account.key]!, role: account.role })),
        data: spec.data,
      }));
      const message = messageOf(instructions, version);
      const expected = await kitSigned(message);
      assert.deepEqual(signer.sign(message), expected);
    }), { numRuns: 60 });
});
