/**
 * The recipient directory through the real HTTP stack and database, and resolveRecipient (what
 * payments use) against the same database.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { getAddressDecoder } from '@solana/kit';
import { startTestService, type TestService } from '../../test/harness.ts';
import { fundedWallet, newPolicy } from '../../test/fixtures.ts';
import { ServiceError } from '../errors/errors.ts';
import { normaliseCategory, normaliseDomain, recipientName, resolveRecipient } from './recipients.ts';

const newAddress = (): string => getAddressDecoder().decode(randomBytes(32));

/** The ServiceError a use-case refused with (and a failure when it did not refuse). */
async function refusal(promise: Promise<unknown>): Promise<ServiceError> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof ServiceError) return error;
    throw error;
  }
  assert.fail('expected a refusal');
}

describe('domain and category syntax', () => {
  test('a domain is a DNS name with a dot, case-insensitive, stored lowercase', () => {
    assert.equal(normaliseDomain('Shop.Example.COM'), 'shop.example.com');
    assert.equal(normaliseDomain('a-1.b2'), 'a-1.b2');
    assert.equal(normaliseDomain(`${'a'.repeat(63)}.com`), `${'a'.repeat(63)}.com`);
    const longest = `${Array.from({ length: 4 }, () => 'a'.repeat(62)).join('.')}.c`;
    assert.equal(longest.length, 253);
    assert.equal(normaliseDomain(longest), longest);
  });

  test('anything else is not a domain', () => {
    for (const text of ['', 'localhost', 'example.com.', '.example.com', 'a..com', '-a.com', 'a-.com', 'a_b.com',
      'exa mple.com', ' example.com', `${'a'.repeat(64)}.com`, `${'a'.repeat(250)}.com`, 'ex\u212Aample.com', 'bücher.de', '1.2.3.4', 'example.123']) {
      assert.equal(normaliseDomain(text), null, JSON.stringify(text));
    }
  });

  test('a category is 1–64 characters of [a-z0-9_.-], stored lowercase', () => {
    assert.equal(normaliseCategory('Food.Delivery_2-x'), 'food.delivery_2-x');
    for (const text of ['', 'a b', 'x'.repeat(65), 'café']) assert.equal(normaliseCategory(text), null, JSON.stringify(text));
  });
});

