// An Aqueduct client over WebTransport (or any transport that opens bidirectional streams of
// ReadableStream/WritableStream): each bidirectional stream carries exactly the frames of
// docs/protocol.md.
//
// Streams used: one publish stream (opened on the first publish, opened again if the broker
// ends it), and one stream per subscription (its delivery stream, §1), on which its ACK, NACK
// and UNSUBSCRIBE are sent too. Stream ids (the frame header's `stream_id`, §2): every
// confirmed request and every subscription gets an id unique among the connection's live ones
// (1, 2, 3, …), so that each CONFIRM or ERROR names the request it answers; publishes without
// confirmation use 0.

import {
  AckMode,
  BROKER_DEFAULT_MAX_BUF_SIZE,
  ErrorCode,
  FrameDecoder,
  FrameError,
  MAX_EXT_LEN,
  Opcode,
  encodeFrame,
  errorCategory,
  errorCodeName,
  isWildcardFilter,
  opcodeName,
  overflowValue,
  toBytes,
} from './codec.js';

/**
 * An error from the broker (an ERROR frame, a stream reset or a connection close with an
 * application code) or from the client. `code` is the spec's code (§9) — also for a request
 * the client refused to send because the broker would refuse it (e.g. INVALID_TOPIC) — or
 * `null` when there is none (the connection or stream closed, a protocol violation by the peer).
 */
/**
 * The largest `data_len` a client accepts by default: a delivery of the largest publish any
 * broker takes (`transport.max_buf_size` is at most 8 MiB) plus its extensions (§6.5, §10).
 * A smaller limit ended a subscription at the first delivery above it.
 */
/** The WebTransport subprotocol of Aqueduct (docs/protocol.md §12). */
export const SUBPROTOCOL = 'aqueduct-v1';
/** How long opening a stream may wait by default (ms) before the call fails. */
const STREAM_OPEN_TIMEOUT_MS = 10000;
/**
 * How long connect() waits for a session that selected no subprotocol to close (a refusal:
 * code and reason), in ms; one that stays open is used (a WebTransport that does not negotiate
 * subprotocols reports none).
 */
const REFUSAL_WAIT_MS = 1000;

/**
 * How long close() waits by default for the broker to answer the flush of what was published
 * without confirm (as the Rust client's close).
 */
const CLOSE_FLUSH_MS = 10000;

/** How long flush() waits by default for the broker's answer (ms), as close()'s flush. */
const FLUSH_TIMEOUT_MS = 10000;

/** The longest delay a timer holds (2^31 - 1 ms); longer ones fire at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** `ms`, a caller's timeout named `what`: a number of milliseconds, `Infinity` for none. */
function checkTimeout(ms, what) {
  if (typeof ms !== 'number' || Number.isNaN(ms) || ms < 0) {
    throw new TypeError(`${what} must be a number of milliseconds (or Infinity), got ${ms}`);
  }
  return ms;
}

/**
 * `setTimeout(fn, ms)`, or no timer (undefined, which clearTimeout takes) above what timers hold:
 * Node and browsers fire a timer of more than 2^31 - 1 ms (~24.8 days; `Infinity` too) at once.
 */
function timerFor(fn, ms) {
  return ms > MAX_TIMER_MS ? undefined : setTimeout(fn, ms);
}

const RECEIVE_MAX_DATA_LEN = 8 * 1024 * 1024 + MAX_EXT_LEN;

export class AqueductError extends Error {
  constructor(code, reason, { streamId, cause } = {}) {
    const name = code === null || code === undefined ? undefined : errorCodeName(code);
    const label = code === null || code === undefined ? '' : name ? `${name} (${code}): ` : `code ${code}: `;
    super(`${label}${reason}`, cause === undefined ? undefined : { cause });
    this.name = 'AqueductError';
    this.code = code ?? null;
    this.reason = reason;
    this.streamId = streamId;
  }

  /** The code's name (`"NOT_AUTHORIZED"`), or `undefined` for a code this version does not know. */
  get codeName() {
    return this.code === null ? undefined : errorCodeName(this.code);
  }

  /** The code's range (§9): framing, request, flow-control, authorization, broker; `null` without a code. */
  get category() {
    return this.code === null ? null : errorCategory(this.code);
  }
}

/** ERRORs that end the stream (§1.1, §10) or the subscription they name (§7.3, §11). */
const FATAL_FOR_STREAM = new Set([ErrorCode.MALFORMED_FRAME, ErrorCode.BAD_MAGIC, ErrorCode.FRAME_TOO_LARGE]);
const FATAL_FOR_SUBSCRIPTION = new Set([ErrorCode.SLOW_CONSUMER, ErrorCode.NOT_AUTHORIZED]);

/**
 * Stream reset codes as a browser reports them: `WebTransportError.streamErrorCode` is one byte,
 * so over WebTransport the broker resets streams with 30 for SLOW_CONSUMER (300) and 51 for
 * SHUTTING_DOWN (501) (docs/protocol.md §12). Other codes (0, or a full code from a transport
 * that carries them, see `openStream`) are passed on as they are.
 */
export const WEBTRANSPORT_STREAM_CODES = Object.freeze({ 30: ErrorCode.SLOW_CONSUMER, 51: ErrorCode.SHUTTING_DOWN });

/** The spec's code (§1.1, §9) for a stream error code as WebTransport reports it. */
export function streamResetCode(code) {
  return WEBTRANSPORT_STREAM_CODES[code] ?? code;
}

function toAqueductError(e, what) {
  if (e instanceof AqueductError) return e;
  if (e instanceof FrameError) return new AqueductError(e.code, e.message, { streamId: e.streamId, cause: e });
  if (e && typeof e.streamErrorCode === 'number') {
    const code = streamResetCode(e.streamErrorCode);
    const seen = code === e.streamErrorCode ? '' : ` (${e.streamErrorCode} on WebTransport)`;
    return new AqueductError(code, `${what}: the stream was reset with code ${code}${seen}`, { cause: e });
  }
  return new AqueductError(null, `${what}: ${e?.message ?? String(e)}`, { cause: e });
}

