// Edge cases of the codec: each invalid input rejected with the right code (§9, §10, §10.1) and a
// message naming the offset, and incremental decoding split at every byte boundary.

import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  DEFAULT_MAX_DATA_LEN,
  ErrorCode,
  FrameDecoder,
  FrameError,
  MAX_EXT_LEN,
  Opcode,
  cutReason,
  decodeExtensions,
  decodeFrame,
  encodeExtensions,
  encodeFrame,
  formatSubscribe,
  parseSubscribe,
  topicFilterProblem,
  topicNameProblem,
  tryDecodeFrame,
} from '../codec.js';

const te = new TextEncoder();
const b = (s) => te.encode(s);
const cat = (...parts) => {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
};
/** A frame from raw parts: header with `command`, `streamId` and the data's length. */
const raw = (command, streamId, ...data) => {
  const d = cat(...data.map((x) => (x instanceof Uint8Array ? x : Uint8Array.from(x))));
  const h = new Uint8Array(10);
  const v = new DataView(h.buffer);
  h[0] = 0x1f;
  h[1] = command;
  v.setUint32(2, streamId, true);
  v.setUint32(6, d.length, true);
  return cat(h, d);
};
const u16 = (n) => Uint8Array.of(n & 0xff, n >> 8);

/** Assert that `fn` throws a FrameError with `code`, whose message names `offset`. */
function rejects(fn, code, { offset, fatal, match } = {}) {
  let err;
  try {
    fn();
  } catch (e) {
    err = e;
  }
  assert.ok(err instanceof FrameError, `expected a FrameError, got ${err}`);
  assert.equal(err.code, code, `code of: ${err.message}`);
  if (offset !== undefined) {
    assert.equal(err.offset, offset, `offset of: ${err.message}`);
    assert.match(err.message, new RegExp(`at byte ${offset}\\b`));
  }
  if (fatal !== undefined) assert.equal(err.fatal, fatal);
  if (match) assert.match(err.message, match);
  return err;
}

const good = encodeFrame({ opcode: Opcode.PUBLISH, streamId: 3, ext: { topic: 'orders', priority: 1 }, body: b('hi') });

test('wrong magic: rejected at the first byte, before a whole header is there, and fatal', () => {
  rejects(() => tryDecodeFrame(Uint8Array.of(0x20)), ErrorCode.BAD_MAGIC, { offset: 0, fatal: true, match: /0x20/ });
  const bad = good.slice();
  bad[0] = 0x1e;
  rejects(() => decodeFrame(bad), ErrorCode.BAD_MAGIC, { offset: 0, fatal: true });
  // In a stream: after one good frame, the offset is that of the bad byte.
  const d = new FrameDecoder();
  d.push(cat(good, Uint8Array.of(0x00, 0x01)));
  assert.equal(d.next().ext.topic, 'orders');
  rejects(() => d.next(), ErrorCode.BAD_MAGIC, { offset: good.length, fatal: true });
  // The frame boundary is lost: nothing after it is decoded, even a valid frame.
  d.push(good);
  rejects(() => d.next(), ErrorCode.BAD_MAGIC, { offset: good.length });
});

test('unknown opcode: that frame only is rejected and skipped, the stream goes on', () => {
  for (const opcode of [0x00, 0x0a, 0x3f]) {
    const frame = raw(opcode, 4, [1, 2, 3]);
    const err = rejects(() => decodeFrame(frame), ErrorCode.UNKNOWN_OPCODE, { offset: 1, fatal: false });
    assert.equal(err.frameLength, 13);
    assert.equal(err.streamId, 4);
  }
  // Flag bits do not hide the opcode: 0x4b is HasExtensions | 0x0b.
  rejects(() => decodeFrame(raw(0x4b, 0, [0, 0])), ErrorCode.UNKNOWN_OPCODE);
  // Checked from the command byte alone, before a malformed extension block (§10.1).
  rejects(() => decodeFrame(raw(0x4a, 0, [0xff, 0xff])), ErrorCode.UNKNOWN_OPCODE);
  const d = new FrameDecoder();
  d.push(cat(raw(0x0a, 1, [9, 9]), good));
  rejects(() => d.next(), ErrorCode.UNKNOWN_OPCODE, { offset: 1 });
  const next = d.next();
  assert.equal(next.streamId, 3);
  assert.equal(next.ext.priority, 1);
  assert.equal(d.next(), null);
});

