// The client's logic against an in-memory fake of the broker's streams (test-support/).

import { test } from 'node:test';
import assert from 'node:assert/strict';

import { AqueductError, SUBPROTOCOL, connect, streamResetCode } from '../client.js';
import { ErrorCode, Opcode, encodeFrame } from '../codec.js';
import { fakeTransport } from '../test-support/fake-broker.js';

const te = new TextEncoder();
const b = (s) => te.encode(s);
const hex = (u8) => Array.from(u8, (x) => x.toString(16).padStart(2, '0')).join(' ');
const u32le = (n) => [n & 0xff, (n >>> 8) & 0xff, (n >>> 16) & 0xff, n >>> 24];
const fromHex = (s) => Uint8Array.from(s.trim().split(/\s+/), (x) => parseInt(x, 16));

async function setup(options = {}) {
  const fake = fakeTransport();
  const errors = [];
  const client = await connect('https://broker.invalid/aqueduct/wt', {
    openStream: fake.openStream,
    onError: (e) => errors.push(e),
    ...options,
  });
  return { fake, client, errors };
}

/**
 * A client whose first stream open waits until `release()` (the broker's stream limit reached);
 * later ones open at once.
 */
async function firstOpenHeld(options) {
  const fake = fakeTransport();
  let release;
  const held = new Promise((resolve) => {
    release = resolve;
  });
  let opens = 0;
  const client = await connect('x', {
    openStream: async () => {
      opens += 1;
      if (opens === 1) await held;
      return fake.openStream();
    },
    close: () => {},
    ...options,
  });
  return { fake, client, release };
}

/** Subscribe to `filter` on the client's first stream and confirm it (stream id 1). */
async function subscribed(fake, client, filter) {
  const subscribing = client.subscribe(filter);
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  return { broker, sub: await subscribing };
}

/** Read the empty PUBLISH_BATCH with CONFIRM a flush() sends on `stream`, and answer it. */
async function answerFlush(stream, before = async () => {}) {
  const { frame, bytes } = await stream.next();
  assert.equal(frame.opcode, Opcode.PUBLISH_BATCH);
  assert.deepEqual(frame.frames, []);
  await before(frame, bytes);
  await stream.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
}

/** Whether `promise` has settled after the event loop has run a little. */
async function settled(promise) {
  let done = false;
  promise.then(
    () => (done = true),
    () => (done = true),
  );
  await new Promise((r) => setTimeout(r, 20));
  return done;
}

test('publish with confirm: the PUBLISH frame on the wire, resolved with the CONFIRM offset', async () => {
  const { fake, client } = await setup();
  const result = client.publish('sensors/t1', '21.5', { priority: 0, ttlMs: 5000, confirm: true });
  const broker = await fake.stream(0);
  const { frame, bytes } = await broker.next();
  // docs/protocol.md example publish-ttl-confirm, with the client's first request id (1).
  assert.equal(
    hex(bytes),
    '1f 41 01 00 00 00 1d 00 00 00 17 00 03 01 00 04 0a 73 65 6e 73 6f 72 73 2f 74 31 05 04 88 13 00 00 08 00 32 31 2e 35',
  );
  assert.equal(await settled(result), false, 'resolved before the CONFIRM');
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [42n] });
  assert.equal(await result, 42n);
  await client.close();
});

test('confirmed publishes get distinct stream ids, are written in call order, and match their CONFIRMs', async () => {
  const { fake, client } = await setup();
  const a = client.publish('a', 'first', { confirm: true });
  const nowait = client.publish('b', 'second');
  const c = client.publish('c', 'third', { confirm: true });
  const broker = await fake.stream(0);
  const frames = [];
  for (let i = 0; i < 3; i++) frames.push((await broker.next()).frame);
  assert.deepEqual(
    frames.map((f) => [f.ext.topic, f.streamId, f.ext.confirm ?? false]),
    [
      ['a', 1, true],
      ['b', 0, false],
      ['c', 2, true],
    ],
  );
  assert.equal(await nowait, undefined);
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [7n] });
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 2, offsets: [0n] });
  assert.deepEqual(await Promise.all([a, c]), [7n, 0n]);
  assert.equal(fake.streams.length, 1, 'all on the one publish stream');
  // The CONFIRM of 'c' says 'b' (sent before it) was handled: close() has nothing to flush.
  await client.close();
  assert.equal(await broker.next(), null, 'no flush, the stream finished');
});

test('answers are matched by stream id: an ERROR for a later request may overtake an earlier CONFIRM', async () => {
  // A broker older than §6.4's rule sent an ERROR for a later frame at once, before the
  // CONFIRMs its durable log still owed earlier ones.
  const { fake, client } = await setup();
  const first = client.publish('a', '1', { confirm: true });
  const second = client.publish('a/+', '2', { confirm: true }).catch((e) => e); // refused locally
  const third = client.publish('b', '3', { confirm: true });
  const broker = await fake.stream(0);
  const ids = [(await broker.next()).frame.streamId, (await broker.next()).frame.streamId];
  assert.deepEqual(ids, [1, 3]);
  assert.equal((await second).code, ErrorCode.INVALID_TOPIC);
  await broker.send({ opcode: Opcode.ERROR, streamId: 3, code: ErrorCode.RATE_LIMITED, reason: 'over quota: retry in 20 ms' });
  await assert.rejects(third, (e) => e instanceof AqueductError && e.code === ErrorCode.RATE_LIMITED);
  assert.equal(await settled(first), false, 'the earlier request still waits for its answer');
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [5n] });
  assert.equal(await first, 5n);
  await client.close();
});

