/**
 * Links relocatable EM_BPF objects (clang's output, one per C file) into an SBPF v3
 * program: the format the Solana loader reads with its strict ELF parser (SIMD-0189).
 * No stock linker writes it, so we do.
 *
 * Output layout, every part required by the loader's checks:
 *
 *   ELF header (ET_DYN, EM_BPF, e_flags 3)
 *   program header 0: PT_LOAD, PF_R, vaddr 0        -> rodata
 *   program header 1: PT_LOAD, PF_X, vaddr 1 << 32  -> bytecode
 *   rodata   (8 zero bytes, then every read-only data section, padded to 8)
 *   bytecode (every code section, in object then section order)
 *   .shstrtab, then section headers: null, .rodata, .text, .shstrtab
 *
 * The output holds no relocations: every one is applied here. The function is pure
 * and deterministic: the same object bytes always give the same program bytes.
 */
import {
  EM_BPF,
  ElfFormatError,
  ET_DYN,
  R_BPF_64_32,
  R_BPF_64_64,
  R_BPF_64_ABS64,
  R_BPF_64_NODYLD32,
  R_BPF_NONE,
  readBpfObject,
  SHF_ALLOC,
  SHF_EXECINSTR,
  SHF_WRITE,
  SHN_ABS,
  SHN_COMMON,
  SHN_UNDEF,
  SHT_NOBITS,
  SHT_PROGBITS,
  SHT_RELA,
  SHT_STRTAB,
  STB_GLOBAL,
  STB_LOCAL,
  STB_WEAK,
  STT_SECTION,
  type ElfObject,
  type ElfSection,
  type ElfSymbol,
} from './elf.ts';
import { isKnownSyscall, isKnownSyscallHash, syscallHash } from './syscalls.ts';

/** SBPF v3 places read-only data at VM address 0 and bytecode at 1 << 32 (SIMD-0189). */
export const RODATA_VADDR = 0n;
export const BYTECODE_VADDR = 1n << 32n;
export const SBPF_V3_FLAGS = 3;
export const ENTRYPOINT_SYMBOL = 'entrypoint';

/** The loader refuses a segment of 4 GiB or more; stop far below that. */
const SEGMENT_SIZE_MAX = 64 * 1024 * 1024;
/** Leading zero bytes of rodata, so that no object sits at the null address. */
const RODATA_NULL_GUARD_SIZE = 8;
const INSTRUCTION_SIZE = 8;

const OPCODE_LDDW = 0x18;
const OPCODE_CALL_IMM = 0x85;
const OPCODE_CALLX = 0x8d;
/** r0..r9: r10, the frame pointer, is never a call target. */
const CALLX_REGISTER_MAX = 9;
const CALL_SOURCE_SYSCALL = 0;
const CALL_SOURCE_INTERNAL = 1;

const ELF_HEADER_SIZE = 64;
const PROGRAM_HEADER_SIZE = 56;
const SECTION_HEADER_SIZE = 64;
const PROGRAM_HEADER_COUNT = 2;
const PT_LOAD = 1;
const PF_X = 1;
const PF_R = 4;

export type LinkErrorCode =
  | 'malformed-object'
  | 'writable-data'
  | 'unsupported-section'
  | 'unknown-relocation'
  | 'bad-relocation-site'
  | 'undefined-symbol'
  | 'duplicate-symbol'
  | 'unknown-syscall'
  | 'call-out-of-range'
  | 'bad-instruction'
  | 'no-entrypoint'
  | 'too-large';

export class LinkError extends Error {
  override name = 'LinkError';
  constructor(
    readonly code: LinkErrorCode,
    message: string,
  ) {
    super(message);
  }
}

/** Where an input section landed in the output. */
interface Placement {
  section: ElfSection;
  segment: 'rodata' | 'text';
  /** Byte offset inside its output segment. */
  offset: number;
}

interface InputObject {
  index: number;
  elf: ElfObject;
  /** By section index. */
  placements: Map<number, Placement>;
}

/** What a symbol reference means once every object is known. */
type Resolution =
  | { kind: 'defined'; placement: Placement; value: bigint; name: string }
  | { kind: 'absolute'; value: bigint; name: string }
  | { kind: 'undefined'; name: string };

