import assert from 'node:assert/strict';
import { test } from 'node:test';
import fc from 'fast-check';
import { MAX_MICRO_USDC, formatUsdc, parseUsdc } from './money.ts';

test('parses positive decimal strings with up to 6 fractional digits into micro-USDC', () => {
  assert.equal(parseUsdc('1'), 1_000_000n);
  assert.equal(parseUsdc('12.5'), 12_500_000n);
  assert.equal(parseUsdc('0.000001'), 1n);
  assert.equal(parseUsdc('9223372036854.775807'), 0x7fff_ffff_ffff_ffffn, 'the largest amount a BIGINT column holds');
});

test('refuses anything that is not a plain positive decimal', () => {
  for (const bad of ['', '0', '0.0', '-1', '+1', '1e3', ' 1', '1 ', '1.', '.5', '01', '1.0000001', '1,5', 'NaN', '١', '100000000000000', '9223372036854.775808', '18446744073709.551615']) {
    assert.equal(parseUsdc(bad), null, JSON.stringify(bad));
  }
  for (const bad of [1, 1.5, null, undefined, {}, 10n]) assert.equal(parseUsdc(bad), null);
  assert.equal(parseUsdc('0', { allowZero: true }), 0n);
});

test('formats with at least two fractional digits and no trailing zeros beyond them', () => {
  assert.equal(formatUsdc(0n), '0.00');
  assert.equal(formatUsdc(12_500_000n), '12.50');
  assert.equal(formatUsdc(1n), '0.000001');
  assert.equal(formatUsdc(1_230_000n), '1.23');
  assert.equal(formatUsdc(1_234_500n), '1.2345');
});

test('format then parse is the identity on every positive amount', () => {
  fc.assert(fc.property(fc.bigInt({ min: 1n, max: MAX_MICRO_USDC }), (micro) => {
    assert.equal(parseUsdc(formatUsdc(micro)), micro);
  }));
});
