// The broker's live web view: connect over WebTransport with the JavaScript client
// (/web/aqueduct/, which is clients/js), subscribe, watch messages arrive, publish.
//
// How it connects: GET /webtransport/cert-hash (served next to this page) gives the SHA-256 of
// the short-lived certificate the broker shows browsers, and the broker's QUIC port; the page
// opens https://<this page's host>:<port><path> (on the broker's own machine — a page opened as
// localhost — the `host` it names instead: browsers resolve localhost to ::1 first and do not fall
// back to 127.0.0.1 for QUIC). With a real certificate (tls.cert_file) that
// endpoint answers 404 and the page connects without pinning. `?token=…` in the page's URL
// fills the token field; `?connect=0` does not connect on load.
//
// For scripts (the browser test): `window.aqueductView` has the client module (`lib`), the
// live `client()`, `connect(token)`, `subscribe(filter, group)` and `ready` (the first connect).

import * as lib from '/web/aqueduct/index.js';

const { connect, AqueductError } = lib;
const $ = (id) => document.getElementById(id);
const meta = (name) => document.querySelector(`meta[name="${name}"]`)?.content ?? '';

const MAX_ROWS = 200;
const params = new URLSearchParams(location.search);
const wtPort = Number(meta('aqueduct-wt-port')) || 4242;
const wtPath = meta('aqueduct-wt-path') || '/aqueduct/wt';

let client = null;
let connecting = null;
let paused = false;
const subscriptions = new Set();

// ----- status, notes, events -----

function setStatus(state, text) {
  const s = $('status');
  s.dataset.state = state;
  s.textContent = text;
  const on = state === 'connected';
  $('subscribe-button').disabled = !on;
  $('publish-button').disabled = !on;
  $('disconnect').disabled = !on;
  $('connect').disabled = state === 'connecting';
  $('connect').textContent = on ? 'Reconnect' : 'Connect';
}

function note(id, text, kind = '') {
  const n = $(id);
  n.textContent = text;
  n.className = `note ${kind}`;
}

function event(text, bad = false) {
  const line = document.createElement('div');
  if (bad) line.className = 'bad';
  line.textContent = `${clock(new Date())}  ${text}`;
  const box = $('events');
  box.prepend(line);
  while (box.childElementCount > 50) box.lastElementChild.remove();
}

function describeError(e) {
  if (e instanceof AqueductError) {
    return e.codeName ? `${e.codeName} (${e.code}): ${e.reason}` : e.message;
  }
  return e?.message ?? String(e);
}

// ----- connecting -----

/** The session URL: this page's host, the broker's QUIC port (from `hash`, else the page's meta). */
function wtUrl(hash) {
  const override = params.get('wt');
  if (override) return override;
  // `location.hostname` has an IPv6 address in brackets already, as a URL needs it.
  const page = location.hostname;
  let host = page;
  if (hash?.host && (page === 'localhost' || page.endsWith('.localhost'))) host = hash.host;
  return `https://${host}:${hash?.port ?? wtPort}${hash?.path ?? wtPath}`;
}

/** The certificate hash to pin, or null (a real certificate: the browser verifies it). */
async function certificateHash() {
  const r = await fetch('/webtransport/cert-hash', { cache: 'no-store' });
  if (r.status === 404) return null;
  if (!r.ok) throw new Error(`GET /webtransport/cert-hash answered ${r.status}`);
  return r.json();
}

async function doConnect(token) {
  if (client) await doDisconnect();
  if (!window.isSecureContext) {
    throw new Error(
      'WebTransport needs a secure context: open this page as http://localhost:… or http://127.0.0.1:… ' +
        '(for a remote broker, through `ssh -L`), or serve it over HTTPS',
    );
  }
  if (typeof globalThis.WebTransport !== 'function') {
    throw new Error('this browser has no WebTransport (Chromium, Chrome, Edge and Firefox have it)');
  }
  setStatus('connecting', 'connecting…');
  const hash = await certificateHash();
  const target = wtUrl(hash);
  const options = {
    protocols: ['aqueduct-v1'],
    onError: (e) => event(`broker: ${describeError(e)}`, true),
  };
  if (hash) options.serverCertificateHashes = [{ algorithm: hash.algorithm, value: hash.value }];
  if (token) {
    // `?wt=` may name another host (a remote broker, see howto-browser.md), and anyone can make
    // a link with it: a token goes to a host other than this page's only if the user says so.
    const host = new URL(target).hostname;
    if (params.get('wt') && host !== location.hostname && !window.confirm(`Send your token to ${host}? Only do so if that is your broker.`)) {
      throw new Error(`not connected: the token was not sent to ${host}`);
    }
    options.token = token;
  }
  const c = await connect(target, options);
  client = c;
  $('where').textContent = target;
  setStatus('connected', token ? 'connected (token)' : 'connected (anonymous)');
  note('connect-note', hash ? `certificate pinned by its SHA-256 ${hash.value.slice(0, 16)}…, valid until ${new Date(hash.not_after * 1000).toLocaleString()}` : 'certificate verified by the browser', 'ok');
  event(`connected to ${target}`);
  watchClosed(c);
  return c;
}