test('oversize data_len: FRAME_TOO_LARGE as soon as the header is there, before the data', () => {
  const header = (len) => {
    const h = Uint8Array.of(0x1f, 0x01, 7, 0, 0, 0, 0, 0, 0, 0);
    new DataView(h.buffer).setUint32(6, len, true);
    return h;
  };
  // At the limit: only "read more".
  assert.deepEqual(tryDecodeFrame(header(DEFAULT_MAX_DATA_LEN)), { incomplete: true, need: 10 + DEFAULT_MAX_DATA_LEN });
  const err = rejects(() => tryDecodeFrame(header(DEFAULT_MAX_DATA_LEN + 1)), ErrorCode.FRAME_TOO_LARGE, {
    offset: 6,
    fatal: true,
    match: /1048577 bytes exceeds the limit of 1048576/,
  });
  assert.equal(err.streamId, 7);
  rejects(() => tryDecodeFrame(header(0xffffffff)), ErrorCode.FRAME_TOO_LARGE);
  // The limit is configurable (a broker's transport.max_buf_size).
  rejects(() => tryDecodeFrame(header(65537), { maxDataLen: 65536 }), ErrorCode.FRAME_TOO_LARGE);
  const d = new FrameDecoder({ maxDataLen: 100 });
  d.push(header(101));
  rejects(() => d.next(), ErrorCode.FRAME_TOO_LARGE, { fatal: true });
  rejects(() => d.next(), ErrorCode.FRAME_TOO_LARGE);
  // The encoder refuses to build such a frame.
  rejects(
    () => encodeFrame({ opcode: Opcode.PUBLISH, ext: { topic: 't' }, body: new Uint8Array(100) }, { maxDataLen: 99 }),
    ErrorCode.FRAME_TOO_LARGE,
  );
});

test('truncated extension entries and inconsistent ext_len: BAD_EXTENSION naming the offset', () => {
  // An entry header cut short: one byte left in the block (block starts at byte 12).
  rejects(() => decodeFrame(raw(0x41, 0, u16(4), [0x03, 1, 0, 0x04], b('x'))), ErrorCode.BAD_EXTENSION, {
    offset: 15,
    match: /block offset 3 truncated: need 2 bytes, have 1/,
  });
  // A value cut short: TOPIC says 5 bytes, the block has 1 more.
  rejects(() => decodeFrame(raw(0x41, 0, u16(6), [0x03, 1, 0, 0x04, 5, 0x61])), ErrorCode.BAD_EXTENSION, {
    offset: 15,
    match: /0x04 at block offset 3 truncated: need 7 bytes, have 3/,
  });
  // ext_len runs past the frame's data.
  rejects(() => decodeFrame(raw(0x41, 0, u16(9), [0x04, 1, 0x61])), ErrorCode.BAD_EXTENSION, {
    offset: 10,
    match: /overruns the frame data/,
  });
  // HasExtensions set, but data_len < 2.
  rejects(() => decodeFrame(raw(0x41, 0, [0x00])), ErrorCode.BAD_EXTENSION, { offset: 10, match: /need 2 for ext_len/ });
  // ext_len above 1024.
  const big = new Uint8Array(MAX_EXT_LEN + 1).fill(0x7f);
  rejects(() => decodeFrame(raw(0x41, 0, u16(MAX_EXT_LEN + 1), big)), ErrorCode.BAD_EXTENSION, {
    offset: 10,
    match: /1025 bytes exceeds the limit of 1024/,
  });
  // The same bytes without the flag are a (legacy) payload, not an extension block.
  assert.equal(decodeFrame(raw(0x01, 0, b('topic:a'))).body.length, 7);
});

