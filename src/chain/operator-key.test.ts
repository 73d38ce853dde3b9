import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, statSync, writeFileSync, chmodSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { createKeyPairSignerFromBytes, getBase58Decoder } from '@solana/kit';
import { generateSecretKey, loadOperatorKey, OPERATOR_KEY_FILE } from './operator-key.ts';

test('first start generates the operator key into the data dir, readable by the owner only', async () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-key-'));
  const first = await loadOperatorKey({ dataDir });
  const path = join(dataDir, OPERATOR_KEY_FILE);
  assert.equal(statSync(path).mode & 0o777, 0o600);
  const again = await loadOperatorKey({ dataDir });
  assert.equal(again.address, first.address, 'the same key is used after a restart');
  const stored = JSON.parse(readFileSync(path, 'utf8')) as number[];
  assert.equal(stored.length, 64);
});

test('AGENT_VAULT_OPERATOR_KEY (JSON array or base58) takes precedence over the data dir', async () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-key-'));
  const secret = generateSecretKey();
  const expected = await createKeyPairSignerFromBytes(secret);
  const fromJson = await loadOperatorKey({ dataDir, secretKey: JSON.stringify([...secret]) });
  const fromBase58 = await loadOperatorKey({ dataDir, secretKey: getBase58Decoder().decode(secret) });
  assert.equal(fromJson.address, expected.address);
  assert.equal(fromBase58.address, expected.address);
  await assert.rejects(loadOperatorKey({ dataDir, secretKey: '[1,2,3]' }), /AGENT_VAULT_OPERATOR_KEY is not a valid secret key/);
});

test('a malformed AGENT_VAULT_OPERATOR_KEY is refused without quoting any of it', async () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-key-'));
  const secret = generateSecretKey();
  const base58 = getBase58Decoder().decode(secret);
  const json = JSON.stringify([...secret]);
  // Quotes an env file kept, a character base58 does not use, a JSON array cut short.
  for (const text of [`"${base58}"`, `${base58.slice(0, 40)}0${base58.slice(41)}`, json.slice(0, -1)]) {
    const error = await loadOperatorKey({ dataDir, secretKey: text }).then(() => null, (caught: Error) => caught);
    assert.ok(error, text.slice(0, 8));
    assert.match(error.message, /AGENT_VAULT_OPERATOR_KEY is not a valid secret key/);
    for (const part of [base58.slice(5, 15), base58.slice(30, 40), json.slice(10, 30), String(secret[3]) + ',' + String(secret[4])]) {
      assert.ok(!error.message.includes(part) && !String(error.stack).includes(part), `the message quotes the key: ${error.message}`);
    }
  }
});

test('a key file readable by other users is refused', async () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-key-'));
  const path = join(dataDir, OPERATOR_KEY_FILE);
  writeFileSync(path, JSON.stringify([...generateSecretKey()]));
  chmodSync(path, 0o644);
  await assert.rejects(loadOperatorKey({ dataDir }), /readable by other users/);
});

test('the signer does not reveal the secret when serialised', async () => {
  const dataDir = mkdtempSync(join(tmpdir(), 'av-key-'));
  const signer = await loadOperatorKey({ dataDir });
  const secret = JSON.parse(readFileSync(join(dataDir, OPERATOR_KEY_FILE), 'utf8')) as number[];
  const seedHex = Buffer.from(secret.slice(0, 32)).toString('hex');
  const seedB58 = getBase58Decoder().decode(Uint8Array.from(secret));
  const printed = JSON.stringify(signer) + String(signer) + JSON.stringify(signer.keyPair);
  assert.ok(!printed.includes(seedHex) && !printed.includes(seedB58));
  assert.equal(signer.keyPair.privateKey.extractable, false);
});
