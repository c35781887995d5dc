#!/usr/bin/env python3
"""A headless Chromium subscriber over WebTransport: messages received per second.

Starts a release aqueduct-broker on 127.0.0.1 (free ports, its own temporary AQUEDUCT_HOME,
`broker.backpressure_policy: block`), opens headless Chromium (Debian `chromium` +
`chromium-driver`, driven by selenium, the flags of crates/aqueduct-cli/tests/python/browser.py)
on the broker's live view page (`GET /` on the metrics endpoint, opened with `?connect=0`), and
in each round, for each mode:

- `client`: the page's own copy of the JavaScript client (clients/js, served at
  /web/aqueduct/index.js; the page exposes the module as `window.aqueductView.lib`) connects a
  fresh WebTransport session (certificate pinned by GET /webtransport/cert-hash) and subscribes
  to --topic with `overflow: 'block'`; a `for await` loop counts messages and body bytes and
  takes performance.now() at the first and at the last message, and checks that the per-topic
  offsets come one after the other (no gap, no duplicate). Nothing is drawn.
- `view`: the live view itself (`window.aqueductView.connect()` + `.subscribe(topic)`): every
  message goes through the view's handler (counters, preview, the table redrawn once per
  animation frame). Its subscription sends no overflow option, so the broker's default applies
  (`block`, configured). The view's loop is timed by wrapping the client's
  `Subscription.prototype.next` (called once right after each message is handled) for that
  subscription only; the view's code is not changed.

Both rates are (N - 1) / (time of message N - time of message 1), in the page's
performance.now(); MB/s counts bodies only (10^6 B).

The page's subscription is reported active by the broker (`aqueduct_active_subscribers` on
/metrics) before `target/release/aqueduct pub TOPIC BODY --count N` publishes N messages of
--payload-size bytes (unconfirmed PUBLISH frames on one stream, not batched). With `block` the
broker holds the publisher when the page falls behind, so the publisher's wall time follows the
page; how fast `aqueduct pub` is on its own is measured first (the same command, no subscriber).
Drops are read from `aqueduct_messages_dropped_total` (any policy) and must stay 0.

Prints per-round lines, then markdown tables: per round (with the CPU other processes used
meanwhile), CPU by process (the page's renderer and its main thread, Chromium's network service,
the broker, the publisher), the median per mode; with --profile, where the page's main thread
spends its time (one more round per mode under the CDP JavaScript profiler); and the exact
`chromium --version`, the load average and the command. On a machine shared with other work,
--quiet SECONDS waits before each round until it is idle. Every wait is bounded; the broker, the
publisher, chromedriver and Chromium are stopped at the end, also on failure.

From the repository root (Debian: apt-get install chromium chromium-driver; pip install selenium):

    cargo build --release -p aqueduct-cli
    python3 scripts/browserbench.py --rounds 3 --messages 200000
    python3 scripts/browserbench.py --rounds 5 --messages 200000 --quiet 120 --profile
"""

import argparse
import json
import os
import queue
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speedbar import BROKER, CLIENT, git_describe  # noqa: E402

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # A benchmark page must not be throttled as a background tab.
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
]
START_WAIT = 30  # seconds: the broker, the page, a subscription, an unsubscription
# Attempts at opening a WebTransport session per round. Before 4c4e27f about one of Chromium's
# sessions in four failed at once ("Opening handshake failed"): the broker read the ALPN before
# the whole ClientHello had arrived (Chromium's spans two Initial packets) and served the
# connection as a native `aqueduct-v1` one. Fixed; failed attempts are still counted and printed.
RETRIES = 10
CONFIG = "broker:\n  backpressure_policy: block\n"


def log(msg):
    print(msg, flush=True)


# ----- the broker -----

