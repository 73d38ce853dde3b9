/**
 * A reader for the one kind of ELF file the program build produces: a little-endian
 * ELF64 relocatable object for EM_BPF, as `clang -target bpf -c` (and `ld.lld -r`)
 * write it. It decodes sections, symbols and relocations and checks every offset
 * against the file's bounds, so that the linker can trust what it gets.
 */

export const EM_BPF = 247;
export const ET_REL = 1;
export const ET_DYN = 3;

export const SHT_NULL = 0;
export const SHT_PROGBITS = 1;
export const SHT_SYMTAB = 2;
export const SHT_STRTAB = 3;
export const SHT_RELA = 4;
export const SHT_NOBITS = 8;
export const SHT_REL = 9;

export const SHF_WRITE = 0x1n;
export const SHF_ALLOC = 0x2n;
export const SHF_EXECINSTR = 0x4n;

export const SHN_UNDEF = 0;
export const SHN_LORESERVE = 0xff00;
export const SHN_ABS = 0xfff1;
export const SHN_COMMON = 0xfff2;

export const STT_NOTYPE = 0;
export const STT_OBJECT = 1;
export const STT_FUNC = 2;
export const STT_SECTION = 3;
export const STT_FILE = 4;

export const STB_LOCAL = 0;
export const STB_GLOBAL = 1;
export const STB_WEAK = 2;

/** BPF relocation types, as LLVM's `ELFRelocs/BPF.def` numbers them. */
export const R_BPF_NONE = 0;
export const R_BPF_64_64 = 1;
export const R_BPF_64_ABS64 = 2;
export const R_BPF_64_ABS32 = 3;
export const R_BPF_64_NODYLD32 = 4;
export const R_BPF_64_32 = 10;

const ELF_HEADER_SIZE = 64;
const SECTION_HEADER_SIZE = 64;
const SYMBOL_SIZE = 24;
const REL_SIZE = 16;
const RELA_SIZE = 24;
/** A name longer than this is a corrupt string table, not a real symbol. */
const NAME_LENGTH_MAX = 4096;

export interface ElfSection {
  index: number;
  name: string;
  type: number;
  flags: bigint;
  /** Offset of the section's bytes in the file (meaningless for SHT_NOBITS). */
  offset: number;
  size: number;
  link: number;
  info: number;
  alignment: number;
  entrySize: number;
  /** The section's bytes; empty for SHT_NOBITS. A view into the object, never copied. */
  data: Uint8Array;
}

export interface ElfSymbol {
  index: number;
  name: string;
  /** STT_* */
  type: number;
  /** STB_* */
  binding: number;
  /** Section index, or SHN_UNDEF / SHN_ABS / SHN_COMMON. */
  sectionIndex: number;
  /** In a relocatable object: the offset inside the symbol's section. */
  value: bigint;
  size: bigint;
}

export interface ElfRelocation {
  /** Offset inside the section the relocation applies to. */
  offset: number;
  type: number;
  symbolIndex: number;
  /** Explicit addend for SHT_RELA; undefined for SHT_REL (the addend sits in the bytes). */
  addend: bigint | undefined;
}

export interface ElfRelocationSection {
  section: ElfSection;
  /** Index of the section these relocations patch. */
  targetIndex: number;
  relocations: ElfRelocation[];
}

export interface ElfObject {
  sections: ElfSection[];
  /** The symbol table, index 0 included (the null symbol); empty if there is none. */
  symbols: ElfSymbol[];
  relocationSections: ElfRelocationSection[];
}

export class ElfFormatError extends Error {
  override name = 'ElfFormatError';
}

