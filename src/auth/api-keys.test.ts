import assert from 'node:assert/strict';
import { test } from 'node:test';
import { describeKey } from './api-keys.ts';

test('a listed key shows its role part and 4 characters, and never gives away a bootstrap key of another shape', () => {
  assert.deepEqual(describeKey('av_viewer_abcdefghijklmnopqrstuvwxyz012345'), { prefix: 'av_viewer_abcd', last4: '2345' });
  const bootstrap = 'mysecretbootstrapvalue_2024';
  const shown = describeKey(bootstrap);
  assert.ok(shown.prefix.length <= bootstrap.length - 16, `at least 16 characters stay hidden: ${shown.prefix}`);
  assert.ok(describeKey('x'.repeat(60)).prefix.length <= 16, 'at most 16 characters shown');
});
