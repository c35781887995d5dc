// docs/protocol.md is normative: every ```hex example=NAME block in it must decode, with this
// codec, to the frame the doc says it is (the table below, written from the doc's comments),
// and the frame must encode back to the same bytes. The same blocks are checked by
// crates/aqueduct-proto/tests/protocol_doc.rs, which finds them the same way.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

import {
  DEFAULT_MAX_DATA_LEN,
  ErrorCode,
  ExtType,
  MAX_EXT_LEN,
  MAX_NAME_LEN,
  MAX_REASON_LEN,
  Opcode,
  decodeFrame,
  encodeFrame,
  errorCodeName,
} from '../codec.js';

const DOC = fileURLToPath(new URL('../../../docs/protocol.md', import.meta.url));
const doc = readFileSync(DOC, 'utf8');
const te = new TextEncoder();
const b = (s) => te.encode(s);
const bytes = (...v) => Uint8Array.from(v);

/** Every ```hex block, keyed by its `example=NAME` tag; `#` starts a comment. */
function docExamples() {
  const out = [];
  const lines = doc.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i].trim();
    if (!line.startsWith('```hex example=')) continue;
    const name = line.slice('```hex example='.length).trim();
    const data = [];
    for (i++; i < lines.length && lines[i].trim() !== '```'; i++) {
      const code = lines[i].split('#')[0];
      for (const tok of code.trim().split(/\s+/).filter(Boolean)) {
        assert.match(tok, /^[0-9a-fA-F]{2}$/, `example ${name}: ${JSON.stringify(tok)} is not a hex byte`);
        data.push(parseInt(tok, 16));
      }
    }
    out.push({ name, bytes: Uint8Array.from(data) });
  }
  return out;
}

// Who sends each example: a broker decodes client frames with peer 'client' (legacy topics
// resolved); a client decodes the broker's with peer 'broker'.
const FROM_BROKER = 'broker';
const FROM_CLIENT = 'client';

const publish = (streamId, ext, body, extra = {}) => ({
  opcode: Opcode.PUBLISH,
  streamId,
  hasExtensions: Object.keys(ext).length > 0,
  ext,
  body,
  ...extra,
});
const subscribe = (streamId, spec, ext) => ({
  opcode: Opcode.SUBSCRIBE,
  streamId,
  hasExtensions: ext !== undefined,
  ext: ext ?? {},
  spec,
});

