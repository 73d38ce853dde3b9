/**
 * A JSON text with one key twice in an object (`{"amount":"1","amount":"2"}`) is valid JSON, and
 * JSON.parse keeps the last value; a gateway, a logger or a signature check in front of the
 * service may keep the first, and so see another amount than the one moved. The API refuses such
 * a body rather than choose. JSON.parse cannot tell (the first value is gone by the time a
 * reviver runs), so the text is scanned once more, after it parsed: it is known to be valid.
 */

/** The path of the first key given twice in an object of `text` (keys as written), or null. */
export function duplicateKeyPath(text: string): string[] | null {
  // One frame per open object or array: an object's keys so far and the key being read; an
  // array's index.
  const stack: Array<{ keys: Set<string> | null; at: string }> = [];
  let index = 0;
  while (index < text.length) {
    const char = text[index]!;
    if (char === '"') {
      const end = stringEnd(text, index);
      const frame = stack[stack.length - 1];
      // A string in an object is a key when a colon follows it (after blanks); else a value.
      if (frame?.keys && nextSignificant(text, end) === ':') {
        const key = JSON.parse(text.slice(index, end)) as string;
        if (frame.keys.has(key)) return [...stack.slice(0, -1).map((enclosing) => enclosing.at), key];
        frame.keys.add(key);
        frame.at = key;
      }
      index = end;
      continue;
    }
    if (char === '{') stack.push({ keys: new Set(), at: '' });
    else if (char === '[') stack.push({ keys: null, at: '0' });
    else if (char === '}' || char === ']') stack.pop();
    else if (char === ',') {
      const frame = stack[stack.length - 1];
      if (frame && !frame.keys) frame.at = String(Number(frame.at) + 1);
    }
    index += 1;
  }
  return null;
}

/** The index just past the string starting at `start` (its opening quote). */
function stringEnd(text: string, start: number): number {
  let index = start + 1;
  while (index < text.length) {
    const char = text[index];
    if (char === '\\') index += 2;
    else if (char === '"') return index + 1;
    else index += 1;
  }
  return index;
}

function nextSignificant(text: string, from: number): string | undefined {
  let index = from;
  while (index < text.length && (text[index] === ' ' || text[index] === '\n' || text[index] === '\r' || text[index] === '\t')) index += 1;
  return text[index];
}
