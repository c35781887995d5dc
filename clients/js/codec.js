// The Aqueduct wire protocol, version 1: the frame codec of docs/protocol.md.
//
// Pure ECMAScript (Uint8Array, DataView, TextEncoder/TextDecoder, BigInt): runs in browsers,
// workers, Node, Deno and Bun. No Node-only API is used.
//
// Decoding separates "need more bytes" (a result, `{ incomplete: true, need }`) from "invalid"
// (a thrown `FrameError` naming the byte offset, what was wrong and the ERROR code a broker
// would answer). `FrameDecoder` decodes a byte stream incrementally.

/** The first byte of every frame. */
export const MAGIC = 0x1f;
/** Length of the fixed header: magic, command, stream_id u32 LE, data_len u32 LE. */
export const HEADER_LEN = 10;
/** Command bit 7: set by a broker on a frame it forwards to another broker. */
export const FLAG_MESH_FORWARDED = 0x80;
/** Command bit 6: an extension block starts the data. */
export const FLAG_HAS_EXTENSIONS = 0x40;
/** Command bits 5..0: the opcode. */
export const OPCODE_MASK = 0x3f;
/** Largest extension block (`ext_len`, §2.1 and §10). */
export const MAX_EXT_LEN = 1024;
/** The codec's own default limit for `data_len` (§10): 1 MiB. */
export const DEFAULT_MAX_DATA_LEN = 1024 * 1024;
/** The broker's default `transport.max_buf_size` (§10): the largest `data_len` it accepts by default. */
export const BROKER_DEFAULT_MAX_BUF_SIZE = 65536;
/** Longest topic name, filter, group id or consumer id, in bytes (§5, §10). */
export const MAX_NAME_LEN = 255;
/** Longest REASON, in bytes (§3, §10). */
export const MAX_REASON_LEN = 255;
/** Largest value of `data_len` (u32). */
const U32_MAX = 0xffffffff;
const U64_MAX = (1n << 64n) - 1n;

/** Opcodes (§4). */
export const Opcode = Object.freeze({
  PUBLISH: 0x01,
  SUBSCRIBE: 0x02,
  UNSUBSCRIBE: 0x03,
  PUBLISH_BATCH: 0x04,
  NACK: 0x05,
  ACK: 0x06,
  CONFIRM: 0x07,
  ERROR: 0x08,
  INFO: 0x09,
});
/** Keys of an INFO answer's entries (§4.1). */
export const InfoKey = Object.freeze({
  PROTOCOL: 0x01,
  MAX_DATA_LEN: 0x02,
  MAX_DELIVERY_DATA_LEN: 0x03,
  MAX_SUBSCRIPTIONS: 0x04,
  BROKER: 0x05,
  DURABLE: 0x06,
});
const OPCODE_NAMES = Object.freeze(
  Object.fromEntries(Object.entries(Opcode).map(([name, value]) => [value, name])),
);
/** The protocol name of an opcode (`"PUBLISH"`), or `undefined` for a reserved one. */
export function opcodeName(opcode) {
  return OPCODE_NAMES[opcode];
}

/** Extension types (§3). Types 0x10..0xFF are reserved; receivers skip them. */
export const ExtType = Object.freeze({
  TRACE: 0x01,
  COMPRESSION: 0x02,
  PRIORITY: 0x03,
  TOPIC: 0x04,
  TTL: 0x05,
  OFFSET: 0x06,
  ATTEMPT: 0x07,
  CONFIRM: 0x08,
  ACK_MODE: 0x09,
  OVERFLOW: 0x0a,
  ORIGINAL_TOPIC: 0x0b,
  ORIGINAL_OFFSET: 0x0c,
  REASON: 0x0d,
  ATTEMPTS_MADE: 0x0e,
  MAX_IN_FLIGHT: 0x0f,
});

/** Priorities (§3): 0 highest … 3 lowest; absent = 2. */
export const Priority = Object.freeze({ HIGHEST: 0, DEFAULT: 2, LOWEST: 3 });
/** COMPRESSION algorithms (§3). */
export const Compression = Object.freeze({ ZSTD: 1 });
/** ACK_MODE values (§3). */
export const AckMode = Object.freeze({ NONE: 0, EXPLICIT: 1 });
/** OVERFLOW values (§3, §7.3). */
export const Overflow = Object.freeze({ DROP_OLDEST: 0, DROP_NEWEST: 1, DISCONNECT: 2, BLOCK: 3 });
/** The spelling of each OVERFLOW value, as in the broker's configuration. */
export const OVERFLOW_NAMES = Object.freeze(['drop_oldest', 'drop_newest', 'disconnect', 'block']);

/** ERROR codes (§9). Clients must accept codes they do not know (see `errorCategory`). */
export const ErrorCode = Object.freeze({
  MALFORMED_FRAME: 100,
  BAD_MAGIC: 101,
  UNKNOWN_OPCODE: 102,
  FRAME_TOO_LARGE: 103,
  BAD_EXTENSION: 104,
  BAD_PAYLOAD: 105,
  BAD_BATCH: 106,
  INVALID_TOPIC: 200,
  BAD_SUBSCRIBE: 201,
  NOT_SUBSCRIBED: 202,
  NOT_IN_FLIGHT: 203,
  STALE_ATTEMPT: 204,
  TOPIC_REQUIRED: 205,
  UNSUPPORTED: 206,
  SLOW_CONSUMER: 300,
  RATE_LIMITED: 301,
  NOT_AUTHORIZED: 400,
  INTERNAL: 500,
  SHUTTING_DOWN: 501,
  STORAGE_FAILED: 502,
});
const ERROR_NAMES = Object.freeze(
  Object.fromEntries(Object.entries(ErrorCode).map(([name, value]) => [value, name])),
);
/** The name of an ERROR code (`"BAD_MAGIC"`), or `undefined` for a code this version does not know. */
export function errorCodeName(code) {
  return ERROR_NAMES[code];
}
/** The range of a code (§9): 1xx framing, 2xx request, 3xx flow control, 4xx authorization, 5xx broker. */
export function errorCategory(code) {
  const range = Math.floor(Number(code) / 100);
  return (
    { 1: 'framing', 2: 'request', 3: 'flow-control', 4: 'authorization', 5: 'broker' }[range] ??
    'unknown'
  );
}