test('an ERROR frame rejects the pending call with an AqueductError carrying the code and reason', async () => {
  const { fake, client, errors } = await setup();
  const result = client.publish('secret/x', 'body', { confirm: true });
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: frame.streamId, code: 400, reason: 'may not publish to secret/x' });
  await assert.rejects(result, (e) => {
    assert.ok(e instanceof AqueductError);
    assert.equal(e.code, ErrorCode.NOT_AUTHORIZED);
    assert.equal(e.codeName, 'NOT_AUTHORIZED');
    assert.equal(e.category, 'authorization');
    assert.equal(e.reason, 'may not publish to secret/x');
    assert.equal(e.streamId, frame.streamId);
    return true;
  });
  // An ERROR for a publish sent without confirmation (stream id 0) goes to onError; a code
  // this version does not know is kept and classified by its range (§9).
  const unconfirmed = client.publish('t', 'x');
  assert.equal((await broker.next()).frame.streamId, 0);
  assert.equal(await unconfirmed, undefined);
  await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: 399, reason: 'new flow control' });
  await new Promise((r) => setTimeout(r, 10));
  assert.equal(errors.length, 1);
  assert.equal(errors[0].code, 399);
  assert.equal(errors[0].codeName, undefined);
  assert.equal(errors[0].category, 'flow-control');
  // close() flushes, and rejects with the refusal no flush has reported yet.
  const closing = client.close();
  await answerFlush(broker);
  await assert.rejects(closing, (e) => e instanceof AqueductError && e.code === 399);
});

test('publishBatch: one PUBLISH_BATCH with CONFIRM, resolved with one offset per message', async () => {
  const { fake, client } = await setup();
  const result = client.publishBatch(
    [
      { topic: 'a', body: '1' },
      { topic: 'b', body: '2', priority: 0 },
    ],
    { confirm: true, ttlMs: 100 },
  );
  const broker = await fake.stream(0);
  const { frame, bytes } = await broker.next();
  assert.equal(frame.opcode, Opcode.PUBLISH_BATCH);
  assert.deepEqual(frame.ext, { confirm: true });
  assert.deepEqual(
    frame.frames.map((f) => f.ext),
    [
      { topic: 'a', ttlMs: 100 },
      { priority: 0, topic: 'b', ttlMs: 100 },
    ],
  );
  assert.equal(bytes[1], 0x44);
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [0n, 7n] });
  assert.deepEqual(await result, [0n, 7n]);
  await client.close();
});

test('requests the broker would refuse are refused before sending, with the spec code', async () => {
  const { fake, client } = await setup({ maxSendDataLen: 100 });
  await assert.rejects(client.publish('a/+', 'x'), (e) => e instanceof AqueductError && e.code === ErrorCode.INVALID_TOPIC);
  await assert.rejects(
    client.publish('a', new Uint8Array(200), { confirm: true }),
    (e) => e instanceof AqueductError && e.code === ErrorCode.FRAME_TOO_LARGE,
  );
  await assert.rejects(client.subscribe('a/#/b'), (e) => e.code === ErrorCode.INVALID_TOPIC);
  await assert.rejects(client.subscribe('a', { group: 'g:1' }), (e) => e.code === ErrorCode.INVALID_TOPIC);
  assert.equal(fake.streams.length, 0, 'nothing was sent');
  await client.close();
});

test('subscribe: SUBSCRIBE with CONFIRM resolves when active; deliveries iterate; ack sends the right ACK bytes', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('sensors/+', { group: 'ingest', ack: true, maxInFlight: 4, overflow: 'drop_newest' });
  const broker = await fake.stream(0);
  const { frame, bytes } = await broker.next();
  assert.equal(frame.opcode, Opcode.SUBSCRIBE);
  assert.deepEqual(frame.spec, { filter: 'sensors/+', group: 'ingest' });
  assert.deepEqual(frame.ext, { confirm: true, ackMode: 1, overflow: 1, maxInFlight: 4 });
  assert.equal(
    hex(bytes),
    hex(
      fromHex(`1f 42 01 00 00 00 2c 00 00 00 0e 00 08 00 09 01 01 0a 01 01 0f 04 04 00 00 00
        ${hex(b('topic:sensors/+:group:ingest'))}`),
    ),
  );
  assert.equal(await settled(subscribing), false, 'resolved before the CONFIRM');
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  const sub = await subscribing;
  assert.equal(sub.id, 1);

  await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { attempt: 2, priority: 0, topic: 'sensors/t1', offset: 7n }, body: b('21.5') });
  await broker.send({
    opcode: Opcode.PUBLISH,
    streamId: 1,
    ext: { attempt: 1, priority: 3, topic: 'sensors/t2', offset: 0n, trace: { traceId: new Uint8Array(16).fill(1), spanId: new Uint8Array(8).fill(2), flags: 1 } },
    body: b('x'),
  });
  const it = sub[Symbol.asyncIterator]();
  const m1 = (await it.next()).value;
  assert.deepEqual(
    [m1.topic, m1.text, m1.priority, m1.offset, m1.attempt],
    ['sensors/t1', '21.5', 0, 7n, 2],
  );
  await m1.ack();
  // docs/protocol.md example ack-wildcard, with this subscription's stream id (1) in place of 5.
  const ack = await broker.next();
  assert.equal(hex(ack.bytes), '1f 46 01 00 00 00 1c 00 00 00 12 00 07 04 02 00 00 00 04 0a 73 65 6e 73 6f 72 73 2f 74 31 07 00 00 00 00 00 00 00');
  await assert.rejects(m1.ack(), /already settled/);

  const m2 = (await it.next()).value;
  assert.equal(m2.extensions.trace.flags, 1);
  assert.equal(m2.priority, 3);
  await m2.nack('bad json');
  const nack = await broker.next();
  assert.equal(nack.frame.opcode, Opcode.NACK);
  assert.deepEqual(nack.frame.ext, { attempt: 1, topic: 'sensors/t2', reason: 'bad json' });
  assert.equal(nack.frame.offset, 0n);
  assert.equal(nack.frame.streamId, 1);
  await client.close();
});

test('a durable subscription learns from its CONFIRM whether the broker log serves it', async () => {
  const { fake, client } = await setup();
  const results = [];
  for (const [n, says] of [[1, 1n], [2, 0n], [3, 7n]]) {
    const subscribing = client.subscribe('orders', { durable: { consumer: `c${n}`, start: 'earliest' } });
    const broker = await fake.stream(n - 1);
    const { frame } = await broker.next();
    assert.deepEqual(frame.spec, { filter: 'orders', durable: { consumer: `c${n}`, start: 'earliest' } });
    await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [says] });
    results.push((await subscribing).durableLog);
  }
  assert.deepEqual(results, [true, false, undefined], 'a value the spec reserves says nothing');
  const plain = client.subscribe('orders');
  const broker = await fake.stream(3);
  const { frame } = await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
  assert.equal((await plain).durableLog, undefined, 'not a durable subscription');
  await client.close();
});