describe('recipient directory API', () => {
  let t: TestService;
  let viewerKey: string;
  let agentKey: string;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService();
    viewerKey = await t.createKey('viewer');
    agentKey = await t.createKey('agent');
    other = await t.createOrganization();
  });
  after(async () => { await t.close(); });

  const create = (body: Record<string, unknown>, key?: string) => t.request('POST', '/v1/recipients', { body, key });
  const countOf = async (key?: string): Promise<number> =>
    (await t.request('GET', '/v1/recipients?limit=100', { key })).body.data.length;

  test('create, read, change and delete a recipient', async () => {
    const address = newAddress();
    const created = await create({ domain: 'Shop.Example.com', address, category: 'Food', label: 'Lunch place' });
    assert.equal(created.status, 200);
    assert.match(created.body.recipient_id, /^rcp_/);
    assert.equal(created.body.domain, 'shop.example.com');
    assert.equal(created.body.address, address);
    assert.equal(created.body.category, 'food');
    assert.equal(created.body.label, 'Lunch place');
    assert.equal(created.body.created_at, created.body.updated_at);
    const id = created.body.recipient_id;

    const read = await t.request('GET', `/v1/recipients/${id}`, { key: viewerKey });
    assert.equal(read.status, 200);
    assert.deepEqual(read.body, created.body);

    const newer = newAddress();
    const changed = await t.request('PATCH', `/v1/recipients/${id}`, { body: { address: newer, category: 'Travel', label: null } });
    assert.equal(changed.status, 200);
    assert.equal(changed.body.address, newer);
    assert.equal(changed.body.category, 'travel');
    assert.equal(changed.body.label, null);
    assert.equal(changed.body.domain, 'shop.example.com');
    assert.ok(changed.body.updated_at >= created.body.updated_at, 'updated_at never goes back');

    // Sending the unchanged domain (in any case) is not a change, so it is accepted.
    const same = await t.request('PATCH', `/v1/recipients/${id}`, { body: { domain: 'SHOP.example.com', category: null } });
    assert.equal(same.status, 200);
    assert.equal(same.body.category, null);
    assert.equal(same.body.address, newer);
    // Nothing to change: the entry is as it was, updated_at included (the test clock moves it otherwise).
    await t.request('POST', '/v1/test_helpers/clock/advance', { body: { seconds: 60 } });
    const unchanged = await t.request('PATCH', `/v1/recipients/${id}`, { body: { domain: 'shop.example.com', label: null } });
    assert.deepEqual(unchanged.body, same.body);

    const deleted = await t.request('DELETE', `/v1/recipients/${id}`);
    assert.equal(deleted.status, 200);
    assert.deepEqual(deleted.body, { recipient_id: id, deleted: true });
    for (const [method, body] of [['GET', undefined], ['PATCH', { label: 'x' }], ['DELETE', undefined]] as const) {
      const gone = await t.request(method, `/v1/recipients/${id}`, { body });
      assert.equal(gone.status, 404, method);
      assert.equal(gone.body.error.code, 'recipient_not_found');
    }
    // A deleted domain is free again.
    const again = await create({ domain: 'shop.example.com', address });
    assert.equal(again.status, 200);
    assert.notEqual(again.body.recipient_id, id);
    assert.equal(again.body.category, null);
    assert.equal(again.body.label, null);
  });

  test('invalid domains and addresses are invalid_recipient, bad categories invalid_request; nothing is stored', async () => {
    const before = await countOf();
    const cases: Array<[Record<string, unknown>, string, string]> = [
      [{ domain: 'localhost', address: newAddress() }, 'invalid_recipient', 'domain'],
      [{ domain: 'bad_domain.com', address: newAddress() }, 'invalid_recipient', 'domain'],
      [{ domain: `${'a'.repeat(251)}.io`, address: newAddress() }, 'invalid_recipient', 'domain'],
      [{ domain: 'ok.example', address: 'not-an-address' }, 'invalid_recipient', 'address'],
      [{ domain: 'ok.example', address: '1111' }, 'invalid_recipient', 'address'],
      [{ domain: 'ok.example', address: `${newAddress()} ` }, 'invalid_recipient', 'address'],
      [{ domain: 'ok.example', address: newAddress(), category: 'has space' }, 'invalid_request', 'category'],
      [{ domain: 'ok.example', address: newAddress(), category: '' }, 'invalid_request', 'category'],
      [{ domain: 'ok.example', address: newAddress(), label: 'x'.repeat(201) }, 'invalid_request', 'label'],
      [{ domain: 'ok.example', address: newAddress(), colour: 'red' }, 'invalid_request', 'colour'],
      [{ address: newAddress() }, 'invalid_request', 'domain'],
      [{ domain: 'ok.example', address: 42 }, 'invalid_request', 'address'],
    ];
    for (const [body, code, param] of cases) {
      const response = await create(body);
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, code, JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    assert.equal(await countOf(), before);
  });

  test('a domain already in the directory is refused whatever its case; the first entry stays as it was', async () => {
    const first = await create({ domain: 'dup.example.org', address: newAddress(), category: 'tools' });
    assert.equal(first.status, 200);
    const before = await countOf();
    const duplicate = await create({ domain: 'DUP.example.org', address: newAddress() });
    assert.equal(duplicate.status, 400);
    assert.equal(duplicate.body.error.code, 'invalid_request');
    assert.equal(duplicate.body.error.param, 'domain');
    assert.equal(await countOf(), before);
    assert.deepEqual((await t.request('GET', `/v1/recipients/${first.body.recipient_id}`)).body, first.body);
    // Uniqueness is per organisation.
    const elsewhere = await create({ domain: 'dup.example.org', address: newAddress() }, other.adminKey);
    assert.equal(elsewhere.status, 200);
  });

  test('a refused change changes nothing: another domain, bad values, an empty body', async () => {
    const created = await create({ domain: 'fixed.example.net', address: newAddress(), category: 'ads', label: 'Ads' });
    const url = `/v1/recipients/${created.body.recipient_id}`;
    const cases: Array<[unknown, string, string]> = [
      [{ domain: 'other.example.net', label: 'renamed' }, 'invalid_request', 'domain'],
      [{ address: 'nope', label: 'renamed' }, 'invalid_recipient', 'address'],
      [{ category: 'no spaces please', label: 'renamed' }, 'invalid_request', 'category'],
      [{ label: '' }, 'invalid_request', 'label'],
      [{}, 'invalid_request', 'body'],
    ];
    for (const [body, code, param] of cases) {
      const response = await t.request('PATCH', url, { body });
      assert.equal(response.status, 400, JSON.stringify(body));
      assert.equal(response.body.error.code, code, JSON.stringify(body));
      assert.equal(response.body.error.param, param, JSON.stringify(body));
    }
    assert.deepEqual((await t.request('GET', url)).body, created.body);
  });

  test('another organisation\'s recipient answers exactly like a missing one, and is left alone', async () => {
    const created = await create({ domain: 'private.example.com', address: newAddress() });
    const url = `/v1/recipients/${created.body.recipient_id}`;
    const missing = '/v1/recipients/rcp_00000000000000000000000000';
    for (const [method, body] of [['GET', undefined], ['PATCH', { label: 'mine now' }], ['DELETE', undefined]] as const) {
      const theirs = await t.request(method, url, { key: other.adminKey, body });
      const absent = await t.request(method, missing, { key: other.adminKey, body });
      assert.equal(theirs.status, 404, method);
      assert.equal(absent.status, 404, method);
      assert.equal(theirs.body.error.code, 'recipient_not_found', method);
      assert.equal(absent.body.error.code, 'recipient_not_found', method);
      assert.equal(theirs.body.error.param, absent.body.error.param, method);
    }
    const listed = await t.request('GET', '/v1/recipients?domain=private.example.com', { key: other.adminKey });
    assert.deepEqual(listed.body.data, []);
    assert.deepEqual((await t.request('GET', url)).body, created.body);
  });

  test('a viewer reads but cannot write; an agent key cannot read the directory; no key is 401', async () => {
    const created = await create({ domain: 'roles.example.com', address: newAddress() });
    const url = `/v1/recipients/${created.body.recipient_id}`;
    assert.equal((await t.request('GET', url, { key: viewerKey })).status, 200);
    assert.equal((await t.request('GET', '/v1/recipients', { key: viewerKey })).status, 200);
    const before = await countOf();
    const writes = [
      ['POST', '/v1/recipients', { domain: 'viewer.example.com', address: newAddress() }],
      ['PATCH', url, { label: 'viewer was here' }],
      ['DELETE', url, undefined],
    ] as const;
    for (const [method, path, body] of writes) {
      const response = await t.request(method, path, { key: viewerKey, body });
      assert.equal(response.status, 403, method);
      assert.equal(response.body.error.code, 'insufficient_permissions', method);
    }
    const agentRead = await t.request('GET', '/v1/recipients', { key: agentKey });
    assert.equal(agentRead.status, 403);
    assert.equal((await t.request('GET', '/v1/recipients', { key: null })).status, 401);
    assert.equal(await countOf(), before);
    assert.deepEqual((await t.request('GET', url)).body, created.body);
    const operator = await t.createKey('operator');
    assert.equal((await create({ domain: 'operator.example.com', address: newAddress() }, operator)).status, 200);
  });

  test('lists page newest first without gaps or repeats, and filter by category and domain', async () => {
    const org = await t.createOrganization('Paging organization');
    const ids: string[] = [];
    for (let i = 0; i < 7; i += 1) {
      const response = await create({ domain: `r${i}.paging.test`, address: newAddress(), category: i % 2 ? 'odd' : 'even' }, org.adminKey);
      assert.equal(response.status, 200);
      ids.push(response.body.recipient_id);
    }
    const deleted = ids[3]!;
    assert.equal((await t.request('DELETE', `/v1/recipients/${deleted}`, { key: org.adminKey })).status, 200);

    const all = await t.request('GET', '/v1/recipients?limit=100', { key: org.adminKey });
    assert.equal(all.body.has_more, false);
    assert.equal(all.body.next_cursor, null);
    const expected = all.body.data.map((r: { recipient_id: string }) => r.recipient_id);
    assert.deepEqual([...expected].sort(), ids.filter((id) => id !== deleted).sort());
    const times = all.body.data.map((r: { created_at: string }) => r.created_at);
    assert.deepEqual(times, [...times].sort().reverse(), 'newest first');

    const paged: string[] = [];
    let cursor: string | null = null;
    for (let pages = 0; pages < 10; pages += 1) {
      const url: string = `/v1/recipients?limit=2${cursor ? `&cursor=${cursor}` : ''}`;
      const page = await t.request('GET', url, { key: org.adminKey });
      assert.equal(page.status, 200);
      assert.ok(page.body.data.length <= 2, 'a page holds at most limit items');
      paged.push(...page.body.data.map((r: { recipient_id: string }) => r.recipient_id));
      cursor = page.body.next_cursor;
      assert.equal(page.body.has_more, cursor !== null);
      if (!cursor) break;
    }
    assert.deepEqual(paged, expected);

    const odd = await t.request('GET', '/v1/recipients?category=ODD', { key: org.adminKey });
    assert.deepEqual(odd.body.data.map((r: { domain: string }) => r.domain).sort(), ['r1.paging.test', 'r5.paging.test']);
    const one = await t.request('GET', '/v1/recipients?domain=R2.Paging.Test', { key: org.adminKey });
    assert.deepEqual(one.body.data.map((r: { domain: string }) => r.domain), ['r2.paging.test']);
    const none = await t.request('GET', '/v1/recipients?domain=r3.paging.test', { key: org.adminKey });
    assert.deepEqual(none.body.data, []);

    for (const [query, param] of [['limit=0', 'limit'], ['limit=101', 'limit'], ['cursor=garbage', 'cursor'],
      ['category=a%20b', 'category'], ['domain=nodot', 'domain'], ['colour=red', 'colour']]) {
      const bad = await t.request('GET', `/v1/recipients?${query}`, { key: org.adminKey });
      assert.equal(bad.status, 400, query);
      assert.equal(bad.body.error.code, 'invalid_request', query);
      assert.equal(bad.body.error.param, param, query);
    }
  });
});