/**
 * Build the WebTransport URL: `url` with the `token` query parameter set (when given; an empty
 * token is none: the client is `anonymous`, where `?token=` would be refused as unknown).
 */
export function webTransportUrl(url, token) {
  const u = new URL(url);
  if (token !== undefined && token !== null && String(token) !== '') u.searchParams.set('token', String(token));
  return u.toString();
}

/**
 * Normalize `serverCertificateHashes` for `new WebTransport()`: each item may be
 * `{ algorithm: 'sha-256', value: BufferSource }`, `{ algorithm, value: 'hex' }` or a hex string
 * (colons and spaces allowed, as `openssl x509 -fingerprint -sha256` prints it).
 */
export function certificateHashes(hashes) {
  return hashes.map((h) => {
    const item = typeof h === 'string' ? { algorithm: 'sha-256', value: h } : h;
    let value = item.value;
    if (typeof value === 'string') {
      const hex = value.replace(/[\s:]/g, '');
      if (!/^([0-9a-fA-F]{2})+$/.test(hex)) throw new TypeError(`certificate hash ${JSON.stringify(value)} is not hex`);
      value = Uint8Array.from(hex.match(/../g), (b) => parseInt(b, 16));
    }
    const algorithm = item.algorithm ?? 'sha-256';
    if (algorithm === 'sha-256' && toBytes(value).length !== 32) {
      throw new TypeError(`a sha-256 certificate hash is 32 bytes, got ${toBytes(value).length}`);
    }
    return { algorithm, value };
  });
}

/**
 * Connect to a broker.
 *
 * With WebTransport (the default): `url` is the broker's WebTransport URL
 * (`https://host:4242/aqueduct/wt`); options `serverCertificateHashes` (for a short-lived
 * self-signed certificate, see README), `token` (sent as the URL query parameter `token`; the
 * broker's `webtransport.tokens` maps it to a client id; empty: none), `protocols` (WebTransport
 * subprotocols to offer; default `['aqueduct-v1']`, which lets connect() tell a refused session:
 * it rejects with NOT_AUTHORIZED (400) and the broker's reason, which names the HTTP status —
 * 401, 403 or 404), `WebTransport` (the
 * constructor to use).
 *
 * Any transport: `openStream` — a function returning (a promise of) `{ readable, writable }`,
 * one new bidirectional stream per call; then `url` is not used. `close` — called by
 * `client.close()`. `closed` — a promise that settles when the connection ends.
 *
 * Limits: `maxDataLen` — the largest `data_len` accepted from the broker (default 8 MiB + 1024,
 * for the largest `transport.max_buf_size` a broker takes; a frame's whole room is taken once its
 * header is in, so a frame at most this large is copied once as it arrives, §6.5, §10); `maxSendDataLen` — the largest `data_len` sent (default 65536, the broker's default
 * `transport.max_buf_size`: a larger frame gets FRAME_TOO_LARGE, which ends the stream, so the
 * client refuses it before sending). `streamOpenTimeoutMs` — how long opening a stream may wait
 * (default 10 s; each subscription takes one, and the broker allows
 * `transport.max_streams_per_connection` open at a time). `onError(err)` — ERRORs no call is waiting for (e.g. for a
 * publish sent without confirmation); default `console.warn`.
 */
export async function connect(url, options = {}) {
  let { openStream, close, closed } = options;
  let session = null;
  if (!openStream) {
    const WT = options.WebTransport ?? globalThis.WebTransport;
    if (typeof WT !== 'function') {
      throw new AqueductError(null, 'WebTransport is not available here (pass options.openStream to use another transport)');
    }
    const init = {};
    if (options.serverCertificateHashes) init.serverCertificateHashes = certificateHashes(options.serverCertificateHashes);
    init.protocols = options.protocols ?? [SUBPROTOCOL];
    try {
      session = new WT(webTransportUrl(url, options.token), init);
      await session.ready;
    } catch (e) {
      throw toAqueductError(e, `could not open a WebTransport session to ${url}`);
    }
    // The broker answers a page it does not admit with a session that selects no subprotocol
    // and closes at once with NOT_AUTHORIZED and a reason naming the HTTP status (§12):
    // browsers do not show pages the status. (`protocol` is undefined in a browser without
    // subprotocols.)
    if (init.protocols.includes(SUBPROTOCOL) && session.protocol === '') {
      const refused = await refusal(session, url);
      if (refused) throw refused;
    }
    openStream = () => session.createBidirectionalStream();
    close = () => session.close({ closeCode: 0, reason: 'client closed' });
    closed = session.closed;
  }
  return new Client({ ...options, openStream, close, closed });
}

/** Close a stream nobody will use (opened too late, or after the client closed). */
function discardStream(stream) {
  try {
    stream.writable?.abort?.().catch?.(() => {});
    stream.readable?.cancel?.().catch?.(() => {});
  } catch {
    // Already closed.
  }
}

/**
 * The error for a session the broker refused (its close code and reason), or null if it did not
 * close within REFUSAL_WAIT_MS (then it was admitted; a later close still reaches
 * `client.error`).
 */
async function refusal(session, url) {
  let timer;
  const waited = new Promise((resolve) => {
    timer = setTimeout(() => resolve(null), REFUSAL_WAIT_MS);
  });
  const info = await Promise.race([session.closed.catch((e) => ({ error: e })), waited]);
  clearTimeout(timer);
  if (info === null) return null;
  if (info.error) return toAqueductError(info.error, `the broker refused the WebTransport session to ${url}`);
  return new AqueductError(info.closeCode ?? null, info.reason || `the broker refused the WebTransport session to ${url}`);
}

/** A connection to a broker. Make one with `connect()`. */
export class Client {
  #openStream;
  #closeTransport;
  #options;
  #nextId = 1;
  #inUse = new Set();
  #publish = null; // Promise<Channel>
  // Since the last flush(): the first ERROR that answered a publish sent without confirm, and
  // the end of a publish stream before the broker had handled what was published on it.
  #refused = null;
  #publishLost = null;
  #published = false; // publish() or publishBatch() was called
  #channels = new Set();
  #subscriptions = new Set();
  #closed = false;
  #closing = null; // the close() in progress
  #error = null;
  #chain = Promise.resolve();
  #ended;
  #end;

