// Types of codec.js: the frame codec of docs/protocol.md. Written by hand.

export declare const MAGIC: 0x1f;
export declare const HEADER_LEN: 10;
export declare const FLAG_MESH_FORWARDED: 0x80;
export declare const FLAG_HAS_EXTENSIONS: 0x40;
export declare const OPCODE_MASK: 0x3f;
export declare const MAX_EXT_LEN: 1024;
export declare const DEFAULT_MAX_DATA_LEN: 1048576;
export declare const BROKER_DEFAULT_MAX_BUF_SIZE: 65536;
export declare const MAX_NAME_LEN: 255;
export declare const MAX_REASON_LEN: 255;

export declare const Opcode: Readonly<{
  PUBLISH: 0x01;
  SUBSCRIBE: 0x02;
  UNSUBSCRIBE: 0x03;
  PUBLISH_BATCH: 0x04;
  NACK: 0x05;
  ACK: 0x06;
  CONFIRM: 0x07;
  ERROR: 0x08;
  INFO: 0x09;
}>;
/** Keys of an INFO answer's entries (§4.1). */
export declare const InfoKey: Readonly<{
  PROTOCOL: 0x01;
  MAX_DATA_LEN: 0x02;
  MAX_DELIVERY_DATA_LEN: 0x03;
  MAX_SUBSCRIPTIONS: 0x04;
  BROKER: 0x05;
  DURABLE: 0x06;
}>;
/** What an INFO answer says (§4.1); a request has none of it. Each field only when sent. */
export interface BrokerInfo {
  /** The protocol version (1). */
  protocol?: number;
  /** The largest `data_len` the broker accepts in a frame from this client. */
  maxDataLen?: number;
  /** The `data_len` a client must be ready to accept in a frame from the broker (§10). */
  maxDeliveryDataLen?: number;
  /** Live subscriptions a connection may hold. */
  maxSubscriptions?: number;
  /** The broker's name and version, for people. */
  broker?: string;
  /** Whether the broker's durable log is on: whether a CONFIRM means stored (§6.4). */
  durable?: boolean;
}
export type OpcodeValue = (typeof Opcode)[keyof typeof Opcode];
export declare function opcodeName(opcode: number): keyof typeof Opcode | undefined;

export declare const ExtType: Readonly<{
  TRACE: 0x01;
  COMPRESSION: 0x02;
  PRIORITY: 0x03;
  TOPIC: 0x04;
  TTL: 0x05;
  OFFSET: 0x06;
  ATTEMPT: 0x07;
  CONFIRM: 0x08;
  ACK_MODE: 0x09;
  OVERFLOW: 0x0a;
  ORIGINAL_TOPIC: 0x0b;
  ORIGINAL_OFFSET: 0x0c;
  REASON: 0x0d;
  ATTEMPTS_MADE: 0x0e;
  MAX_IN_FLIGHT: 0x0f;
}>;

export declare const Priority: Readonly<{ HIGHEST: 0; DEFAULT: 2; LOWEST: 3 }>;
/** 0 is the most urgent, 3 the least. */
export type PriorityLevel = 0 | 1 | 2 | 3;
export declare const Compression: Readonly<{ ZSTD: 1 }>;
export declare const AckMode: Readonly<{ NONE: 0; EXPLICIT: 1 }>;
export declare const Overflow: Readonly<{ DROP_OLDEST: 0; DROP_NEWEST: 1; DISCONNECT: 2; BLOCK: 3 }>;
export type OverflowName = 'drop_oldest' | 'drop_newest' | 'disconnect' | 'block';
export declare const OVERFLOW_NAMES: readonly ['drop_oldest', 'drop_newest', 'disconnect', 'block'];
export declare function overflowValue(policy: OverflowName | 0 | 1 | 2 | 3): 0 | 1 | 2 | 3;