interface LinkState {
  objects: InputObject[];
  /** Global and weak definitions, by name. */
  globals: Map<string, { object: InputObject; symbol: ElfSymbol }>;
  rodata: Uint8Array;
  text: Uint8Array;
}

/**
 * Links one object, or several (objects are laid out in the order given, which fixes
 * the output bytes). Several objects are linked here rather than merged first with
 * `ld.lld -r`: ld.lld-14 mis-applies R_BPF_64_64 addends when it merges read-only
 * sections (it adds the section offset to the lddw opcode, or refuses mergeable
 * string and constant sections with "offset is outside the section").
 */
export function linkProgram(objectBytes: Uint8Array | readonly Uint8Array[]): Uint8Array {
  const inputs = objectBytes instanceof Uint8Array ? [objectBytes] : objectBytes;
  if (inputs.length === 0) throw new LinkError('malformed-object', 'no objects to link');
  const objects: InputObject[] = inputs.map((bytes, index) => ({ index, elf: readObject(bytes, index, inputs.length), placements: new Map() }));

  const rodataSections: Array<{ object: InputObject; section: ElfSection }> = [];
  const textSections: Array<{ object: InputObject; section: ElfSection }> = [];
  for (const object of objects) {
    const classified = classifySections(object.elf, objectLabel(object, objects.length));
    rodataSections.push(...classified.rodataSections.map((section) => ({ object, section })));
    textSections.push(...classified.textSections.map((section) => ({ object, section })));
  }
  const rodataSize = place(rodataSections, 'rodata', RODATA_NULL_GUARD_SIZE);
  const textSize = place(textSections, 'text', 0);
  if (textSize === 0) throw new LinkError('no-entrypoint', 'the object has no code (no executable section)');
  if (rodataSize > SEGMENT_SIZE_MAX || textSize > SEGMENT_SIZE_MAX) {
    throw new LinkError('too-large', `program too large: ${rodataSize} bytes of rodata, ${textSize} bytes of code`);
  }

  const rodata = new Uint8Array(rodataSize);
  const text = new Uint8Array(textSize);
  for (const object of objects) {
    for (const placement of object.placements.values()) {
      (placement.segment === 'rodata' ? rodata : text).set(placement.section.data, placement.offset);
    }
  }

  const linker: LinkState = { objects, globals: collectGlobals(objects), rodata, text };
  for (const object of objects) {
    for (const relocationSection of object.elf.relocationSections) {
      const placement = object.placements.get(relocationSection.targetIndex);
      // Relocations of sections that are not part of the program (debug info, BTF) go with them.
      if (placement === undefined) continue;
      if (relocationSection.section.type === SHT_RELA) {
        throw new LinkError(
          'unknown-relocation',
          `${relocationSection.section.name} uses explicit addends (SHT_RELA); clang's BPF backend writes SHT_REL only`,
        );
      }
      for (const relocation of relocationSection.relocations) {
        applyRelocation(linker, object, placement, relocation.type, relocation.offset, relocation.symbolIndex);
      }
    }
  }
  finishCode(text);

  const entryOffset = findEntrypoint(linker);
  return writeProgram(rodata, text, BYTECODE_VADDR + BigInt(entryOffset));
}

function readObject(bytes: Uint8Array, index: number, count: number): ElfObject {
  try {
    return readBpfObject(bytes);
  } catch (error) {
    if (error instanceof ElfFormatError) {
      throw new LinkError('malformed-object', `cannot read ${count > 1 ? `object ${index}` : 'the object'}: ${error.message}`);
    }
    throw error;
  }
}

function objectLabel(object: InputObject, count: number): string {
  return count > 1 ? `object ${object.index}: ` : '';
}

