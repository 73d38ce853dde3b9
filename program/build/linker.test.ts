/**
 * The linker, end to end: the fixture program is compiled with the real clang, linked
 * by us, deployed through the real BPF Upgradeable Loader in LiteSVM and run. Refusals
 * are checked on real clang objects, some of them patched by hand.
 */
import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import {
  appendTransactionMessageInstructions,
  createTransactionMessage,
  generateKeyPairSigner,
  lamports,
  pipe,
  setTransactionMessageFeePayerSigner,
  signTransactionMessageWithSigners,
  type Address,
  type KeyPairSigner,
} from '@solana/kit';
import { FailedTransactionMetadata, FeatureSet, LiteSVM } from 'litesvm';
import { deployUpgradeableProgram } from '../../src/validator/loader.ts';
import { buildProgram, compileObjects, compileProgram, FIXTURE_SOURCES, isToolchainInstalled, TOOLCHAIN_INSTALL_HINT } from './build.ts';
import { readBpfObject, R_BPF_64_32, SHT_REL } from './elf.ts';
import { BYTECODE_VADDR, LinkError, linkProgram } from './linker.ts';

const skip = isToolchainInstalled() ? false : `clang is not installed (${TOOLCHAIN_INSTALL_HINT})`;
const FIXTURE_GREETING_LOG = 'Program log: fixture: hello from the linker';
/** fixtures/error_codes.c: error_codes[selector & 7] = 6000 + (selector & 7). */
const FIXTURE_ERROR_BASE = 6000;
const FIXTURE_ERROR_NO_INSTRUCTION_DATA = 0x101;