export declare const ErrorCode: Readonly<{
  MALFORMED_FRAME: 100;
  BAD_MAGIC: 101;
  UNKNOWN_OPCODE: 102;
  FRAME_TOO_LARGE: 103;
  BAD_EXTENSION: 104;
  BAD_PAYLOAD: 105;
  BAD_BATCH: 106;
  INVALID_TOPIC: 200;
  BAD_SUBSCRIBE: 201;
  NOT_SUBSCRIBED: 202;
  NOT_IN_FLIGHT: 203;
  STALE_ATTEMPT: 204;
  TOPIC_REQUIRED: 205;
  UNSUPPORTED: 206;
  SLOW_CONSUMER: 300;
  RATE_LIMITED: 301;
  NOT_AUTHORIZED: 400;
  INTERNAL: 500;
  SHUTTING_DOWN: 501;
  STORAGE_FAILED: 502;
}>;
export type ErrorCodeName = keyof typeof ErrorCode;
export type ErrorCategory = 'framing' | 'request' | 'flow-control' | 'authorization' | 'broker' | 'unknown';
export declare function errorCodeName(code: number): ErrorCodeName | undefined;
export declare function errorCategory(code: number): ErrorCategory;

/** An invalid frame or value. `code` is the ERROR code a broker answers for it. */
export declare class FrameError extends Error {
  constructor(
    code: number,
    problem: string,
    options?: { offset?: number; frameOffset?: number; fatal?: boolean; frameLength?: number; streamId?: number },
  );
  readonly name: 'FrameError';
  readonly code: number;
  /** What was wrong, without the code and offset. */
  readonly problem: string;
  /** The byte where the problem is, from the start of the buffer or stream decoded. */
  offset: number | undefined;
  /** Where the bad frame started. */
  frameOffset: number | undefined;
  /** The frame boundary is lost (BAD_MAGIC, FRAME_TOO_LARGE): nothing after it can be decoded. */
  fatal: boolean;
  /** For a non-fatal decoding error: the bad frame's length (skip it and go on). */
  frameLength: number | undefined;
  streamId: number | undefined;
}

export type Bytes = Uint8Array | ArrayBuffer | ArrayBufferView | string;
export declare function toBytes(value: Bytes | null | undefined): Uint8Array;

export interface TraceContext {
  /** 16 bytes. */
  traceId: Uint8Array;
  /** 8 bytes. */
  spanId: Uint8Array;
  flags: number;
}

export interface CompressionInfo {
  /** 1 = zstd; others are passed through. */
  algorithm: number;
  uncompressedLength: number;
}

/** An entry of a reserved type (0x10..0xFF), kept as it came. */
export interface UnknownExtension {
  type: number;
  value: Uint8Array;
}

/** The extension block (§3): each field present only when its entry is. */
export interface Extensions {
  trace?: TraceContext;
  compression?: CompressionInfo;
  priority?: PriorityLevel;
  topic?: string;
  ttlMs?: number;
  offset?: bigint;
  attempt?: number;
  confirm?: true;
  ackMode?: 0 | 1;
  overflow?: 0 | 1 | 2 | 3;
  originalTopic?: string;
  originalOffset?: bigint;
  reason?: string;
  attemptsMade?: number;
  maxInFlight?: number;
  unknown?: UnknownExtension[];
}

/** Extensions as given to the encoder: offsets may be safe integers, overflow a name. */
export interface ExtensionsInit extends Omit<Extensions, 'offset' | 'originalOffset' | 'overflow' | 'confirm' | 'trace'> {
  offset?: bigint | number;
  originalOffset?: bigint | number;
  overflow?: 0 | 1 | 2 | 3 | OverflowName;
  confirm?: boolean;
  trace?: { traceId: Bytes; spanId: Bytes; flags?: number };
}

export type DurableStart = bigint | 'earliest' | 'latest';

/** A SUBSCRIBE payload: `topic:<filter>[:group:<id>][:durable:<consumer>:<start>]`. */
export interface SubscribeSpec {
  filter: string;
  group?: string;
  durable?: { consumer: string; start: DurableStart };
}

interface FrameBase {
  streamId: number;
  /** Whether the command byte has HasExtensions (an empty block, `ext_len` 0, counts). */
  hasExtensions: boolean;
  ext: Extensions;
  /** Set on frames a broker forwards to another (never from a client). */
  meshForwarded?: true;
}