test('known extensions: wrong length or value, repeated: BAD_EXTENSION; bad topic: INVALID_TOPIC', () => {
  const ext = (...entries) => raw(0x41, 0, u16(entries.flat().length), entries.flat(), b('body'));
  rejects(() => decodeFrame(ext([0x03, 1, 4])), ErrorCode.BAD_EXTENSION, { match: /priority must be 0..=3/ });
  rejects(() => decodeFrame(ext([0x03, 2, 0, 0])), ErrorCode.BAD_EXTENSION, { match: /1 byte/ });
  rejects(() => decodeFrame(ext([0x07, 4, 0, 0, 0, 0])), ErrorCode.BAD_EXTENSION, { match: /start at 1/ });
  rejects(() => decodeFrame(ext([0x05, 3, 0, 0, 0])), ErrorCode.BAD_EXTENSION, { match: /4 bytes/ });
  rejects(() => decodeFrame(ext([0x08, 1, 0])), ErrorCode.BAD_EXTENSION, { match: /empty/ });
  rejects(() => decodeFrame(ext([0x09, 1, 2])), ErrorCode.BAD_EXTENSION, { match: /0 or 1/ });
  rejects(() => decodeFrame(ext([0x0a, 1, 4])), ErrorCode.BAD_EXTENSION, { match: /overflow/ });
  rejects(() => decodeFrame(ext([0x0d, 1, 0xff])), ErrorCode.BAD_EXTENSION, { match: /UTF-8/ });
  rejects(() => decodeFrame(ext([0x0f, 4, 0, 0, 0, 0])), ErrorCode.BAD_EXTENSION, { match: /at least 1/ });
  rejects(() => decodeFrame(ext([0x01, 24, ...new Array(24).fill(0)])), ErrorCode.BAD_EXTENSION, { match: /25 bytes/ });
  rejects(() => decodeFrame(ext([0x03, 1, 0], [0x03, 1, 1])), ErrorCode.BAD_EXTENSION, {
    offset: 15,
    match: /more than once/,
  });
  rejects(() => decodeFrame(ext([0x04, 3, 0x61, 0x2b, 0x62])), ErrorCode.INVALID_TOPIC, { offset: 12 });
  rejects(() => decodeFrame(ext([0x04, 0])), ErrorCode.INVALID_TOPIC);
  rejects(() => decodeFrame(ext([0x0b, 2, 0x61, 0x3a])), ErrorCode.INVALID_TOPIC);
  // The first bad entry decides (§10.1): a bad priority before a bad topic.
  rejects(() => decodeFrame(ext([0x03, 1, 9], [0x04, 1, 0x23])), ErrorCode.BAD_EXTENSION);
  rejects(() => decodeFrame(ext([0x04, 1, 0x23], [0x03, 1, 9])), ErrorCode.INVALID_TOPIC);
});

test('unknown extension types are skipped (and kept), an empty block means no extensions', () => {
  const f = decodeFrame(raw(0x41, 2, u16(10), [0x7f, 3, 1, 2, 3], [0x04, 1, 0x61], [0x10, 0]));
  assert.equal(f.ext.topic, 'a');
  assert.deepEqual(f.ext.unknown, [
    { type: 0x7f, value: Uint8Array.of(1, 2, 3) },
    { type: 0x10, value: new Uint8Array(0) },
  ]);
  // Re-encoded in canonical order: known first, reserved types ascending.
  assert.deepEqual(
    encodeFrame(f),
    raw(0x41, 2, u16(10), [0x04, 1, 0x61], [0x10, 0], [0x7f, 3, 1, 2, 3]),
  );
  // An empty block (ext_len 0) on a SUBSCRIBE: kept, so it round-trips (§7.5: it asks for
  // Aqueduct's deliveries rather than the seed's).
  const sub = raw(0x42, 1, u16(0), b('topic:a'));
  const decoded = decodeFrame(sub, { peer: 'client' });
  assert.deepEqual(decoded.ext, {});
  assert.equal(decoded.hasExtensions, true);
  assert.deepEqual(encodeFrame(decoded), sub);
});

