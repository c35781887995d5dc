// Aqueduct's JavaScript client: the frame codec of docs/protocol.md and a client over
// WebTransport. See README.md.
export * from './codec.js';
export * from './client.js';
