// Types of client.js: the Aqueduct client over WebTransport. Written by hand.

import type { BrokerInfo, Bytes, ErrorCategory, ErrorCodeName, Extensions, OverflowName, PriorityLevel } from './codec.js';

/** An error from the broker (ERROR frame, stream reset, connection close) or the client. */
export declare class AqueductError extends Error {
  constructor(code: number | null, reason: string, options?: { streamId?: number; cause?: unknown });
  readonly name: 'AqueductError';
  /** The spec's code (§9), or `null` when there is none (connection closed, protocol violation). */
  readonly code: number | null;
  readonly reason: string;
  /** The `stream_id` of the ERROR frame, if it came from one. */
  readonly streamId: number | undefined;
  readonly codeName: ErrorCodeName | undefined;
  readonly category: ErrorCategory | null;
}

/** One bidirectional stream, as `WebTransport.createBidirectionalStream()` gives it. */
export interface BidirectionalStream {
  readable: ReadableStream<Uint8Array>;
  writable: WritableStream<Uint8Array>;
}

export type CertificateHash =
  | string
  | { algorithm?: string; value: BufferSource | string };

export interface ConnectOptions {
  /** Hashes of the broker's certificate (a short-lived ECDSA one), e.g. from `GET /webtransport/cert-hash`. */
  serverCertificateHashes?: CertificateHash[];
  /** Sent as the URL query parameter `token`; the broker (`webtransport.tokens`) maps it to a client id. Empty: none (`anonymous`). */
  token?: string;
  /** WebTransport subprotocols to offer; default `['aqueduct-v1']` (with it, connect() rejects a refused session with the broker's code and reason). */
  protocols?: string[];
  /** The WebTransport constructor (default `globalThis.WebTransport`). */
  WebTransport?: new (url: string, init?: object) => {
    ready: Promise<unknown>;
    protocol?: string;
    closed: Promise<{ closeCode?: number; reason?: string }>;
    createBidirectionalStream(): Promise<BidirectionalStream>;
    close(info?: { closeCode?: number; reason?: string }): void;
  };
  /** Another transport: opens one bidirectional stream per call (then `url` is not used). */
  openStream?: () => BidirectionalStream | Promise<BidirectionalStream>;
  /** With `openStream`: called by `client.close()`. */
  close?: () => void | Promise<void>;
  /** With `openStream`: settles when the connection ends. */
  closed?: Promise<{ closeCode?: number; reason?: string } | void>;
  /** Largest `data_len` accepted from the broker; default 8 MiB + 1024 (the largest `transport.max_buf_size`, plus extensions). */
  maxDataLen?: number;
  /** Largest `data_len` sent; default 65536 (the broker's default `transport.max_buf_size`). */
  maxSendDataLen?: number;
  /** ERRORs no call waits for; default `console.warn`. */
  onError?: (err: AqueductError) => void;
  /** How long opening a stream may wait (ms) before the call fails; default 10000; `Infinity`: no limit. */
  streamOpenTimeoutMs?: number;
  /** How long `close()` waits for the broker to answer the flush of what was published without `confirm` (ms); default 10000; `Infinity`: no limit. */
  closeFlushTimeoutMs?: number;
}

export interface PublishOptions {
  priority?: PriorityLevel;
  /** Drop the message if not delivered within this many ms (0 = none). */
  ttlMs?: number;
  confirm?: boolean;
}

export interface BatchItem {
  topic: string;
  body: Bytes;
  priority?: PriorityLevel;
  ttlMs?: number;
}

export interface SubscribeOptions {
  group?: string;
  durable?: { consumer: string; start: bigint | number | 'earliest' | 'latest' };
  /** Settle each message with `ack()` / `nack()` (always so in a group). */
  ack?: boolean;
  maxInFlight?: number;
  overflow?: OverflowName;
  /** ERRORs about this subscription that do not end it (e.g. a refused ACK). */
  onError?: (err: AqueductError) => void;
  /** Deliveries read ahead of the application; default 256. */
  buffer?: number;
}