test('byte-wide extension values outside 0..=255 are refused, not cut to their low byte', () => {
  const pub = (ext) => () => encodeFrame({ opcode: Opcode.PUBLISH, ext: { topic: 'a', ...ext }, body: b('x') });
  const trace = { traceId: new Uint8Array(16).fill(1), spanId: new Uint8Array(8).fill(2) };
  assert.throws(pub({ trace: { ...trace, flags: 256 } }), /trace flags must be a u8/);
  assert.throws(pub({ compression: { algorithm: 257, uncompressedLength: 1 } }), /compression algorithm must be a u8/);
  assert.throws(pub({ compression: { algorithm: 'zstd', uncompressedLength: 1 } }), /compression algorithm must be a u8/);
  assert.throws(pub({ unknown: [{ type: 0x110, value: new Uint8Array(0) }] }), /extension type must be a u8/);
  // In range, as before.
  const f = decodeFrame(pub({ trace: { ...trace, flags: 1 }, unknown: [{ type: 0x7f, value: Uint8Array.of(9) }] })());
  assert.equal(f.ext.trace.flags, 1);
  assert.deepEqual(f.ext.unknown, [{ type: 0x7f, value: Uint8Array.of(9) }]);
});

test('payloads of the wrong shape: BAD_PAYLOAD, after the extension block is checked', () => {
  rejects(() => decodeFrame(raw(0x06, 1, new Uint8Array(7))), ErrorCode.BAD_PAYLOAD, { offset: 10, match: /8-byte/ });
  rejects(() => decodeFrame(raw(0x05, 1, new Uint8Array(9))), ErrorCode.BAD_PAYLOAD);
  // A CONFIRM's data is never refused (protocol.md 7.1): not whole u64s, it lists no offset.
  assert.deepEqual(decodeFrame(raw(0x07, 1, new Uint8Array(9))).offsets, []);
  rejects(() => decodeFrame(raw(0x08, 1, [200])), ErrorCode.BAD_PAYLOAD, { match: /2-byte code/ });
  // A reason that is not UTF-8 keeps its code (protocol.md 9): the bad bytes become U+FFFD.
  const bad = decodeFrame(raw(0x08, 1, [200, 0, 0xc3, 0x78]));
  assert.equal(bad.code, ErrorCode.INVALID_TOPIC);
  assert.equal(bad.reason, '\ufffdx');
  // CONFIRM and ERROR carry no (known) extension.
  rejects(() => decodeFrame(raw(0x47, 1, u16(2), [0x08, 0])), ErrorCode.BAD_PAYLOAD, { match: /no extensions/ });
  // §10.1: the extension block is reported before the payload.
  rejects(() => decodeFrame(raw(0x46, 1, u16(3), [0x03, 1, 7], new Uint8Array(3))), ErrorCode.BAD_EXTENSION);
  // Legacy publish (as a broker reads it): a bad ttl prefix, then a bad topic.
  rejects(() => decodeFrame(raw(0x01, 1, b('ttl:x:orders')), { peer: 'client' }), ErrorCode.BAD_PAYLOAD);
  rejects(() => decodeFrame(raw(0x01, 1, b('ttl:4294967296:orders')), { peer: 'client' }), ErrorCode.BAD_PAYLOAD, {
    match: /32 bits/,
  });
  rejects(() => decodeFrame(raw(0x01, 1, b('topic:a+b')), { peer: 'client' }), ErrorCode.INVALID_TOPIC, { offset: 16 });
  // A client reading a delivery takes the payload as the body, whatever it is (§7.5).
  assert.deepEqual(decodeFrame(raw(0x01, 7, b('a:b#c'))).body, b('a:b#c'));
  // The MeshForwarded bit from a client: UNSUPPORTED (§2), checked after the opcode.
  rejects(() => decodeFrame(raw(0x81, 1, b('orders')), { peer: 'client' }), ErrorCode.UNSUPPORTED, { offset: 1 });
  rejects(() => decodeFrame(raw(0x8a, 1, b('orders')), { peer: 'client' }), ErrorCode.UNKNOWN_OPCODE);
  // ... and on a batch's sub-frame: the batch is invalid (§6.3), as the Rust codec says.
  const sub = raw(0xc1, 0, u16(3), [0x04, 1, 0x61], b('1'));
  rejects(() => decodeFrame(raw(0x04, 9, sub), { peer: 'client' }), ErrorCode.BAD_BATCH, {
    match: /sub-frame 0 at byte 10: .*MeshForwarded/,
  });
  // The encoder never sets it on a sub-frame.
  const batch = encodeFrame({ opcode: Opcode.PUBLISH_BATCH, streamId: 9, frames: [{ ext: { topic: 'a' }, body: b('1'), meshForwarded: true }] });
  assert.equal(batch[10 + 1] & 0x80, 0, "the sub-frame's command byte (after the batch's header)");
  assert.equal(decodeFrame(batch, { peer: 'client' }).frames.length, 1);
});