/**
 * A frame (or a value for one) is invalid. `code` is the ERROR code a broker answers (§9, §10.1),
 * `offset` the byte where the problem is (from the start of the buffer or stream being decoded),
 * `frameOffset` where the frame started, `fatal` whether the frame boundary is lost
 * (BAD_MAGIC, FRAME_TOO_LARGE: nothing after it can be decoded), `frameLength` how many bytes to
 * skip to go on (for a non-fatal error found while decoding).
 */
export class FrameError extends Error {
  constructor(code, problem, { offset, frameOffset, fatal = false, frameLength, streamId } = {}) {
    const where = offset === undefined ? '' : ` at byte ${offset}`;
    super(`${errorCodeName(code) ?? code}${where}: ${problem}`);
    this.name = 'FrameError';
    this.code = code;
    this.problem = problem;
    this.offset = offset;
    this.frameOffset = frameOffset;
    this.fatal = fatal;
    this.frameLength = frameLength;
    this.streamId = streamId;
  }
}

const utf8 = new TextEncoder();
// ignoreBOM: a leading U+FEFF is part of the text (a topic, a reason), as in the Rust codec.
const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });
// An ERROR's reason: bad bytes become U+FFFD, so the code is never lost (protocol.md 9).
const lenientUtf8 = new TextDecoder('utf-8', { ignoreBOM: true });

/** Bytes of `value`: a Uint8Array (as is), an ArrayBuffer or typed array view, or a string (UTF-8). */
export function toBytes(value) {
  if (value instanceof Uint8Array) return value;
  if (typeof value === 'string') return utf8.encode(value);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (value === undefined || value === null) return new Uint8Array(0);
  throw new TypeError('expected a Uint8Array, ArrayBuffer, typed array or string');
}

function decodeUtf8(bytes) {
  try {
    return strictUtf8.decode(bytes);
  } catch {
    return null;
  }
}

// ---------------------------------------------------------------------------------------------
// Names (§5)

// A lone UTF-16 surrogate: TextEncoder would turn it into U+FFFD, silently naming another topic.
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function nameBytes(name) {
  if (typeof name !== 'string') return toBytes(name);
  // Not UTF-8 once encoded: fails the check below as bytes that are not UTF-8 would.
  if (LONE_SURROGATE.test(name)) return Uint8Array.of(0xff);
  return utf8.encode(name);
}

function checkCommon(bytes) {
  if (bytes.length === 0) return 'empty';
  if (bytes.length > MAX_NAME_LEN) return `${bytes.length} bytes long (max ${MAX_NAME_LEN})`;
  for (let i = 0; i < bytes.length; i++) {
    if (bytes[i] === 0x3a) return `contains forbidden character ':' at byte ${i}`;
    if (bytes[i] === 0) return `contains forbidden character NUL at byte ${i}`;
  }
  if (decodeUtf8(bytes) === null) return 'not valid UTF-8';
  return null;
}

/** Why `name` is not a valid topic name (§5), or `null` if it is. */
export function topicNameProblem(name) {
  const bytes = nameBytes(name);
  const common = checkCommon(bytes);
  if (common) return common;
  for (let i = 0; i < bytes.length; i++) {
    if (bytes[i] === 0x2b || bytes[i] === 0x23) {
      return `wildcard '${String.fromCharCode(bytes[i])}' at byte ${i} is not allowed in a topic name`;
    }
  }
  return null;
}

/** Why `filter` is not a valid topic filter (§5), or `null` if it is. */
export function topicFilterProblem(filter) {
  const bytes = nameBytes(filter);
  const common = checkCommon(bytes);
  if (common) return common;
  let levelStart = 0;
  for (let i = 0; i < bytes.length; i++) {
    const b = bytes[i];
    if (b === 0x2f) levelStart = i + 1;
    else if (b === 0x2b || b === 0x23) {
      const end = i + 1;
      const whole = i === levelStart && (end === bytes.length || bytes[end] === 0x2f);
      if (!whole) return `wildcard '${String.fromCharCode(b)}' at byte ${i} must occupy a whole level`;
      if (b === 0x23 && end !== bytes.length) return `'#' at byte ${i} must be the last level`;
    }
  }
  return null;
}

/** Why `id` is not a valid group id or consumer id (§5), or `null` if it is. */
export function idProblem(id) {
  return checkCommon(nameBytes(id));
}

/** True when `filter` has a `+` or `#` level (an ACK/NACK for it then needs TOPIC, §8). */
export function isWildcardFilter(filter) {
  return String(filter)
    .split('/')
    .some((level) => level === '+' || level === '#');
}

function requireName(kind, value, problemOf) {
  if (typeof value !== 'string') throw new TypeError(`${kind} must be a string`);
  const problem = problemOf(value);
  if (problem) throw new FrameError(ErrorCode.INVALID_TOPIC, `invalid ${kind} ${JSON.stringify(value)}: ${problem}`);
  return value;
}

// ---------------------------------------------------------------------------------------------
// Integers

function u32(kind, v, { min = 0 } = {}) {
  if (!Number.isInteger(v) || v < min || v > U32_MAX) {
    throw new RangeError(`${kind} must be an integer in ${min}..=${U32_MAX}, got ${v}`);
  }
  return v;
}

function u64(kind, v) {
  const big = typeof v === 'bigint' ? v : Number.isSafeInteger(v) ? BigInt(v) : null;
  if (big === null || big < 0n || big > U64_MAX) {
    throw new RangeError(`${kind} must be a u64 (a bigint or a safe integer), got ${v}`);
  }
  return big;
}