test('a delivery above 1 MiB (a broker with a larger transport.max_buf_size) is taken by default', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('big');
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
  const sub = await subscribing;
  const body = new Uint8Array(4 * 1024 * 1024).fill(7);
  await broker.send({ opcode: Opcode.PUBLISH, streamId: frame.streamId, ext: { topic: 'big', offset: 0n }, body });
  const m = (await sub[Symbol.asyncIterator]().next()).value;
  assert.equal(m.body.length, body.length);
  await client.close();
});

test('a SUBSCRIBE CONFIRM of any length confirms (protocol.md 7.1); the subscribe hung before', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('orders', { durable: { consumer: 'c1', start: 'earliest' } });
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  const id = frame.streamId;
  // CONFIRM (0x07) with 4 bytes of data: magic, opcode, stream id LE, data_len LE, data.
  await broker.send(new Uint8Array([0x1f, 0x07, id & 0xff, (id >> 8) & 0xff, 0, 0, 4, 0, 0, 0, 1, 2, 3, 4]));
  assert.equal((await subscribing).durableLog, undefined, 'confirmed, saying nothing');
  await client.close();
});

test('ack on a subscription without wildcards: ATTEMPT but no TOPIC; refusals go to onError', async () => {
  const { fake, client } = await setup();
  const refusals = [];
  const subscribing = client.subscribe('orders', { ack: true, onError: (e) => refusals.push(e) });
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  const sub = await subscribing;
  await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { attempt: 1, priority: 2, topic: 'orders', offset: 42n }, body: b('hello') });
  const { value: m } = await sub.next();
  await m.ack();
  const { bytes } = await broker.next();
  assert.equal(hex(bytes), '1f 46 01 00 00 00 10 00 00 00 06 00 07 04 01 00 00 00 2a 00 00 00 00 00 00 00');
  await broker.send({ opcode: Opcode.ERROR, streamId: 1, code: ErrorCode.STALE_ATTEMPT, reason: 'attempt 1 is not current' });
  await new Promise((r) => setTimeout(r, 10));
  assert.deepEqual(refusals.map((e) => e.code), [ErrorCode.STALE_ATTEMPT]);
  assert.equal(sub.ended, false, 'a refused ACK does not end the subscription');
  await client.close();
});

test('a refused SUBSCRIBE rejects with the ERROR, and the client finishes that stream', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('secret/#');
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: 1, code: 400, reason: 'may not subscribe to secret/#' });
  await assert.rejects(subscribing, (e) => e instanceof AqueductError && e.code === 400 && e.reason === 'may not subscribe to secret/#');
  assert.equal(await broker.next(), null, 'the client finished its sending side');
  await client.close();
});

test('SLOW_CONSUMER ends the iterator with the AqueductError after the messages that came before', async () => {
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'jobs');
  await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { attempt: 1, priority: 2, topic: 'jobs', offset: 0n }, body: b('a') });
  await broker.send({ opcode: Opcode.ERROR, streamId: 1, code: 300, reason: 'slow consumer' });
  const seen = [];
  await assert.rejects(
    (async () => {
      for await (const m of sub) seen.push(m.text);
    })(),
    (e) => e instanceof AqueductError && e.code === ErrorCode.SLOW_CONSUMER,
  );
  assert.deepEqual(seen, ['a']);
  assert.equal(sub.ended, true);
  await client.close();
});

test('a delivery stream the broker finishes while the subscription lives (its shutdown) ends the iterator with SHUTTING_DOWN', async () => {
  // It ended quietly, as an unsubscribe does, and the session's close (501) came too late to say
  // why.
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'jobs');
  await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { attempt: 1, priority: 2, topic: 'jobs', offset: 0n }, body: b('a') });
  await broker.finish();
  const seen = [];
  await assert.rejects(
    (async () => {
      for await (const m of sub) seen.push(m.text);
    })(),
    (e) => e instanceof AqueductError && e.code === ErrorCode.SHUTTING_DOWN && e.streamId === 1,
  );
  assert.deepEqual(seen, ['a'], 'after the messages that came before');
  assert.equal(sub.ended, true);
  await client.close();
});

test('an unsubscribe the broker answers by finishing the stream ends the iterator normally', async () => {
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'jobs');
  const done = sub.unsubscribe();
  assert.equal((await broker.next()).frame.opcode, Opcode.UNSUBSCRIBE);
  await broker.finish();
  await done;
  assert.deepEqual(await sub.next(), { value: undefined, done: true });
  await client.close();
});

test('a delivery stream reset by the broker ends the iterator with the reset code', async () => {
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'jobs');
  await broker.reset(300);
  await assert.rejects(sub.next(), (e) => e instanceof AqueductError && e.code === 300);
  assert.deepEqual(await sub.next(), { value: undefined, done: true });
  await client.close();
});

test('a reset while the subscription\'s buffer is full is seen at once: the subscription ends (its stream stopped both ways), its messages still come first', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('jobs', { buffer: 2 });
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  const sub = await subscribing;
  for (let i = 0; i < 3; i++) {
    await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { topic: 'jobs', offset: BigInt(i) }, body: b(`job ${i}`) });
  }
  await broker.reset(300);
  // Nothing taken by the application: the reset is seen anyway (the client was waiting for
  // room before reading on, and saw it only once the application made some).
  for (let i = 0; i < 100 && !sub.ended; i++) await new Promise((resolve) => setTimeout(resolve, 5));
  assert.equal(sub.ended, true, 'ended without the application taking anything');
  const stopped = await Promise.race([
    broker.writer.closed.then(() => 'finished', () => 'reset'),
    new Promise((resolve) => setTimeout(() => resolve('still open'), 5000)),
  ]);
  assert.equal(stopped, 'reset', 'the client ended its sending side');
  const got = [];
  for (;;) {
    try {
      const { value, done } = await sub.next();
      if (done) break;
      got.push(value.text);
    } catch (e) {
      assert.ok(e instanceof AqueductError && e.code === 300, String(e));
      break;
    }
  }
  assert.ok(got.length >= 2 && got.every((t, i) => t === `job ${i}`), JSON.stringify(got));
  await client.close();
});

