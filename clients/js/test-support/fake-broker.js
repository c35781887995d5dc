// An in-memory stand-in for the broker's side of WebTransport streams, for tests of the client
// logic: `openStream` gives the client `{ readable, writable }` pairs, and each stream's broker
// end reads the client's frames (with their exact bytes) and writes frames back.

import { FrameDecoder, encodeFrame } from '../codec.js';

export function fakeTransport() {
  const streams = [];
  const waiting = [];
  let opened = 0;
  // Each direction buffers up to 1 MiB, as a QUIC stream's flow-control window would: a write
  // resolves once buffered, not only when the other end reads it.
  const pipe = () =>
    new TransformStream({}, new ByteLengthQueuingStrategy({ highWaterMark: 1 << 20 }), new ByteLengthQueuingStrategy({ highWaterMark: 1 << 20 }));
  const openStream = async () => {
    const toBroker = pipe();
    const toClient = pipe();
    const side = new BrokerStream(opened++, toBroker.readable, toClient.writable);
    streams.push(side);
    waiting.shift()?.(side);
    return { readable: toClient.readable, writable: toBroker.writable };
  };
  /** The broker end of the `index`-th stream the client opens (waits for it). */
  const stream = (index) => {
    if (streams[index]) return Promise.resolve(streams[index]);
    return new Promise((resolve) => {
      const check = (side) => {
        if (side.index === index) resolve(side);
        else waiting.push(check);
      };
      waiting.push(check);
    });
  };
  return { openStream, streams, stream };
}

export class BrokerStream {
  constructor(index, readable, writable) {
    this.index = index;
    this.reader = readable.getReader();
    this.writer = writable.getWriter();
    this.decoder = new FrameDecoder({ peer: 'client' });
    this.received = new Uint8Array(0);
    this.clientFinished = false;
  }

  /** The next frame the client sent: `{ frame, bytes }`, or `null` if it finished the stream. */
  async next() {
    for (;;) {
      const before = this.decoder.consumed;
      const frame = this.decoder.next();
      if (frame !== null) {
        return { frame, bytes: this.received.slice(before, this.decoder.consumed) };
      }
      const { value, done } = await this.reader.read();
      if (done) {
        this.decoder.finish();
        this.clientFinished = true;
        return null;
      }
      const all = new Uint8Array(this.received.length + value.length);
      all.set(this.received);
      all.set(value, this.received.length);
      this.received = all;
      this.decoder.push(value);
    }
  }

  /** Write a frame (an object for `encodeFrame`, or raw bytes) to the client. */
  async send(frame) {
    await this.writer.write(frame instanceof Uint8Array ? frame : encodeFrame(frame));
  }

  /** Finish the broker's sending side (FIN). */
  async finish() {
    await this.writer.close();
  }

  /** Reset the broker's sending side with an application error code, as WebTransport reports it. */
  async reset(code) {
    const err = new Error(`stream reset with code ${code}`);
    err.name = 'WebTransportError';
    err.source = 'stream';
    err.streamErrorCode = code;
    await this.writer.abort(err);
  }
}