function classifySections(object: ElfObject, label: string): { rodataSections: ElfSection[]; textSections: ElfSection[] } {
  const rodataSections: ElfSection[] = [];
  const textSections: ElfSection[] = [];
  for (const section of object.sections) {
    if ((section.flags & SHF_ALLOC) === 0n) continue;
    if ((section.flags & SHF_EXECINSTR) !== 0n) {
      if (section.type !== SHT_PROGBITS) throw new LinkError('unsupported-section', `${label}code section ${section.name} has no bytes`);
      if (section.size % INSTRUCTION_SIZE !== 0) {
        throw new LinkError('malformed-object', `${label}code section ${section.name} is ${section.size} bytes, not whole instructions`);
      }
      textSections.push(section);
    } else if (isReadOnlyDataName(section.name)) {
      // .data.rel.ro is marked writable in objects, but only a loader would ever write
      // it (to relocate); we relocate it here, so the program sees it as read-only.
      if (section.type !== SHT_PROGBITS) {
        throw new LinkError('unsupported-section', `${label}read-only section ${section.name} has no bytes`);
      }
      rodataSections.push(section);
    } else if (section.size === 0) {
      continue;
    } else if ((section.flags & SHF_WRITE) !== 0n || section.type === SHT_NOBITS) {
      throw new LinkError(
        'writable-data',
        `${label}writable section ${section.name} (${section.size} bytes): SBPF programs have no writable globals; ` +
          'make the data const, or keep state in accounts, on the stack or in the heap',
      );
    } else {
      throw new LinkError('unsupported-section', `${label}allocated section ${section.name} is neither code nor read-only data`);
    }
  }
  for (const symbol of object.symbols) {
    if (symbol.sectionIndex === SHN_COMMON) {
      throw new LinkError('writable-data', `${label}common symbol ${symbol.name} is an uninitialized writable global; SBPF programs have none`);
    }
  }
  return { rodataSections, textSections };
}

function isReadOnlyDataName(name: string): boolean {
  return name === '.rodata' || name.startsWith('.rodata.') || name === '.data.rel.ro' || name.startsWith('.data.rel.ro.');
}

/** Lays sections out one after another, each at its own alignment; returns the padded size. */
function place(sections: Array<{ object: InputObject; section: ElfSection }>, segment: Placement['segment'], start: number): number {
  let offset = start;
  for (const { object, section } of sections) {
    const alignment = segment === 'text' ? Math.max(INSTRUCTION_SIZE, section.alignment) : section.alignment;
    offset = alignUp(offset, alignment);
    object.placements.set(section.index, { section, segment, offset });
    offset += section.size;
  }
  return alignUp(offset, INSTRUCTION_SIZE);
}

function collectGlobals(objects: InputObject[]): LinkState['globals'] {
  const globals: LinkState['globals'] = new Map();
  for (const object of objects) {
    for (const symbol of object.elf.symbols) {
      if (symbol.sectionIndex === SHN_UNDEF || (symbol.binding !== STB_GLOBAL && symbol.binding !== STB_WEAK)) continue;
      const existing = globals.get(symbol.name);
      if (existing === undefined || (existing.symbol.binding === STB_WEAK && symbol.binding === STB_GLOBAL)) {
        globals.set(symbol.name, { object, symbol });
      } else if (existing.symbol.binding === STB_GLOBAL && symbol.binding === STB_GLOBAL) {
        throw new LinkError(
          'duplicate-symbol',
          `${symbol.name} is defined in object ${existing.object.index} and again in object ${object.index}`,
        );
      }
    }
  }
  return globals;
}

function resolveSymbol(linker: LinkState, object: InputObject, symbol: ElfSymbol): Resolution {
  let owner = object;
  let definition = symbol;
  if (symbol.binding !== STB_LOCAL) {
    const global = linker.globals.get(symbol.name);
    if (global !== undefined) {
      owner = global.object;
      definition = global.symbol;
    }
  }
  const name = describe(definition);
  if (definition.sectionIndex === SHN_UNDEF) return { kind: 'undefined', name: definition.name };
  if (definition.sectionIndex === SHN_ABS) return { kind: 'absolute', value: definition.value, name };
  const placement = owner.placements.get(definition.sectionIndex);
  if (placement === undefined) {
    throw new LinkError('undefined-symbol', `${name} is in a section that is not part of the program`);
  }
  return { kind: 'defined', placement, value: definition.value, name };
}