describe('linkProgram', { skip }, () => {
  let workDir: string;
  let fixture: Uint8Array;

  before(async () => {
    workDir = await mkdtemp(join(tmpdir(), 'agent-vault-linker-test-'));
    const built = await buildProgram({ sources: [...FIXTURE_SOURCES], outPath: join(workDir, 'fixture.so') });
    fixture = new Uint8Array(await readFile(built.outPath));
  });
  after(async () => {
    await rm(workDir, { recursive: true, force: true });
  });

  const featureSets: Array<[string, () => LiteSVM]> = [
    ['default features', () => new LiteSVM()],
    ['all features enabled', () => new LiteSVM().withFeatureSet(FeatureSet.allEnabled()).withBuiltins()],
  ];
  for (const [name, makeSvm] of featureSets) {
    // The guarantee: our output passes the loader's strict ELF parser and verifier, and
    // syscalls, internal calls, cross-object calls and rodata addresses all resolve.
    test(`deploys through the upgradeable loader and runs (${name})`, async () => {
      const { svm, payer, program } = await deployFixture(makeSvm, fixture);

      const selected = await invoke(svm, payer, program, new Uint8Array([3]));
      assert.ok(selected.logs.includes(FIXTURE_GREETING_LOG), selected.logs.join('\n'));
      assert.equal(selected.customError, FIXTURE_ERROR_BASE + 3);

      const wrapped = await invoke(svm, payer, program, new Uint8Array([13]));
      assert.equal(wrapped.customError, FIXTURE_ERROR_BASE + (13 & 7));

      const empty = await invoke(svm, payer, program, new Uint8Array(0));
      assert.equal(empty.customError, FIXTURE_ERROR_NO_INSTRUCTION_DATA);
      assert.ok(selected.computeUnits > 0n && selected.computeUnits < 1_000n, `fixture used ${selected.computeUnits} CU`);
    });
  }

  // The guarantee: a program bigger than one transaction is written in several chunks, in order.
  test('deploys a program that needs several Write transactions', async () => {
    const tableLength = 1024;
    const source = join(workDir, 'large.c');
    await writeFile(
      source,
      [
        'typedef unsigned long uint64_t;',
        `static const uint64_t table[${tableLength}] = { ${Array.from({ length: tableLength }, (_, i) => i * 7 + 1).join(', ')} };`,
        'uint64_t entrypoint(const unsigned char *input) {',
        `  return table[(input[16] | (input[17] << 8)) & ${tableLength - 1}];`,
        '}',
      ].join('\n'),
    );
    const programBytes = await compileProgram({ sources: [source] });
    assert.ok(programBytes.length > 3 * 1232, `program is only ${programBytes.length} bytes`);
    const { svm, payer, program, transactionCount } = await deployFixture(() => new LiteSVM(), programBytes);
    assert.ok(transactionCount >= 5, `deployed in ${transactionCount} transactions`);
    const index = 1000;
    const result = await invoke(svm, payer, program, new Uint8Array([index & 0xff, index >> 8]));
    assert.equal(result.customError, index * 7 + 1);
  });

  // The guarantee: addresses stored in data (R_BPF_64_ABS64) point at the right bytes.
  test('resolves a table of string pointers in read-only data', async () => {
    const programBytes = await compileProgram({ sources: [await writeSnippet(workDir, [
      'typedef unsigned long uint64_t;',
      'extern void sol_log_(const char *, uint64_t);',
      'static const char *const names[3] = {"zero", "one", "two"};',
      'static const uint64_t lengths[3] = {4, 3, 3};',
      'uint64_t entrypoint(const unsigned char *input) {',
      '  uint64_t i = input[16] % 3;',
      '  sol_log_(names[i], lengths[i]);',
      '  return 7000 + i;',
      '}',
    ])] });
    const { svm, payer, program } = await deployFixture(() => new LiteSVM(), programBytes);
    const result = await invoke(svm, payer, program, new Uint8Array([2]));
    assert.equal(result.customError, 7002);
    assert.ok(result.logs.includes('Program log: two'), result.logs.join('\n'));
  });

  // The guarantee: clang's callx encoding (register in the immediate) is rewritten for SBPF v3.
  test('calls through a table of function pointers', async () => {
    const programBytes = await compileProgram({ sources: [await writeSnippet(workDir, [
      'typedef unsigned long uint64_t;',
      '__attribute__((noinline)) static uint64_t add_one(uint64_t x) { return x + 1; }',
      '__attribute__((noinline)) static uint64_t add_two(uint64_t x) { return x + 2; }',
      'static uint64_t (*const handlers[2])(uint64_t) = {add_one, add_two};',
      'uint64_t entrypoint(const unsigned char *input) { return 8000 + handlers[input[16] & 1](input[17]); }',
    ])] });
    const { svm, payer, program } = await deployFixture(() => new LiteSVM(), programBytes);
    assert.equal((await invoke(svm, payer, program, new Uint8Array([0, 40]))).customError, 8041);
    assert.equal((await invoke(svm, payer, program, new Uint8Array([1, 40]))).customError, 8042);
  });

  // The guarantee: the committed artifact can be checked by rebuilding it.
  test('is deterministic, and ignores debug info and function sections', async () => {
    const again = await compileProgram({ sources: [...FIXTURE_SOURCES] });
    assert.deepEqual(again, fixture);
    const withDebugInfo = await compileProgram({ sources: [...FIXTURE_SOURCES], extraCompilerFlags: ['-g'] });
    assert.deepEqual(withDebugInfo, fixture);
    const withSections = await compileProgram({ sources: [...FIXTURE_SOURCES], extraCompilerFlags: ['-ffunction-sections', '-fdata-sections'] });
    assert.equal(withSections.length, fixture.length);
  });

  test('writes the SBPF v3 layout: ET_DYN, e_flags 3, rodata at 0 then code at 1 << 32', () => {
    const view = new DataView(fixture.buffer, fixture.byteOffset, fixture.byteLength);
    assert.equal(view.getUint16(16, true), 3, 'ET_DYN');
    assert.equal(view.getUint16(18, true), 247, 'EM_BPF');
    assert.equal(view.getUint32(48, true), 3, 'e_flags');
    assert.equal(view.getUint16(56, true), 2, 'two program headers');
    const rodataOffset = Number(view.getBigUint64(64 + 8, true));
    assert.equal(view.getBigUint64(64 + 16, true), 0n);
    assert.equal(view.getBigUint64(64 + 56 + 16, true), BYTECODE_VADDR);
    assert.deepEqual([...fixture.subarray(rodataOffset, rodataOffset + 8)], [0, 0, 0, 0, 0, 0, 0, 0]);
    assert.equal(view.getBigUint64(24, true), BYTECODE_VADDR, 'entrypoint is the first function');
  });

  // The guarantee: the runtime has no writable globals, so the build must fail, not the program.
  test('refuses writable globals (.data and .bss)', async () => {
    for (const [declaration, section] of [
      ['static unsigned long counter = 5;', '.data'],
      ['static unsigned long counter;', '.bss'],
    ]) {
      const objects = await compileSnippet(
        workDir,
        `${declaration}\nunsigned long entrypoint(const unsigned char *input) { counter += input[0]; return counter; }`,
      );
      assert.throws(
        () => linkProgram(objects),
        (error: unknown) => error instanceof LinkError && error.code === 'writable-data' && error.message.includes(`writable section ${section}`),
      );
    }
  });

  test('refuses an unknown relocation type', async () => {
    const [object] = await compileObjects({ sources: [FIXTURE_SOURCES[0]!] });
    const patched = new Uint8Array(object!);
    const relocations = readBpfObject(patched).relocationSections.find((r) => r.section.type === SHT_REL)!;
    const callRelocation = relocations.relocations.findIndex((r) => r.type === R_BPF_64_32);
    // r_info's low 32 bits are the type.
    new DataView(patched.buffer).setUint32(relocations.section.offset + callRelocation * 16 + 8, 99, true);
    assert.throws(() => linkProgram(patched), (error: unknown) => {
      return error instanceof LinkError && error.code === 'unknown-relocation' && /unknown relocation type 99 at \.text\+0x/.test(error.message);
    });
  });

  test('refuses an undefined symbol that is not called', async () => {
    const objects = await compileSnippet(
      workDir,
      'extern const unsigned long limit;\nunsigned long entrypoint(const unsigned char *input) { return limit + input[0]; }',
    );
    assert.throws(
      () => linkProgram(objects),
      (error: unknown) => error instanceof LinkError && error.code === 'undefined-symbol' && error.message.includes('undefined symbol limit'),
    );
  });

  // The loader only resolves a syscall when the call runs; a typo must fail the build instead.
  test('refuses a call to an undefined function that is not a syscall', async () => {
    const objects = await compileSnippet(
      workDir,
      'extern void sol_lgo_(const char *, unsigned long);\nunsigned long entrypoint(const unsigned char *input) { sol_lgo_("x", 1); return 0; }',
    );
    assert.throws(
      () => linkProgram(objects),
      (error: unknown) => error instanceof LinkError && error.code === 'unknown-syscall' && error.message.includes('sol_lgo_'),
    );
  });

  test('refuses a call through a constant address that is no syscall hash', async () => {
    const objects = await compileSnippet(
      workDir,
      'typedef void (*log_fn)(const char *, unsigned long);\nunsigned long entrypoint(const unsigned char *input) { ((log_fn)0x12345678)("x", 1); return 0; }',
    );
    assert.throws(
      () => linkProgram(objects),
      (error: unknown) => error instanceof LinkError && error.code === 'unknown-syscall' && error.message.includes('0x12345678'),
    );
  });

  test('refuses two definitions of one global and a missing entrypoint', async () => {
    const [first] = await compileSnippet(workDir, 'unsigned long entrypoint(const unsigned char *input) { return input[0]; }');
    assert.throws(() => linkProgram([first!, first!]), (error: unknown) => error instanceof LinkError && error.code === 'duplicate-symbol');
    const [noEntry] = await compileSnippet(workDir, 'unsigned long start(const unsigned char *input) { return input[0]; }');
    assert.throws(() => linkProgram(noEntry!), (error: unknown) => error instanceof LinkError && error.code === 'no-entrypoint');
  });
});