test('INFO entries (§4.1): unknown keys skipped, a known key once and with its length, entries whole', () => {
  assert.deepEqual(decodeFrame(raw(0x09, 3, [])).info, {});
  for (const durable of [false, true]) {
    const frame = encodeFrame({ opcode: Opcode.INFO, streamId: 3, info: { durable } });
    assert.deepEqual([...frame.subarray(10)], [0x06, 1, durable ? 1 : 0]);
    assert.deepEqual(decodeFrame(frame).info, { durable });
  }
  // A request's extension block is accepted and ignored.
  assert.deepEqual(decodeFrame(raw(0x49, 3, u16(0)), { peer: 'client' }).info, {});
  assert.deepEqual(decodeFrame(raw(0x09, 3, [0x01, 1, 1, 0x7f, 3, 9, 9, 9, 0x04, 4, 0x10, 0x27, 0, 0])).info, {
    protocol: 1,
    maxSubscriptions: 10000,
  });
  for (const [payload, problem] of [
    [[0x01, 1, 1, 0x01, 1, 2], /a key appears twice/],
    [[0x02, 2, 0, 1], /u32 entry must be 4 bytes/],
    [[0x01, 2, 1, 1], /PROTOCOL must be 1 byte/],
    [[0x05, 0], /BROKER must not be empty/],
    [[0x05, 1, 0xff], /BROKER must be UTF-8/],
    [[0x06, 1, 2], /DURABLE must be 1 byte, 0 or 1/],
    [[0x06, 0], /DURABLE must be 1 byte, 0 or 1/],
    [[0x06, 1, 1, 0x06, 1, 0], /a key appears twice/],
    [[0x7f, 5, 1], /cut short/],
    [[0x01], /cut short/],
  ]) {
    rejects(() => decodeFrame(raw(0x09, 3, payload)), ErrorCode.BAD_PAYLOAD, { match: problem });
  }
  // A leading U+FEFF is text, as in the Rust codec (TextDecoder drops it by default).
  assert.equal(decodeFrame(raw(0x09, 3, [0x05, 4, 0xef, 0xbb, 0xbf, 0x61])).info.broker, '\ufeffa');
  // A broker name longer than an entry holds is cut at a character boundary.
  const long = `${'x'.repeat(254)}é`;
  const back = decodeFrame(encodeFrame({ opcode: Opcode.INFO, streamId: 1, info: { broker: long } }));
  assert.equal(back.info.broker, 'x'.repeat(254));
});

test('SUBSCRIBE and UNSUBSCRIBE grammar (§7.1, §7.2, §10.1)', () => {
  const sub = (s) => () => decodeFrame(raw(0x02, 1, b(s)), { peer: 'client' });
  assert.deepEqual(parseSubscribe(b('topic:a/#:durable:c:latest:group:g')), {
    filter: 'a/#',
    durable: { consumer: 'c', start: 'latest' },
    group: 'g',
  });
  assert.equal(parseSubscribe(b('topic:a:durable:c:18446744073709551615')).durable.start, 18446744073709551615n);
  rejects(sub('orders'), ErrorCode.BAD_SUBSCRIBE, { offset: 10, match: /must start with "topic:"/ });
  rejects(sub('topic:a/b#'), ErrorCode.INVALID_TOPIC, { offset: 16 });
  rejects(sub('topic:#/a'), ErrorCode.INVALID_TOPIC, { match: /last level/ });
  rejects(sub('topic:'), ErrorCode.INVALID_TOPIC, { match: /empty/ });
  rejects(sub('topic:a:queue:x'), ErrorCode.BAD_SUBSCRIBE, { offset: 18, match: /unknown option/ });
  rejects(sub('topic:a:group'), ErrorCode.BAD_SUBSCRIBE, { match: /missing its value/ });
  rejects(sub('topic:a:group:g:group:h'), ErrorCode.BAD_SUBSCRIBE, { match: /twice/ });
  rejects(sub('topic:a:group:'), ErrorCode.INVALID_TOPIC, { match: /group id: empty/ });
  rejects(sub('topic:a:durable:c'), ErrorCode.BAD_SUBSCRIBE, { match: /missing its value/ });
  rejects(sub('topic:a:durable:c:soon'), ErrorCode.BAD_SUBSCRIBE, { match: /decimal offset/ });
  rejects(sub('topic:a:durable:c:18446744073709551616'), ErrorCode.BAD_SUBSCRIBE, { match: /64 bits/ });
  rejects(() => decodeFrame(raw(0x03, 1, b('topic:a:group:g'))), ErrorCode.BAD_SUBSCRIBE, { offset: 17 });
  rejects(() => decodeFrame(raw(0x03, 1, b('topic:a+'))), ErrorCode.INVALID_TOPIC);
  assert.equal(formatSubscribe({ filter: 'a', durable: { consumer: 'c', start: 5n }, group: 'g' }), 'topic:a:group:g:durable:c:5');
  assert.throws(() => formatSubscribe({ filter: 'a:b' }), (e) => e.code === ErrorCode.INVALID_TOPIC);
});