function applyRelocation(
  linker: LinkState,
  object: InputObject,
  placement: Placement,
  type: number,
  offset: number,
  symbolIndex: number,
): void {
  const symbol = object.elf.symbols[symbolIndex];
  if (symbol === undefined) throw new LinkError('malformed-object', `relocation refers to missing symbol ${symbolIndex}`);
  const site = `${objectLabel(object, linker.objects.length)}${placement.section.name}+0x${offset.toString(16)}`;
  if (type === R_BPF_NONE || type === R_BPF_64_NODYLD32) return;
  if (type !== R_BPF_64_64 && type !== R_BPF_64_32 && type !== R_BPF_64_ABS64) {
    throw new LinkError('unknown-relocation', `unknown relocation type ${type} at ${site} (against ${describe(symbol)})`);
  }
  const target = resolveSymbol(linker, object, symbol);

  if (placement.segment === 'text') {
    const at = placement.offset + offset;
    if (offset % INSTRUCTION_SIZE !== 0 || offset + INSTRUCTION_SIZE > placement.section.size) {
      throw new LinkError('bad-relocation-site', `relocation at ${site} is not on an instruction`);
    }
    const view = dataView(linker.text);
    const opcode = linker.text[at]!;
    if (type === R_BPF_64_64) {
      if (opcode !== OPCODE_LDDW || offset + 2 * INSTRUCTION_SIZE > placement.section.size) {
        throw new LinkError('bad-relocation-site', `R_BPF_64_64 at ${site} is on opcode 0x${opcode.toString(16)}, not lddw`);
      }
      // REL: the addend is the 64-bit value already split across the two immediates.
      const addend = BigInt(view.getUint32(at + 4, true)) | (BigInt(view.getUint32(at + 12, true)) << 32n);
      const address = (vmAddress(target, 'R_BPF_64_64', site) + addend) & 0xffff_ffff_ffff_ffffn;
      view.setUint32(at + 4, Number(address & 0xffff_ffffn), true);
      view.setUint32(at + 12, Number(address >> 32n), true);
      return;
    }
    if (type === R_BPF_64_32) {
      if (opcode !== OPCODE_CALL_IMM) {
        throw new LinkError('bad-relocation-site', `R_BPF_64_32 at ${site} is on opcode 0x${opcode.toString(16)}, not call`);
      }
      const registers = linker.text[at + 1]!;
      if (target.kind === 'undefined') {
        if (!isKnownSyscall(target.name)) {
          throw new LinkError('unknown-syscall', `call at ${site} to undefined function ${target.name}, which is not a Solana syscall`);
        }
        linker.text[at + 1] = (registers & 0x0f) | (CALL_SOURCE_SYSCALL << 4);
        view.setUint32(at + 4, syscallHash(target.name), true);
        return;
      }
      if (target.kind !== 'defined' || target.placement.segment !== 'text') {
        throw new LinkError('call-out-of-range', `call at ${site} targets ${target.name}, which is not code`);
      }
      // REL: LLVM stores (target offset in the symbol's section - 8) / 8 in the immediate,
      // so a call to the symbol itself holds -1.
      const addendBytes = (view.getInt32(at + 4, true) + 1) * INSTRUCTION_SIZE;
      const destination = target.placement.offset + Number(target.value) + addendBytes;
      if (destination < 0 || destination >= linker.text.length || destination % INSTRUCTION_SIZE !== 0) {
        throw new LinkError('call-out-of-range', `call at ${site} to ${target.name} lands outside the code`);
      }
      linker.text[at + 1] = (registers & 0x0f) | (CALL_SOURCE_INTERNAL << 4);
      view.setInt32(at + 4, destination / INSTRUCTION_SIZE - (at / INSTRUCTION_SIZE + 1), true);
      return;
    }
    throw new LinkError('unknown-relocation', `relocation type ${type} at ${site} does not apply to code`);
  }

  if (type === R_BPF_64_ABS64) {
    if (offset + 8 > placement.section.size) throw new LinkError('bad-relocation-site', `R_BPF_64_ABS64 at ${site} runs past the section`);
    const at = placement.offset + offset;
    const view = dataView(linker.rodata);
    const address = (vmAddress(target, 'R_BPF_64_ABS64', site) + view.getBigUint64(at, true)) & 0xffff_ffff_ffff_ffffn;
    view.setBigUint64(at, address, true);
    return;
  }
  throw new LinkError('unknown-relocation', `relocation type ${type} at ${site} does not apply to data`);
}