export interface PublishFrame extends FrameBase {
  opcode: 0x01;
  body: Uint8Array;
  /** Decoded with `peer: 'client'` and no TOPIC: the legacy target of the payload (§6.2). */
  legacy?: { topic: string; ttlMs?: number };
}
export interface SubscribeFrame extends FrameBase {
  opcode: 0x02;
  spec: SubscribeSpec;
}
export interface UnsubscribeFrame extends FrameBase {
  opcode: 0x03;
  filter: string;
}
export interface PublishBatchFrame extends FrameBase {
  opcode: 0x04;
  frames: PublishFrame[];
}
export interface SettleFrame extends FrameBase {
  opcode: 0x05 | 0x06;
  offset: bigint;
}
export interface ConfirmFrame extends FrameBase {
  opcode: 0x07;
  offsets: bigint[];
}
export interface ErrorFrame extends FrameBase {
  opcode: 0x08;
  code: number;
  reason: string;
}
export interface InfoFrame extends FrameBase {
  opcode: 0x09;
  info: BrokerInfo;
}
/** A decoded frame. */
export type Frame =
  | PublishFrame
  | SubscribeFrame
  | UnsubscribeFrame
  | PublishBatchFrame
  | SettleFrame
  | ConfirmFrame
  | ErrorFrame
  | InfoFrame;

interface FrameInitBase {
  streamId?: number;
  ext?: ExtensionsInit;
  /** Write an extension block even when `ext` is empty. */
  hasExtensions?: boolean;
  meshForwarded?: boolean;
}
/** A frame as given to `encodeFrame`. */
export type FrameInit =
  | (FrameInitBase & { opcode: 0x01; body?: Bytes })
  | (FrameInitBase & { opcode: 0x02; spec: SubscribeSpec | (Omit<SubscribeSpec, 'durable'> & { durable?: { consumer: string; start: DurableStart | number } }) })
  | (FrameInitBase & { opcode: 0x03; filter: string })
  | (FrameInitBase & { opcode: 0x04; frames: Array<FrameInitBase & { opcode?: 0x01; body?: Bytes }> })
  | (FrameInitBase & { opcode: 0x05 | 0x06; offset: bigint | number })
  | (Omit<FrameInitBase, 'ext'> & { opcode: 0x07; offsets?: Array<bigint | number> })
  | (Omit<FrameInitBase, 'ext'> & { opcode: 0x08; code: number; reason?: string })
  | (FrameInitBase & { opcode: 0x09; info?: BrokerInfo });

export interface DecodeOptions {
  /** Largest accepted `data_len`; default 1 MiB (§10). */
  maxDataLen?: number;
  /** Who sent the bytes: `'broker'` (default) or `'client'` (decode as a broker does). */
  peer?: 'broker' | 'client';
  /** Absolute offset of the buffer's first byte, for error messages. */
  base?: number;
}

export type TryDecodeResult = { incomplete: true; need: number } | { incomplete?: undefined; frame: Frame; length: number };

/** One frame at the start of `buf`, or "need more"; throws FrameError when invalid. */
export declare function tryDecodeFrame(buf: Uint8Array, options?: DecodeOptions): TryDecodeResult;
/** Exactly one complete frame; throws FrameError otherwise. */
export declare function decodeFrame(buf: Bytes, options?: DecodeOptions): Frame;
/** Encode a frame (canonical extension order, §2.1). */
export declare function encodeFrame(frame: FrameInit, options?: { maxDataLen?: number }): Uint8Array;

export declare function decodeExtensions(block: Uint8Array, base?: number): Extensions;
export declare function encodeExtensions(ext?: ExtensionsInit): Uint8Array;
export declare function parseSubscribe(payload: Bytes, base?: number): SubscribeSpec;
export declare function parseUnsubscribe(payload: Bytes, base?: number): string;
export declare function formatSubscribe(spec: SubscribeSpec): string;
export declare function parseLegacyTarget(payload: Bytes, base?: number): { topic: string; ttlMs?: number };
export declare function cutReason(reason: string): Uint8Array;

export declare function topicNameProblem(name: string | Uint8Array): string | null;
export declare function topicFilterProblem(filter: string | Uint8Array): string | null;
export declare function idProblem(id: string | Uint8Array): string | null;
export declare function isWildcardFilter(filter: string): boolean;

/** Incremental decoder of a byte stream. */
export declare class FrameDecoder {
  constructor(options?: { maxDataLen?: number; peer?: 'broker' | 'client' });
  /** Bytes buffered and not yet decoded. */
  readonly buffered: number;
  /** Bytes decoded (or skipped) so far: the stream offset of the next frame. */
  readonly consumed: number;
  push(chunk: Bytes): void;
  /** The next frame, or `null` for "need more bytes"; throws FrameError for an invalid frame. */
  next(): Frame | null;
  frames(): Generator<Frame, void, undefined>;
  /** The stream ended: throws MALFORMED_FRAME if a partial frame is buffered. */
  finish(): void;
}
