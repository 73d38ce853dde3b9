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
import { decodeBase58 } from './base58.ts';
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

test('any message of static accounts: random accounts, roles, signers, programs and data lengths match kit', async () => {
  // Keys 0–19 are plain accounts, 15–24 programs (15–19 are both), 25 and 26 the fee payer and
  // the arbiter as accounts of an instruction too, in any role of theirs.
  const account = fc.oneof(
    fc.record({ key: fc.integer({ min: 0, max: 19 }), role: fc.constantFrom(AccountRole.READONLY, AccountRole.WRITABLE) }),
    fc.record({ key: fc.constantFrom(25, 26), role: fc.constantFrom(...Object.values(AccountRole).filter((r) => typeof r === 'number')) }),
  );
  const instruction = fc.record({
    program: fc.integer({ min: 15, max: 24 }),
    accounts: fc.array(account, { maxLength: 12 }),
    data: fc.uint8Array({ maxLength: 300, size: 'max' }),
  });
  const signerOf = { 25: operator, 26: arbiter } as Record<number, KeyPairSigner>;
  let compared = 0;
  await fc.assert(fc.asyncProperty(fc.array(instruction, { minLength: 1, maxLength: 4 }), fc.constantFrom<0 | 'legacy'>(0, 'legacy'),
    async (specs, version) => {
      const instructions: Instruction[] = specs.map((spec) => ({
        programAddress: keys[spec.program]!,
        accounts: spec.accounts.map(({ key, role }) => {
          const holder = signerOf[key];
          if (!holder) return { address: keys[key]!, role };
          // A signer role carries the signer (kit signs with it); a plain role is just the address.
          return (role & 2) !== 0 ? { address: holder.address, role, signer: holder } as never : { address: holder.address, role };
        }),
        data: spec.data,
      }));
      const message = messageOf(instructions, version);
      let expected: Awaited<ReturnType<typeof kitSigned>> | null;
      try {
        expected = await kitSigned(message);
      } catch {
        expected = null; // kit refuses it (a program also used writable): ours must leave it to kit
      }
      assert.deepEqual(signer.sign(message), expected);
      if (expected) compared += 1;
    }), { numRuns: 300 });
  assert.ok(compared > 150, `most random messages are valid and compared byte for byte (${compared})`);
});

test('one collator for the account order: addresses differing only in case or digits sort as kit sorts them', async () => {
  // The same address but its last two characters: base58 low digits, so still 32 bytes.
  const similar = ['aa', 'AA', 'aA', 'Aa', 'a1', 'A1', 'zz', 'ZZ', '11', '99', 'bB', 'Bb'].map(
    (tail) => `${keys[0]!.slice(0, -2)}${tail}` as Address);
  const valid = similar.filter((candidate) => {
    try {
      return decodeBase58(candidate)?.length === 32;
    } catch {
      return false;
    }
  });
  assert.ok(valid.length >= 10, `enough valid look-alike addresses (${valid.length})`);
  const message = messageOf([{ programAddress: keys[20]!, accounts: valid.map((address, i) => ({ address, role: i % 2 ? AccountRole.WRITABLE : AccountRole.READONLY })), data: new Uint8Array([1]) }]);
  assert.deepEqual(signer.sign(message), await kitSigned(message));
});