/** What each example is, from the doc's own comments. */
const EXPECTED = {
  publish: [FROM_CLIENT, publish(1, { topic: 'orders' }, b('hello'))],
  'publish-ttl-confirm': [
    FROM_CLIENT,
    publish(2, { priority: 0, topic: 'sensors/t1', ttlMs: 5000, confirm: true }, b('21.5')),
  ],
  'publish-trace-compression': [
    FROM_CLIENT,
    publish(
      3,
      {
        trace: { traceId: new Uint8Array(16).fill(0x11), spanId: new Uint8Array(8).fill(0x22), flags: 1 },
        compression: { algorithm: 1, uncompressedLength: 1000 },
        topic: 'logs',
      },
      bytes(0x28, 0xb5, 0x2f, 0xfd),
    ),
  ],
  'legacy-publish': [FROM_CLIENT, publish(3, {}, b('orders'), { legacy: { topic: 'orders' } })],
  'legacy-publish-ttl': [
    FROM_CLIENT,
    publish(3, {}, b('ttl:1500:topic:orders'), { legacy: { topic: 'orders', ttlMs: 1500 } }),
  ],
  'publish-batch': [
    FROM_CLIENT,
    {
      opcode: Opcode.PUBLISH_BATCH,
      streamId: 9,
      hasExtensions: false,
      ext: {},
      frames: [publish(0, { topic: 'a' }, b('1')), publish(0, { topic: 'b' }, b('2'))],
    },
  ],
  confirm: [FROM_BROKER, { opcode: Opcode.CONFIRM, streamId: 2, hasExtensions: false, ext: {}, offsets: [42n] }],
  'confirm-batch': [
    FROM_BROKER,
    { opcode: Opcode.CONFIRM, streamId: 9, hasExtensions: false, ext: {}, offsets: [0n, 7n] },
  ],
  delivery: [FROM_BROKER, publish(1, { attempt: 1, priority: 2, topic: 'orders', offset: 42n }, b('hello'))],
  'delivery-dead-letter': [
    FROM_BROKER,
    publish(
      4,
      {
        attempt: 1,
        priority: 2,
        topic: '__dlq__orders',
        offset: 0n,
        originalTopic: 'orders',
        originalOffset: 42n,
        reason: 'nacked',
        attemptsMade: 4,
      },
      b('hello'),
    ),
  ],
  subscribe: [FROM_CLIENT, subscribe(1, { filter: 'orders' })],
  'subscribe-confirm': [FROM_CLIENT, subscribe(1, { filter: 'orders' }, { confirm: true })],
  'confirm-subscribe': [FROM_BROKER, { opcode: Opcode.CONFIRM, streamId: 1, hasExtensions: false, ext: {}, offsets: [] }],
  'confirm-subscribe-durable': [FROM_BROKER, { opcode: Opcode.CONFIRM, streamId: 7, hasExtensions: false, ext: {}, offsets: [1n] }],
  'subscribe-group': [
    FROM_CLIENT,
    subscribe(5, { filter: 'sensors/+', group: 'ingest' }, { ackMode: 1, overflow: 1 }),
  ],
  'subscribe-durable': [
    FROM_CLIENT,
    subscribe(7, { filter: 'orders', group: 'billing', durable: { consumer: 'c1', start: 100n } }, { confirm: true }),
  ],
  unsubscribe: [FROM_CLIENT, { opcode: Opcode.UNSUBSCRIBE, streamId: 1, hasExtensions: false, ext: {}, filter: 'orders' }],
  'subscribe-seed': [FROM_CLIENT, subscribe(7, { filter: 'orders' })],
  // A seed-style delivery: the payload is the body, never a legacy topic (§7.5).
  'delivery-seed': [FROM_BROKER, publish(7, {}, b('orders'))],
  'delivery-seed-priority': [FROM_BROKER, publish(7, { priority: 0 }, b('orders'))],
  ack: [FROM_CLIENT, { opcode: Opcode.ACK, streamId: 1, hasExtensions: false, ext: {}, offset: 42n }],
  'ack-wildcard': [
    FROM_CLIENT,
    { opcode: Opcode.ACK, streamId: 5, hasExtensions: true, ext: { attempt: 2, topic: 'sensors/t1' }, offset: 7n },
  ],
  nack: [FROM_CLIENT, { opcode: Opcode.NACK, streamId: 1, hasExtensions: false, ext: {}, offset: 42n }],
  'nack-reason': [
    FROM_CLIENT,
    { opcode: Opcode.NACK, streamId: 1, hasExtensions: true, ext: { reason: 'bad json' }, offset: 42n },
  ],
  error: [
    FROM_BROKER,
    { opcode: Opcode.ERROR, streamId: 5, hasExtensions: false, ext: {}, code: ErrorCode.INVALID_TOPIC, reason: 'bad topic' },
  ],
  'info-request': [FROM_CLIENT, { opcode: Opcode.INFO, streamId: 3, hasExtensions: false, ext: {}, info: {} }],
  info: [
    FROM_BROKER,
    {
      opcode: Opcode.INFO,
      streamId: 3,
      hasExtensions: false,
      ext: {},
      info: {
        protocol: 1,
        maxDataLen: 65536,
        maxDeliveryDataLen: 66560,
        maxSubscriptions: 10000,
        broker: 'aqueduct-broker 0.1.0',
        durable: false,
      },
    },
  ],
};

