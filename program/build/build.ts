/**
 * Builds the on-chain program: clang compiles each `program/src/*.c` to a BPF object and
 * our linker turns the objects into the SBPF v3 program committed at
 * `program/agent_vault.so`. The objects live in a temporary directory that is always
 * removed.
 *
 * Neither `ld.lld -r` nor `llvm-objcopy` takes part: ld.lld-14 corrupts R_BPF_64_64
 * addends when it merges read-only sections (see linker.ts), so the linker takes every
 * object itself, and it already leaves debug and BTF sections behind.
 *
 * CLI: `node --import tsx program/build/build.ts [--check]`
 *   (no flag)  build and write program/agent_vault.so
 *   --check    rebuild to a temporary file and compare with the committed one; exit 1 if they differ
 */
import { execFile, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readdirSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { linkProgram } from './linker.ts';

const execFileAsync = promisify(execFile);

export const REPOSITORY_ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
export const PROGRAM_SOURCE_DIR = join(REPOSITORY_ROOT, 'program', 'src');
export const PROGRAM_ARTIFACT_PATH = join(REPOSITORY_ROOT, 'program', 'agent_vault.so');
/** The linker's test program (two objects; see fixtures/entrypoint.c). */
export const FIXTURE_SOURCES: readonly string[] = ['entrypoint.c', 'error_codes.c'].map((name) =>
  join(REPOSITORY_ROOT, 'program', 'build', 'fixtures', name),
);

export const TOOLCHAIN_INSTALL_HINT = 'apt-get install -y clang';

/** Flags every compilation gets; `-Werror` makes warnings build failures. */
export const COMPILER_FLAGS: readonly string[] = [
  '-target', 'bpf',
  '-mcpu=v3',
  '-O2',
  '-fno-builtin',
  '-ffreestanding',
  '-nostdlib',
  '-Wall',
  '-Werror',
];

const TOOL_TIMEOUT_MS = 120_000;
const TOOL_OUTPUT_BYTES_MAX = 16 * 1024 * 1024;
const SOURCE_COUNT_MAX = 256;

type ToolName = 'clang';
const TOOL_CANDIDATES: Record<ToolName, readonly string[]> = {
  clang: ['clang', 'clang-14'],
};

export class ToolchainMissingError extends Error {
  override name = 'ToolchainMissingError';
  constructor(readonly tool: ToolName) {
    super(`${tool} not found (tried ${TOOL_CANDIDATES[tool].join(', ')}); install the toolchain with \`${TOOLCHAIN_INSTALL_HINT}\``);
  }
}

export class BuildError extends Error {
  override name = 'BuildError';
}

export class ReproducibilityError extends Error {
  override name = 'ReproducibilityError';
}

export interface BuildProgramOptions {
  /** C files to compile; defaults to every `program/src/*.c`. */
  sources?: string[];
  /** Where to write the program; defaults to `program/agent_vault.so`. */
  outPath?: string;
  /** Appended to the standard flags (tests use it, e.g. `-ffunction-sections`). */
  extraCompilerFlags?: string[];
}

export interface BuildResult {
  outPath: string;
  sources: string[];
  /** In bytes. */
  size: number;
  sha256: string;
}

/** A committed artifact that matches its sources. */
export interface ReproducibilityReport {
  path: string;
  /** In bytes. */
  size: number;
  sha256: string;
}

const resolvedTools = new Map<ToolName, string>();

/** The first candidate of a tool that runs, or a ToolchainMissingError naming the package. */
export function findTool(tool: ToolName): string {
  const known = resolvedTools.get(tool);
  if (known !== undefined) return known;
  for (const candidate of TOOL_CANDIDATES[tool]) {
    const probe = spawnSync(candidate, ['--version'], { stdio: 'ignore', timeout: TOOL_TIMEOUT_MS });
    if (probe.error === undefined && probe.status === 0) {
      resolvedTools.set(tool, candidate);
      return candidate;
    }
  }
  throw new ToolchainMissingError(tool);
}

/** True when the compiler is installed. */
export function isToolchainInstalled(): boolean {
  try {
    for (const tool of Object.keys(TOOL_CANDIDATES) as ToolName[]) findTool(tool);
    return true;
  } catch (error) {
    if (error instanceof ToolchainMissingError) return false;
    throw error;
  }
}

export function programSources(): string[] {
  if (!existsSync(PROGRAM_SOURCE_DIR)) return [];
  return readdirSync(PROGRAM_SOURCE_DIR)
    .filter((name) => name.endsWith('.c'))
    .sort(compareCodeUnits)
    .map((name) => join(PROGRAM_SOURCE_DIR, name));
}

/** Compiles and links the program; returns the program's bytes without writing them. */
export async function compileProgram(options: Pick<BuildProgramOptions, 'sources' | 'extraCompilerFlags'> = {}): Promise<Uint8Array> {
  return linkProgram(await compileObjects(options));
}

/** Compiles each source to a relocatable BPF object, in source order. */
export async function compileObjects(options: Pick<BuildProgramOptions, 'sources' | 'extraCompilerFlags'> = {}): Promise<Uint8Array[]> {
  const sources = (options.sources ?? programSources()).map((source) => resolve(source));
  if (sources.length === 0) throw new BuildError(`no C sources to build (looked in ${relative(process.cwd(), PROGRAM_SOURCE_DIR) || '.'})`);
  if (sources.length > SOURCE_COUNT_MAX) throw new BuildError(`${sources.length} sources; at most ${SOURCE_COUNT_MAX}`);
  const clang = findTool('clang');

  const workDir = await mkdtemp(join(tmpdir(), 'agent-vault-build-'));
  try {
    const objects: Uint8Array[] = [];
    for (const [index, source] of sources.entries()) {
      const object = join(workDir, `${String(index).padStart(3, '0')}-${basename(source, '.c')}.o`);
      await run(clang, [
        ...COMPILER_FLAGS,
        // Nothing from the build machine's paths may reach the output.
        `-ffile-prefix-map=${REPOSITORY_ROOT}=.`,
        `-fdebug-prefix-map=${REPOSITORY_ROOT}=.`,
        ...(options.extraCompilerFlags ?? []),
        '-c', source,
        '-o', object,
      ]);
      objects.push(new Uint8Array(await readFile(object)));
    }
    return objects;
  } finally {
    await rm(workDir, { recursive: true, force: true });
  }
}

export async function buildProgram(options: BuildProgramOptions = {}): Promise<BuildResult> {
  const sources = (options.sources ?? programSources()).map((source) => resolve(source));
  const outPath = resolve(options.outPath ?? PROGRAM_ARTIFACT_PATH);
  const program = await compileProgram({ sources, extraCompilerFlags: options.extraCompilerFlags });
  await mkdir(dirname(outPath), { recursive: true });
  // Write then rename, so a failed build never leaves half a program behind.
  const partialPath = `${outPath}.partial`;
  await writeFile(partialPath, program);
  await rename(partialPath, outPath);
  return { outPath, sources, size: program.length, sha256: sha256Hex(program) };
}

/**
 * Rebuilds the program and compares it, byte for byte, with the committed artifact.
 * Returns what matched; throws ReproducibilityError when the bytes differ or the
 * artifact is missing.
 */
export async function checkProgramReproducible(options: Pick<BuildProgramOptions, 'sources' | 'outPath'> = {}): Promise<ReproducibilityReport> {
  const committedPath = resolve(options.outPath ?? PROGRAM_ARTIFACT_PATH);
  const rebuilt = await compileProgram({ sources: options.sources });
  const rebuiltSha256 = sha256Hex(rebuilt);
  const shownPath = relative(process.cwd(), committedPath) || committedPath;
  if (!existsSync(committedPath)) {
    throw new ReproducibilityError(`${shownPath} does not exist; build it with \`agent-vault program build\` and commit it`);
  }
  const committed = new Uint8Array(await readFile(committedPath));
  const committedSha256 = sha256Hex(committed);
  if (committedSha256 !== rebuiltSha256) {
    throw new ReproducibilityError(
      `${shownPath} differs from a fresh build of its sources: committed ${committed.length} bytes, sha256 ${committedSha256}; ` +
        `rebuilt ${rebuilt.length} bytes, sha256 ${rebuiltSha256}${describeFirstDifference(committed, rebuilt)}. ` +
        'Rebuild with `agent-vault program build` and commit the result.',
    );
  }
  return { path: committedPath, size: rebuilt.length, sha256: rebuiltSha256 };
}

async function run(tool: string, args: string[]): Promise<void> {
  try {
    await execFileAsync(tool, args, { cwd: REPOSITORY_ROOT, timeout: TOOL_TIMEOUT_MS, maxBuffer: TOOL_OUTPUT_BYTES_MAX });
  } catch (error) {
    const failure = error as { stderr?: string; stdout?: string; killed?: boolean; message: string };
    const output = `${failure.stderr ?? ''}${failure.stdout ?? ''}`.trim() || failure.message;
    const reason = failure.killed === true ? `timed out after ${TOOL_TIMEOUT_MS} ms` : 'failed';
    throw new BuildError(`${tool} ${reason}:\n${output}`);
  }
}

function describeFirstDifference(a: Uint8Array, b: Uint8Array): string {
  const length = Math.min(a.length, b.length);
  for (let at = 0; at < length; at += 1) {
    if (a[at] !== b[at]) return ` (first difference at byte 0x${at.toString(16)})`;
  }
  return '';
}

function sha256Hex(bytes: Uint8Array): string {
  return createHash('sha256').update(bytes).digest('hex');
}

function compareCodeUnits(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

async function main(argv: string[]): Promise<number> {
  const check = argv.includes('--check');
  const unknown = argv.filter((argument) => argument !== '--check');
  if (unknown.length > 0) {
    process.stderr.write(`unknown argument ${unknown[0]}\nusage: build.ts [--check]\n`);
    return 2;
  }
  if (check) {
    const report = await checkProgramReproducible();
    process.stdout.write(`${relative(process.cwd(), report.path)} matches a fresh build (sha256 ${report.sha256})\n`);
    return 0;
  }
  const result = await buildProgram();
  process.stdout.write(`wrote ${relative(process.cwd(), result.outPath)} (${result.size} bytes, sha256 ${result.sha256})\n`);
  return 0;
}

if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(resolve(process.argv[1])).href) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (error: unknown) => {
      process.stderr.write(`${error instanceof Error ? error.message : String(error)}\n`);
      process.exit(1);
    },
  );
}