  constructor(options) {
    this.#ended = new Promise((resolve) => {
      this.#end = resolve;
    });
    this.#openStream = options.openStream;
    this.#closeTransport = options.close;
    this.#options = {
      maxDataLen: options.maxDataLen ?? RECEIVE_MAX_DATA_LEN,
      maxSendDataLen: options.maxSendDataLen ?? BROKER_DEFAULT_MAX_BUF_SIZE,
      onError: shielded(options.onError ?? ((err) => console.warn('aqueduct:', err.message))),
      streamOpenTimeoutMs: checkTimeout(options.streamOpenTimeoutMs ?? STREAM_OPEN_TIMEOUT_MS, 'streamOpenTimeoutMs'),
      closeFlushTimeoutMs: checkTimeout(options.closeFlushTimeoutMs ?? CLOSE_FLUSH_MS, 'closeFlushTimeoutMs'),
    };
    if (options.closed && typeof options.closed.then === 'function') {
      options.closed.then(
        (info) => this.#lost(new AqueductError(info?.closeCode ?? null, `the connection closed${info?.reason ? `: ${info.reason}` : ''}`)),
        (e) => this.#lost(toAqueductError(e, 'the connection failed')),
      );
    }
  }

  /** True once `close()` was called or the connection ended. */
  get closed() {
    return this.#closed;
  }

  /** Why the connection ended (an `AqueductError`); null while open or after `close()`. */
  get error() {
    return this.#error;
  }

  /**
   * Resolves when the client ends: to the `AqueductError` the connection ended with (the
   * broker's close code and reason, a lost connection), or to null after `close()`. It never
   * rejects. The client does not reconnect by itself: await this, then `connect()` again and
   * subscribe again (a durable consumer resumes where it left off).
   */
  whenClosed() {
    return this.#ended;
  }

  /**
   * Publish `body` (bytes or a string, sent as UTF-8) to `topic`. Options: `priority` (0 highest
   * … 3 lowest; the broker's default is 2), `ttlMs` (drop it if not delivered in time; 0 = none),
   * `confirm` (wait for the broker). Resolves to the message's offset (a bigint) with `confirm`,
   * else to `undefined` once the frame is written.
   */
  async publish(topic, body, opts = {}) {
    const confirm = opts.confirm === true;
    this.#published = true;
    const offsets = await this.#send(
      (streamId) => ({
        opcode: Opcode.PUBLISH,
        streamId,
        ext: publishExt(topic, opts, confirm),
        body: toBytes(body),
      }),
      confirm,
    );
    if (!confirm) return undefined;
    if (offsets.length !== 1) {
      throw new AqueductError(null, `the CONFIRM of a PUBLISH carries ${offsets.length} offsets (expected 1)`);
    }
    return offsets[0];
  }

  /**
   * Publish several messages in one PUBLISH_BATCH frame: all or nothing (§6.3). `items`:
   * `{ topic, body, priority?, ttlMs? }`; `opts.priority` and `opts.ttlMs` apply to items that do
   * not set their own. With `opts.confirm`, resolves to one offset per message, in order.
   */
  async publishBatch(items, opts = {}) {
    const confirm = opts.confirm === true;
    this.#published = true;
    const frames = items.map((item) => ({
      opcode: Opcode.PUBLISH,
      streamId: 0,
      ext: publishExt(item.topic, { priority: item.priority ?? opts.priority, ttlMs: item.ttlMs ?? opts.ttlMs }, false),
      body: toBytes(item.body),
    }));
    const offsets = await this.#send(
      (streamId) => ({ opcode: Opcode.PUBLISH_BATCH, streamId, ext: confirm ? { confirm: true } : {}, frames }),
      confirm,
    );
    if (!confirm) return undefined;
    if (offsets.length !== items.length) {
      throw new AqueductError(null, `the CONFIRM of a batch of ${items.length} carries ${offsets.length} offsets`);
    }
    return offsets;
  }

  /**
   * Wait until the broker has handled everything this client published so far: an empty
   * PUBLISH_BATCH with CONFIRM goes out after it on the same stream, and the broker answers in
   * order (§6.3, §6.4) — with the durable log on, after storing what came before as
   * `aal.fsync` says. Rejects with the first ERROR the broker answered a publish sent without
   * `confirm` before it and after the last flush (that message was not taken; `onError` saw it
   * too), or if a stream that carried such publishes ended before the broker had handled them
   * (failed, or finished by the broker after a stream-fatal error). Resolves at once if this
   * client never published.
   *
   * Rejects after `timeoutMs` (default 10 s, as close()'s flush) without an answer, saying what
   * was published may not all have been taken; a refusal or lost stream it would have reported
   * is then left to the next flush. A broker that throttles this client (a publish quota, §11)
   * or waits for a slow disk answers later: pass more, or `Infinity` to wait as long as it takes.
   */
  async flush({ timeoutMs = FLUSH_TIMEOUT_MS } = {}) {
    this.#checkOpen();
    checkTimeout(timeoutMs, 'timeoutMs');
    if (timeoutMs > MAX_TIMER_MS) return this.#flushNow();
    const abandoned = { value: false };
    let timer;
    const late = new Promise((_, reject) => {
      timer = setTimeout(() => {
        abandoned.value = true;
        reject(new AqueductError(null, `the broker did not answer the flush within ${timeoutMs} ms: what was published may not all have been taken`));
      }, timeoutMs);
    });
    try {
      return await Promise.race([this.#flushNow(abandoned), late]);
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * The flush itself. Once `abandoned.value` is set (its caller gave up waiting), what went
   * wrong before it is left to the next flush instead of being taken by its late answer.
   */
  async #flushNow(abandoned = { value: false }) {
    if (!this.#published) return;
    // What went wrong before the empty batch, taken when its answer is dispatched: an ERROR for
    // a frame sent after it comes after that answer (§6.4) and is the next flush's.
    let earlier;
    let failure = null;
    try {
      await this.#sendNow(
        (streamId) => ({ opcode: Opcode.PUBLISH_BATCH, streamId, ext: { confirm: true }, frames: [] }),
        true,
        Opcode.CONFIRM,
        // What went wrong before it (#send marks the frames before it covered, not those sent
        // since).
        () => {
          if (!abandoned.value) earlier = this.#takeUnflushed();
        },
      );
    } catch (e) {
      failure = e;
    }
    if (abandoned.value) return;
    if (earlier === undefined) earlier = this.#takeUnflushed();
    if (earlier) throw earlier;
    if (failure) throw failure;
  }

  #takeUnflushed() {
    const e = this.#refused ?? this.#publishLost;
    this.#refused = null;
    this.#publishLost = null;
    return e;
  }

  /**
   * Ask the broker what it allows (§4.1). Resolves to `{ protocol, maxDataLen,
   * maxDeliveryDataLen, maxSubscriptions, broker }`, each present when the broker said it:
   * `maxDataLen` is the largest frame data it accepts from this client (a larger publish would
   * end the stream with FRAME_TOO_LARGE). A broker older than INFO rejects with
   * `UNKNOWN_OPCODE`.
   */
  async info() {
    return this.#send((streamId) => ({ opcode: Opcode.INFO, streamId }), true, Opcode.INFO);
  }

  /**
   * Send a frame on the publish stream; with `confirm`, resolve to its answer (an `expect`
   * frame), `onAnswer(channel, sentBefore)` being called (with how many frames without confirm the channel had sent before this one) when that answer is dispatched.
   */
  async #send(build, confirm, expect = Opcode.CONFIRM, onAnswer = undefined) {
    this.#checkOpen();
    return this.#sendNow(build, confirm, expect, onAnswer);
  }

  /** [`#send`] without the check for a close() begun: for the flush close() makes. */
  async #sendNow(build, confirm, expect = Opcode.CONFIRM, onAnswer = undefined) {
    this.#checkClosed();
    const streamId = confirm ? this.#allocId() : 0;
    try {
      const bytes = this.#encode(build(streamId));
      // Frames go out in call order: each is handed to the stream (WritableStream queues
      // writes in order) inside one chain; the write itself and the answer are awaited outside.
      const sent = await this.#inOrder(async () => {
        const channel = await this.#publishChannel();
        if (!confirm) channel.sent += 1;
        const sentBefore = channel.sent;
        // Answers come in request order (§6.4): one for this frame says the broker handled
        // every frame sent before it on this stream, so those need no flush.
        const answered = (ch) => {
          ch.covered = Math.max(ch.covered, sentBefore);
          onAnswer?.(ch, sentBefore);
        };
        return { answer: confirm ? channel.request(streamId, bytes, expect, answered) : channel.write(bytes) };
      });
      const answer = await sent.answer;
      return confirm ? answer : undefined;
    } finally {
      if (confirm) this.#inUse.delete(streamId);
    }
  }

  #inOrder(fn) {
    const run = this.#chain.then(fn);
    this.#chain = run.catch(() => {});
    return run;
  }

  #encode(frame) {
    try {
      return encodeFrame(frame, { maxDataLen: this.#options.maxSendDataLen });
    } catch (e) {
      if (e instanceof FrameError) throw new AqueductError(e.code, e.problem, { cause: e });
      throw e;
    }
  }

  /**
   * Subscribe to `filter` (a topic name, or with `+` / `#` wildcards). Options: `group` (join a
   * consumer group: each message to one member), `durable: { consumer, start }` (`start`: an
   * offset, `'earliest'` or `'latest'`), `ack` (settle each message with `ack()`/`nack()`; always
   * so in a group), `maxInFlight` (at most this many unsettled at a time), `overflow`
   * (`'drop_oldest'`, `'drop_newest'`, `'disconnect'`, `'block'`), `onError(err)` (ERRORs about
   * this subscription that do not end it, e.g. a refused ACK), `buffer` (deliveries read ahead of
   * the application, default 256; beyond it the stream is not read and QUIC flow control holds
   * the broker).
   *
   * The SUBSCRIBE carries the CONFIRM extension: the promise resolves once the broker has made
   * the subscription active (§7.1) — anything published after that is delivered — and rejects
   * with the broker's ERROR otherwise. A durable subscription's `durableLog` then says whether
   * the broker serves it from its durable log (`true`) or, running without the log, made it an
   * in-memory consumer group (`false`: nothing replayed, no position kept across restarts);
   * `undefined` if the broker does not say (one older than this rule).
   */
  async subscribe(filter, opts = {}) {
    this.#checkOpen();
    const ext = { confirm: true };
    if (opts.ack === true) ext.ackMode = AckMode.EXPLICIT;
    if (opts.maxInFlight !== undefined) ext.maxInFlight = opts.maxInFlight;
    if (opts.overflow !== undefined) ext.overflow = overflowValue(opts.overflow);
    const spec = { filter };
    if (opts.group !== undefined) spec.group = opts.group;
    if (opts.durable !== undefined) spec.durable = opts.durable;
    const id = this.#allocId();
    let sub;
    try {
      const bytes = this.#encode({ opcode: Opcode.SUBSCRIBE, streamId: id, ext, spec });
      sub = new Subscription(this, id, filter, opts, this.#options.onError);
      const channel = await this.#openChannel({
        onDelivery: (frame) => sub._deliver(frame),
        onError: (err) => sub._error(err),
        onEnd: (err) => sub._streamEnded(err),
        room: () => sub._room(),
      });
      sub._attach(channel);
      const answer = await channel.request(id, bytes);
      // A durable SUBSCRIBE's CONFIRM says whether the broker's log serves it (§7.1).
      if (opts.durable !== undefined && answer.length === 1 && (answer[0] === 0n || answer[0] === 1n)) {
        sub.durableLog = answer[0] === 1n;
      }
    } catch (e) {
      this.#inUse.delete(id);
      sub?._abandon();
      throw e;
    }
    // Ended already (its CONFIRM and its end came in one read): nothing to keep.
    if (!sub.ended) this.#subscriptions.add(sub);
    return sub;
  }

  /**
   * Flush what was published without `confirm` (within `closeFlushTimeoutMs`, 10 s by
   * default), then close every stream and the connection: pending calls reject, subscriptions
   * end. The connection is closed either way; it rejects as `flush()` would — a publish sent
   * without `confirm` was refused, or what was published may not all have been taken (its
   * stream failed, or the flush was not answered in time). Without the flush the broker would drop what it had received on a
   * stream but not yet read when the session closed. A second call waits for the first.
   */
  close() {
    this.#closing ??= this.#flushAndClose();
    return this.#closing;
  }

  async #flushAndClose() {
    // Ended already (the connection was lost): what was not taken is said all the same.
    if (this.#closed) {
      const e = this.#takeUnflushed();
      if (e) throw e;
      return;
    }
    let failure = null;
    try {
      await this.#flushOnClose();
    } catch (e) {
      failure = e;
    }
    this.#lost(new AqueductError(null, 'the client was closed'), { byUser: true });
    try {
      await this.#closeTransport?.();
    } catch {
      // Already closed.
    }
    if (failure) throw failure;
  }

  /**
   * The flush close() makes: only if a publish without `confirm` has been sent since the last
   * answered flush (confirmed publishes were taken, or their calls reject), bounded.
   */
  async #flushOnClose() {
    // The whole of it, the publishes still on their way to the stream included, within the
    // time.
    const ms = this.#options.closeFlushTimeoutMs;
    let timer;
    const late = new Promise((_, reject) => {
      timer = timerFor(
        () => reject(new AqueductError(null, `the broker did not answer the flush within ${ms} ms: what was published may not all have been taken`)),
        ms,
      );
    });
    try {
      // Publishes called before close() are handed to the stream in this chain: once it has
      // run they are counted in `sent` (calls made since close() are refused).
      await Promise.race([this.#chain, late]);
      const ch = this.#publish && (await Promise.race([this.#publish.catch(() => null), late]));
      if (ch && ch.usable && ch.sent > ch.covered) await Promise.race([this.#flushNow(), late]);
    } finally {
      clearTimeout(timer);
    }
    const e = this.#takeUnflushed();
    if (e) throw e;
  }

  #lost(err, { byUser = false } = {}) {
    if (this.#closed) return;
    this.#closed = true;
    if (!byUser) this.#error = err;
    this.#end(byUser ? null : err);
    // Closed by the application: iterators end (done); the connection lost: they throw.
    for (const sub of this.#subscriptions) sub._end(byUser ? null : err);
    for (const ch of this.#channels) ch.shut(err);
    this.#channels.clear();
    this.#subscriptions.clear();
  }

  /** Calls of the application: refused once close() has begun, or the client ended. */
  #checkOpen() {
    if (this.#closing && !this.#closed) throw new AqueductError(null, 'the client is closing');
    this.#checkClosed();
  }

  #checkClosed() {
    if (!this.#closed) return;
    const e = this.#error;
    throw e ? new AqueductError(e.code, e.reason, { cause: e }) : new AqueductError(null, 'the client is closed');
  }

  #allocId() {
    for (;;) {
      const id = this.#nextId;
      this.#nextId = id >= 0xffffffff ? 1 : id + 1;
      if (!this.#inUse.has(id)) {
        this.#inUse.add(id);
        return id;
      }
    }
  }

  async #publishChannel() {
    for (;;) {
      const opening = this.#publish;
      if (!opening) break;
      const ch = await opening.catch(() => null);
      if (ch && ch.usable) return ch;
      if (this.#publish === opening) break; // not replaced meanwhile: open a new one
    }
    const refusal = (err) => {
      this.#refused ??= err;
      this.#options.onError(err);
    };
    this.#publish = this.#openChannel({
      // An ERROR for a publish sent without confirm: the application hears of it now, and the
      // next flush() fails with it.
      onError: refusal,
      // An undecodable frame no request waits for may be the ERROR that refused a publish sent
      // without confirm: the next flush fails with it, as with a readable refusal.
      onUnreadable: refusal,
      // A stream-fatal ERROR: the broker reads nothing after the frame it answers, so what was
      // sent without confirm since the last answered request may not have been read. Said at
      // once (the broker's FIN, which onEnd waits for, may come much later).
      onBroken: (err, channel) => {
        if (channel.sent === channel.covered) return;
        this.#publishLost ??= new AqueductError(
          err.code,
          `the broker stopped reading the publish stream after a stream-fatal error (${err.message}): publishes sent without confirm may not have been read`,
          { cause: err },
        );
      },
      // Ended with frames sent without confirm that no flush has covered yet: failed, or
      // finished by the broker (it does so only after a stream-fatal ERROR, and reads nothing
      // after that frame).
      onEnd: (failure, channel) => {
        if (channel.sent === channel.covered || channel.finished) return;
        this.#publishLost ??=
          failure ??
          new AqueductError(null, 'the broker finished the publish stream after a stream-fatal error: publishes sent after it were not read');
      },
    });
    return this.#publish;
  }

  async #openChannel(handlers) {
    const stream = await this.#openStreamBounded();
    if (this.#closed) discardStream(stream);
    // Not #checkOpen: the flush close() makes may open the publish stream anew.
    this.#checkClosed();
    const ch = new Channel(stream, {
      maxDataLen: this.#options.maxDataLen,
      report: this.#options.onError,
      ...handlers,
      onEnd: (err) => {
        this.#channels.delete(ch);
        handlers.onEnd?.(err, ch);
      },
    });
    this.#channels.add(ch);
    return ch;
  }

  /**
   * A new stream, or an error once `streamOpenTimeoutMs` passed: the broker gives a connection
   * at most `transport.max_streams_per_connection` open streams (each subscription takes one),
   * and opening one more waits until another ends. A stream that opens after the time is closed.
   */
  async #openStreamBounded() {
    const opening = Promise.resolve().then(() => this.#openStream());
    const ms = this.#options.streamOpenTimeoutMs;
    const late = {};
    let timer;
    const waited = new Promise((resolve) => {
      timer = timerFor(() => resolve(late), ms);
    });
    // The client ending meanwhile (close(), a lost connection) ends the wait too.
    const ended = {};
    let got;
    try {
      got = await Promise.race([opening, waited, this.#ended.then(() => ended)]);
    } catch (e) {
      throw toAqueductError(e, 'could not open a stream');
    } finally {
      clearTimeout(timer);
    }
    if (got === ended) {
      opening.then(discardStream, () => {});
      this.#checkClosed();
    }
    if (got !== late) return got;
    opening.then(discardStream, () => {});
    throw new AqueductError(
      null,
      `could not open a stream within ${ms} ms: the broker allows a connection transport.max_streams_per_connection open streams (256 by default) and each subscription takes one; close some, or raise it`,
    );
  }

  /** @internal */
  _release(sub) {
    this.#subscriptions.delete(sub);
    this.#inUse.delete(sub.id);
  }
}

/**
 * An application callback that cannot break the client: one that throws is reported on the
 * console, and the stream that called it goes on (it tore the stream down, failing its pending
 * calls and ending its subscription).
 */
function shielded(callback) {
  return (err) => {
    try {
      callback(err);
    } catch (e) {
      console.error('aqueduct: an onError callback threw:', e);
    }
  };
}

function publishExt(topic, opts, confirm) {
  const ext = { topic };
  if (opts.priority !== undefined) ext.priority = opts.priority;
  if (opts.ttlMs !== undefined) ext.ttlMs = opts.ttlMs;
  if (confirm) ext.confirm = true;
  return ext;
}

/** One bidirectional stream: writes frames, reads and dispatches the broker's. */
class Channel {
  constructor(stream, { maxDataLen, report, onDelivery, onError, onBroken, onUnreadable, onEnd, room }) {
    this.writer = stream.writable.getWriter();
    this.reader = stream.readable.getReader();
    this.decoder = new FrameDecoder({ maxDataLen });
    this.report = report;
    this.onDelivery = onDelivery;
    this.onError = onError;
    this.onBroken = onBroken;
    this.onUnreadable = onUnreadable;
    this.onEnd = onEnd;
    this.room = room;
    // The reader's end (a reset rejects `closed` at once) ends a wait for room: one handler for
    // the stream's life (one per wait, on a promise pending until the stream ends, piled up).
    this.readerEnded = false;
    this.wakeRoom = null;
    if (room) {
      const ended = () => {
        this.readerEnded = true;
        this.wakeRoom?.();
      };
      this.reader.closed.then(ended, ended);
    }
    this.pending = new Map(); // stream id -> { resolve, reject, expect, onAnswer }, in the order sent
    this.sent = 0; // frames sent here without confirm
    this.covered = 0; // of them, those sent before a request (a flush, a confirmed publish) that was answered
    this.ended = false;
    this.broken = false; // a stream-fatal ERROR arrived: the broker reads nothing more
    this.finished = false; // our sending side is finished
    this.pump();
  }

  get usable() {
    return !this.ended && !this.broken && !this.finished;
  }

  async write(bytes) {
    if (!this.usable) throw new AqueductError(null, 'the stream is closed');
    try {
      await this.writer.write(bytes);
    } catch (e) {
      throw toAqueductError(e, 'could not write to the stream');
    }
  }

  /**
   * Send a frame that the broker answers with an `expect` frame (CONFIRM, INFO) or an ERROR
   * carrying `id`; resolves to the CONFIRM's offsets or the INFO's entries.
   */
  request(id, bytes, expect = Opcode.CONFIRM, onAnswer = undefined) {
    const answer = new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, expect, onAnswer });
    });
    this.write(bytes).catch((e) => this.answer(id, 'reject', e));
    return answer;
  }

  /** Settle the request `id` (`how`: 'resolve' or 'reject'); a resolving answer must be of the opcode it expects. */
  answer(id, how, value, opcode) {
    const p = this.pending.get(id);
    if (!p) return false;
    if (how === 'resolve' && opcode !== p.expect) {
      how = 'reject';
      value = new AqueductError(null, `the broker answered ${opcodeName(opcode)} where ${opcodeName(p.expect)} was due (stream id ${id})`);
    }
    // Matched by stream id, not by position: answers on one stream come in request order
    // (§6.4), except a SUBSCRIBE's CONFIRM, and a broker older than that rule sent an ERROR for
    // a later frame before the CONFIRMs the durable log still owed.
    this.pending.delete(id);
    if (how === 'resolve') p.onAnswer?.(this);
    p[how](value);
    return true;
  }

  async pump() {
    let failure = null;
    try {
      for (;;) {
        // Waiting for the application to take what is buffered, the stream's reset (a slow
        // consumer closed with code 300, §7.3) is still seen: the reader's `closed` rejects at
        // once on a reset (what was received stays buffered here), and the read below reports
        // it, which ends the stream's sending side too. It was seen only once the application
        // had made room.
        const room = this.room && !this.readerEnded ? this.room() : undefined;
        if (room) {
          await new Promise((resolve) => {
            this.wakeRoom = resolve;
            room.then(resolve);
          });
          this.wakeRoom = null;
        }
        const { value, done } = await this.reader.read();
        if (done) {
          this.decoder.finish();
          break;
        }
        this.decoder.push(value);
        for (;;) {
          let frame;
          try {
            frame = this.decoder.next();
          } catch (e) {
            if (e instanceof FrameError && !e.fatal) {
              // One bad frame: skipped (§10 step 4), the stream goes on. A request it answered
              // fails with it, rather than waiting for an answer that will not come.
              const err = new AqueductError(e.code, `the broker sent an invalid frame: ${e.message}`, { cause: e });
              // An unknown opcode is no answer (a newer broker's frame): only reported, and a
              // request waiting on its stream id goes on waiting for its own answer.
              if (e.code === ErrorCode.UNKNOWN_OPCODE) {
                this.report(err);
                continue;
              }
              const unanswered = e.streamId === undefined || !this.answer(e.streamId, 'reject', err);
              if (unanswered && this.onUnreadable) this.onUnreadable(err);
              else if (unanswered) this.report(err);
              continue;
            }
            throw e;
          }
          if (frame === null) break;
          this.dispatch(frame);
        }
      }
    } catch (e) {
      if (!this.ended) {
        failure =
          e instanceof FrameError
            ? new AqueductError(e.code, `the broker sent an invalid frame: ${e.message}`, { cause: e })
            : toAqueductError(e, 'the stream failed');
        this.reader.cancel().catch(() => {});
        this.writer.abort().catch(() => {});
      }
    }
    this.end(failure);
  }

  dispatch(frame) {
    switch (frame.opcode) {
      case Opcode.CONFIRM:
        if (!this.answer(frame.streamId, 'resolve', frame.offsets, Opcode.CONFIRM)) {
          this.report(new AqueductError(null, `unexpected CONFIRM for stream id ${frame.streamId}`));
        }
        return;
      case Opcode.INFO:
        if (!this.answer(frame.streamId, 'resolve', frame.info, Opcode.INFO)) {
          this.report(new AqueductError(null, `unexpected INFO for stream id ${frame.streamId}`));
        }
        return;
      case Opcode.ERROR: {
        const err = new AqueductError(frame.code, frame.reason, { streamId: frame.streamId });
        if (FATAL_FOR_STREAM.has(frame.code) && !this.broken) {
          this.broken = true;
          this.onBroken?.(err, this);
        }
        if (this.answer(frame.streamId, 'reject', err)) return;
        if (this.onError) this.onError(err);
        else this.report(err);
        return;
      }
      case Opcode.PUBLISH:
        if (this.onDelivery) this.onDelivery(frame);
        else this.report(new AqueductError(null, `unexpected delivery (stream id ${frame.streamId}) on a publish stream`));
        return;
      default:
        this.report(new AqueductError(null, `unexpected ${opcodeName(frame.opcode)} frame from the broker`));
    }
  }

  end(failure) {
    if (this.ended) return;
    this.ended = true;
    const err = failure ?? new AqueductError(null, 'the broker finished the stream before answering');
    for (const p of this.pending.values()) p.reject(err);
    this.pending.clear();
    this.onEnd?.(failure);
  }

  /** Finish our sending side (FIN): the broker handles what came before and finishes its side. */
  finish() {
    if (this.finished || this.ended) return;
    this.finished = true;
    this.writer.close().catch(() => {});
  }

  /** Close both directions at once (client closed, connection lost). */
  shut(err) {
    if (!this.ended) {
      this.end(err);
      this.reader.cancel().catch(() => {});
      if (!this.finished) this.writer.close().catch(() => {});
    }
  }
}