test('over WebTransport, one-byte reset codes are the spec codes: 30 is SLOW_CONSUMER (300), 51 is SHUTTING_DOWN (501)', async () => {
  assert.equal(streamResetCode(30), ErrorCode.SLOW_CONSUMER);
  assert.equal(streamResetCode(51), ErrorCode.SHUTTING_DOWN);
  assert.equal(streamResetCode(0), 0);
  assert.equal(streamResetCode(300), 300);
  for (const [wire, code, name] of [
    [30, 300, 'SLOW_CONSUMER'],
    [51, 501, 'SHUTTING_DOWN'],
  ]) {
    const { fake, client } = await setup();
    const { broker, sub } = await subscribed(fake, client, 'jobs');
    await broker.reset(wire);
    await assert.rejects(
      sub.next(),
      (e) => e instanceof AqueductError && e.code === code && e.codeName === name && e.message.includes(`${wire} on WebTransport`),
    );
    assert.deepEqual(await sub.next(), { value: undefined, done: true });
    await client.close();
  }
});

test('unsubscribe: UNSUBSCRIBE with the filter and stream id, FIN, resolved when the broker finishes', async () => {
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'orders');
  const waiting = sub.next();
  const done = sub.unsubscribe();
  assert.deepEqual(await waiting, { value: undefined, done: true });
  const { bytes } = await broker.next();
  // docs/protocol.md example unsubscribe.
  assert.equal(hex(bytes), '1f 03 01 00 00 00 0c 00 00 00 74 6f 70 69 63 3a 6f 72 64 65 72 73');
  assert.equal(await broker.next(), null, 'then FIN');
  assert.equal(await settled(done), false, 'resolved before the broker finished');
  // A delivery the broker wrote before handling the UNSUBSCRIBE is dropped (§7.2).
  await broker.send({ opcode: Opcode.PUBLISH, streamId: 1, ext: { attempt: 1, priority: 2, topic: 'orders', offset: 5n }, body: b('late') });
  await broker.finish();
  await done;
  assert.deepEqual(await sub.next(), { value: undefined, done: true });
  await client.close();
});

test('unsubscribe: a broker that does not finish the stream in time gets it stopped (the stream is not kept)', async () => {
  const { fake, client } = await setup();
  const { broker, sub } = await subscribed(fake, client, 'orders');
  const done = sub.unsubscribe({ timeoutMs: 50 });
  await broker.next();
  assert.equal(await broker.next(), null, 'UNSUBSCRIBE, then FIN');
  await assert.rejects(done, (e) => e instanceof AqueductError && /within 50 ms/.test(e.message));
  // The client stopped reading: the broker's side of the stream fails (bounded: without the
  // stop it would stay open, and the test fails rather than waits).
  let timer;
  const outcome = await Promise.race([
    broker.writer.closed.then(
      () => 'finished',
      () => 'stopped',
    ),
    new Promise((resolve) => {
      timer = setTimeout(() => resolve('still open'), 5000);
    }),
  ]);
  clearTimeout(timer);
  assert.equal(outcome, 'stopped');
  await client.close();
});

test('an invalid frame from the broker fails the stream with its code; the next publish uses a new stream', async () => {
  const { fake, client } = await setup();
  const result = client.publish('a', '1', { confirm: true });
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send(Uint8Array.of(0x2a, 0, 0, 0));
  await assert.rejects(result, (e) => e instanceof AqueductError && e.code === ErrorCode.BAD_MAGIC && /at byte 0/.test(e.message));
  const again = client.publish('a', '2', { confirm: true });
  const second = await fake.stream(1);
  const { frame } = await second.next();
  await second.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [1n] });
  assert.equal(await again, 1n);
  await client.close();
});

test('a stream-fatal ERROR (FRAME_TOO_LARGE) rejects its request and later ones, and retires the stream', async () => {
  const { fake, client } = await setup();
  const big = client.publish('a', '1', { confirm: true });
  const after = client.publish('a', '2', { confirm: true });
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: frame.streamId, code: ErrorCode.FRAME_TOO_LARGE, reason: 'too large' });
  await assert.rejects(big, (e) => e.code === ErrorCode.FRAME_TOO_LARGE);
  await broker.finish();
  await assert.rejects(after, (e) => e instanceof AqueductError && /finished the stream before answering/.test(e.message));
  const next = client.publish('a', '3');
  const second = await fake.stream(1);
  assert.equal((await second.next()).frame.ext.topic, 'a');
  await next;
  // close() flushes the new stream's publish (the lost ones were reported by their calls).
  const closing = client.close();
  await answerFlush(second);
  await closing;
});

test('a flush covers what was sent before it, not what was sent while it waited for its answer', async () => {
  // A, flush F1, C (confirmed, refused as stream-fatal), D: F1's answer must not count D as
  // covered; the broker never read D, and the next flush says so. It reset the count to zero at
  // F1's answer, and the next flush resolved.
  const { fake, client } = await setup();
  await client.publish('a', 'A');
  const f1 = client.flush();
  const big = client.publish('a', 'C', { confirm: true });
  big.catch(() => {});
  await client.publish('a', 'D');
  const s = await fake.stream(0);
  await s.next(); // A
  const { frame: F } = await s.next();
  const { frame: C } = await s.next();
  await s.send({ opcode: Opcode.CONFIRM, streamId: F.streamId, offsets: [] });
  await f1;
  await s.send({ opcode: Opcode.ERROR, streamId: C.streamId, code: ErrorCode.FRAME_TOO_LARGE, reason: 'too large' });
  await s.finish();
  await assert.rejects(big, (e) => e.code === ErrorCode.FRAME_TOO_LARGE);
  const f2 = client.flush();
  const s2 = await fake.stream(1);
  await answerFlush(s2);
  await assert.rejects(f2, (e) => e instanceof AqueductError);
  await client.close();
});

test('subscribe with buffer 0 is refused (it would never read, not even its CONFIRM)', async () => {
  const { client } = await setup();
  await assert.rejects(client.subscribe('b', { buffer: 0 }), RangeError);
  await client.close();
});

test('close(): pending calls reject, iterators end, nothing more can be sent', async () => {
  const { fake, client } = await setup();
  const subscribing = client.subscribe('b');
  const s0 = await fake.stream(0);
  await s0.next();
  await s0.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  const sub = await subscribing;
  const pending = client.publish('a', '1', { confirm: true });
  await (await fake.stream(1)).next();
  const waiting = sub.next();
  await client.close();
  await assert.rejects(pending, (e) => e instanceof AqueductError && /closed/.test(e.message));
  assert.deepEqual(await waiting, { value: undefined, done: true });
  await assert.rejects(client.publish('a', '2'), /closed/);
  assert.equal(client.closed, true);
});