class Broker:
    def __init__(self, home):
        path = os.path.join(home, "config.yaml")
        with open(path, "w") as f:
            f.write(CONFIG)
        args = [BROKER, "--config", path, "--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--log", "info"]
        env = dict(os.environ, AQUEDUCT_HOME=home, NO_COLOR="1")
        self.home = home
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.tail = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.addr = self.metrics = None
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self):
        deadline = time.monotonic() + START_WAIT
        while self.addr is None or self.metrics is None:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError("the broker did not start within %ds:\n%s" % (START_WAIT, "".join(self.tail[-20:])))
            if line is None:
                raise RuntimeError("the broker exited:\n" + "".join(self.tail[-20:]))
            m = re.search(r"addr=(\S+)", line)
            if m and "broker listening" in line:
                self.addr = m.group(1)
            elif m and "metrics endpoint listening" in line:
                self.metrics = m.group(1)
        # The HTTP endpoint is served just after its log line.
        while True:
            try:
                self.get("/healthz", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the broker's HTTP endpoint did not answer within %ds" % START_WAIT)
                time.sleep(0.05)

    def _drain(self):
        for line in self.proc.stderr:
            self.tail = (self.tail + [line])[-200:]
            self.lines.put(line)
        self.lines.put(None)

    def get(self, path, timeout=10):
        with urllib.request.urlopen(f"http://{self.metrics}{path}", timeout=timeout) as r:
            return r.read().decode()

    def metric(self, name, labels=None):
        """The sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.get("/metrics").splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            m = re.match(r"^([a-z_]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in (labels or {}).items()):
                total += float(m.group(3))
        return total

    def until_metric(self, name, want, what, timeout=START_WAIT):
        deadline = time.monotonic() + timeout
        while True:
            v = self.metric(name)
            if v == want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout}s waiting for {what} ({name} = {v}, want {want})")
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# ----- the publisher -----

class Publisher:
    """`aqueduct pub TOPIC BODY --count N`, started now; a thread notes when it exits."""

    def __init__(self, broker, topic, body, count):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [CLIENT, "--addr", broker.addr, "pub", topic, body, "--count", str(count)],
            env=dict(os.environ, AQUEDUCT_HOME=broker.home, NO_COLOR="1"),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out = self.err = ""
        self.elapsed = None  # seconds from start to exit
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        self.out, self.err = self.proc.communicate()
        self.elapsed = time.monotonic() - self.t0

    def finish(self, timeout):
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.kill()
            raise RuntimeError(f"aqueduct pub did not finish within {timeout}s")
        if self.proc.returncode != 0:
            raise RuntimeError(f"aqueduct pub failed ({self.proc.returncode}): {self.out[-1000:]} {self.err[-1000:]}")
        return self.elapsed

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.thread.join(10)


def publisher_alone(broker, topic, body, count, timeout):
    """msg/s of `aqueduct pub` with no subscriber (what the publisher can do on its own,
    process start and connection included)."""
    pub = Publisher(broker, topic, body, count)
    try:
        return count / pub.finish(timeout)
    finally:
        pub.kill()


# ----- the page -----

def run_js(driver, body, *args):
    """Run an async function body in the page (`v` is window.aqueductView); its result."""
    script = (
        "const done = arguments[arguments.length - 1];"
        "const args = Array.from(arguments).slice(0, -1);"
        "const v = window.aqueductView;"
        f"(async (...args) => {{ {body} }})(...args).then("
        "  (r) => done({ ok: true, value: r }),"
        "  (e) => done({ ok: false, error: String(e && e.message || e), code: e && e.code }));"
    )
    r = driver.execute_async_script(script, *args)
    if not r["ok"]:
        raise RuntimeError(f"in the page: {r['error']} (code {r.get('code')})")
    return r["value"]


# Resets window.bench; connects a fresh client, subscribes with overflow 'block', and counts.
CLIENT_START = """
const [topic, buffer, retries] = args;
const lib = v.lib;
const old = window.bench;
if (old && old.client) await old.client.close().catch(() => {});
const r = await fetch('/webtransport/cert-hash', { cache: 'no-store' });
if (!r.ok) throw new Error('GET /webtransport/cert-hash answered ' + r.status);
const hash = await r.json();
const url = `https://${location.hostname}:${hash.port}${hash.path}`;
// Bounded retries: some sessions fail their opening handshake (see RETRIES in the script).
let client = null, attempts = 0, failure = null;
while (client === null && attempts < retries) {
  attempts += 1;
  try {
    client = await lib.connect(url, {
      protocols: ['aqueduct-v1'],
      serverCertificateHashes: [{ algorithm: hash.algorithm, value: hash.value }],
      onError: (e) => { window.bench.error = 'broker: ' + String(e && e.message || e); },
    });
  } catch (e) {
    failure = e;
  }
}
if (client === null) throw failure;
const b = window.bench = { client, sub: null, count: 0, bytes: 0, first: 0, last: 0,
  gaps: 0, noOffset: 0, next: null, error: null, ended: false };
b.sub = await client.subscribe(topic, { overflow: 'block', buffer });
(async () => {
  try {
    for await (const m of b.sub) {
      const now = performance.now();
      if (b.count === 0) b.first = now;
      b.last = now;
      b.count += 1;
      b.bytes += m.body.length;
      const o = m.offset;
      if (o === undefined) b.noOffset += 1;
      else {
        if (b.next !== null && o !== b.next) b.gaps += 1;
        b.next = o + 1n;
      }
    }
  } catch (e) {
    b.error = String(e && e.message || e);
  }
  b.ended = true;
})();
return { url, attempts };
"""

CLIENT_STATE = """
const b = window.bench;
return { count: b.count, bytes: b.bytes, first: b.first, last: b.last, gaps: b.gaps,
  noOffset: b.noOffset, error: b.error, ended: b.ended };
"""

CLIENT_STOP = """
const b = window.bench;
if (b && b.sub) await b.sub.unsubscribe().catch(() => {});
if (b && b.client) await b.client.close().catch(() => {});
return true;
"""

# The live view's own connection and subscription, timed at its loop's next() calls.
VIEW_START = """
const [topic, buffer, retries] = args;
let attempts = 0;
for (;;) {
  attempts += 1;
  try {
    await v.connect('');
    break;
  } catch (e) {
    if (attempts >= retries) throw e;
  }
}
// The view's loop (`for await (const m of sub)`) calls next() once before the first message
// and once right after handling each one: call k + 1 is when message k has been handled. The
// method is looked up when the loop starts, so it is wrapped for the view's subscription
// before it is made, and the original put back once it is made.
const proto = v.lib.Subscription.prototype;
const original = proto.next;
const b = window.bench = { view: null, calls: 0, first: 0, last: 0, target: 0, error: null };
proto.next = function () {
  b.calls += 1;
  if (b.calls === 2) b.first = performance.now();
  else if (b.calls === b.target + 1) b.last = performance.now();
  return original.call(this);
};
let s;
try {
  s = await v.subscribe(topic);
} finally {
  proto.next = original;
}
b.view = s;
return { url: document.getElementById('where').textContent, attempts };
"""

VIEW_STATE = """
const b = window.bench;
const ended = b.view.li.classList.contains('ended');
return { count: b.view.count, bytes: 0, first: b.first, last: b.last, gaps: 0, noOffset: 0,
  error: ended ? b.view.counter.textContent : null, ended };
"""

VIEW_STOP = """
const b = window.bench;
if (b && b.view) b.view.remove();
return true;
"""


def start_browser(profile):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    # Full paths: without them selenium would try to download a browser.
    options.binary_location = os.environ.get("CHROMIUM") or shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_script_timeout(START_WAIT)
    driver.set_page_load_timeout(START_WAIT)
    return driver


def until_page(driver, what, js, timeout=START_WAIT):
    deadline = time.monotonic() + timeout
    while not driver.execute_script(f"return ({js});"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what} ({js})")
        time.sleep(0.05)


def chromium_version():
    binary = os.environ.get("CHROMIUM") or shutil.which("chromium")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


# ----- CPU: where the round's time went -----

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICKS  # ppid, utime + stime (s)


def chromium_kind(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return None
    if "NetworkService" in cmd:
        return "network"
    if "--type=renderer" in cmd:
        return "renderer"
    if "--type=gpu-process" in cmd:
        return "gpu"
    if "--type=" in cmd:
        return "other"
    return "browser" if "chrom" in cmd else "other"


def cpu_sample(broker_pid, driver_pid):
    """CPU seconds so far: the broker's, and Chromium's by process kind (chromedriver's tree)."""
    parents, cpu = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)], cpu[int(d)] = _stat(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out = {"broker": cpu.get(broker_pid, 0.0)}
    tree, frontier = set(), {driver_pid} if driver_pid else set()
    while frontier:
        tree |= frontier
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in tree}
    tree.discard(driver_pid)
    for pid in tree:
        kind = chromium_kind(pid)
        if kind:
            out[kind] = out.get(kind, 0.0) + cpu[pid]
        if kind == "renderer":
            # Its main thread (tid = pid): where the page's JavaScript (the client, the view) runs.
            try:
                out["renderer main"] = out.get("renderer main", 0.0) + _stat(f"{pid}/task/{pid}")[1]
            except (OSError, IndexError, ValueError):
                pass
    out["publisher"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime + \
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    out["machine"] = (sum(v) - v[3] - v[4]) / TICKS  # all CPUs, not idle and not iowait
    return out


def profile_top(profile, n=12):
    """The page's main thread by function (self time), from a CDP Profiler profile."""
    nodes = {node["id"]: node["callFrame"] for node in profile["nodes"]}
    by = {}
    for sample in profile["samples"]:
        cf = nodes[sample]
        where = f"{os.path.basename(cf['url'])}:{cf['lineNumber'] + 1}" if cf["url"] else "no URL"
        key = f"{cf['functionName'] or '(anonymous)'} ({where})"
        by[key] = by.get(key, 0) + 1
    total = max(1, len(profile["samples"]))
    return [(k, v / total) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:n]]


