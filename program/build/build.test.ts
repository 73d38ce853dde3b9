import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { readdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import {
  buildProgram,
  checkProgramReproducible,
  FIXTURE_SOURCES,
  isToolchainInstalled,
  REPOSITORY_ROOT,
  ReproducibilityError,
  TOOLCHAIN_INSTALL_HINT,
  ToolchainMissingError,
} from './build.ts';

const skip = isToolchainInstalled() ? false : `clang is not installed (${TOOLCHAIN_INSTALL_HINT})`;

test('a missing compiler names the package to install', () => {
  const error = new ToolchainMissingError('clang');
  assert.match(error.message, /clang not found \(tried clang, clang-14\)/);
  assert.ok(error.message.includes('apt-get install -y clang'));
});

describe('buildProgram', { skip }, () => {
  let workDir: string;
  before(async () => {
    workDir = await mkdtemp(join(tmpdir(), 'agent-vault-build-test-'));
  });
  after(async () => {
    await rm(workDir, { recursive: true, force: true });
  });

  // The guarantee: the build never leaves compiler output in the source tree.
  test('writes only the program, and reports its size and hash', async () => {
    const fixtureDir = join(REPOSITORY_ROOT, 'program', 'build', 'fixtures');
    const before = (await readdir(fixtureDir)).sort();
    const outPath = join(workDir, 'out', 'fixture.so');
    const result = await buildProgram({ sources: [...FIXTURE_SOURCES], outPath });
    const bytes = await readFile(outPath);
    assert.equal(result.size, bytes.length);
    assert.match(result.sha256, /^[0-9a-f]{64}$/);
    assert.deepEqual((await readdir(fixtureDir)).sort(), before);
    assert.deepEqual(await readdir(join(workDir, 'out')), ['fixture.so']);
  });

  // The guarantee: a committed artifact that drifted from its sources is caught.
  test('checkProgramReproducible accepts a fresh build and refuses a changed or missing one', async () => {
    const outPath = join(workDir, 'committed.so');
    const built = await buildProgram({ sources: [...FIXTURE_SOURCES], outPath });
    const report = await checkProgramReproducible({ sources: [...FIXTURE_SOURCES], outPath });
    assert.equal(report.sha256, built.sha256);

    const changed = await readFile(outPath);
    const last = changed.length - 1;
    changed.writeUInt8(changed.readUInt8(last) ^ 0xff, last);
    await writeFile(outPath, changed);
    await assert.rejects(checkProgramReproducible({ sources: [...FIXTURE_SOURCES], outPath }), (error: unknown) => {
      return error instanceof ReproducibilityError && /differs from a fresh build/.test(error.message) && /first difference at byte 0x/.test(error.message);
    });
    await assert.rejects(
      checkProgramReproducible({ sources: [...FIXTURE_SOURCES], outPath: join(workDir, 'absent.so') }),
      (error: unknown) => error instanceof ReproducibilityError && /does not exist/.test(error.message),
    );
  });

  test('a compile error is reported with clang\'s message', async () => {
    const source = join(workDir, 'broken.c');
    await writeFile(source, 'unsigned long entrypoint(void) { int unused; return 0; }\n');
    await assert.rejects(buildProgram({ sources: [source], outPath: join(workDir, 'broken.so') }), /unused variable 'unused'/);
  });

  test('the CLI refuses an unknown flag with exit code 2', () => {
    assert.throws(
      () => execFileSync(process.execPath, ['--import', 'tsx', join(REPOSITORY_ROOT, 'program/build/build.ts'), '--nope'], { stdio: 'pipe' }),
      (error: unknown) => (error as { status?: number }).status === 2,
    );
  });
});