test('close(): flushes what was published without confirm, and closes once the broker answered', async () => {
  const { fake, client } = await setup();
  await client.publish('a', 'one');
  const closing = client.close();
  assert.equal(client.close(), closing, 'a second call waits for the first');
  const broker = await fake.stream(0);
  assert.equal((await broker.next()).frame.opcode, Opcode.PUBLISH);
  await answerFlush(broker, async () => {
    assert.equal(await settled(closing), false, 'closed before the broker answered the flush');
    assert.equal(client.closed, false);
  });
  await closing;
  assert.equal(client.closed, true);
  assert.equal(await broker.next(), null, 'then the stream is finished');
});

test('close(): rejects with the refusal of a publish sent without confirm, and closes anyway', async () => {
  const { fake, client } = await setup();
  await client.publish('a', 'refused');
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no publish rights on a' });
  const closing = client.close();
  await answerFlush(broker);
  await assert.rejects(closing, (e) => e instanceof AqueductError && e.code === ErrorCode.NOT_AUTHORIZED);
  assert.equal(client.closed, true);
});

test('close(): a flush the broker does not answer fails after closeFlushTimeoutMs, and the client closes', async () => {
  const { fake, client } = await setup({ closeFlushTimeoutMs: 50 });
  await client.publish('a', 'unanswered');
  const closing = client.close();
  const broker = await fake.stream(0);
  assert.equal((await broker.next()).frame.opcode, Opcode.PUBLISH);
  assert.equal((await broker.next()).frame.opcode, Opcode.PUBLISH_BATCH, 'the flush');
  await assert.rejects(closing, (e) => e instanceof AqueductError && /did not answer the flush within 50 ms/.test(e.message));
  assert.equal(client.closed, true);
});

test('close() right after a publish not awaited flushes it; calls made once close() began are refused', async () => {
  const { fake, client } = await setup();
  const sent = client.publish('a', 'not awaited'); // the first: its stream is not even open yet
  const closing = client.close();
  await assert.rejects(client.publish('a', 'too late'), (e) => e instanceof AqueductError && /closing/.test(e.message));
  await assert.rejects(client.flush(), /closing/);
  const broker = await fake.stream(0);
  assert.equal((await broker.next()).frame.ext.topic, 'a');
  await answerFlush(broker);
  await sent;
  await closing;
  assert.equal(await broker.next(), null, 'nothing else: the stream finished');
});

test('close() keeps to closeFlushTimeoutMs while publishes still wait for their stream to open', async () => {
  const { client } = await setup({
    closeFlushTimeoutMs: 50,
    streamOpenTimeoutMs: 60000,
    openStream: () => new Promise(() => {}), // the broker gives no stream
  });
  const publishes = [1, 2, 3].map((i) => client.publish('a', `${i}`).catch((e) => e));
  const closing = client.close();
  let timer;
  const verdict = await Promise.race([
    closing.then(
      () => 'resolved',
      (e) => e,
    ),
    new Promise((r) => {
      timer = setTimeout(() => r('still waiting after 5 s'), 5000);
    }),
  ]);
  clearTimeout(timer);
  assert.ok(verdict instanceof AqueductError, String(verdict));
  assert.match(verdict.message, /did not answer the flush within 50 ms/);
  assert.equal(client.closed, true);
  for (const p of await Promise.all(publishes)) assert.ok(p instanceof AqueductError, 'each publish failed, saying so');
});

test('close() after a stream-fatal ERROR on the publish stream says what was published after it may be lost', async () => {
  const { fake, client } = await setup();
  const big = client.publish('a', 'too large', { confirm: true });
  await client.publish('a', 'after it');
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: frame.streamId, code: ErrorCode.FRAME_TOO_LARGE, reason: 'too large' });
  await assert.rejects(big, (e) => e.code === ErrorCode.FRAME_TOO_LARGE);
  // The broker has not finished the stream yet: the ERROR alone says it.
  await assert.rejects(client.close(), (e) => e instanceof AqueductError && /may not have been read/.test(e.message));
});

test('close() after the connection was lost still says a publish was refused', async () => {
  let closeSession;
  const fake = fakeTransport();
  const client = await connect('x', {
    openStream: fake.openStream,
    onError: () => {},
    close: () => {},
    closed: new Promise((resolve) => {
      closeSession = resolve;
    }),
  });
  await client.publish('a', 'refused');
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no publish rights on a' });
  await new Promise((r) => setTimeout(r, 10));
  closeSession({ closeCode: 0, reason: 'idle timeout' });
  await client.whenClosed();
  await assert.rejects(client.close(), (e) => e instanceof AqueductError && e.code === ErrorCode.NOT_AUTHORIZED);
});

test('an undecodable frame no request waits for on the publish stream fails the next flush (it may be a refusal)', async () => {
  const { fake, client, errors } = await setup();
  await client.publish('a', 'x');
  const broker = await fake.stream(0);
  await broker.next();
  // An ERROR for stream id 0 too short to hold its code. (One whose reason is not UTF-8 is
  // no longer undecodable: it keeps its code, protocol.md 9.)
  const bad = Uint8Array.of(0x1f, Opcode.ERROR, 0, 0, 0, 0, 1, 0, 0, 0, 0x90);
  await broker.send(bad);
  const flushed = client.flush();
  await answerFlush(broker);
  await assert.rejects(flushed, (e) => e instanceof AqueductError && /invalid frame/.test(e.message));
  assert.equal(errors.length, 1, 'reported too');
  await client.close();
});

test('an onError callback that throws does not break the stream', async () => {
  const { fake, client } = await setup({
    onError: () => {
      throw new Error('application bug');
    },
  });
  const logged = console.error;
  const said = [];
  console.error = (...args) => said.push(args.join(' '));
  try {
    await client.publish('a', 'refused');
    const confirmed = client.publish('a', 'taken', { confirm: true });
    const broker = await fake.stream(0);
    await broker.next();
    const { frame } = await broker.next();
    await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no' });
    await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [5n] });
    assert.equal(await confirmed, 5n, 'the stream went on');
    assert.ok(said.some((l) => /onError callback threw/.test(l)), said.join('\n'));
  } finally {
    console.error = logged;
  }
  await assert.rejects(client.close(), (e) => e.code === ErrorCode.NOT_AUTHORIZED);
});