/** The VM address of a resolved symbol; only calls may name undefined ones (syscalls). */
function vmAddress(target: Resolution, relocation: string, site: string): bigint {
  if (target.kind === 'undefined') {
    throw new LinkError(
      'undefined-symbol',
      `${relocation} at ${site} refers to undefined symbol ${target.name}; only calls (to syscalls) may be undefined`,
    );
  }
  if (target.kind === 'absolute') return target.value;
  const base = target.placement.segment === 'text' ? BYTECODE_VADDR : RODATA_VADDR;
  return base + BigInt(target.placement.offset) + target.value;
}

/**
 * One pass over the finished code:
 * - internal calls the compiler resolved itself (within one section) must land inside the code;
 * - syscalls must name a syscall the loader knows (it would only fail when the call runs);
 * - `callx` is re-encoded: clang writes the target register in the immediate (the
 *   Linux eBPF encoding), SBPF v3 reads it from the destination register field.
 */
function finishCode(text: Uint8Array): void {
  const view = dataView(text);
  const instructionCount = text.length / INSTRUCTION_SIZE;
  for (let index = 0; index < instructionCount; index += 1) {
    const at = index * INSTRUCTION_SIZE;
    const opcode = text[at];
    if (opcode === OPCODE_LDDW) {
      index += 1;
      continue;
    }
    if (opcode === OPCODE_CALLX) {
      const destination = text[at + 1]! & 0x0f;
      const register = view.getInt32(at + 4, true);
      if (register < 0 || register > CALLX_REGISTER_MAX || (destination !== 0 && destination !== register)) {
        throw new LinkError('bad-instruction', `callx at instruction ${index} names register ${register} (dst field ${destination})`);
      }
      text[at + 1] = (text[at + 1]! & 0xf0) | register;
      view.setInt32(at + 4, 0, true);
      continue;
    }
    if (opcode !== OPCODE_CALL_IMM) continue;
    if (text[at + 1]! >> 4 === CALL_SOURCE_SYSCALL) {
      // A call through a constant address (the SDK's SOL_SBPFV3 headers) lands here too.
      const hash = view.getUint32(at + 4, true);
      if (!isKnownSyscallHash(hash)) {
        throw new LinkError('unknown-syscall', `call at instruction ${index} to syscall hash 0x${hash.toString(16)}, which names no known syscall`);
      }
      continue;
    }
    const target = index + 1 + view.getInt32(at + 4, true);
    if (target < 0 || target >= instructionCount) {
      throw new LinkError('call-out-of-range', `internal call at instruction ${index} targets instruction ${target}, outside the code`);
    }
  }
}

function findEntrypoint(linker: LinkState): number {
  const entry = linker.globals.get(ENTRYPOINT_SYMBOL);
  if (entry === undefined || entry.symbol.binding !== STB_GLOBAL) {
    throw new LinkError('no-entrypoint', `no global \`${ENTRYPOINT_SYMBOL}\` function is defined`);
  }
  const placement = entry.object.placements.get(entry.symbol.sectionIndex);
  if (placement === undefined || placement.segment !== 'text') {
    throw new LinkError('no-entrypoint', `\`${ENTRYPOINT_SYMBOL}\` is not in an executable section`);
  }
  const offset = placement.offset + Number(entry.symbol.value);
  if (offset % INSTRUCTION_SIZE !== 0) throw new LinkError('no-entrypoint', `\`${ENTRYPOINT_SYMBOL}\` is not instruction-aligned`);
  return offset;
}