describe('resolveRecipient', () => {
  let t: TestService;
  let other: { orgId: string; adminKey: string };
  before(async () => {
    t = await startTestService();
    other = await t.createOrganization();
  });
  after(async () => { await t.close(); });

  const add = async (body: Record<string, unknown>, key?: string): Promise<string> => {
    const response = await t.request('POST', '/v1/recipients', { body, key });
    assert.equal(response.status, 200, JSON.stringify(response.body));
    return response.body.recipient_id;
  };

  test('an address outside the directory pays as is, under the request\'s category (lowercase) or none', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    assert.deepEqual(await resolveRecipient(db, t.orgId, address),
      { address, domain: null, category: null, categories: [], recipientId: null });
    assert.deepEqual(await resolveRecipient(db, t.orgId, address, 'Groceries'),
      { address, domain: null, category: 'groceries', categories: ['groceries'], recipientId: null });
    assert.deepEqual(await resolveRecipient(db, t.orgId, address, null),
      { address, domain: null, category: null, categories: [], recipientId: null });
  });

  test('an address in the directory takes the directory\'s category over the request\'s', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    const id = await add({ domain: 'casino.example.com', address, category: 'Gambling' });
    assert.deepEqual(await resolveRecipient(db, t.orgId, address, 'food'),
      { address, domain: null, category: 'gambling', categories: ['gambling'], recipientId: id });
    // Another organisation's directory says nothing about this address for us.
    assert.deepEqual(await resolveRecipient(db, other.orgId, address, 'food'),
      { address, domain: null, category: 'food', categories: ['food'], recipientId: null });
  });

  test('an address listed only without a category falls back to the request\'s', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    const id = await add({ domain: 'plain.example.com', address });
    assert.deepEqual(await resolveRecipient(db, t.orgId, address, 'Books'),
      { address, domain: null, category: 'books', categories: ['books'], recipientId: id });
  });

  test('among entries for one address, one with a category wins, so a bare address cannot dodge a blocked category', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    await add({ domain: 'first-uncategorised.example.com', address });
    const categorised = await add({ domain: 'second-categorised.example.com', address, category: 'gambling' });
    assert.deepEqual(await resolveRecipient(db, t.orgId, address, 'food'),
      { address, domain: null, category: 'gambling', categories: ['gambling'], recipientId: categorised });
  });

  test('a second domain for an address without a category of its own counts under the address\'s: no dodging by name', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    await add({ domain: 'dodge-casino.example.com', address, category: 'gambling' });
    const cdn = await add({ domain: 'dodge-cdn.example.com', address });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'dodge-cdn.example.com', 'food'),
      { address, domain: 'dodge-cdn.example.com', category: 'gambling', categories: ['gambling'], recipientId: cdn });
    const wallet = await fundedWallet(t, '5', await newPolicy(t, { blockedCategories: ['gambling'] }));
    for (const to of ['dodge-cdn.example.com', 'dodge-casino.example.com', address]) {
      const check = await t.request('POST', '/v1/payments/check', { body: { walletId: wallet.wallet_id, to, amount: '1', category: 'food' } });
      assert.equal(check.status, 200, JSON.stringify(check.body));
      assert.equal(check.body.allowed, false, to);
      assert.equal(check.body.violation.rule, 'blocked_categories', to);
    }
  });

  // Guarantee (docs/recipients.md): a second domain for an address the directory puts in
  // `gambling` counts as `gambling` too, whatever its own entry says; so does the bare address.
  test('every category the live entries give an address is the payment\'s to judge: its own first, then the others oldest first', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    const shop = await add({ domain: 'multi-shop.example.com', address, category: 'shopping' });
    await add({ domain: 'multi-plain.example.com', address });
    const casino = await add({ domain: 'multi-casino.example.com', address, category: 'Gambling' });
    await add({ domain: 'multi-shop2.example.com', address, category: 'shopping' });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'multi-shop.example.com', 'food'),
      { address, domain: 'multi-shop.example.com', category: 'shopping', categories: ['shopping', 'gambling'], recipientId: shop });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'Multi-Casino.example.com'),
      { address, domain: 'multi-casino.example.com', category: 'gambling', categories: ['gambling', 'shopping'], recipientId: casino });
    assert.deepEqual((await resolveRecipient(db, t.orgId, 'multi-plain.example.com', 'food')).categories, ['shopping', 'gambling'],
      'an entry without a category: the address\'s, the request\'s not among them');
    assert.deepEqual((await resolveRecipient(db, t.orgId, address, 'food')).categories, ['shopping', 'gambling'], 'the bare address');
    // Deleted entries stop counting; another organisation's never do.
    assert.equal((await t.request('DELETE', `/v1/recipients/${casino}`)).status, 200);
    assert.deepEqual((await resolveRecipient(db, t.orgId, address)).categories, ['shopping']);
    await add({ domain: 'multi-theirs.example.com', address, category: 'adult' }, other.adminKey);
    assert.deepEqual((await resolveRecipient(db, t.orgId, 'multi-shop.example.com')).categories, ['shopping']);
    assert.deepEqual((await resolveRecipient(db, other.orgId, address, 'food')).categories, ['adult']);
  });

  test('a payment names a domain in its directory form and an address as given', () => {
    const address = newAddress();
    assert.equal(recipientName(' API.Vendor.IO '), 'api.vendor.io');
    assert.equal(recipientName(` ${address} `), address);
    assert.equal(recipientName(address.toLowerCase()), address.toLowerCase(), 'base58 is case-sensitive: never lowercased');
    assert.equal(recipientName(' Not A Domain '), 'Not A Domain', 'neither: left for resolveRecipient to refuse');
  });

  test('a domain resolves case-insensitively to its address and category', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    const id = await add({ domain: 'api.vendor.io', address, category: 'saas' });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'API.Vendor.IO', 'food'),
      { address, domain: 'api.vendor.io', category: 'saas', categories: ['saas'], recipientId: id });
    const bare = newAddress();
    const bareId = await add({ domain: 'nocat.vendor.io', address: bare });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'nocat.vendor.io', 'Food'),
      { address: bare, domain: 'nocat.vendor.io', category: 'food', categories: ['food'], recipientId: bareId });
    assert.deepEqual(await resolveRecipient(db, t.orgId, 'nocat.vendor.io'),
      { address: bare, domain: 'nocat.vendor.io', category: null, categories: [], recipientId: bareId });
  });

  test('a change of address applies to the next resolution', async () => {
    const db = t.service.ctx.db;
    const id = await add({ domain: 'moving.example.com', address: newAddress() });
    const moved = newAddress();
    assert.equal((await t.request('PATCH', `/v1/recipients/${id}`, { body: { address: moved } })).status, 200);
    assert.equal((await resolveRecipient(db, t.orgId, 'moving.example.com')).address, moved);
  });

  test('an unknown, deleted or other organisation\'s domain is invalid_recipient on `to`', async () => {
    const db = t.service.ctx.db;
    const gone = await add({ domain: 'gone.example.com', address: newAddress() });
    assert.equal((await t.request('DELETE', `/v1/recipients/${gone}`)).status, 200);
    await add({ domain: 'theirs.example.com', address: newAddress() }, other.adminKey);
    for (const to of ['unknown.example.com', 'gone.example.com', 'theirs.example.com']) {
      const error = await refusal(resolveRecipient(db, t.orgId, to));
      assert.equal(error.code, 'invalid_recipient', to);
      assert.equal(error.details.param, 'to', to);
    }
  });

  test('what is neither an address nor a domain is invalid_recipient on `to`', async () => {
    const db = t.service.ctx.db;
    const address = newAddress();
    for (const to of ['', ' ', 'no-dot', `${address} `, ` ${address}`, 'exa mple.com', 'x'.repeat(254),
      `${'a'.repeat(250)}.com`, '0OIl0OIl0OIl0OIl0OIl0OIl0OIl0OIl0OIl']) {
      const error = await refusal(resolveRecipient(db, t.orgId, to));
      assert.equal(error.code, 'invalid_recipient', JSON.stringify(to));
      assert.equal(error.details.param, 'to', JSON.stringify(to));
    }
  });

  test('a malformed request category is invalid_request on `category`', async () => {
    const error = await refusal(resolveRecipient(t.service.ctx.db, t.orgId, newAddress(), 'not a category'));
    assert.equal(error.code, 'invalid_request');
    assert.equal(error.details.param, 'category');
  });
});
