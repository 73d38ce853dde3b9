/**
 * The pure side of policies: parsing request fields, API formatting, the audit diff.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { ServiceError } from '../errors/errors.ts';
import { normaliseDomain } from '../recipients/recipients.ts';
import { diffFields, parseExpiry, parsePolicyFields, parseRecipients, type PolicyFields } from './fields.ts';

const NOW_MS = Date.UTC(2026, 3, 1, 12, 0, 0);
const ADDRESS = 'So11111111111111111111111111111111111111112';

function refusal(run: () => unknown): ServiceError {
  try {
    run();
  } catch (error) {
    assert.ok(error instanceof ServiceError, String(error));
    return error;
  }
  assert.fail('expected a refusal');
}

describe('policy fields', () => {
  test('"0" is a real limit, null clears, absent fields stay absent', () => {
    const fields = parsePolicyFields({ maxPerTx: '0', maxPerDay: null, maxPerMonth: '12.5', requireCoSign: '0.000001' }, NOW_MS);
    assert.deepEqual(fields, { maxPerTx: 0n, maxPerDay: null, maxPerMonth: 12_500_000n, requireCoSign: 1n });
    assert.deepEqual(parsePolicyFields({}, NOW_MS), {});
  });

  test('a malformed or oversized amount is invalid_amount naming its snake_case field', () => {
    for (const [input, param] of [
      [{ maxPerTx: '-1' }, 'max_per_tx'], [{ maxPerDay: '1e3' }, 'max_per_day'], [{ maxPerMonth: '1.0000001' }, 'max_per_month'],
      [{ requireCoSign: ' 1' }, 'require_co_sign'], [{ maxPerTx: '9223372036854.775808' }, 'max_per_tx'], [{ maxPerTx: '' }, 'max_per_tx'],
    ] as const) {
      const error = refusal(() => parsePolicyFields(input, NOW_MS));
      assert.equal(error.code, 'invalid_amount');
      assert.equal(error.details.param, param);
    }
    assert.equal(parsePolicyFields({ maxPerTx: '9223372036854.775807' }, NOW_MS).maxPerTx, 0x7fff_ffff_ffff_ffffn);
  });

  test('recipients: base58 addresses kept as is, domains lowercased, duplicates dropped in order', () => {
    assert.deepEqual(parseRecipients([ADDRESS, 'API.Example.com', 'api.example.com', 'xn--bcher-kva.example']),
      [ADDRESS, 'api.example.com', 'xn--bcher-kva.example']);
  });

  test('recipients: a domain is valid exactly when the recipient directory takes it (normaliseDomain)', () => {
    // Top labels with digits or one letter, and short names: the directory takes them, so an allowlist does.
    for (const domain of ['Pay.Svc.Corp1', 'a.b', 'x.io2', 'svc.internal-1', `${'a'.repeat(63)}.com`]) {
      assert.deepEqual(parseRecipients([domain]), [normaliseDomain(domain)], domain);
      assert.notEqual(normaliseDomain(domain), null, domain);
    }
    for (const text of ['a..com', 'a_b.com', 'example.123', '1.2.3.4', 'bücher.de', 'ex\u212Aample.com', `${'a'.repeat(250)}.com`]) {
      assert.equal(normaliseDomain(text), null, text);
      assert.equal(refusal(() => parseRecipients([text])).code, 'invalid_recipient', text);
    }
  });

  test('a recipient that is neither an address nor a domain is invalid_recipient with its index', () => {
    for (const [bad, index] of [['not an address', 1], ['localhost', 1], ['example.', 1], ['-x.com', 1], ['10.0.0.1', 1],
      [ADDRESS.slice(0, 30), 1], ['0OIl'.repeat(10), 1], [`${'a'.repeat(64)}.com`, 1]] as const) {
      const error = refusal(() => parseRecipients([ADDRESS, bad]));
      assert.equal(error.code, 'invalid_recipient', bad);
      assert.equal(error.details.param, `allowed_recipients.${index}`);
    }
  });

  test('expiry: ISO 8601 with a zone, kept to the second, in the future', () => {
    assert.equal(parseExpiry('2026-12-31T23:59:59.999Z', NOW_MS).toISOString(), '2026-12-31T23:59:59.000Z');
    assert.equal(parseExpiry('2027-01-01T01:00:00+02:00', NOW_MS).toISOString(), '2026-12-31T23:00:00.000Z');
    assert.equal(parseExpiry('2026-05-01T00:00Z', NOW_MS).toISOString(), '2026-05-01T00:00:00.000Z');
    assert.equal(parseExpiry('2028-02-29T00:00:00-05:30', NOW_MS).toISOString(), '2028-02-29T05:30:00.000Z');
    for (const bad of ['2026-12-31', '2026-12-31T10:00:00', '2026-02-30T00:00:00Z', '2026-13-01T00:00:00Z',
      '2026-12-31T24:00:00Z', '2026-12-31 10:00:00Z', 'tomorrow', '2026-12-31T10:00:00+19:00', '2027-02-29T00:00:00Z']) {
      const error = refusal(() => parseExpiry(bad, NOW_MS));
      assert.equal(error.code, 'invalid_request', bad);
      assert.equal(error.details.param, 'expiry');
    }
    for (const past of ['2026-04-01T12:00:00Z', '2026-04-01T12:00:00.900Z', '2020-01-01T00:00:00Z']) {
      assert.match(refusal(() => parseExpiry(past, NOW_MS)).message, /future/, past);
    }
  });

  test('categories are deduplicated in order', () => {
    assert.deepEqual(parsePolicyFields({ blockedCategories: ['gambling', 'adult', 'gambling'] }, NOW_MS).blockedCategories,
      ['gambling', 'adult']);
  });

  test('the diff names changed fields in snake_case with API-formatted values; a creation diffs from nothing', () => {
    const before: PolicyFields = {
      name: 'Ops', maxPerTx: 10_000_000n, maxPerDay: null, maxPerMonth: null, velocityCap: 5, allowedRecipients: [],
      blockedCategories: ['gambling'], requireCoSign: null, expiry: null,
    };
    const after: PolicyFields = { ...before, maxPerTx: 25_000_000n, maxPerDay: 0n, expiry: new Date('2026-12-31T00:00:00Z'),
      blockedCategories: ['gambling'] };
    assert.deepEqual(diffFields(before, after), {
      max_per_tx: { from: '10.00', to: '25.00' },
      max_per_day: { from: null, to: '0.00' },
      expiry: { from: null, to: '2026-12-31T00:00:00.000Z' },
    });
    assert.deepEqual(diffFields(before, { ...before }), {});
    const created = diffFields(null, before);
    assert.deepEqual(Object.keys(created), ['name', 'max_per_tx', 'max_per_day', 'max_per_month', 'velocity_cap',
      'allowed_recipients', 'blocked_categories', 'require_co_sign', 'expiry']);
    assert.deepEqual(created.blocked_categories, { from: null, to: ['gambling'] });
  });
});