/** Reads a relocatable EM_BPF object. Throws ElfFormatError on anything malformed. */
export function readBpfObject(bytes: Uint8Array): ElfObject {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (bytes.length < ELF_HEADER_SIZE) throw new ElfFormatError(`object is ${bytes.length} bytes, shorter than an ELF header`);
  if (bytes[0] !== 0x7f || bytes[1] !== 0x45 || bytes[2] !== 0x4c || bytes[3] !== 0x46) {
    throw new ElfFormatError('not an ELF file (bad magic)');
  }
  if (bytes[4] !== 2) throw new ElfFormatError('not a 64-bit ELF file');
  if (bytes[5] !== 1) throw new ElfFormatError('not a little-endian ELF file');
  const type = view.getUint16(16, true);
  const machine = view.getUint16(18, true);
  if (type !== ET_REL) throw new ElfFormatError(`ELF type is ${type}, expected a relocatable object (${ET_REL})`);
  if (machine !== EM_BPF) throw new ElfFormatError(`ELF machine is ${machine}, expected EM_BPF (${EM_BPF})`);

  const sectionHeaderOffset = toSafeNumber(view.getBigUint64(40, true), 'e_shoff');
  const sectionHeaderSize = view.getUint16(58, true);
  const sectionCount = view.getUint16(60, true);
  const sectionNamesIndex = view.getUint16(62, true);
  if (sectionHeaderSize !== SECTION_HEADER_SIZE) {
    throw new ElfFormatError(`section header size is ${sectionHeaderSize}, expected ${SECTION_HEADER_SIZE}`);
  }
  // Extended section numbering (e_shnum = 0) only appears beyond 0xff00 sections.
  if (sectionCount === 0 || sectionCount >= SHN_LORESERVE) throw new ElfFormatError(`unsupported section count ${sectionCount}`);
  checkRange(bytes, sectionHeaderOffset, sectionCount * SECTION_HEADER_SIZE, 'section header table');
  if (sectionNamesIndex >= sectionCount) throw new ElfFormatError('section name table index out of range');

  const rawSections = [];
  for (let index = 0; index < sectionCount; index += 1) {
    const at = sectionHeaderOffset + index * SECTION_HEADER_SIZE;
    const sectionType = view.getUint32(at + 4, true);
    const offset = toSafeNumber(view.getBigUint64(at + 24, true), 'sh_offset');
    const size = toSafeNumber(view.getBigUint64(at + 32, true), 'sh_size');
    if (sectionType !== SHT_NOBITS && sectionType !== SHT_NULL) checkRange(bytes, offset, size, `section ${index}`);
    rawSections.push({
      index,
      nameOffset: view.getUint32(at, true),
      type: sectionType,
      flags: view.getBigUint64(at + 8, true),
      offset,
      size,
      link: view.getUint32(at + 40, true),
      info: view.getUint32(at + 44, true),
      alignment: toSafeNumber(view.getBigUint64(at + 48, true), 'sh_addralign'),
      entrySize: toSafeNumber(view.getBigUint64(at + 56, true), 'sh_entsize'),
    });
  }
  const sectionNames = rawSections[sectionNamesIndex]!;
  const sectionNameBytes = bytes.subarray(sectionNames.offset, sectionNames.offset + sectionNames.size);
  const sections: ElfSection[] = rawSections.map((raw) => ({
    index: raw.index,
    name: readString(sectionNameBytes, raw.nameOffset, 'section name'),
    type: raw.type,
    flags: raw.flags,
    offset: raw.offset,
    size: raw.size,
    link: raw.link,
    info: raw.info,
    alignment: Math.max(1, raw.alignment),
    entrySize: raw.entrySize,
    data: raw.type === SHT_NOBITS || raw.type === SHT_NULL ? new Uint8Array(0) : bytes.subarray(raw.offset, raw.offset + raw.size),
  }));

  const symbolTables = sections.filter((section) => section.type === SHT_SYMTAB);
  if (symbolTables.length > 1) throw new ElfFormatError('more than one symbol table');
  const symbols = symbolTables[0] === undefined ? [] : readSymbols(symbolTables[0], sections);

  const relocationSections: ElfRelocationSection[] = [];
  for (const section of sections) {
    if (section.type !== SHT_REL && section.type !== SHT_RELA) continue;
    if (section.info === 0 || section.info >= sections.length) {
      throw new ElfFormatError(`relocation section ${section.name} targets section ${section.info}, which does not exist`);
    }
    relocationSections.push({
      section,
      targetIndex: section.info,
      relocations: readRelocations(section, symbols.length),
    });
  }
  return { sections, symbols, relocationSections };
}