async function watchClosed(c) {
  // The client has no close event: poll its state (cheap) and show the end.
  const timer = setInterval(() => {
    if (!c.closed) return;
    clearInterval(timer);
    if (client === c) {
      client = null;
      setStatus('failed', 'disconnected');
      event(c.error ? `the connection closed: ${describeError(c.error)}` : 'the connection closed', true);
      for (const s of subscriptions) s.markEnded('connection closed');
    }
  }, 500);
}

async function doDisconnect() {
  const c = client;
  client = null;
  for (const s of [...subscriptions]) s.remove();
  let failed = null;
  if (c) {
    // close() flushes what was published without confirm first, and says if it was not all taken.
    await c.close().catch((e) => (failed = e));
  }
  setStatus('idle', 'not connected');
  event(failed ? `disconnected: ${describeError(failed)}` : 'disconnected', failed !== null);
}

function startConnect(token) {
  connecting = doConnect(token).catch((e) => {
    setStatus('failed', 'not connected');
    let why = describeError(e);
    // A refusal comes with the broker's reason (the client's connect() rejects with it); a
    // handshake that failed means no broker answered there.
    if (why.includes('Opening handshake failed')) {
      why += ' No broker answered on that UDP port (is it running, and is UDP to it allowed?), or its certificate did not match.';
    }
    note('connect-note', why, 'bad');
    event(`connect failed: ${why}`, true);
    throw e;
  });
  return connecting;
}

// ----- messages: table, counters, rate -----

let total = 0;
let totalBytes = 0;
const arrivals = []; // arrival times (ms) within the last second
const history = new Array(60).fill(0); // messages per second, last 60 s
let pending = []; // rows not yet drawn
let drawScheduled = false;

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

const strictUtf8 = new TextDecoder('utf-8', { fatal: true });

/** A short preview: the text if the body is printable UTF-8, else its first bytes in hex. */
function preview(body) {
  const head = body.subarray(0, 160);
  try {
    const text = strictUtf8.decode(head, { stream: body.length > head.length });
    if (!/[\u0000-\u0008\u000e-\u001f\u007f]/.test(text)) {
      return { text: text.length > 120 || body.length > head.length ? `${text.slice(0, 120)}…` : text, hex: false };
    }
  } catch {
    // not UTF-8
  }
  const hex = Array.from(body.subarray(0, 24), (b) => b.toString(16).padStart(2, '0')).join(' ');
  return { text: body.length > 24 ? `${hex} …` : hex, hex: true };
}

function onMessage(m) {
  total += 1;
  totalBytes += m.body.length;
  arrivals.push(performance.now());
  if (paused) return;
  pending.push({ at: new Date(), topic: m.topic, priority: m.priority, offset: m.offset, size: m.body.length, body: preview(m.body) });
  if (pending.length > MAX_ROWS) pending = pending.slice(-MAX_ROWS);
  if (!drawScheduled) {
    drawScheduled = true;
    requestAnimationFrame(draw);
  }
}

