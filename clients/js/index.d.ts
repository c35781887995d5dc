// Types of index.js. Written by hand.
export * from './codec.js';
export * from './client.js';