test('PUBLISH_BATCH: an invalid sub-frame is BAD_BATCH naming the sub-frame', () => {
  const sub = (topic, body) => encodeFrame({ opcode: Opcode.PUBLISH, ext: { topic }, body: b(body) });
  const ok = decodeFrame(raw(0x04, 9, sub('a', '1'), sub('b', '2')), { peer: 'client' });
  assert.deepEqual(ok.frames.map((f) => f.ext.topic), ['a', 'b']);
  const badSecond = sub('b', '2');
  badSecond[0] = 0;
  rejects(() => decodeFrame(raw(0x04, 9, sub('a', '1'), badSecond)), ErrorCode.BAD_BATCH, {
    offset: 10 + 16,
    match: /sub-frame 1 at byte 26: BAD_MAGIC/,
  });
  rejects(() => decodeFrame(raw(0x04, 9, encodeFrame({ opcode: Opcode.ACK, offset: 1n })), { peer: 'client' }), ErrorCode.BAD_BATCH, {
    match: /sub-frame 0 .*must be PUBLISH/,
  });
  rejects(() => decodeFrame(raw(0x04, 9, sub('a', '1').subarray(0, 14))), ErrorCode.BAD_BATCH, { match: /runs past the end/ });
  rejects(() => decodeFrame(raw(0x04, 9, sub('a', '1'), [0x1f, 0x01])), ErrorCode.BAD_BATCH, { match: /sub-frame 1.*header cut short/ });
  rejects(() => decodeFrame(raw(0x04, 9, raw(0x01, 0, b('a:b')))), ErrorCode.BAD_BATCH, { match: /INVALID_TOPIC/ });
  // The batch's own extension block is checked first.
  rejects(() => decodeFrame(raw(0x44, 9, u16(1), [0x08], badSecond)), ErrorCode.BAD_EXTENSION);
  // Batches nested 3,000 deep (about 30 KB): refused by the first sub-frame's command byte, not
  // decoded level by level (which exhausted the stack with a RangeError).
  let nested = sub('a', '1');
  for (let i = 0; i < 3000; i++) nested = raw(0x04, 9, nested);
  rejects(() => decodeFrame(nested, { peer: 'client' }), ErrorCode.BAD_BATCH, { match: /sub-frame 0 at byte 10: sub-frames must be PUBLISH frames$/ });
});