/** 14:05:09.123 */
function clock(d) {
  const two = (n) => String(n).padStart(2, '0');
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}.${String(d.getMilliseconds()).padStart(3, '0')}`;
}

function cell(text, cls) {
  const td = document.createElement('td');
  if (cls) td.className = cls;
  td.textContent = text;
  return td;
}

function draw() {
  drawScheduled = false;
  const rows = $('rows');
  rows.querySelector('.empty-row')?.remove();
  const frag = document.createDocumentFragment();
  for (const r of pending.reverse()) {
    const tr = document.createElement('tr');
    tr.className = 'fresh';
    tr.append(cell(clock(r.at), 'mono'), cell(r.topic, 'mono'));
    const p = document.createElement('td');
    const badge = document.createElement('span');
    badge.className = `prio p${r.priority}`;
    badge.textContent = `p${r.priority}`;
    p.append(badge);
    tr.append(p, cell(r.offset === undefined ? '' : String(r.offset), 'num'), cell(formatBytes(r.size), 'num'));
    const body = cell('', 'body');
    const span = document.createElement('span');
    if (r.body.hex) span.className = 'hex';
    span.textContent = r.body.text;
    body.title = r.body.text;
    body.append(span);
    tr.append(body);
    frag.append(tr);
  }
  pending = [];
  rows.prepend(frag);
  while (rows.childElementCount > MAX_ROWS) rows.lastElementChild.remove();
}

function tick() {
  const now = performance.now();
  while (arrivals.length && arrivals[0] < now - 1000) arrivals.shift();
  $('rate').textContent = String(arrivals.length);
  $('total').textContent = total.toLocaleString();
  $('bytes').textContent = formatBytes(totalBytes);
}

function sample() {
  history.shift();
  history.push(arrivals.length);
  const c = $('spark');
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  const max = Math.max(1, ...history);
  g.strokeStyle = '#1f6feb';
  g.lineWidth = 1.5;
  g.beginPath();
  history.forEach((v, i) => {
    const x = (i / (history.length - 1)) * (c.width - 2) + 1;
    const y = c.height - 2 - (v / max) * (c.height - 6);
    if (i === 0) g.moveTo(x, y);
    else g.lineTo(x, y);
  });
  g.stroke();
}

setInterval(tick, 250);
setInterval(sample, 1000);

// ----- subscriptions -----

class ViewSubscription {
  constructor(filter, group) {
    this.filter = filter;
    this.group = group || undefined;
    this.count = 0;
    this.sub = null;
    this.li = document.createElement('li');
    this.label = document.createElement('span');
    this.label.textContent = this.group ? `${filter}  (group ${this.group})` : filter;
    this.counter = document.createElement('span');
    this.counter.className = 'count';
    this.counter.textContent = '0';
    const x = document.createElement('button');
    x.type = 'button';
    x.className = 'secondary';
    x.textContent = 'Unsubscribe';
    x.addEventListener('click', () => this.remove());
    this.li.append(this.label, this.counter, x);
  }

  async start(c) {
    this.sub = await c.subscribe(this.filter, { group: this.group });
    subscriptions.add(this);
    $('subs').append(this.li);
    this.loop();
    return this;
  }

  async loop() {
    try {
      for await (const m of this.sub) {
        this.count += 1;
        this.counter.textContent = this.count.toLocaleString();
        onMessage(m);
        // Group members settle each message (the broker redelivers what is not acknowledged).
        if (this.group) m.ack().catch((e) => event(`ack failed: ${describeError(e)}`, true));
      }
    } catch (e) {
      this.markEnded(describeError(e));
      event(`subscription ${this.filter} ended: ${describeError(e)}`, true);
    }
  }

  markEnded(why) {
    this.li.classList.add('ended');
    this.counter.textContent = `ended: ${why}`;
  }

  remove() {
    subscriptions.delete(this);
    this.li.remove();
    this.sub?.unsubscribe().catch(() => {});
  }
}

async function doSubscribe(filter, group) {
  if (!client) throw new Error('not connected');
  const s = await new ViewSubscription(filter, group).start(client);
  event(`subscribed to ${filter}${group ? ` (group ${group})` : ''}`);
  return s;
}

// ----- forms -----

$('connect-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  startConnect($('token').value.trim()).catch(() => {});
});

$('disconnect').addEventListener('click', () => doDisconnect());

$('subscribe-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const filter = $('filter').value.trim();
  const group = $('group').value.trim();
  note('subscribe-note', 'subscribing…');
  try {
    await doSubscribe(filter, group);
    note('subscribe-note', `subscribed to ${filter}`, 'ok');
  } catch (e) {
    note('subscribe-note', describeError(e), 'bad');
  }
});

$('publish-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  if (!client) return;
  const topic = $('pub-topic').value.trim();
  const body = $('pub-body').value;
  const priority = Number($('pub-priority').value);
  const confirm = $('pub-confirm').checked;
  const count = Math.max(1, Math.min(10000, Number($('pub-count').value) || 1));
  note('publish-note', 'publishing…');
  try {
    let offset;
    for (let i = 0; i < count; i++) offset = await client.publish(topic, body, { priority, confirm });
    if (confirm) {
      const what = count === 1 ? 'published' : `published ${count} messages`;
      note('publish-note', `${what} to ${topic}, offset ${offset}`, 'ok');
    } else {
      // Not confirmed: the broker may still refuse it (an ACL rule, a quota), which shows only
      // in the events below. Not green, then.
      const what = count === 1 ? 'sent' : `sent ${count} messages`;
      note('publish-note', `${what} to ${topic} (not confirmed: the broker may still refuse it; tick "wait for the broker's confirmation" to know)`);
    }
  } catch (e) {
    note('publish-note', describeError(e), 'bad');
  }
});

$('pause').addEventListener('click', () => {
  paused = !paused;
  $('pause').textContent = paused ? 'Resume' : 'Pause';
});

$('clear').addEventListener('click', () => {
  $('rows').replaceChildren();
  total = 0;
  totalBytes = 0;
  tick();
});

// ----- start -----

$('token').value = params.get('token') ?? '';
$('where').textContent = wtUrl();
const ready = params.get('connect') === '0' ? Promise.resolve(null) : startConnect($('token').value.trim());
ready.catch(() => {});

window.aqueductView = {
  lib,
  ready,
  client: () => client,
  connect: (token) => startConnect(token),
  subscribe: (filter, group) => doSubscribe(filter, group),
};