function view(bytes) {
  return new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

// ---------------------------------------------------------------------------------------------
// Extension block (§2.1, §3)

/**
 * Decode the entries of an extension block (the bytes after `ext_len`). `base` is the absolute
 * offset of `block[0]`, used in error messages. Returns the extensions object (see codec.d.ts).
 */
export function decodeExtensions(block, base = 0) {
  const ext = {};
  const seen = new Set();
  const bad = (code, problem, offset) => {
    throw new FrameError(code, problem, { offset: base + offset });
  };
  const truncated = (at, type, need) =>
    bad(
      ErrorCode.BAD_EXTENSION,
      `extension entry${type === undefined ? '' : ` 0x${hex2(type)}`} at block offset ${at} truncated: need ${need} bytes, have ${block.length - at}`,
      at,
    );
  for (const { at, type, value } of entries(block, truncated)) {
    const known = type >= ExtType.TRACE && type <= ExtType.MAX_IN_FLIGHT;
    if (known) {
      // Validated first, then checked for repetition (as the reference codec does).
      decodeEntry(ext, type, value, (code, problem) =>
        bad(code, `extension 0x${hex2(type)} (${extName(type)}) at block offset ${at} is invalid: ${problem}`, at),
      );
      if (seen.has(type)) {
        bad(ErrorCode.BAD_EXTENSION, `extension 0x${hex2(type)} (${extName(type)}) at block offset ${at} appears more than once`, at);
      }
      seen.add(type);
    } else {
      (ext.unknown ??= []).push({ type, value: value.slice() });
    }
  }
  return ext;
}

/**
 * The entries of a block laid out `type u8 | len u8 | value[len]` (extension entries, and
 * INFO's), in order: `{ at, type, value }`. An entry cut short calls `truncated(at, type, need)`
 * (`type` undefined when even it is missing), which must throw.
 */
function* entries(block, truncated) {
  let at = 0;
  while (at < block.length) {
    if (block.length - at < 2) truncated(at, undefined, 2);
    const type = block[at];
    const len = block[at + 1];
    if (at + 2 + len > block.length) truncated(at, type, 2 + len);
    yield { at, type, value: block.subarray(at + 2, at + 2 + len) };
    at += 2 + len;
  }
}

const EXT_NAMES = Object.freeze(Object.fromEntries(Object.entries(ExtType).map(([n, v]) => [v, n])));
function extName(type) {
  return EXT_NAMES[type] ?? 'reserved';
}
function hex2(b) {
  return b.toString(16).padStart(2, '0');
}

function decodeEntry(ext, type, value, fail) {
  const fixed = (n) => {
    if (value.length !== n) fail(ErrorCode.BAD_EXTENSION, `value must be ${n} byte${n === 1 ? '' : 's'}, got ${value.length}`);
    return view(value);
  };
  switch (type) {
    case ExtType.TRACE:
      fixed(25);
      ext.trace = { traceId: value.slice(0, 16), spanId: value.slice(16, 24), flags: value[24] };
      break;
    case ExtType.COMPRESSION: {
      const v = fixed(5);
      ext.compression = { algorithm: value[0], uncompressedLength: v.getUint32(1, true) };
      break;
    }
    case ExtType.PRIORITY:
      fixed(1);
      if (value[0] > 3) fail(ErrorCode.BAD_EXTENSION, `priority must be 0..=3, got ${value[0]}`);
      ext.priority = value[0];
      break;
    case ExtType.TOPIC:
    case ExtType.ORIGINAL_TOPIC: {
      const problem = topicNameProblem(value);
      if (problem) fail(ErrorCode.INVALID_TOPIC, `not a valid topic name: ${problem}`);
      ext[type === ExtType.TOPIC ? 'topic' : 'originalTopic'] = decodeUtf8(value);
      break;
    }
    case ExtType.TTL:
      ext.ttlMs = fixed(4).getUint32(0, true);
      break;
    case ExtType.OFFSET:
      ext.offset = fixed(8).getBigUint64(0, true);
      break;
    case ExtType.ATTEMPT: {
      const a = fixed(4).getUint32(0, true);
      if (a === 0) fail(ErrorCode.BAD_EXTENSION, 'attempt numbers start at 1');
      ext.attempt = a;
      break;
    }
    case ExtType.CONFIRM:
      if (value.length !== 0) fail(ErrorCode.BAD_EXTENSION, `value must be empty, got ${value.length} bytes`);
      ext.confirm = true;
      break;
    case ExtType.ACK_MODE:
      fixed(1);
      if (value[0] > 1) fail(ErrorCode.BAD_EXTENSION, `ack mode must be 0 or 1, got ${value[0]}`);
      ext.ackMode = value[0];
      break;
    case ExtType.OVERFLOW:
      fixed(1);
      if (value[0] > 3) fail(ErrorCode.BAD_EXTENSION, `overflow policy must be 0..=3, got ${value[0]}`);
      ext.overflow = value[0];
      break;
    case ExtType.ORIGINAL_OFFSET:
      ext.originalOffset = fixed(8).getBigUint64(0, true);
      break;
    case ExtType.REASON: {
      const r = decodeUtf8(value);
      if (r === null) fail(ErrorCode.BAD_EXTENSION, 'reason must be UTF-8');
      ext.reason = r;
      break;
    }
    case ExtType.ATTEMPTS_MADE:
      ext.attemptsMade = fixed(4).getUint32(0, true);
      break;
    case ExtType.MAX_IN_FLIGHT: {
      const n = fixed(4).getUint32(0, true);
      if (n === 0) fail(ErrorCode.BAD_EXTENSION, 'max in flight must be at least 1');
      ext.maxInFlight = n;
      break;
    }
  }
}

/** Cut a reason to at most 255 UTF-8 bytes, at a character boundary (§8.3). */
export function cutReason(reason) {
  const bytes = utf8.encode(reason);
  if (bytes.length <= MAX_REASON_LEN) return bytes;
  let len = MAX_REASON_LEN;
  while (len > 0 && (bytes[len] & 0xc0) === 0x80) len--; // bytes[len] is a continuation byte
  return bytes.slice(0, len);
}

/**
 * Encode the entries of an extension block (without `ext_len`), in the canonical order of §2.1:
 * ATTEMPT first, then ascending type; unknown (reserved) entries last, by type.
 */
export function encodeExtensions(ext = {}) {
  const parts = [];
  const entry = (type, value) => {
    if (value.length > 255) throw new RangeError(`extension 0x${hex2(type)} value is ${value.length} bytes (max 255)`);
    parts.push(Uint8Array.of(type, value.length), value);
  };
  const le32 = (v) => {
    const b = new Uint8Array(4);
    view(b).setUint32(0, v, true);
    return b;
  };
  const le64 = (v) => {
    const b = new Uint8Array(8);
    view(b).setBigUint64(0, v, true);
    return b;
  };
  // A byte-wide value: refused outside 0..=255 (a Uint8Array would keep its low byte unsaid).
  const u8 = (what, v) => {
    if (!Number.isInteger(v) || v < 0 || v > 0xff) throw new RangeError(`${what} must be a u8 (0..=255), got ${v}`);
    return v;
  };
  if (ext.attempt !== undefined) entry(ExtType.ATTEMPT, le32(u32('attempt', ext.attempt, { min: 1 })));
  if (ext.trace !== undefined) {
    const { traceId, spanId, flags = 0 } = ext.trace;
    const t = toBytes(traceId);
    const s = toBytes(spanId);
    if (t.length !== 16 || s.length !== 8) throw new RangeError('trace id must be 16 bytes and span id 8 bytes');
    const v = new Uint8Array(25);
    v.set(t, 0);
    v.set(s, 16);
    v[24] = u8('trace flags', flags);
    entry(ExtType.TRACE, v);
  }
  if (ext.compression !== undefined) {
    const v = new Uint8Array(5);
    v[0] = u8('compression algorithm', ext.compression.algorithm);
    view(v).setUint32(1, u32('uncompressed length', ext.compression.uncompressedLength), true);
    entry(ExtType.COMPRESSION, v);
  }
  if (ext.priority !== undefined) {
    if (!Number.isInteger(ext.priority) || ext.priority < 0 || ext.priority > 3) {
      throw new RangeError(`priority must be 0..=3, got ${ext.priority}`);
    }
    entry(ExtType.PRIORITY, Uint8Array.of(ext.priority));
  }
  if (ext.topic !== undefined) entry(ExtType.TOPIC, utf8.encode(requireName('topic name', ext.topic, topicNameProblem)));
  if (ext.ttlMs !== undefined) entry(ExtType.TTL, le32(u32('ttl', ext.ttlMs)));
  if (ext.offset !== undefined) entry(ExtType.OFFSET, le64(u64('offset', ext.offset)));
  if (ext.confirm) entry(ExtType.CONFIRM, new Uint8Array(0));
  if (ext.ackMode !== undefined) {
    if (ext.ackMode !== 0 && ext.ackMode !== 1) throw new RangeError(`ack mode must be 0 or 1, got ${ext.ackMode}`);
    entry(ExtType.ACK_MODE, Uint8Array.of(ext.ackMode));
  }
  if (ext.overflow !== undefined) entry(ExtType.OVERFLOW, Uint8Array.of(overflowValue(ext.overflow)));
  if (ext.originalTopic !== undefined) {
    entry(ExtType.ORIGINAL_TOPIC, utf8.encode(requireName('original topic', ext.originalTopic, topicNameProblem)));
  }
  if (ext.originalOffset !== undefined) entry(ExtType.ORIGINAL_OFFSET, le64(u64('original offset', ext.originalOffset)));
  if (ext.reason !== undefined) entry(ExtType.REASON, cutReason(String(ext.reason)));
  if (ext.attemptsMade !== undefined) entry(ExtType.ATTEMPTS_MADE, le32(u32('attempts made', ext.attemptsMade)));
  if (ext.maxInFlight !== undefined) entry(ExtType.MAX_IN_FLIGHT, le32(u32('max in flight', ext.maxInFlight, { min: 1 })));
  if (ext.unknown) {
    const sorted = [...ext.unknown].sort((a, b) => a.type - b.type); // stable
    for (const { type, value } of sorted) {
      if (type >= ExtType.TRACE && type <= ExtType.MAX_IN_FLIGHT) {
        throw new RangeError(`extension 0x${hex2(type)} is a known type; set its field instead`);
      }
      entry(u8('extension type', type), toBytes(value));
    }
  }
  const block = concat(parts);
  if (block.length > MAX_EXT_LEN) {
    throw new FrameError(ErrorCode.BAD_EXTENSION, `extension block of ${block.length} bytes exceeds the limit of ${MAX_EXT_LEN} bytes`);
  }
  return block;
}

/** The wire value of an overflow policy given as a number (0..=3) or a name (`"block"`). */
export function overflowValue(policy) {
  const v = typeof policy === 'string' ? OVERFLOW_NAMES.indexOf(policy) : policy;
  if (!Number.isInteger(v) || v < 0 || v > 3) {
    throw new RangeError(`overflow must be one of ${OVERFLOW_NAMES.join(', ')} (or 0..=3), got ${policy}`);
  }
  return v;
}

function hasEntries(ext) {
  if (!ext) return false;
  return Object.entries(ext).some(([k, v]) =>
    k === 'confirm' ? v === true : k === 'unknown' ? v !== undefined && v.length > 0 : v !== undefined,
  );
}

function concat(parts) {
  let len = 0;
  for (const p of parts) len += p.length;
  const out = new Uint8Array(len);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SUBSCRIBE grammar (§7.1)

/**
 * Parse a SUBSCRIBE payload:
 * `topic:<filter>[:group:<id>][:durable:<consumer>:<start>]`, options in either order, each at
 * most once. `base` is the absolute offset of the payload for error messages.
 */
export function parseSubscribe(payload, base = 0) {
  const bytes = toBytes(payload);
  const { filter, end } = filterPart(bytes, base);
  const spec = { filter };
  let at = end;
  const badSub = (problem, offset) => {
    throw new FrameError(ErrorCode.BAD_SUBSCRIBE, problem, { offset: base + offset });
  };
  const nextToken = () => {
    if (at >= bytes.length) badSub('option is missing its value', at);
    const start = at + 1;
    let stop = bytes.indexOf(0x3a, start);
    if (stop < 0) stop = bytes.length;
    at = stop;
    return { start, token: bytes.subarray(start, stop) };
  };
  const id = (kind, { start, token }) => {
    const problem = idProblem(token);
    if (problem) throw new FrameError(ErrorCode.INVALID_TOPIC, `invalid ${kind}: ${problem}`, { offset: base + start });
    return decodeUtf8(token);
  };
  while (at < bytes.length) {
    const key = nextToken();
    const name = decodeUtf8(key.token);
    if (name === 'group') {
      if (spec.group !== undefined) badSub('"group" given twice', key.start);
      spec.group = id('group id', nextToken());
    } else if (name === 'durable') {
      if (spec.durable !== undefined) badSub('"durable" given twice', key.start);
      const consumer = id('consumer id', nextToken());
      const startTok = nextToken();
      spec.durable = { consumer, start: parseStart(startTok.token, base + startTok.start) };
    } else {
      badSub('unknown option (expected "group" or "durable")', key.start);
    }
  }
  return spec;
}

function filterPart(bytes, base) {
  const prefix = utf8.encode('topic:');
  if (bytes.length < 6 || prefix.some((b, i) => bytes[i] !== b)) {
    throw new FrameError(ErrorCode.BAD_SUBSCRIBE, 'payload must start with "topic:"', { offset: base });
  }
  let end = bytes.indexOf(0x3a, 6);
  if (end < 0) end = bytes.length;
  const raw = bytes.subarray(6, end);
  const problem = topicFilterProblem(raw);
  if (problem) throw new FrameError(ErrorCode.INVALID_TOPIC, `invalid topic filter: ${problem}`, { offset: base + 6 });
  return { filter: decodeUtf8(raw), end };
}

function parseStart(token, offset) {
  const s = decodeUtf8(token);
  if (s === 'earliest' || s === 'latest') return s;
  if (!s || s.length > 20 || !/^[0-9]+$/.test(s)) {
    throw new FrameError(ErrorCode.BAD_SUBSCRIBE, 'durable start must be a decimal offset, "earliest" or "latest"', { offset });
  }
  const v = BigInt(s);
  if (v > U64_MAX) throw new FrameError(ErrorCode.BAD_SUBSCRIBE, 'durable offset does not fit in 64 bits', { offset });
  return v;
}

/** Parse an UNSUBSCRIBE payload: `topic:<filter>` and nothing else (§7.2). Returns the filter. */
export function parseUnsubscribe(payload, base = 0) {
  const bytes = toBytes(payload);
  const { filter, end } = filterPart(bytes, base);
  if (end !== bytes.length) {
    throw new FrameError(ErrorCode.BAD_SUBSCRIBE, 'UNSUBSCRIBE takes only "topic:<filter>"', { offset: base + end });
  }
  return filter;
}

/** The SUBSCRIBE payload text of a spec `{ filter, group?, durable?: { consumer, start } }` (group first, as the grammar writes it). */
export function formatSubscribe(spec) {
  let s = `topic:${requireName('topic filter', spec.filter, topicFilterProblem)}`;
  if (spec.group !== undefined) s += `:group:${requireName('group id', spec.group, idProblem)}`;
  if (spec.durable !== undefined) {
    const { consumer, start } = spec.durable;
    let st;
    if (start === 'earliest' || start === 'latest') st = start;
    else st = u64('durable start', start).toString();
    s += `:durable:${requireName('consumer id', consumer, idProblem)}:${st}`;
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Legacy PUBLISH (§6.2)

/**
 * The target of a legacy PUBLISH payload `[ttl:<ms>:][topic:]<topic name>`: `{ topic, ttlMs? }`.
 * Only a broker reads this: a client takes a delivery's payload as its body (§7.5).
 */
export function parseLegacyTarget(payload, base = 0) {
  const bytes = toBytes(payload);
  const startsWith = (at, text) => {
    const t = utf8.encode(text);
    return bytes.length - at >= t.length && t.every((b, i) => bytes[at + i] === b);
  };
  let start = 0;
  let ttlMs;
  if (startsWith(0, 'ttl:')) {
    let i = 4;
    while (i < bytes.length && bytes[i] >= 0x30 && bytes[i] <= 0x39) i++;
    if (i === 4 || bytes[i] !== 0x3a) {
      throw new FrameError(ErrorCode.BAD_PAYLOAD, 'legacy "ttl:" prefix must be "ttl:<ms>:"', { offset: base });
    }
    const ms = Number(decodeUtf8(bytes.subarray(4, i)));
    if (!(ms <= U32_MAX)) {
      throw new FrameError(ErrorCode.BAD_PAYLOAD, 'legacy ttl does not fit in 32 bits of milliseconds', { offset: base + 4 });
    }
    ttlMs = ms;
    start = i + 1;
  }
  if (startsWith(start, 'topic:')) start += 6;
  const raw = bytes.subarray(start);
  const problem = topicNameProblem(raw);
  if (problem) throw new FrameError(ErrorCode.INVALID_TOPIC, `invalid legacy topic payload: ${problem}`, { offset: base + start });
  const target = { topic: decodeUtf8(raw) };
  if (ttlMs !== undefined) target.ttlMs = ttlMs;
  return target;
}

// ---------------------------------------------------------------------------------------------
// Frames

/**
 * Try to decode one frame at the start of `buf`.
 *
 * Returns `{ incomplete: true, need }` when more bytes are needed (`need`: the total buffered
 * length required to go on), or `{ frame, length }`. Throws `FrameError` when the bytes can
 * never be a valid frame; a non-fatal one carries `frameLength` (skip that many bytes and go on).
 *
 * Options: `maxDataLen` (default 1 MiB, §10); `peer`: who sent the bytes, `"broker"` (default:
 * the view of a client) or `"client"` (the view of a broker: a PUBLISH without TOPIC is resolved
 * as a legacy publish, §6.2, and the MeshForwarded bit is refused with UNSUPPORTED); `base`: the
 * absolute offset of `buf[0]` in the stream, for error messages.
 */
export function tryDecodeFrame(buf, options = {}) {
  const { maxDataLen = DEFAULT_MAX_DATA_LEN, peer = 'broker', base = 0, subFrame = false } = options;
  if (buf.length > 0 && buf[0] !== MAGIC) {
    throw new FrameError(ErrorCode.BAD_MAGIC, `bad magic byte 0x${hex2(buf[0])} (expected 0x1f)`, {
      offset: base,
      frameOffset: base,
      fatal: true,
    });
  }
  if (buf.length < HEADER_LEN) return { incomplete: true, need: HEADER_LEN };
  const v = view(buf);
  const command = buf[1];
  const streamId = v.getUint32(2, true);
  const dataLen = v.getUint32(6, true);
  if (dataLen > maxDataLen) {
    throw new FrameError(ErrorCode.FRAME_TOO_LARGE, `frame data of ${dataLen} bytes exceeds the limit of ${maxDataLen} bytes`, {
      offset: base + 6,
      frameOffset: base,
      fatal: true,
      streamId,
    });
  }
  const length = HEADER_LEN + dataLen;
  if (buf.length < length) return { incomplete: true, need: length };
  try {
    const frame = decodeComplete(buf.subarray(0, length), command, streamId, dataLen, peer, base, subFrame);
    return { frame, length };
  } catch (e) {
    if (e instanceof FrameError) {
      e.frameOffset = base;
      e.frameLength = length;
      e.streamId = streamId;
    }
    throw e;
  }
}

/**
 * Decode exactly one complete frame (throws `FrameError` if `buf` is a partial frame, has
 * trailing bytes, or is invalid). Options as for `tryDecodeFrame`.
 */
export function decodeFrame(buf, options = {}) {
  const bytes = toBytes(buf);
  const r = tryDecodeFrame(bytes, options);
  const base = options.base ?? 0;
  if (r.incomplete) {
    throw new FrameError(ErrorCode.MALFORMED_FRAME, `frame cut short: need ${r.need} bytes, have ${bytes.length}`, {
      offset: base + bytes.length,
      frameOffset: base,
    });
  }
  if (r.length !== bytes.length) {
    throw new FrameError(ErrorCode.BAD_PAYLOAD, `${bytes.length - r.length} bytes after the end of the frame`, {
      offset: base + r.length,
    });
  }
  return r.frame;
}

function decodeComplete(buf, command, streamId, dataLen, peer, base, subFrame) {
  const opcode = command & OPCODE_MASK;
  if (!OPCODE_NAMES[opcode]) {
    throw new FrameError(ErrorCode.UNKNOWN_OPCODE, `unknown opcode 0x${hex2(opcode)}`, { offset: base + 1 });
  }
  const meshForwarded = (command & FLAG_MESH_FORWARDED) !== 0;
  // A batch's sub-frame with it is invalid as the frame would be on its own (§6.3): the batch
  // decoder makes this BAD_BATCH.
  if (meshForwarded && subFrame) {
    throw new FrameError(ErrorCode.UNSUPPORTED, 'sub-frames must not set the MeshForwarded bit (0x80)', {
      offset: base + 1,
    });
  }
  if (meshForwarded && peer === 'client') {
    throw new FrameError(ErrorCode.UNSUPPORTED, 'the MeshForwarded bit (0x80) is set; clients must send it as 0', {
      offset: base + 1,
    });
  }
  const hasExtensions = (command & FLAG_HAS_EXTENSIONS) !== 0;
  const data = buf.subarray(HEADER_LEN);
  const dataBase = base + HEADER_LEN;
  let ext = {};
  let payloadStart = 0;
  if (hasExtensions) {
    if (dataLen < 2) {
      throw new FrameError(ErrorCode.BAD_EXTENSION, `extension flag set but data is only ${dataLen} bytes (need 2 for ext_len)`, {
        offset: dataBase,
      });
    }
    const extLen = view(data).getUint16(0, true);
    if (extLen > MAX_EXT_LEN) {
      throw new FrameError(ErrorCode.BAD_EXTENSION, `extension block of ${extLen} bytes exceeds the limit of ${MAX_EXT_LEN} bytes`, {
        offset: dataBase,
      });
    }
    if (2 + extLen > dataLen) {
      throw new FrameError(
        ErrorCode.BAD_EXTENSION,
        `extension block of ${extLen} bytes overruns the frame data (${dataLen - 2} bytes available)`,
        { offset: dataBase },
      );
    }
    ext = decodeExtensions(data.subarray(2, 2 + extLen), dataBase + 2);
    payloadStart = 2 + extLen;
  }
  const payload = data.subarray(payloadStart);
  const payloadBase = dataBase + payloadStart;
  const frame = { opcode, streamId, hasExtensions, ext };
  if (meshForwarded) frame.meshForwarded = true;
  const badPayload = (problem) => {
    throw new FrameError(ErrorCode.BAD_PAYLOAD, `bad ${OPCODE_NAMES[opcode]} payload: ${problem} (payload is ${payload.length} bytes)`, {
      offset: payloadBase,
    });
  };
  switch (opcode) {
    case Opcode.PUBLISH:
      frame.body = payload.slice();
      if (ext.topic === undefined && peer === 'client') frame.legacy = parseLegacyTarget(payload, payloadBase);
      break;
    case Opcode.SUBSCRIBE:
      frame.spec = parseSubscribe(payload, payloadBase);
      break;
    case Opcode.UNSUBSCRIBE:
      frame.filter = parseUnsubscribe(payload, payloadBase);
      break;
    case Opcode.PUBLISH_BATCH:
      frame.frames = decodeBatch(payload, payloadBase);
      break;
    case Opcode.ACK:
    case Opcode.NACK:
      if (payload.length !== 8) badPayload('payload must be the 8-byte little-endian offset');
      frame.offset = view(payload).getBigUint64(0, true);
      break;
    case Opcode.INFO:
      // A request's extension block is accepted and ignored (§4.1); the answer carries none.
      frame.info = decodeInfo(payload, badPayload);
      break;
    case Opcode.CONFIRM:
    case Opcode.ERROR: {
      if (hasEntries({ ...ext, unknown: undefined })) badPayload('this opcode takes no extensions');
      if (opcode === Opcode.CONFIRM) {
        // protocol.md 7.1: a client MUST accept any CONFIRM as a SUBSCRIBE's confirmation,
        // whatever its data. Data that is not whole u64s lists no offset (a PUBLISH waiting for
        // one then reports how many it got).
        const pv = view(payload);
        frame.offsets = [];
        if (payload.length % 8 === 0) {
          for (let i = 0; i < payload.length; i += 8) frame.offsets.push(pv.getBigUint64(i, true));
        }
      } else {
        if (payload.length < 2) badPayload('payload must start with a 2-byte code');
        frame.code = view(payload).getUint16(0, true);
        frame.reason = lenientUtf8.decode(payload.subarray(2));
      }
      break;
    }
  }
  return frame;
}

/** INFO entries (§4.1): unknown keys skipped; a known key once, with its length. */
function decodeInfo(payload, badPayload) {
  const info = {};
  const seen = new Set();
  for (const { type: key, value } of entries(payload, () => badPayload('an entry is cut short'))) {
    const len = value.length;
    const u32At = () => {
      if (len !== 4) badPayload('a u32 entry must be 4 bytes');
      return view(value).getUint32(0, true);
    };
    if (key >= InfoKey.PROTOCOL && key <= InfoKey.DURABLE) {
      if (seen.has(key)) badPayload('a key appears twice');
      seen.add(key);
    }
    switch (key) {
      case InfoKey.PROTOCOL:
        if (len !== 1) badPayload('PROTOCOL must be 1 byte');
        info.protocol = value[0];
        break;
      case InfoKey.MAX_DATA_LEN:
        info.maxDataLen = u32At();
        break;
      case InfoKey.MAX_DELIVERY_DATA_LEN:
        info.maxDeliveryDataLen = u32At();
        break;
      case InfoKey.MAX_SUBSCRIPTIONS:
        info.maxSubscriptions = u32At();
        break;
      case InfoKey.BROKER: {
        if (len === 0) badPayload('BROKER must not be empty');
        const broker = decodeUtf8(value);
        if (broker === null) badPayload('BROKER must be UTF-8');
        info.broker = broker;
        break;
      }
      case InfoKey.DURABLE:
        if (len !== 1 || value[0] > 1) badPayload('DURABLE must be 1 byte, 0 or 1');
        info.durable = value[0] === 1;
        break;
      default: // a key of a later version
    }
  }
  return info;
}

/** INFO entries in ascending key order; a `broker` longer than 255 bytes is cut at a character. */
function encodeInfo(info) {
  const parts = [];
  const entry = (key, value) => parts.push(Uint8Array.of(key, value.length), value);
  const u32Entry = (key, v) => {
    const value = new Uint8Array(4);
    view(value).setUint32(0, u32(`INFO entry 0x${hex2(key)}`, v), true);
    entry(key, value);
  };
  if (info.protocol !== undefined) {
    if (!Number.isInteger(info.protocol) || info.protocol < 0 || info.protocol > 0xff) {
      throw new RangeError(`protocol must be a u8, got ${info.protocol}`);
    }
    entry(InfoKey.PROTOCOL, Uint8Array.of(info.protocol));
  }
  if (info.maxDataLen !== undefined) u32Entry(InfoKey.MAX_DATA_LEN, info.maxDataLen);
  if (info.maxDeliveryDataLen !== undefined) u32Entry(InfoKey.MAX_DELIVERY_DATA_LEN, info.maxDeliveryDataLen);
  if (info.maxSubscriptions !== undefined) u32Entry(InfoKey.MAX_SUBSCRIPTIONS, info.maxSubscriptions);
  if (info.broker !== undefined && info.broker !== '') entry(InfoKey.BROKER, cutReason(info.broker));
  if (info.durable !== undefined) entry(InfoKey.DURABLE, Uint8Array.of(info.durable ? 1 : 0));
  return concat(parts);
}

function decodeBatch(payload, base) {
  const frames = [];
  let at = 0;
  while (at < payload.length) {
    const index = frames.length;
    const fail = (problem, cause) => {
      throw new FrameError(ErrorCode.BAD_BATCH, `batch sub-frame ${index} at byte ${base + at}: ${problem}`, {
        offset: cause?.offset ?? base + at,
      });
    };
    const rest = payload.subarray(at);
    // Refused by its command byte before it is decoded: a sub-frame that is itself a batch
    // would be decoded, nested ones within it, before being refused, and a batch nested a few
    // thousand deep exhausted the stack.
    if (rest.length >= 2 && rest[0] === MAGIC && (rest[1] & OPCODE_MASK) !== Opcode.PUBLISH) {
      fail('sub-frames must be PUBLISH frames');
    }
    let r;
    try {
      r = tryDecodeFrame(rest, { maxDataLen: U32_MAX, peer: 'client', base: base + at, subFrame: true });
    } catch (e) {
      if (e instanceof FrameError) fail(e.message, e);
      throw e;
    }
    if (r.incomplete) {
      fail(rest.length < HEADER_LEN ? 'sub-frame header cut short' : 'sub-frame data runs past the end of the batch');
    }
    if (r.frame.opcode !== Opcode.PUBLISH) fail('sub-frames must be PUBLISH frames');
    frames.push(r.frame);
    at += r.length;
  }
  return frames;
}

/**
 * Encode a frame to bytes. `frame` is `{ opcode, streamId = 0, ext = {}, hasExtensions?, ... }`
 * plus the opcode's fields (see codec.d.ts). An extension block is written when `ext` has an
 * entry, or when `hasExtensions` is true (an empty block, `ext_len` 0: for a SUBSCRIBE it asks
 * for Aqueduct's deliveries, §7.5). Throws `FrameError`/`RangeError`/`TypeError` for values the
 * spec does not allow, and `FrameError(FRAME_TOO_LARGE)` above `options.maxDataLen` (default
 * no limit beyond u32).
 */
export function encodeFrame(frame, options = {}) {
  const { maxDataLen = U32_MAX } = options;
  const opcode = frame.opcode;
  if (!OPCODE_NAMES[opcode]) throw new RangeError(`unknown opcode ${opcode}`);
  const streamId = u32('stream id', frame.streamId ?? 0);
  const ext = frame.ext ?? {};
  let payload;
  switch (opcode) {
    case Opcode.PUBLISH:
      payload = toBytes(frame.body);
      break;
    case Opcode.SUBSCRIBE:
      payload = utf8.encode(formatSubscribe(frame.spec));
      break;
    case Opcode.UNSUBSCRIBE:
      payload = utf8.encode(`topic:${requireName('topic filter', frame.filter, topicFilterProblem)}`);
      break;
    case Opcode.PUBLISH_BATCH:
      payload = concat(
        (frame.frames ?? []).map((sub) => {
          if (sub.opcode !== undefined && sub.opcode !== Opcode.PUBLISH) throw new RangeError('batch sub-frames must be PUBLISH frames');
          // Never with the MeshForwarded bit: the broker refuses such a batch (§6.3).
          return encodeFrame({ ...sub, opcode: Opcode.PUBLISH, streamId: sub.streamId ?? 0, meshForwarded: false });
        }),
      );
      break;
    case Opcode.ACK:
    case Opcode.NACK: {
      payload = new Uint8Array(8);
      view(payload).setBigUint64(0, u64('offset', frame.offset), true);
      break;
    }
    case Opcode.INFO:
      payload = encodeInfo(frame.info ?? {});
      break;
    case Opcode.CONFIRM: {
      const offsets = frame.offsets ?? [];
      payload = new Uint8Array(8 * offsets.length);
      offsets.forEach((o, i) => view(payload).setBigUint64(8 * i, u64('offset', o), true));
      break;
    }
    case Opcode.ERROR: {
      const reason = utf8.encode(frame.reason ?? '');
      payload = new Uint8Array(2 + reason.length);
      const code = frame.code;
      if (!Number.isInteger(code) || code < 0 || code > 0xffff) throw new RangeError(`error code must be a u16, got ${code}`);
      view(payload).setUint16(0, code, true);
      payload.set(reason, 2);
      break;
    }
  }
  const entries = hasEntries(ext) ? encodeExtensions(ext) : null;
  if (entries && (opcode === Opcode.CONFIRM || opcode === Opcode.ERROR)) {
    throw new RangeError(`${OPCODE_NAMES[opcode]} carries no extension block (§4)`);
  }
  const withBlock = entries !== null || frame.hasExtensions === true;
  const block = entries ?? new Uint8Array(0);
  const dataLen = (withBlock ? 2 + block.length : 0) + payload.length;
  if (dataLen > maxDataLen) {
    throw new FrameError(ErrorCode.FRAME_TOO_LARGE, `frame data of ${dataLen} bytes exceeds the limit of ${maxDataLen} bytes`, {
      streamId,
    });
  }
  const out = new Uint8Array(HEADER_LEN + dataLen);
  const ov = view(out);
  out[0] = MAGIC;
  out[1] = opcode | (withBlock ? FLAG_HAS_EXTENSIONS : 0) | (frame.meshForwarded ? FLAG_MESH_FORWARDED : 0);
  ov.setUint32(2, streamId, true);
  ov.setUint32(6, dataLen, true);
  let at = HEADER_LEN;
  if (withBlock) {
    ov.setUint16(at, block.length, true);
    out.set(block, at + 2);
    at += 2 + block.length;
  }
  out.set(payload, at);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Incremental decoding

/**
 * Decodes frames from a byte stream given in chunks of any size.
 *
 * `push(chunk)` appends bytes; `next()` returns the next frame, or `null` when more bytes are
 * needed; it throws `FrameError` for an invalid frame. After a non-fatal error the bad frame has
 * been skipped and `next()` goes on with the frame after it (§10 step 4); after a fatal one
 * (BAD_MAGIC, FRAME_TOO_LARGE) every later call throws the same error (§10 step 2).
 * `finish()` says the stream ended: it throws MALFORMED_FRAME if a partial frame is buffered.
 * Error offsets count from the first byte ever pushed.
 */
/** A decoder's buffer larger than this is let go of once it is empty. */
const SHRINK_ABOVE = 256 * 1024;

export class FrameDecoder {
  constructor(options = {}) {
    this.options = { maxDataLen: options.maxDataLen ?? DEFAULT_MAX_DATA_LEN, peer: options.peer ?? 'broker' };
    this.buf = new Uint8Array(0);
    this.start = 0; // first unread byte in buf
    this.end = 0; // end of the buffered bytes in buf
    this.consumed = 0; // stream offset of buf[start]
    this.failure = null;
  }

  /** Bytes buffered and not yet decoded. */
  get buffered() {
    return this.end - this.start;
  }

  push(chunk) {
    const bytes = toBytes(chunk);
    if (bytes.length === 0) return;
    if (this.end + bytes.length > this.buf.length) {
      const live = this.end - this.start;
      if (live + bytes.length <= this.buf.length && this.start > 0) {
        this.buf.copyWithin(0, this.start, this.end);
      } else {
        // Room for the whole frame being received, once its header is in (one copy for a large
        // frame, and no more room than it needs); else doubling.
        const need = live + bytes.length;
        const frame = this.#frameLength(bytes);
        const size = frame !== undefined && frame >= need ? Math.max(frame, 4096) : Math.max(need, 2 * this.buf.length, 4096);
        const grown = new Uint8Array(size);
        grown.set(this.buf.subarray(this.start, this.end));
        this.buf = grown;
      }
      this.start = 0;
      this.end = live;
    }
    this.buf.set(bytes, this.end);
    this.end += bytes.length;
  }

  /**
   * The whole length of the frame at the start of what is buffered plus `bytes` (header and
   * data), once its header is in and its `data_len` within the limit; else undefined.
   */
  #frameLength(bytes) {
    const live = this.end - this.start;
    if (live + bytes.length < HEADER_LEN) return undefined;
    const at = (i) => (i < live ? this.buf[this.start + i] : bytes[i - live]);
    const dataLen = (at(6) | (at(7) << 8) | (at(8) << 16) | (at(9) << 24)) >>> 0;
    if (dataLen > this.options.maxDataLen) return undefined;
    return HEADER_LEN + dataLen;
  }

  next() {
    if (this.failure) throw this.failure;
    const window = this.buf.subarray(this.start, this.end);
    let r;
    try {
      r = tryDecodeFrame(window, { ...this.options, base: this.consumed });
    } catch (e) {
      if (e instanceof FrameError && !e.fatal && e.frameLength !== undefined) {
        this.advance(e.frameLength);
      } else {
        this.failure = e;
      }
      throw e;
    }
    if (r.incomplete) return null;
    this.advance(r.length);
    return r.frame;
  }

  advance(n) {
    this.start += n;
    this.consumed += n;
    if (this.start === this.end) {
      this.start = 0;
      this.end = 0;
      // Emptied after a large frame: let go of its room (a stream that received one large
      // delivery would otherwise keep it for good).
      if (this.buf.length > SHRINK_ABOVE) this.buf = new Uint8Array(0);
    }
  }

  /** Every complete frame buffered (stops at, and throws, the first invalid one). */
  *frames() {
    for (let f = this.next(); f !== null; f = this.next()) yield f;
  }

  finish() {
    if (this.failure) throw this.failure;
    if (this.buffered > 0) {
      throw new FrameError(
        ErrorCode.MALFORMED_FRAME,
        `the stream ended inside a frame (${this.buffered} bytes of it buffered)`,
        { offset: this.consumed + this.buffered, frameOffset: this.consumed },
      );
    }
  }
}