// Every frame shape, as one stream.
const STREAM_FRAMES = [
  { opcode: Opcode.PUBLISH, streamId: 1, ext: { topic: 'orders', priority: 0, ttlMs: 5000, confirm: true }, body: b('hello') },
  { opcode: Opcode.PUBLISH, streamId: 2, ext: { attempt: 3, topic: 'x/y', offset: 2n ** 64n - 1n, reason: 'é'.repeat(10) }, body: new Uint8Array(0) },
  { opcode: Opcode.SUBSCRIBE, streamId: 3, ext: { confirm: true, ackMode: 1, overflow: 3, maxInFlight: 8 }, spec: { filter: 'a/+/#', group: 'g' } },
  { opcode: Opcode.UNSUBSCRIBE, streamId: 3, filter: 'a/+/#' },
  { opcode: Opcode.PUBLISH_BATCH, streamId: 4, ext: { confirm: true }, frames: [{ ext: { topic: 'a' }, body: b('1') }] },
  { opcode: Opcode.ACK, streamId: 3, ext: { attempt: 1, topic: 'a/b/c' }, offset: 9n },
  { opcode: Opcode.NACK, streamId: 3, ext: { reason: 'no' }, offset: 10n },
  { opcode: Opcode.CONFIRM, streamId: 4, offsets: [1n, 2n] },
  { opcode: Opcode.ERROR, streamId: 5, code: 999, reason: 'a code this version does not know' },
];
const stream = cat(...STREAM_FRAMES.map((f) => encodeFrame(f)));
const expected = STREAM_FRAMES.map((f) => decodeFrame(encodeFrame(f)));

test('incremental decoding: the stream split at every byte boundary gives the same frames', () => {
  assert.equal(expected.length, STREAM_FRAMES.length);
  for (let split = 0; split <= stream.length; split++) {
    const d = new FrameDecoder();
    const got = [];
    d.push(stream.subarray(0, split));
    got.push(...d.frames());
    d.push(stream.subarray(split));
    got.push(...d.frames());
    d.finish();
    assert.deepEqual(got, expected, `split at byte ${split}`);
  }
});

test('incremental decoding: one byte at a time, "need more" until each frame is complete', () => {
  const d = new FrameDecoder();
  const got = [];
  const ends = [];
  let total = 0;
  for (const f of STREAM_FRAMES) ends.push((total += encodeFrame(f).length));
  for (let i = 0; i < stream.length; i++) {
    d.push(stream.subarray(i, i + 1));
    const f = d.next();
    if (f === null) {
      assert.ok(!ends.includes(i + 1), `a frame ends at byte ${i + 1} but next() asked for more`);
    } else {
      assert.ok(ends.includes(i + 1), `a frame came out at byte ${i + 1}, which is not a frame end`);
      got.push(f);
      assert.equal(d.next(), null);
    }
  }
  assert.deepEqual(got, expected);
  d.finish();
});

test('every proper prefix of a valid frame is "need more", never an error; the stream ending there is MALFORMED_FRAME', () => {
  for (const f of STREAM_FRAMES) {
    const bytes = encodeFrame(f);
    for (let n = 0; n < bytes.length; n++) {
      const r = tryDecodeFrame(bytes.subarray(0, n));
      assert.equal(r.incomplete, true, `prefix of ${n} bytes`);
      assert.equal(r.need, n < 10 ? 10 : bytes.length);
      if (n > 0) {
        const d = new FrameDecoder();
        d.push(bytes.subarray(0, n));
        assert.equal(d.next(), null);
        rejects(() => d.finish(), ErrorCode.MALFORMED_FRAME, { offset: n });
      }
    }
  }
});

test('a bad frame in the middle of a stream is skipped; offsets count from the stream start', () => {
  const bad = raw(0x46, 3, u16(2), [0x07, 0], new Uint8Array(8)); // ATTEMPT with no value
  const first = encodeFrame(STREAM_FRAMES[0]);
  const d = new FrameDecoder();
  d.push(cat(first, bad, first));
  d.next();
  const err = rejects(() => d.next(), ErrorCode.BAD_EXTENSION, { offset: first.length + 12, fatal: false });
  assert.equal(err.frameOffset, first.length);
  assert.deepEqual(d.next(), expected[0]);
  assert.equal(d.next(), null);
});