async function writeSnippet(workDir: string, lines: string[]): Promise<string> {
  const path = join(workDir, `snippet-${Math.random().toString(36).slice(2)}.c`);
  await writeFile(path, `${lines.join('\n')}\n`);
  return path;
}

async function compileSnippet(workDir: string, source: string): Promise<Uint8Array[]> {
  return compileObjects({ sources: [await writeSnippet(workDir, [source])] });
}

async function deployFixture(makeSvm: () => LiteSVM, programBytes: Uint8Array) {
  const svm = makeSvm();
  const payer = await generateKeyPairSigner();
  const programKeypair = await generateKeyPairSigner();
  svm.airdrop(payer.address, lamports(100_000_000_000n));
  const deployed = await deployUpgradeableProgram(svm, { payer, programKeypair, upgradeAuthority: payer, programBytes });
  return { svm, payer, program: deployed.programAddress, transactionCount: deployed.transactionCount };
}

async function invoke(svm: LiteSVM, payer: KeyPairSigner, program: Address, data: Uint8Array) {
  const message = pipe(
    createTransactionMessage({ version: 0 }),
    (m) => setTransactionMessageFeePayerSigner(payer, m),
    (m) => svm.setTransactionMessageLifetimeUsingLatestBlockhash(m),
    (m) => appendTransactionMessageInstructions([{ programAddress: program, accounts: [], data }], m),
  );
  const result = svm.sendTransaction(await signTransactionMessageWithSigners(message));
  assert.ok(result instanceof FailedTransactionMetadata, 'the fixture always returns an error');
  // litesvm's index does not export the error classes, so read them by shape:
  // TransactionErrorInstructionError { index, err() } holding InstructionErrorCustom { code }.
  const error: unknown = result.err();
  assert.ok(typeof error === 'object' && error !== null && 'index' in error && 'err' in error && typeof error.err === 'function', String(error));
  const instructionError: unknown = error.err();
  assert.ok(typeof instructionError === 'object' && instructionError !== null && 'code' in instructionError, String(instructionError));
  return { customError: instructionError.code, logs: result.meta().logs(), computeUnits: result.meta().computeUnitsConsumed() };
}