export declare function connect(url: string, options?: ConnectOptions): Promise<Client>;
/** The WebTransport subprotocol of Aqueduct: `aqueduct-v1`. */
export declare const SUBPROTOCOL: string;
export declare function webTransportUrl(url: string, token?: string | null): string;
/** WebTransport's one-byte stream reset codes → the spec's codes: 30 → 300 (SLOW_CONSUMER), 51 → 501 (SHUTTING_DOWN). */
export declare const WEBTRANSPORT_STREAM_CODES: Readonly<Record<number, number>>;
/** The spec's code for a stream error code as WebTransport reports it (30 → 300, 51 → 501; others as they are). */
export declare function streamResetCode(code: number): number;
export declare function certificateHashes(hashes: CertificateHash[]): Array<{ algorithm: string; value: BufferSource }>;

export declare class Client {
  private constructor(options: ConnectOptions);
  readonly closed: boolean;
  /** Why the connection ended (the broker's close code and reason, a lost connection); null while open or after `close()`. */
  readonly error: AqueductError | null;
  /**
   * Resolves when the client ends: to the error the connection ended with, or to null after
   * `close()`; never rejects. The client does not reconnect by itself.
   */
  whenClosed(): Promise<AqueductError | null>;
  publish(topic: string, body: Bytes, opts: PublishOptions & { confirm: true }): Promise<bigint>;
  publish(topic: string, body: Bytes, opts?: PublishOptions): Promise<bigint | undefined>;
  publishBatch(items: BatchItem[], opts: Omit<PublishOptions, 'confirm'> & { confirm: true }): Promise<bigint[]>;
  publishBatch(items: BatchItem[], opts?: PublishOptions): Promise<bigint[] | undefined>;
  subscribe(filter: string, opts?: SubscribeOptions): Promise<Subscription>;
  /**
   * Wait until the broker has handled everything published so far; rejects with the first ERROR
   * that answered a publish sent without `confirm` since the last flush, or if a stream that
   * carried such publishes ended before the broker had handled them, or after `timeoutMs`
   * (default 10000; `Infinity`: no limit) without the broker's answer (what it would have
   * reported is then the next flush's). A broker that throttles the client (publish quota) or
   * waits for a slow disk answers later.
   */
  flush(opts?: { timeoutMs?: number }): Promise<void>;
  /** Ask the broker what it allows (§4.1); a broker older than INFO rejects with UNKNOWN_OPCODE. */
  info(): Promise<BrokerInfo>;
  /**
   * Flush what was published without `confirm` (bounded by `closeFlushTimeoutMs`), then close every
   * stream and the connection; pending calls reject, iterators end. The connection is closed either
   * way; rejects as `flush()` would (a refused publish, a failed stream, or no answer in time).
   */
  close(): Promise<void>;
}

export declare class Subscription implements AsyncIterableIterator<Message> {
  private constructor();
  /** The SUBSCRIBE's stream id. */
  readonly id: number;
  readonly filter: string;
  readonly group: string | undefined;
  /**
   * A durable subscription: `true` if the broker serves it from its durable log, `false` if the
   * broker runs without the log and made it an in-memory consumer group. `undefined` for other
   * subscriptions, or from a broker that does not say (one older than this rule).
   */
  readonly durableLog: boolean | undefined;
  readonly wildcard: boolean;
  readonly ended: boolean;
  next(): Promise<IteratorResult<Message, undefined>>;
  return(): Promise<IteratorResult<Message, undefined>>;
  [Symbol.asyncIterator](): Subscription;
  /** Resolves once the broker has finished the stream; after `timeoutMs` (default 10000; `Infinity`: no limit) the client stops reading it and the call rejects. */
  unsubscribe(options?: { timeoutMs?: number }): Promise<void>;
}

export declare class Message {
  private constructor();
  readonly topic: string;
  readonly body: Uint8Array;
  /** The body as UTF-8 text. */
  readonly text: string;
  readonly priority: PriorityLevel;
  readonly offset: bigint | undefined;
  readonly attempt: number | undefined;
  readonly extensions: Extensions;
  readonly streamId: number;
  ack(): Promise<void>;
  nack(reason?: string): Promise<void>;
}