test('connect over WebTransport: URL with the token, certificate hashes, session closing fails pending calls', async () => {
  const seen = {};
  const fake = fakeTransport();
  let closeSession;
  class FakeWebTransport {
    constructor(url, init) {
      seen.url = url;
      seen.init = init;
      this.ready = Promise.resolve();
      this.closed = new Promise((resolve) => {
        closeSession = resolve;
      });
    }
    createBidirectionalStream() {
      return fake.openStream();
    }
    close(info) {
      seen.closedWith = info;
    }
  }
  const hash = 'AB:'.repeat(31) + 'AB';
  const client = await connect('https://localhost:4242/aqueduct/wt', {
    WebTransport: FakeWebTransport,
    token: 'tok en&1',
    serverCertificateHashes: [hash],
    protocols: ['aqueduct-v1'],
  });
  assert.equal(seen.url, 'https://localhost:4242/aqueduct/wt?token=tok+en%261');
  assert.equal(new URL(seen.url).searchParams.get('token'), 'tok en&1');
  assert.equal(seen.init.serverCertificateHashes[0].algorithm, 'sha-256');
  assert.deepEqual(seen.init.serverCertificateHashes[0].value, new Uint8Array(32).fill(0xab));
  assert.deepEqual(seen.init.protocols, ['aqueduct-v1']);
  const pending = client.publish('a', '1', { confirm: true });
  await (await fake.stream(0)).next();
  closeSession({ closeCode: 501, reason: 'broker shutting down' });
  await assert.rejects(pending, (e) => e instanceof AqueductError && e.code === ErrorCode.SHUTTING_DOWN && /broker shutting down/.test(e.message));
  assert.equal(client.closed, true);
  await assert.rejects(
    connect('https://localhost/', { WebTransport: FakeWebTransport, serverCertificateHashes: ['abcd'] }),
    /32 bytes/,
  );
  await assert.rejects(connect('https://localhost/', { WebTransport: undefined }), (e) => e instanceof AqueductError && /WebTransport is not available/.test(e.message));
});

test('connect over WebTransport: a refused session (no subprotocol selected) rejects with the close code and reason', async () => {
  const seen = {};
  const make = ({ protocol, closed }) =>
    class {
      constructor(url, init) {
        seen.url = url;
        seen.init = init;
        this.ready = Promise.resolve();
        this.protocol = protocol;
        this.closed = closed;
      }
      createBidirectionalStream() {
        throw new Error('no streams on a refused session');
      }
      close() {}
    };
  const reason = 'WebTransport session refused (401): unknown token (webtransport.tokens)';
  await assert.rejects(
    connect('https://localhost:4242/aqueduct/wt', {
      WebTransport: make({ protocol: '', closed: Promise.resolve({ closeCode: 400, reason }) }),
      token: 'guessed',
    }),
    (e) => e instanceof AqueductError && e.code === ErrorCode.NOT_AUTHORIZED && e.reason === reason,
  );
  // The subprotocol is offered by default: that is how a refusal is told at `ready`.
  assert.deepEqual(seen.init.protocols, [SUBPROTOCOL]);
  // Selected: admitted. An empty token is none (`?token=` would be refused as unknown).
  const client = await connect('https://localhost:4242/aqueduct/wt', {
    WebTransport: make({ protocol: SUBPROTOCOL, closed: new Promise(() => {}) }),
    token: '',
  });
  assert.equal(seen.url, 'https://localhost:4242/aqueduct/wt');
  assert.equal(client.closed, false);
  assert.equal(client.error, null);
  // A WebTransport that reports no subprotocol but whose session stays open (one that does not
  // negotiate them): admitted after a short wait, not refused.
  const unnegotiated = await connect('https://localhost:4242/aqueduct/wt', {
    WebTransport: make({ protocol: '', closed: new Promise(() => {}) }),
  });
  assert.equal(unnegotiated.closed, false);
});

test('a connection the broker closes: later calls fail with its code and reason, client.error keeps it', async () => {
  let closeSession;
  const fake = fakeTransport();
  const client = await connect('x', {
    openStream: fake.openStream,
    close: () => {},
    closed: new Promise((resolve) => {
      closeSession = resolve;
    }),
  });
  closeSession({ closeCode: 0, reason: 'disconnected by an administrator' });
  await new Promise((r) => setTimeout(r, 0));
  assert.equal(client.closed, true);
  assert.match(client.error.message, /disconnected by an administrator/);
  await assert.rejects(client.publish('a', '1'), (e) => e instanceof AqueductError && /disconnected by an administrator/.test(e.message));
  await client.close();
  assert.match(client.error.message, /disconnected by an administrator/);
});

test('a stream the broker gives no room for: subscribe fails after streamOpenTimeoutMs, and the stream opened later is closed', async () => {
  const { fake, client, release } = await firstOpenHeld({ streamOpenTimeoutMs: 30 });
  await assert.rejects(
    client.subscribe('a/#'),
    (e) => e instanceof AqueductError && /could not open a stream within 30 ms/.test(e.message) && /max_streams_per_connection/.test(e.message),
  );
  // The stream that opens late is closed, not left half-used: the broker end sees it reset
  // (it would wait forever otherwise).
  release();
  const late = await fake.stream(0);
  await assert.rejects(late.next());
  // The client still works.
  const pending = client.publish('a/b', 'x', { confirm: true });
  const side = await fake.stream(1);
  const { frame } = await side.next();
  await side.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [0n] });
  assert.equal(await pending, 0n);
});

test('a frame the client does not expect is reported, the stream goes on', async () => {
  const { fake, client, errors } = await setup();
  const result = client.publish('a', '1', { confirm: true });
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  await broker.send(encodeFrame({ opcode: Opcode.PUBLISH, streamId: 9, ext: { topic: 'x' }, body: b('?') }));
  await broker.send(Uint8Array.of(0x1f, 0x0a, 0, 0, 0, 0, 1, 0, 0, 0, 0)); // unknown opcode: skipped
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [3n] });
  assert.equal(await result, 3n);
  assert.deepEqual(
    errors.map((e) => e.code),
    [null, ErrorCode.UNKNOWN_OPCODE],
  );
  await client.close();
});