const hex = (u8) => Array.from(u8, (x) => x.toString(16).padStart(2, '0')).join(' ');

test('docs/protocol.md has hex examples, and every one is checked here (and every check has its example)', () => {
  const names = docExamples().map((e) => e.name);
  assert.ok(names.length >= 24, `found only ${names.length} examples`);
  assert.equal(new Set(names).size, names.length, 'example names are unique');
  assert.deepEqual([...names].sort(), Object.keys(EXPECTED).sort());
});

for (const { name, bytes: wire } of docExamples()) {
  test(`docs/protocol.md example ${name}: decodes to what the doc says and encodes back byte for byte`, () => {
    const entry = EXPECTED[name];
    assert.ok(entry, `docs/protocol.md example ${name} is not checked by this test`);
    const [peer, want] = entry;
    const frame = decodeFrame(wire, { peer });
    assert.deepEqual(frame, want, `example ${name} decodes differently`);
    assert.equal(hex(encodeFrame(frame)), hex(wire), `example ${name} does not re-encode identically`);
    // Also built from the expectation alone (the encoder's canonical order is the doc's).
    assert.equal(hex(encodeFrame(want)), hex(wire), `example ${name} differs from what the codec encodes`);
    // The header's data_len counts everything after the 10-byte header.
    assert.equal(new DataView(wire.buffer).getUint32(6, true), wire.length - 10);
  });
}

/** Rows `| a | b | ... |` of the markdown table that follows `heading`. */
function tableAfter(heading) {
  const start = doc.indexOf(heading);
  assert.ok(start >= 0, `docs/protocol.md has ${heading}`);
  const lines = doc.slice(start).split('\n');
  const first = lines.findIndex((l) => l.startsWith('|'));
  const rows = [];
  for (let i = first + 2; i < lines.length && lines[i].startsWith('|'); i++) {
    rows.push(lines[i].split('|').slice(1, -1).map((c) => c.trim()));
  }
  return rows;
}

test('ErrorCode is exactly the code table of §9', () => {
  const rows = tableAfter('## 9. ERROR').filter((r) => /^\d+$/.test(r[0]));
  const fromDoc = Object.fromEntries(rows.map((r) => [r[1], Number(r[0])]));
  assert.deepEqual({ ...ErrorCode }, fromDoc);
  for (const [name, code] of Object.entries(fromDoc)) assert.equal(errorCodeName(code), name);
  assert.equal(errorCodeName(999), undefined);
});

test('ExtType is exactly the extension table of §3', () => {
  const rows = tableAfter('## 3. Extension types');
  const fromDoc = Object.fromEntries(
    rows.map((r) => [r[1].replace(/ \(seed\)$/, ''), parseInt(r[0].replace(/`/g, ''), 16)]),
  );
  assert.deepEqual({ ...ExtType }, fromDoc);
});

test('Opcode is exactly the opcode table of §4', () => {
  const rows = tableAfter('## 4. Opcodes');
  const fromDoc = Object.fromEntries(
    rows.map((r) => [r[1].replace(/ \(seed\)$/, ''), parseInt(r[0].replace(/`/g, ''), 16)]),
  );
  assert.deepEqual({ ...Opcode }, fromDoc);
});

test('the limits of §10 and §2.1', () => {
  const rows = Object.fromEntries(tableAfter('## 10. Limits').map((r) => [r[0], r[1]]));
  assert.equal(rows['extension block (`ext_len`)'], `${MAX_EXT_LEN} bytes`);
  assert.equal(rows['topic name / filter / group id / consumer id'], `${MAX_NAME_LEN} bytes`);
  assert.equal(rows.REASON, `${MAX_REASON_LEN} bytes`);
  assert.match(rows['`data_len`'], /the codec's own default is 1 MiB/);
  assert.equal(DEFAULT_MAX_DATA_LEN, 1 << 20);
  assert.match(doc, /at most \*\*1024\*\*/);
});