/**
 * A live subscription: an async iterator of `Message`s (`for await (const m of sub)`). Breaking
 * out of the loop unsubscribes. The iterator ends (done) when the subscription ends normally,
 * and throws an `AqueductError` when the broker closed it (SLOW_CONSUMER, NOT_AUTHORIZED, a
 * stream reset, a stream-fatal error) — after the messages that arrived before.
 */
export class Subscription {
  #client;
  #channel = null;
  #queue = [];
  #waiters = [];
  #roomWaiters = [];
  #ended = false;
  #error = null;
  #buffer;
  #onError;
  #unsubscribing = null;
  #streamEnd;
  #resolveStreamEnd;

  constructor(client, id, filter, opts, fallbackOnError) {
    this.#client = client;
    /** The SUBSCRIBE's stream id: deliveries carry it, ACK/NACK/UNSUBSCRIBE name it. */
    this.id = id;
    this.filter = filter;
    this.group = opts.group;
    /**
     * Durable subscriptions: served from the broker's log (true) or in memory only (false);
     * undefined for other subscriptions, or from a broker that does not say.
     */
    this.durableLog = undefined;
    this.#buffer = opts.buffer ?? 256;
    if (!Number.isInteger(this.#buffer) || this.#buffer < 1) {
      // 0 would never read (not even the SUBSCRIBE's answer).
      throw new RangeError(`buffer must be a whole number of messages, at least 1, got ${opts.buffer}`);
    }
    this.#onError = shielded(opts.onError ?? fallbackOnError);
    this.wildcard = isWildcardFilter(filter);
    this.#streamEnd = new Promise((resolve) => {
      this.#resolveStreamEnd = resolve;
    });
  }

  /** True once the subscription has ended. */
  get ended() {
    return this.#ended;
  }

  _attach(channel) {
    this.#channel = channel;
  }

  _abandon() {
    this.#ended = true;
    this.#channel?.finish();
  }

  _deliver(frame) {
    if (this.#ended) return; // written before the broker handled our UNSUBSCRIBE (§7.2)
    if (frame.streamId !== this.id) {
      this.#onError(new AqueductError(null, `delivery for unknown subscription (stream id ${frame.streamId})`));
      return;
    }
    this.#push(new Message(this, frame));
  }

  _error(err) {
    if (err.streamId === this.id && FATAL_FOR_SUBSCRIPTION.has(err.code)) {
      this.#client._release(this);
      this._end(err);
      this.#channel?.finish();
      return;
    }
    if (FATAL_FOR_STREAM.has(err.code)) {
      // The broker stops reading the stream and finishes it (§1.1): the subscription ends.
      this.#client._release(this);
      this._end(err);
      return;
    }
    if (this.#unsubscribing && err.code === ErrorCode.NOT_SUBSCRIBED) {
      this.#unsubscribing.error = err;
      return;
    }
    this.#onError(err);
  }

  _streamEnded(err) {
    this.#client._release(this);
    // Finished by the broker while live (not unsubscribed, not given up here, no ERROR before):
    // that is its shutdown, which writes what is queued and then finishes such streams (§1.1).
    // Ended quietly, the loop would read as an unsubscribe; and the session's close (501)
    // comes later, once the subscription has ended.
    this._end(err ?? new AqueductError(ErrorCode.SHUTTING_DOWN, 'the broker finished the subscription\'s stream: it is shutting down (§1.1)', { streamId: this.id }));
    this.#resolveStreamEnd(err);
  }

  _room() {
    if (this.#queue.length < this.#buffer || this.#ended) return undefined;
    return new Promise((resolve) => this.#roomWaiters.push(resolve));
  }

  #push(message) {
    const w = this.#waiters.shift();
    if (w) w.resolve({ value: message, done: false });
    else this.#queue.push(message);
  }

  _end(err, { discard = false } = {}) {
    if (this.#ended) return;
    this.#ended = true;
    this.#error = err ?? null;
    if (discard) this.#queue = [];
    for (const w of this.#waiters.splice(0)) {
      if (this.#error) {
        w.reject(this.#error);
        this.#error = null;
      } else w.resolve({ value: undefined, done: true });
    }
    for (const r of this.#roomWaiters.splice(0)) r();
  }

  /** The next message: `{ value, done }`. */
  next() {
    if (this.#queue.length > 0) {
      const value = this.#queue.shift();
      if (this.#queue.length < this.#buffer) for (const r of this.#roomWaiters.splice(0)) r();
      return Promise.resolve({ value, done: false });
    }
    if (this.#ended) {
      if (this.#error) {
        const err = this.#error;
        this.#error = null;
        return Promise.reject(err);
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => this.#waiters.push({ resolve, reject }));
  }

  /** Called when a `for await` loop is left early: unsubscribes. */
  async return() {
    await this.unsubscribe().catch(() => {});
    return { value: undefined, done: true };
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  /**
   * Send an ACK or NACK for a delivery on this subscription's stream (§8). The broker answers
   * nothing on success; its refusals (NOT_IN_FLIGHT, STALE_ATTEMPT, …) go to `onError`.
   */
  async _settle(opcode, message, reason) {
    if (this.#ended) throw new AqueductError(null, 'the subscription has ended: the broker would answer NOT_SUBSCRIBED');
    if (message.offset === undefined) throw new AqueductError(null, 'the delivery has no OFFSET: it cannot be settled');
    const ext = {};
    if (message.attempt !== undefined) ext.attempt = message.attempt;
    // Offsets are per topic: a wildcard subscription must say which topic (§8).
    if (this.wildcard) ext.topic = message.topic;
    if (reason !== undefined) ext.reason = reason;
    const bytes = encodeFrame({ opcode, streamId: this.id, ext, offset: message.offset });
    await this.#channel.write(bytes);
  }

  /**
   * Cancel the subscription: UNSUBSCRIBE, then finish the stream. Resolves once the broker has
   * finished its side too (it then has handled the UNSUBSCRIBE, §1.1); rejects with the
   * broker's ERROR (e.g. NOT_SUBSCRIBED), or after `timeoutMs` (default 10 s) without an answer
   * (the stream is then stopped: STOP_SENDING).
   * Messages not yet taken from the iterator are discarded.
   */
  async unsubscribe({ timeoutMs = 10000 } = {}) {
    checkTimeout(timeoutMs, 'timeoutMs');
    if (this.#unsubscribing) return this.#unsubscribing.done;
    const state = { error: null, done: null };
    this.#unsubscribing = state;
    state.done = (async () => {
      if (this.#ended) return;
      const ch = this.#channel;
      this._end(null, { discard: true });
      const bytes = encodeFrame({ opcode: Opcode.UNSUBSCRIBE, streamId: this.id, filter: this.filter });
      await ch.write(bytes);
      ch.finish();
      let timer;
      const timeout = new Promise((resolve) => {
        timer = timerFor(() => resolve('timeout'), timeoutMs);
      });
      const end = await Promise.race([this.#streamEnd, timeout]);
      clearTimeout(timer);
      let late = null;
      if (end === 'timeout') {
        // Stop reading (STOP_SENDING): the stream is let go of, not kept open for an answer
        // that did not come, and the broker ends what it still serves on it (§1.1).
        late = new AqueductError(null, `the broker did not finish the stream within ${timeoutMs} ms of the UNSUBSCRIBE`);
        ch.shut(late);
      }
      this.#client._release(this);
      if (state.error) throw state.error;
      if (late) throw late;
      if (end) throw end;
    })();
    return state.done;
  }
}

const text = new TextDecoder();

/** One delivered message. */
export class Message {
  #sub;
  #settled = false;

  constructor(sub, frame) {
    this.#sub = sub;
    const ext = frame.ext;
    /** The concrete topic (also for wildcard subscriptions). */
    this.topic = ext.topic ?? sub.filter;
    /** The body, as sent. */
    this.body = frame.body;
    /** 0 highest … 3 lowest (2 when the delivery carries no PRIORITY). */
    this.priority = ext.priority ?? 2;
    /** The per-topic offset (a bigint). */
    this.offset = ext.offset;
    /** 1 for the first delivery, +1 for each redelivery. */
    this.attempt = ext.attempt;
    /** Every extension of the delivery, decoded (trace, compression, dead-letter origin, …). */
    this.extensions = ext;
    /** The stream id of the subscription's SUBSCRIBE. */
    this.streamId = frame.streamId;
  }

  /** The body decoded as UTF-8 (invalid bytes become U+FFFD). */
  get text() {
    return text.decode(this.body);
  }

  /** Acknowledge: the message is done (for subscriptions with `ack: true`, and group members). */
  async ack() {
    this.#once();
    await this.#sub._settle(Opcode.ACK, this);
  }

  /** Reject: the broker redelivers it, or dead-letters it after its retries with `reason`. */
  async nack(reason) {
    this.#once();
    await this.#sub._settle(Opcode.NACK, this, reason);
  }

  #once() {
    if (this.#settled) throw new AqueductError(null, 'this delivery was already settled');
    this.#settled = true;
  }
}