test('a frame of an unknown opcode with a waiting request\'s stream id answers nothing: the request gets its own CONFIRM', async () => {
  const { fake, client, errors } = await setup();
  const result = client.publish('a', '1', { confirm: true });
  const broker = await fake.stream(0);
  const { frame } = await broker.next();
  const id = frame.streamId;
  // A newer broker's frame (reserved opcode 0x0a) on the publish's own stream id.
  await broker.send(Uint8Array.of(0x1f, 0x0a, id & 0xff, (id >> 8) & 0xff, (id >> 16) & 0xff, id >>> 24, 0, 0, 0, 0));
  await broker.send({ opcode: Opcode.CONFIRM, streamId: id, offsets: [7n] });
  assert.equal(await result, 7n);
  assert.deepEqual(errors.map((e) => e.code), [ErrorCode.UNKNOWN_OPCODE]);
  await client.close();
});

test('info(): an INFO request on the wire, resolved with the answer; an old broker\'s UNKNOWN_OPCODE rejects', async () => {
  const { fake, client } = await setup();
  const asked = client.info();
  const broker = await fake.stream(0);
  const { frame, bytes } = await broker.next();
  // docs/protocol.md example info-request, with the client's first request id (1).
  assert.equal(hex(bytes), '1f 09 01 00 00 00 00 00 00 00');
  const answer = { protocol: 1, maxDataLen: 4096, maxDeliveryDataLen: 5120, maxSubscriptions: 7, broker: 'aqueduct-broker 0.1.0' };
  await broker.send({ opcode: Opcode.INFO, streamId: frame.streamId, info: answer });
  assert.deepEqual(await asked, answer);
  const old = client.info();
  const second = (await broker.next()).frame;
  await broker.send({ opcode: Opcode.ERROR, streamId: second.streamId, code: ErrorCode.UNKNOWN_OPCODE, reason: 'unknown opcode 0x09' });
  await assert.rejects(old, (e) => e instanceof AqueductError && e.code === ErrorCode.UNKNOWN_OPCODE);
  await client.close();
});

test('info(): an invalid INFO answer, or an answer of the wrong kind, rejects the call instead of leaving it waiting', async () => {
  const { fake, client, errors } = await setup();
  const bad = client.info();
  const broker = await fake.stream(0);
  const first = (await broker.next()).frame;
  // INFO whose PROTOCOL entry is 2 bytes long: BAD_PAYLOAD, that frame skipped.
  await broker.send(Uint8Array.of(0x1f, 0x09, ...u32le(first.streamId), 4, 0, 0, 0, 0x01, 2, 1, 1));
  await assert.rejects(bad, (e) => e instanceof AqueductError && e.code === ErrorCode.BAD_PAYLOAD);
  const crossed = client.info();
  const second = (await broker.next()).frame;
  await broker.send({ opcode: Opcode.CONFIRM, streamId: second.streamId, offsets: [1n] });
  await assert.rejects(crossed, (e) => e instanceof AqueductError && /answered CONFIRM where INFO was due/.test(e.message));
  // The stream goes on: a publish on it is confirmed.
  const later = client.publish('a', '1', { confirm: true });
  const third = (await broker.next()).frame;
  await broker.send({ opcode: Opcode.CONFIRM, streamId: third.streamId, offsets: [5n] });
  assert.equal(await later, 5n);
  assert.deepEqual(errors, [], 'answers to a request are not reported elsewhere');
  await client.close();
});

test('flush(): an empty PUBLISH_BATCH with CONFIRM after what was published, resolved by its answer', async () => {
  const { fake, client } = await setup();
  await client.flush(); // nothing published: nothing sent
  await client.publish('a', 'one');
  const flushed = client.flush();
  const broker = await fake.stream(0);
  assert.equal((await broker.next()).frame.opcode, Opcode.PUBLISH);
  await answerFlush(broker, async (frame, bytes) => {
    // PUBLISH_BATCH (0x04) with an extension block (0x40), its stream id, data_len 4: the block
    // holds only CONFIRM, and no frames follow.
    assert.equal(hex(bytes), `1f 44 ${hex(Uint8Array.from(u32le(frame.streamId)))} 04 00 00 00 02 00 08 00`);
    assert.equal(await settled(flushed), false, 'resolved before the broker answered');
  });
  await flushed;
  await client.close();
});

test('flush(): rejects with an ERROR that answered an unconfirmed publish since the last flush, once', async () => {
  const { fake, client, errors } = await setup();
  await client.publish('a', 'refused');
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no publish rights on a' });
  const flushed = client.flush();
  await answerFlush(broker);
  await assert.rejects(flushed, (e) => e instanceof AqueductError && e.code === ErrorCode.NOT_AUTHORIZED);
  assert.equal(errors.length, 1, 'onError heard of it too');
  // Reported once: the next flush succeeds.
  const again = client.flush();
  await answerFlush(broker);
  await again;
  await client.close();
});

test('flush(): an answer that does not come in timeoutMs rejects; the refusal it would have reported is the next flush\'s', async () => {
  const { fake, client } = await setup({ closeFlushTimeoutMs: 50 });
  await client.publish('a', 'refused');
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no publish rights on a' });
  const flushed = client.flush({ timeoutMs: 30 });
  const { frame } = await broker.next();
  assert.equal(frame.opcode, Opcode.PUBLISH_BATCH, 'the flush went out');
  await assert.rejects(flushed, (e) => e instanceof AqueductError && /did not answer the flush within 30 ms/.test(e.message));
  // Its answer comes late: the refusal before it is not taken by the flush that gave up.
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
  const next = client.flush();
  await answerFlush(broker);
  await assert.rejects(next, (e) => e instanceof AqueductError && e.code === ErrorCode.NOT_AUTHORIZED);
  await client.close();
});

test('flush({ timeoutMs: Infinity }) waits as long as the broker takes (no timer that would fire at once)', async () => {
  // Node turns a delay it cannot hold (Infinity, above 2^31 - 1) into 1 ms.
  const { fake, client } = await setup();
  await client.publish('a', 'slow');
  const flushed = client.flush({ timeoutMs: Infinity });
  const broker = await fake.stream(0);
  await broker.next();
  const { frame } = await broker.next();
  assert.equal(await settled(flushed), false, 'still waiting');
  await broker.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
  await flushed;
  for (const bad of [NaN, -1, '5000']) {
    await assert.rejects(client.flush({ timeoutMs: bad }), TypeError, String(bad));
  }
  await client.close();
});