def machine_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICKS


def wait_quiet(max_wait, threshold=0.25):
    """Wait (at most max_wait s) until the machine's busy CPU over 2 s is below threshold cores
    (other sessions' work on a shared machine); the last 2 s figure."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = machine_busy(), time.monotonic()
        time.sleep(2)
        busy = (machine_busy() - b0) / (time.monotonic() - t0)
        if busy < threshold or time.monotonic() > deadline:
            return busy


# ----- one round -----

def round_(driver, broker, mode, a, body, profile=False):
    start, state, stop = {"client": (CLIENT_START, CLIENT_STATE, CLIENT_STOP),
                          "view": (VIEW_START, VIEW_STATE, VIEW_STOP)}[mode]
    dropped0 = broker.metric("aqueduct_messages_dropped_total", {"topic": a.topic})
    delivered0 = broker.metric("aqueduct_messages_delivered_total", {"topic": a.topic})
    opened = run_js(driver, start, a.topic, a.buffer, RETRIES)
    try:
        broker.until_metric("aqueduct_active_subscribers", 1, "the page's subscription")
        if mode == "view":
            driver.execute_script("window.bench.target = arguments[0];", a.messages)
        driver_pid = getattr(getattr(driver.service, "process", None), "pid", None)
        cpu0 = cpu_sample(broker.proc.pid, driver_pid)
        if profile:
            driver.execute_cdp_cmd("Profiler.enable", {})
            driver.execute_cdp_cmd("Profiler.setSamplingInterval", {"interval": 200})  # µs
            driver.execute_cdp_cmd("Profiler.start", {})
        t0 = time.monotonic()
        pub = Publisher(broker, a.topic, body, a.messages)
        progress, seen = time.monotonic(), -1
        try:
            while True:
                s = driver.execute_script(state)
                if s["error"]:
                    raise RuntimeError(f"{mode}: the subscription failed in the page: {s['error']}")
                if s["count"] >= a.messages and (mode == "client" or s["last"]):
                    break
                if s["count"] != seen:
                    seen, progress = s["count"], time.monotonic()
                elif time.monotonic() - progress > a.stall:
                    raise RuntimeError(f"{mode}: no message for {a.stall}s at {s['count']:,} of {a.messages:,} "
                                       f"(dropped so far: {broker.metric('aqueduct_messages_dropped_total', {'topic': a.topic}) - dropped0:.0f})")
                if time.monotonic() - t0 > a.timeout:
                    raise RuntimeError(f"{mode}: {s['count']:,} of {a.messages:,} after {a.timeout}s")
                time.sleep(0.1)
            pub_done = pub.finish(a.timeout)
            # CPU from the publisher's start to the last message (or the publisher's exit).
            wall = time.monotonic() - t0
            cpu1 = cpu_sample(broker.proc.pid, driver_pid)
            if profile:
                profile = driver.execute_cdp_cmd("Profiler.stop", {})["profile"]
        finally:
            pub.kill()
        cpu = {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / wall for k in cpu1}
        # What else ran on the machine meanwhile (other sessions' work; this script's own
        # Python and chromedriver are in it too, a few percent).
        cpu["others"] = max(0.0, cpu.pop("machine") - sum(v for k, v in cpu.items() if k != "renderer main"))
        time.sleep(0.3)  # anything beyond N (there must be nothing) would arrive now
        s = driver.execute_script(state)
    finally:
        run_js(driver, stop)
    broker.until_metric("aqueduct_active_subscribers", 0, "the page's unsubscription")
    dropped = broker.metric("aqueduct_messages_dropped_total", {"topic": a.topic}) - dropped0
    delivered = broker.metric("aqueduct_messages_delivered_total", {"topic": a.topic}) - delivered0
    if mode == "client":
        span = (s["last"] - s["first"]) / 1000
        counted = s["count"] - 1  # the intervals between message 1 and message N
        nbytes = s["bytes"] * counted / max(1, s["count"])
    else:
        span = (s["last"] - s["first"]) / 1000
        counted = s["count"] - 1  # from the end of message 1 to the end of message N
        nbytes = counted * a.payload_size
    r = {
        "mode": mode, "url": opened["url"], "attempts": opened["attempts"], "received": s["count"], "dropped": dropped, "delivered": delivered,
        "gaps": s["gaps"], "no_offset": s["noOffset"], "span_s": span,
        "msgs_per_s": counted / span if span > 0 else float("nan"),
        "mb_per_s": nbytes / span / 1e6 if span > 0 else float("nan"),
        "publisher_s": pub_done, "cpu": cpu, "profile": profile_top(profile) if profile else None,
    }
    problems = []
    if s["count"] != a.messages:
        problems.append(f"received {s['count']:,}, published {a.messages:,}")
    if dropped:
        problems.append(f"the broker dropped {dropped:.0f}")
    if s["gaps"]:
        problems.append(f"{s['gaps']} offset gaps or repeats")
    if mode == "client" and s["bytes"] != a.messages * a.payload_size:
        problems.append(f"{s['bytes']:,} body bytes, expected {a.messages * a.payload_size:,}")
    r["problems"] = problems
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--payload-size", type=int, default=128)
    p.add_argument("--topic", default="bench/browser")
    p.add_argument("--modes", default="client,view", help="comma-separated: client (the JS client alone), view (the live view)")
    p.add_argument("--buffer", type=int, default=256, help="the JS client's subscription read-ahead (its default: 256)")
    p.add_argument("--stall", type=float, default=20.0, help="fail a round after this many seconds without a new message")
    p.add_argument("--timeout", type=float, default=300.0, help="fail a round after this many seconds")
    p.add_argument("--quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each round wait up to this long until the machine is idle (busy CPU over 2 s "
                        "below 0.25 cores), for a machine shared with other work; 0: do not wait")
    p.add_argument("--profile", action="store_true",
                   help="after the rounds, one more round per mode (not in the figures) under the page's "
                        "JavaScript profiler (CDP, 200 µs sampling): prints where the main thread's time goes")
    a = p.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("client", "view"):
            p.error(f"unknown mode {m!r}")
    for binary in (BROKER, CLIENT):
        if not os.access(binary, os.X_OK):
            sys.exit(f"browserbench: {binary} missing: cargo build --release -p aqueduct-cli")
    body = ("x" * a.payload_size)
    command = "python3 scripts/browserbench.py " + " ".join(sys.argv[1:])
    version = chromium_version()
    log(f"chromium --version: {version}")
    code = git_describe()
    binaries = {b: (os.stat(b).st_mtime_ns, os.stat(b).st_size) for b in (BROKER, CLIENT)}

    results, failures = [], []
    home = tempfile.mkdtemp(prefix="aqueduct-browserbench-")
    profile = tempfile.mkdtemp(prefix="aqueduct-browserbench-chromium-")
    broker = driver = None
    try:
        broker = Broker(home)
        log(f"broker: QUIC/WebTransport {broker.addr}, HTTP {broker.metrics}")
        hash_ = json.loads(broker.get("/webtransport/cert-hash"))
        log(f"certificate hash {hash_['value'][:16]}…, WebTransport path {hash_['path']}")
        alone = publisher_alone(broker, a.topic + "/alone", body, a.messages, a.timeout)
        log(f"aqueduct pub alone (no subscriber): {alone:,.0f} msg/s")
        driver = start_browser(profile)
        driver.get(f"http://{broker.metrics}/?connect=0")
        until_page(driver, "the live view's module", "window.aqueductView && window.aqueductView.lib")
        ua = driver.execute_script("return navigator.userAgent;")
        for r in range(1, a.rounds + 1):
            for mode in modes:
                idle = wait_quiet(a.quiet) if a.quiet > 0 else None
                res = round_(driver, broker, mode, a, body)
                res["round"] = r
                res["before"] = idle
                results.append(res)
                log(f"round {r} {mode}: {res['received']:,} received in {res['span_s']:.3f}s (first to last): "
                    f"{res['msgs_per_s']:,.0f} msg/s, {res['mb_per_s']:.2f} MB/s; publisher done after "
                    f"{res['publisher_s']:.2f}s; dropped {res['dropped']:.0f}, offset gaps {res['gaps']}"
                    + (f"; session opened at attempt {res['attempts']}" if res["attempts"] > 1 else "")
                    + (f"; machine busy before: {res['before']:.2f} cores" if res["before"] is not None else "")
                    + (f"; PROBLEMS: {'; '.join(res['problems'])}" if res["problems"] else ""))
                log(f"  CPU (cores, publish start to last message): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in sorted(res["cpu"].items(), key=lambda kv: -kv[1])))
                failures += [f"round {r} {mode}: {x}" for x in res["problems"]]
        profiles = []
        if a.profile:
            for mode in modes:
                res = round_(driver, broker, mode, a, body, profile=True)
                profiles.append(res)
                log(f"profiled round {mode}: {res['msgs_per_s']:,.0f} msg/s under the profiler")
    except BaseException:
        if driver is not None:
            try:
                for entry in driver.get_log("browser")[-30:]:
                    print(f"browser console: {entry['level']} {entry['message']}", file=sys.stderr)
            except Exception:
                pass
        if broker is not None:
            print("broker log (tail):\n" + "".join(broker.tail[-20:]), file=sys.stderr)
        raise
    finally:
        if driver is not None:
            try:
                driver.quit()
            except Exception:
                proc = getattr(driver.service, "process", None)
                if proc is not None and proc.poll() is None:
                    proc.kill()
        if broker is not None:
            broker.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(profile, ignore_errors=True)

    load = os.getloadavg()
    print()
    changed = [os.path.basename(b) for b, v in binaries.items()
               if not os.path.exists(b) or (os.stat(b).st_mtime_ns, os.stat(b).st_size) != v]
    print(f"code {code} (git describe at the start); {version}; user agent {ua}")
    if changed:
        print(f"WARNING: {', '.join(changed)} rebuilt during the run: later rounds' publishers ran another build")
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    print(f"{a.rounds} rounds, {a.messages:,} messages of {a.payload_size} B per round and mode, "
          f"`aqueduct pub --count` (alone: {alone:,.0f} msg/s), overflow block, JS buffer {a.buffer}")
    failed_opens = sum(r["attempts"] - 1 for r in results + profiles)
    print(f"WebTransport sessions opened: {len(results) + len(profiles)}, after {failed_opens} failed attempt(s) "
          "(\"Opening handshake failed\", see RETRIES in the script)")
    print(f"command: {command}")
    print()
    print("| round | mode | received | dropped | first → last | msg/s | MB/s | publisher done after | other load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['round']} | {r['mode']} | {r['received']:,} | {r['dropped']:.0f} | {r['span_s']:.3f} s | "
              f"{r['msgs_per_s']:,.0f} | {r['mb_per_s']:.2f} | {r['publisher_s']:.2f} s | {r['cpu']['others']:.2f} cores |")
    kinds = ["renderer", "renderer main", "network", "browser", "gpu", "other", "broker", "publisher", "others"]
    print()
    print("CPU during the rounds, in cores (CPU seconds / wall seconds from publish start to the last "
          "message; Chromium by process: renderer = the page's process, renderer main = its main thread, where the page's JavaScript runs, network = the network service, where QUIC runs; others = every other process on the machine), median:")
    print()
    print("| mode | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for mode in modes:
        rows = [r["cpu"] for r in results if r["mode"] == mode]
        if rows:
            print(f"| {mode} | " + " | ".join(f"{statistics.median(c.get(k, 0.0) for c in rows):.2f}" for k in kinds) + " |")
    print()
    print("| mode | msg/s (median) | MB/s (median) | rounds (msg/s) |")
    print("|---|---:|---:|---|")
    for mode in modes:
        rates = [r["msgs_per_s"] for r in results if r["mode"] == mode]
        mbs = [r["mb_per_s"] for r in results if r["mode"] == mode]
        if rates:
            print(f"| {mode} | **{statistics.median(rates):,.0f}** | {statistics.median(mbs):.2f} | "
                  + ", ".join(f"{x:,.0f}" for x in rates) + " |")
    for res in profiles:
        print()
        print(f"Profile of the page's main thread, {res['mode']} mode ({res['msgs_per_s']:,.0f} msg/s under the "
              "profiler), self time by function:")
        print()
        print("| share | function |")
        print("|---:|---|")
        for k, v in res["profile"]:
            print(f"| {v:.1%} | `{k}` |")
    if failures:
        print()
        print("FAILED: " + "; ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
