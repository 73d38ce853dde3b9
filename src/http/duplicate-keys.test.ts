import assert from 'node:assert/strict';
import { test } from 'node:test';
import fc from 'fast-check';
import { duplicateKeyPath } from './duplicate-keys.ts';

test('a key given twice in one object is found, with its path; anything else is not', () => {
  const cases: Array<[string, string[] | null]> = [
    ['{"amount":"1","amount":"2"}', ['amount']],
    ['{"amount":"1","\\u0061mount":"2"}', ['amount']],
    ['{ "a" : 1 , "b" : { "c" : 1, "c" : 2 } }', ['b', 'c']],
    ['{"allocations":[{"wallet_id":"w","amount":"1"},{"wallet_id":"x","wallet_id":"y"}]}', ['allocations', '1', 'wallet_id']],
    ['[{"a":1},{"a":2}]', null],
    ['{"a":{"x":1},"b":{"x":1}}', null],
    ['{"a":"\\"a\\":","b":"a"}', null],
    ['{"memo":"{\\"k\\":1,\\"k\\":2}"}', null],
    ['{"a":["a","a"],"b":"a"}', null],
    ['{"":1,"":2}', ['']],
    ['"text"', null],
    ['{}', null],
  ];
  for (const [text, path] of cases) assert.deepEqual(duplicateKeyPath(text), path, text);
});

test('JSON written by JSON.stringify never has a key twice', () => {
  fc.assert(fc.property(fc.jsonValue(), (value) => duplicateKeyPath(JSON.stringify(value)) === null));
});