test('Infinity for streamOpenTimeoutMs, closeFlushTimeoutMs and unsubscribe\'s timeoutMs waits as long as it takes (no timer that fires at once); what is not a number of ms is refused', async () => {
  const { fake, client, release } = await firstOpenHeld({
    onError: () => {},
    streamOpenTimeoutMs: Infinity,
    closeFlushTimeoutMs: Infinity,
  });
  const subscribing = client.subscribe('orders');
  assert.equal(await settled(subscribing), false, 'still opening');
  release();
  const broker = await fake.stream(0);
  await broker.next();
  await broker.send({ opcode: Opcode.CONFIRM, streamId: 1, offsets: [] });
  const sub = await subscribing;
  const unsubscribing = sub.unsubscribe({ timeoutMs: Infinity });
  await broker.next();
  assert.equal(await broker.next(), null, 'UNSUBSCRIBE, then FIN');
  assert.equal(await settled(unsubscribing), false, 'waits for the broker to finish');
  await broker.finish();
  await unsubscribing;
  await client.publish('a', 'slow');
  const closing = client.close();
  const pub = await fake.stream(1);
  await pub.next();
  const { frame } = await pub.next();
  assert.equal(await settled(closing), false, 'waits for the flush\'s answer');
  await pub.send({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] });
  await closing;
  for (const bad of [NaN, -1, '5000']) {
    await assert.rejects(connect('x', { openStream: fake.openStream, close: () => {}, streamOpenTimeoutMs: bad }), TypeError, String(bad));
    await assert.rejects(connect('x', { openStream: fake.openStream, close: () => {}, closeFlushTimeoutMs: bad }), TypeError, String(bad));
  }
});

test('flush(): rejects if the stream that carried publishes failed, although a new one answers', async () => {
  const { fake, client } = await setup();
  await client.publish('a', 'maybe lost');
  const first = await fake.stream(0);
  await first.next();
  await first.reset(3);
  // The client sees the reset; the flush then goes out on a new stream and is answered there.
  const flushed = client.flush();
  const second = await fake.stream(1);
  await answerFlush(second);
  await assert.rejects(flushed, (e) => e instanceof AqueductError);
  await client.close();
});

test('whenClosed(): resolves with the error the connection ended with, or null after close(); never rejects', async () => {
  let closeSession;
  const fake = fakeTransport();
  const lost = await connect('x', {
    openStream: fake.openStream,
    close: () => {},
    closed: new Promise((resolve) => {
      closeSession = resolve;
    }),
  });
  const ended = lost.whenClosed();
  assert.equal(await settled(ended), false, 'open: not resolved');
  closeSession({ closeCode: 501, reason: 'broker shutting down' });
  const err = await ended;
  assert.ok(err instanceof AqueductError);
  assert.equal(err.code, 501);
  assert.match(err.message, /broker shutting down/);
  assert.equal(await lost.whenClosed(), err, 'the same answer later');

  const { client } = await setup();
  const byUser = client.whenClosed();
  await client.close();
  assert.equal(await byUser, null);
});

test('flush() right after a publish not awaited yet still goes out after it', async () => {
  const { fake, client } = await setup();
  client.publish('a', 'not awaited');
  const flushed = client.flush();
  const broker = await fake.stream(0);
  assert.equal((await broker.next()).frame.opcode, Opcode.PUBLISH);
  await answerFlush(broker, async () => {
    assert.equal(await settled(flushed), false, 'resolved before the broker answered');
  });
  await flushed;
  await client.close();
});

test('flush(): an ERROR for a publish sent after it is the next flush\'s, even when it arrives with its answer', async () => {
  const { fake, client, errors } = await setup();
  await client.publish('a', 'before');
  const flushed = client.flush();
  await client.publish('secret', 'after');
  const broker = await fake.stream(0);
  await broker.next();
  const { frame } = await broker.next();
  await broker.next();
  // The answer and the later refusal in one write: dispatched together.
  const both = new Uint8Array([
    ...encodeFrame({ opcode: Opcode.CONFIRM, streamId: frame.streamId, offsets: [] }),
    ...encodeFrame({ opcode: Opcode.ERROR, streamId: 0, code: ErrorCode.NOT_AUTHORIZED, reason: 'no publish rights on secret' }),
  ]);
  await broker.send(both);
  await flushed;
  const next = client.flush();
  await answerFlush(broker);
  await assert.rejects(next, (e) => e.code === ErrorCode.NOT_AUTHORIZED);
  assert.equal(errors.length, 1);
  await client.close();
});

test('flush(): rejects when the broker finished the publish stream after a stream-fatal ERROR for a confirmed frame', async () => {
  const { fake, client } = await setup();
  const big = client.publish('a', 'too large for this broker', { confirm: true });
  await client.publish('a', 'after it, not read');
  const first = await fake.stream(0);
  const { frame } = await first.next();
  await first.next();
  await first.send({ opcode: Opcode.ERROR, streamId: frame.streamId, code: ErrorCode.FRAME_TOO_LARGE, reason: 'frame of 30 bytes over 20' });
  await first.finish();
  await assert.rejects(big, (e) => e.code === ErrorCode.FRAME_TOO_LARGE);
  const flushed = client.flush();
  const second = await fake.stream(1);
  await answerFlush(second);
  // Known from the ERROR on (the broker reads nothing after the frame it answers), not only
  // from the FIN.
  await assert.rejects(
    flushed,
    (e) => e instanceof AqueductError && e.code === ErrorCode.FRAME_TOO_LARGE && /may not have been read/.test(e.message),
  );
  await client.close();
});

test('flush(): a publish stream that fails after a flush covered everything on it is no loss', async () => {
  const { fake, client } = await setup();
  await client.publish('a', 'covered');
  const covered = client.flush();
  const first = await fake.stream(0);
  await first.next();
  await answerFlush(first);
  await covered;
  await first.reset(3);
  await new Promise((r) => setTimeout(r, 0));
  const flushed = client.flush();
  const second = await fake.stream(1);
  await answerFlush(second);
  await flushed;
  await client.close();
});