test('the encoder writes the canonical order of §2.1 (ATTEMPT first, then ascending) and enforces the value rules', () => {
  const ext = { maxInFlight: 2, topic: 't', attempt: 5, priority: 3, confirm: true };
  assert.deepEqual(encodeExtensions(ext), Uint8Array.of(0x07, 4, 5, 0, 0, 0, 0x03, 1, 3, 0x04, 1, 0x74, 0x08, 0, 0x0f, 4, 2, 0, 0, 0));
  assert.deepEqual(decodeExtensions(encodeExtensions(ext)), ext);
  assert.throws(() => encodeExtensions({ priority: 4 }), RangeError);
  assert.throws(() => encodeExtensions({ attempt: 0 }), RangeError);
  assert.throws(() => encodeExtensions({ ttlMs: 2 ** 32 }), RangeError);
  assert.throws(() => encodeExtensions({ maxInFlight: 0 }), RangeError);
  assert.throws(() => encodeExtensions({ offset: -1n }), RangeError);
  assert.throws(() => encodeExtensions({ topic: 'a/#' }), (e) => e.code === ErrorCode.INVALID_TOPIC);
  assert.throws(() => encodeExtensions({ topic: 'x'.repeat(256) }), (e) => e.code === ErrorCode.INVALID_TOPIC);
  // Over 1024 bytes of entries.
  const unknown = Array.from({ length: 5 }, (_, i) => ({ type: 0x20 + i, value: new Uint8Array(250) }));
  assert.throws(() => encodeExtensions({ unknown }), (e) => e.code === ErrorCode.BAD_EXTENSION && /1260 bytes/.test(e.message));
  // CONFIRM and ERROR carry no extension block.
  assert.throws(() => encodeFrame({ opcode: Opcode.CONFIRM, ext: { confirm: true }, offsets: [] }), RangeError);
  // A REASON over 255 bytes is cut at a character boundary (§8.3).
  const cut = cutReason('é'.repeat(200));
  assert.equal(cut.length, 254);
  assert.equal(new TextDecoder().decode(cut), 'é'.repeat(127));
});

test('names (§5): topic names, filters, wildcards as whole levels', () => {
  for (const ok of ['a', 'a//b', '/a', 'sport/', '$SYS/x', '__dlq__orders', 'é']) assert.equal(topicNameProblem(ok), null, ok);
  for (const bad of ['', 'a:b', 'a\0', 'a/+', 'a#', 'x'.repeat(256)]) assert.notEqual(topicNameProblem(bad), null, bad);
  // A lone surrogate is no UTF-8 (TextEncoder would make it U+FFFD: another topic).
  for (const bad of ['a\uD800', '\uDC00b', 'x\uDBFFy']) assert.notEqual(topicNameProblem(bad), null, JSON.stringify(bad));
  assert.equal(topicNameProblem('a\uD83D\uDE00'), null, 'a surrogate pair is fine');
  assert.equal(topicNameProblem(Uint8Array.of(0xff)), 'not valid UTF-8');
  for (const ok of ['#', '+', 'sport/#', '+/+', 'a/+/b', '/+']) assert.equal(topicFilterProblem(ok), null, ok);
  for (const bad of ['a+', 'a/#/b', '#a', 'a/b+/c', '++']) assert.notEqual(topicFilterProblem(bad), null, bad);
});

test('FrameDecoder: a large frame does not leave its room behind, nor make the buffer twice its size', () => {
  const d = new FrameDecoder({ maxDataLen: 4 << 20 });
  const big = encodeFrame({ opcode: Opcode.PUBLISH, streamId: 1, ext: { topic: 'a' }, body: new Uint8Array(3 << 20) });
  // Pushed in 16 KiB reads, as a stream delivers it: few copies (a new buffer each time it
  // grows), and never more room than the frame needs.
  let buffers = 0;
  let last = null;
  for (let at = 0; at < big.length; at += 16384) {
    d.push(big.subarray(at, at + 16384));
    if (d.buf !== last) buffers += 1;
    last = d.buf;
    assert.ok(d.buf.length <= big.length, `buffer ${d.buf.length} for a frame of ${big.length} bytes`);
  }
  assert.ok(buffers <= 3, `${buffers} buffers for one frame`);
  assert.equal(d.next().body.length, 3 << 20);
  assert.ok(d.buf.length <= 256 * 1024, `kept ${d.buf.length} bytes after the frame`);
  // Small frames after it go on as before.
  d.push(encodeFrame({ opcode: Opcode.PUBLISH, streamId: 1, ext: { topic: 'a' }, body: b('x') }));
  assert.deepEqual(d.next().body, b('x'));
});