function readSymbols(table: ElfSection, sections: ElfSection[]): ElfSymbol[] {
  if (table.size % SYMBOL_SIZE !== 0) throw new ElfFormatError(`symbol table size ${table.size} is not a multiple of ${SYMBOL_SIZE}`);
  const names = sections[table.link];
  if (names === undefined || names.type !== SHT_STRTAB) throw new ElfFormatError('symbol table has no string table');
  const view = new DataView(table.data.buffer, table.data.byteOffset, table.data.byteLength);
  const symbols: ElfSymbol[] = [];
  for (let index = 0; index < table.size / SYMBOL_SIZE; index += 1) {
    const at = index * SYMBOL_SIZE;
    const info = view.getUint8(at + 4);
    const sectionIndex = view.getUint16(at + 6, true);
    const type = info & 0xf;
    if (sectionIndex !== SHN_UNDEF && sectionIndex < SHN_LORESERVE && sectionIndex >= sections.length) {
      throw new ElfFormatError(`symbol ${index} refers to section ${sectionIndex}, which does not exist`);
    }
    symbols.push({
      index,
      name: readString(names.data, view.getUint32(at, true), 'symbol name'),
      type,
      binding: info >> 4,
      sectionIndex,
      value: view.getBigUint64(at + 8, true),
      size: view.getBigUint64(at + 16, true),
    });
  }
  return symbols;
}

function readRelocations(section: ElfSection, symbolCount: number): ElfRelocation[] {
  const explicitAddend = section.type === SHT_RELA;
  const entrySize = explicitAddend ? RELA_SIZE : REL_SIZE;
  if (section.size % entrySize !== 0) {
    throw new ElfFormatError(`relocation section ${section.name} size ${section.size} is not a multiple of ${entrySize}`);
  }
  const view = new DataView(section.data.buffer, section.data.byteOffset, section.data.byteLength);
  const relocations: ElfRelocation[] = [];
  for (let at = 0; at < section.size; at += entrySize) {
    const info = view.getBigUint64(at + 8, true);
    const symbolIndex = Number(info >> 32n);
    if (symbolIndex >= symbolCount) {
      throw new ElfFormatError(`relocation in ${section.name} refers to symbol ${symbolIndex}, which does not exist`);
    }
    relocations.push({
      offset: toSafeNumber(view.getBigUint64(at, true), 'r_offset'),
      type: Number(info & 0xffff_ffffn),
      symbolIndex,
      addend: explicitAddend ? view.getBigInt64(at + 16, true) : undefined,
    });
  }
  return relocations;
}

function readString(table: Uint8Array, offset: number, what: string): string {
  if (offset >= table.length) {
    if (offset === 0 && table.length === 0) return '';
    throw new ElfFormatError(`${what} offset ${offset} is outside its string table`);
  }
  const end = table.indexOf(0, offset);
  if (end === -1 || end - offset > NAME_LENGTH_MAX) throw new ElfFormatError(`${what} at ${offset} is not terminated`);
  return new TextDecoder('utf-8', { fatal: false }).decode(table.subarray(offset, end));
}

function checkRange(bytes: Uint8Array, offset: number, size: number, what: string): void {
  if (offset + size > bytes.length) {
    throw new ElfFormatError(`${what} (offset ${offset}, ${size} bytes) runs past the end of the ${bytes.length}-byte file`);
  }
}

function toSafeNumber(value: bigint, field: string): number {
  if (value > BigInt(Number.MAX_SAFE_INTEGER)) throw new ElfFormatError(`${field} ${value} is too large`);
  return Number(value);
}