function writeProgram(rodata: Uint8Array, text: Uint8Array, entry: bigint): Uint8Array {
  const sectionNames = ['', '.rodata', '.text', '.shstrtab'];
  const { table: sectionNameTable, offsets: nameOffsets } = stringTable(sectionNames);

  const rodataOffset = ELF_HEADER_SIZE + PROGRAM_HEADER_COUNT * PROGRAM_HEADER_SIZE;
  const textOffset = rodataOffset + rodata.length;
  const namesOffset = textOffset + text.length;
  const sectionHeadersOffset = alignUp(namesOffset + sectionNameTable.length, 8);
  const fileSize = sectionHeadersOffset + sectionNames.length * SECTION_HEADER_SIZE;

  const output = new Uint8Array(fileSize);
  const view = dataView(output);
  output.set([0x7f, 0x45, 0x4c, 0x46, 2 /* 64-bit */, 1 /* little-endian */, 1 /* EV_CURRENT */], 0);
  view.setUint16(16, ET_DYN, true);
  view.setUint16(18, EM_BPF, true);
  view.setUint32(20, 1, true);
  view.setBigUint64(24, entry, true);
  view.setBigUint64(32, BigInt(ELF_HEADER_SIZE), true);
  view.setBigUint64(40, BigInt(sectionHeadersOffset), true);
  view.setUint32(48, SBPF_V3_FLAGS, true);
  view.setUint16(52, ELF_HEADER_SIZE, true);
  view.setUint16(54, PROGRAM_HEADER_SIZE, true);
  view.setUint16(56, PROGRAM_HEADER_COUNT, true);
  view.setUint16(58, SECTION_HEADER_SIZE, true);
  view.setUint16(60, sectionNames.length, true);
  view.setUint16(62, sectionNames.length - 1, true);

  writeProgramHeader(view, ELF_HEADER_SIZE, PF_R, rodataOffset, RODATA_VADDR, rodata.length);
  writeProgramHeader(view, ELF_HEADER_SIZE + PROGRAM_HEADER_SIZE, PF_X, textOffset, BYTECODE_VADDR, text.length);
  output.set(rodata, rodataOffset);
  output.set(text, textOffset);
  output.set(sectionNameTable, namesOffset);

  const header = (index: number) => sectionHeadersOffset + index * SECTION_HEADER_SIZE;
  writeSectionHeader(view, header(1), nameOffsets[1]!, SHT_PROGBITS, SHF_ALLOC, RODATA_VADDR, rodataOffset, rodata.length, 8);
  writeSectionHeader(view, header(2), nameOffsets[2]!, SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, BYTECODE_VADDR, textOffset, text.length, 8);
  writeSectionHeader(view, header(3), nameOffsets[3]!, SHT_STRTAB, 0n, 0n, namesOffset, sectionNameTable.length, 1);
  return output;
}

function writeProgramHeader(view: DataView, at: number, flags: number, offset: number, vaddr: bigint, size: number): void {
  view.setUint32(at, PT_LOAD, true);
  view.setUint32(at + 4, flags, true);
  view.setBigUint64(at + 8, BigInt(offset), true);
  view.setBigUint64(at + 16, vaddr, true);
  view.setBigUint64(at + 24, vaddr, true);
  view.setBigUint64(at + 32, BigInt(size), true);
  view.setBigUint64(at + 40, BigInt(size), true);
  view.setBigUint64(at + 48, BigInt(INSTRUCTION_SIZE), true);
}

function writeSectionHeader(
  view: DataView,
  at: number,
  name: number,
  type: number,
  flags: bigint,
  address: bigint,
  offset: number,
  size: number,
  alignment: number,
): void {
  view.setUint32(at, name, true);
  view.setUint32(at + 4, type, true);
  view.setBigUint64(at + 8, flags, true);
  view.setBigUint64(at + 16, address, true);
  view.setBigUint64(at + 24, BigInt(offset), true);
  view.setBigUint64(at + 32, BigInt(size), true);
  view.setBigUint64(at + 48, BigInt(alignment), true);
}

function stringTable(strings: string[]): { table: Uint8Array; offsets: number[] } {
  const encoder = new TextEncoder();
  const parts: Uint8Array[] = [];
  const offsets: number[] = [];
  let size = 0;
  for (const value of strings) {
    offsets.push(size);
    const bytes = encoder.encode(`${value}\0`);
    parts.push(bytes);
    size += bytes.length;
  }
  const table = new Uint8Array(size);
  let at = 0;
  for (const part of parts) {
    table.set(part, at);
    at += part.length;
  }
  return { table, offsets };
}

function describe(symbol: ElfSymbol): string {
  if (symbol.type === STT_SECTION) return `section symbol ${symbol.index}`;
  return symbol.name === '' ? `symbol ${symbol.index}` : `symbol ${symbol.name}`;
}

function dataView(bytes: Uint8Array): DataView {
  return new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

function alignUp(value: number, alignment: number): number {
  return Math.ceil(value / alignment) * alignment;
}
