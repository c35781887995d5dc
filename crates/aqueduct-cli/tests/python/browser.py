"""The browser test's driver (run by crates/aqueduct-cli/tests/browser.rs): headless Chromium,
through selenium, opens the broker's live web view (served by the broker's HTTP endpoint), whose
page uses the JavaScript client of clients/js over WebTransport; the other side is the real
`aqueduct` command line. Prints `ok: …` per check and `all browser checks passed` at the end;
any failure raises (non-zero exit).

Usage: browser.py PAGE_URL AQUEDUCT_BIN BROKER_ADDR HOME TOKEN SCREENSHOT_PNG
"""

import functools
import http.server
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

PAGE, CLI, ADDR, HOME, TOKEN, SCREENSHOT = sys.argv[1:7]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
WAIT = 30  # seconds, for any one condition
ENV = dict(os.environ, AQUEDUCT_HOME=HOME, AQUEDUCT_ADDR=ADDR, NO_COLOR="1")

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def ok(what):
    print(f"ok: {what}", flush=True)


def aqueduct(*args, stdin=None):
    """Run `aqueduct ARGS` to completion (bounded); its standard output."""
    out = subprocess.run(
        [CLI, *args], input=stdin, env=ENV, capture_output=True, text=True, timeout=WAIT
    )
    if out.returncode != 0:
        raise AssertionError(f"aqueduct {' '.join(args)} failed: {out.stderr}")
    return out.stdout


class Sub:
    """A running `aqueduct sub`: its output lines as they come."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [CLI, "sub", *args],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        self.errors = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.append), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.errors.put), daemon=True).start()
        deadline = time.monotonic() + WAIT
        while True:
            try:
                line = self.errors.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"aqueduct sub {' '.join(args)} did not subscribe within {WAIT}s")
            if line.startswith("subscribed to"):
                return

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line.rstrip("\n"))

    def wait_exit(self):
        code = self.proc.wait(timeout=WAIT)
        assert code == 0, f"aqueduct sub exited with {code}"

    def stop(self):
        self.proc.terminate()
        self.wait_exit()


def until(driver, what, js, timeout=WAIT):
    """Wait until the page's `js` expression is truthy; its value."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
            lambda d: d.execute_script(f"return ({js});")
        )
    except Exception as e:
        raise AssertionError(f"timed out after {timeout}s waiting for {what} ({js})") from e


def until_py(what, cond, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def run_js(driver, body, *args):
    """Run an async function body in the page (`v` is window.aqueductView); its result, or raise
    with the page's error."""
    script = (
        "const done = arguments[arguments.length - 1];"
        "const args = Array.from(arguments).slice(0, -1);"
        "const v = window.aqueductView;"
        f"(async (...args) => {{ {body} }})(...args).then("
        "  (r) => done({ ok: true, value: r }),"
        "  (e) => done({ ok: false, error: String(e && e.message || e), code: e && e.code, name: e && e.codeName }));"
    )
    r = driver.execute_async_script(script, *args)
    if not r["ok"]:
        raise AssertionError(f"in the page: {r['error']} (code {r.get('code')})")
    return r["value"]


def js_error(driver, body):
    """Run a body that must fail in the page: the error's {error, code, name}."""
    script = (
        "const done = arguments[arguments.length - 1];"
        "const v = window.aqueductView;"
        f"(async () => {{ {body} }})().then("
        "  () => done(null),"
        "  (e) => done({ error: String(e && e.message || e), code: e && e.code, name: e && e.codeName }));"
    )
    return driver.execute_async_script(script)


def main():
    options = webdriver.ChromeOptions()
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="aqueduct-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    # Full paths: without them selenium would try to download a browser (no network here).
    options.binary_location = os.environ.get("CHROMIUM") or shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_script_timeout(WAIT)
    driver.set_page_load_timeout(WAIT)
    try:
        checks(driver)
    except BaseException:
        for entry in driver.get_log("browser"):
            print(f"browser console: {entry['level']} {entry['message']}", file=sys.stderr)
        try:
            print("page events:\n" + driver.find_element(By.ID, "events").text, file=sys.stderr)
        except Exception:
            pass
        raise
    finally:
        driver.quit()
    print("all browser checks passed", flush=True)


def checks(driver):
    driver.set_window_size(1440, 1000)
    driver.get(f"{PAGE}?token={TOKEN}")
    until(driver, "the live view to connect", "document.getElementById('status').dataset.state === 'connected'")
    ok("the live view connected over WebTransport (certificate hash from /webtransport/cert-hash, token)")

    # --- 1. A wildcard filter typed into the page's field, and a stalled subscriber (one
    # unacknowledged message at a time) through the JS client: bytes intact, priorities in order.
    field = driver.find_element(By.ID, "filter")
    field.clear()
    field.send_keys("sensors/#")
    driver.find_element(By.ID, "subscribe-button").click()
    until(driver, "the form's subscription", "document.getElementById('subscribe-note').textContent === 'subscribed to sensors/#'")
    run_js(
        driver,
        """
        window.held = { got: [], release: null };
        const gate = new Promise((r) => { window.held.release = r; });
        const sub = await v.client().subscribe('sensors/#', { ack: true, maxInFlight: 1 });
        (async () => {
          let first = true;
          for await (const m of sub) {
            window.held.got.push({ topic: m.topic, priority: m.priority, offset: String(m.offset), text: m.text,
              hex: Array.from(m.body, (b) => b.toString(16).padStart(2, '0')).join('') });
            if (first) { first = false; await gate; }
            await m.ack();
          }
        })();
        """,
    )
    body = "naïve ☕ 🚀 \x01\x7f\ttab — ünïcødé"
    aqueduct("pub", "sensors/hall/t1", body, "--priority", "2", "--confirm")
    until(driver, "the first delivery", "window.held.got.length === 1")
    first = driver.execute_script("return window.held.got[0];")
    assert first["topic"] == "sensors/hall/t1", first
    assert first["hex"] == body.encode("utf-8").hex(), (first["hex"], body.encode("utf-8").hex())
    ok("a wildcard subscription (sensors/#) got what `aqueduct pub` sent, bytes intact")
    # Behind the unacknowledged one: five of each priority, lowest first.
    for p in (3, 2, 1, 0):
        lines = "".join(f"p{p}-{i}\n" for i in range(5))
        aqueduct("pub", f"sensors/p{p}", "--priority", str(p), "--confirm", stdin=lines)
    driver.execute_script("window.held.release();")
    until(driver, "all 21 deliveries", "window.held.got.length === 21")
    got = driver.execute_script("return window.held.got;")
    order = [m["text"] for m in got[1:]]
    expected = [f"p{p}-{i}" for p in (0, 1, 2, 3) for i in range(5)]
    assert order == expected, f"delivered in the order {order}, expected {expected}"
    assert [m["priority"] for m in got[1:]] == [p for p in (0, 1, 2, 3) for _ in range(5)]
    ok("published at priorities 3, 2, 1, 0 to a stalled subscriber: delivered 0 first, then 1, 2, 3, in order within each")
    until(driver, "the live view's table", "document.querySelectorAll('#rows tr').length >= 21")
    table = driver.find_element(By.ID, "rows").text
    assert "sensors/hall/t1" in table and "sensors/p0" in table, table
    ok("the live view lists them (topic, priority, offset, body)")

    # --- 2. The page publishes (its form, and the client with confirm); `aqueduct sub` gets it.
    sub = Sub("web/#", "--count", "4")
    topic = driver.find_element(By.ID, "pub-topic")
    topic.clear()
    topic.send_keys("web/form")
    text = driver.find_element(By.ID, "pub-body")
    text.clear()
    text.send_keys("from the form")
    driver.find_element(By.CSS_SELECTOR, "#pub-priority option[value='1']").click()
    driver.find_element(By.ID, "publish-button").click()
    until(driver, "the form's confirmation", "document.getElementById('publish-note').textContent.startsWith('published to web/form, offset 0')")
    offsets = run_js(
        driver,
        """
        const c = v.client();
        const a = await c.publish('web/js', 'ünï ✓ from the client', { priority: 0, confirm: true });
        const b = await c.publish('web/js', new Uint8Array([104, 105]), { confirm: true });
        await c.publish('web/js', 'flushed');
        await c.flush();
        return [String(a), String(b)];
        """,
    )
    assert offsets == ["0", "1"], offsets
    sub.wait_exit()
    assert sub.lines == [
        "web/form #0 p1: from the form",
        "web/js #0 p0: ünï ✓ from the client",
        "web/js #1 p2: hi",
        "web/js #2 p2: flushed",
    ], sub.lines
    ok("what the page published (form and client, with CONFIRM, and without it then flush()) reached `aqueduct sub`, in order, bytes intact")

    # --- 3. One consumer group: the page and a native `aqueduct sub --group` member.
    native = Sub("jobs", "--group", "workers")
    run_js(
        driver,
        """
        window.jobs = [];
        const sub = await v.client().subscribe('jobs', { group: 'workers' });
        (async () => { for await (const m of sub) { window.jobs.push(m.text); await m.ack(); } })();
        """,
    )
    jobs = [f"job-{i}" for i in range(20)]
    aqueduct("pub", "jobs", "--confirm", stdin="".join(j + "\n" for j in jobs))
    native_jobs = lambda: [l.split(": ", 1)[1] for l in native.lines]
    browser_jobs = lambda: driver.execute_script("return window.jobs;")
    until_py("20 jobs between the two members", lambda: len(native_jobs()) + len(browser_jobs()) >= 20)
    native.stop()
    b, n = browser_jobs(), native_jobs()
    assert sorted(b + n) == sorted(jobs), f"browser {b}, native {n}"
    assert not set(b) & set(n), f"both got {set(b) & set(n)}"
    assert b and n, f"browser {b}, native {n}: one member got nothing"
    ok(f"a group shared with a native member: each of 20 jobs to exactly one (browser {len(b)}, native {len(n)}), none lost")

    # --- 4. The ACL: the token's client id may not touch secret/#; anonymous (the CLI) may.
    err = js_error(driver, "await v.client().subscribe('secret/plans');")
    assert err and err["code"] == 400 and err["name"] == "NOT_AUTHORIZED", err
    err = js_error(driver, "await v.client().publish('secret/plans', 'x', { confirm: true });")
    assert err and err["code"] == 400 and err["name"] == "NOT_AUTHORIZED", err
    err = js_error(driver, "const c = v.client(); await c.publish('secret/plans', 'x'); await c.flush();")
    assert err and err["code"] == 400 and err["name"] == "NOT_AUTHORIZED", err
    assert "offset 0" in aqueduct("pub", "secret/plans", "anonymous may", "--confirm")
    ok("refused by the ACL rule for the token's client id: SUBSCRIBE and PUBLISH get NOT_AUTHORIZED (400), and flush() after a PUBLISH sent without confirm rejects with it")

    # --- 5. A screenshot of the live view with messages flowing.
    lines = "".join(f"reading {i}: {20 + i % 7}.{i % 10} °C\n" for i in range(60))
    aqueduct("pub", "sensors/hall/t2", stdin=lines)
    aqueduct("pub", "sensors/roof/wind", "--priority", "1", stdin="".join(f"gust {i} m/s\n" for i in range(20)))
    aqueduct("pub", "sensors/door/main", "opened", "--priority", "0")
    until(driver, "the view's counters", "Number(document.getElementById('rate').textContent) > 0 && document.body.innerText.includes('sensors/door/main')")
    driver.execute_script("window.scrollTo(0, 0);")
    os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
    assert driver.save_screenshot(SCREENSHOT), "screenshot"
    ok(f"screenshot of the live view: {SCREENSHOT}")

    # --- 6. A token the broker does not know: the session is refused, and the page learns why
    # (browsers show pages no HTTP status: the broker opens the session without the subprotocol
    # and closes it with NOT_AUTHORIZED and the reason, which the JS client's connect() rejects
    # with), and the page shows it.
    driver.get(f"{PAGE}?token=not-a-token-of-this-broker")
    until(driver, "the refused connect", "document.getElementById('status').dataset.state === 'failed'")
    note = driver.find_element(By.ID, "connect-note").text
    assert "NOT_AUTHORIZED (400): WebTransport session refused (401): unknown token" in note, note
    ok(f"a refused session (unknown token) shows the broker's reason: {note}")

    # --- 7. The documentation's code as written: the page of clients/js/README.md ("In a browser
    # page"), served from localhost next to a copy of clients/js as the README says, and the
    # snippet of docs/howto-browser.md ("The JavaScript client"), which imports the client from
    # the broker's /web/aqueduct/; the metrics address `localhost:9090` in them replaced by this
    # broker's (the only change).
    metrics_port = re.search(r":(\d+)/", PAGE).group(1)
    readme_page = doc_block(os.path.join(ROOT, "clients/js/README.md"), "## In a browser page", "html")
    howto_js = doc_block(os.path.join(ROOT, "docs/howto-browser.md"), "## The JavaScript client", "js")
    site = tempfile.mkdtemp(prefix="aqueduct-doc-pages-")
    os.makedirs(os.path.join(site, "aqueduct"))
    for name in os.listdir(os.path.join(ROOT, "clients/js")):
        if name.endswith(".js"):
            shutil.copy(os.path.join(ROOT, "clients/js", name), os.path.join(site, "aqueduct"))
    here = lambda text: text.replace("localhost:9090", f"localhost:{metrics_port}")
    with open(os.path.join(site, "readme.html"), "w", encoding="utf-8") as f:
        f.write(here(readme_page))
    # The snippet prints with console.log: the harness keeps what it prints (a classic script
    # runs before the module).
    with open(os.path.join(site, "howto.html"), "w", encoding="utf-8") as f:
        f.write(
            '<!doctype html>\n<meta charset="utf-8">\n'
            "<script>window.printed = []; const log = console.log;"
            " console.log = (...a) => { window.printed.push(a.map(String).join(' ')); log(...a); };</script>\n"
            f'<script type="module">\n{here(howto_js)}\n</script>\n'
        )
    handler = functools.partial(QuietHandler, directory=site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        site_url = f"http://localhost:{server.server_address[1]}"
        driver.get(f"{site_url}/readme.html")
        page_log = "document.getElementById('log').textContent"
        try:
            until(driver, "the README page's publish", f"{page_log}.includes('published at offset')")
            until(driver, "the README page's delivery", f"{page_log}.includes('orders/eu #')")
        except AssertionError as e:
            raise AssertionError(f"{e}; the page printed: {driver.execute_script(f'return {page_log};')!r}") from e
        lines = driver.find_element(By.ID, "log").text.splitlines()
        assert "orders/eu #0 p1: first order" in lines and "published at offset 0" in lines, lines
        ok("clients/js/README.md's browser page, as written: subscribed, published with CONFIRM, got its message")

        driver.get(f"{site_url}/howto.html")
        printed = lambda: driver.execute_script("return window.printed || [];")
        # The snippet says nothing when its subscription is active: publish until it prints.
        deadline = time.monotonic() + WAIT
        n = 0
        while not any(line.startswith("sensors/howto ") for line in printed()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the howto snippet printed nothing within {WAIT}s: {printed()}")
            aqueduct("pub", "sensors/howto", f"reading {n}", "--priority", "1", "--confirm")
            n += 1
            time.sleep(0.2)
        first = next(line for line in printed() if line.startswith("sensors/howto "))
        assert re.fullmatch(r"sensors/howto \d+ 1 reading \d+", first), first
        ok(f"docs/howto-browser.md's snippet, as written (its token): printed `{first}`")
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(site, ignore_errors=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def doc_block(path, heading, lang):
    """The first ```LANG code block of the section HEADING (a whole line) of the Markdown file
    PATH, before the next heading of the same level."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = re.search(rf"^{re.escape(heading)}$", text, re.M)
    assert start, f"no heading {heading!r} in {path}"
    level = heading.split(" ", 1)[0]
    end = re.compile(rf"^{level} ", re.M).search(text, start.end())
    section = text[start.end() : end.start() if end else len(text)]
    m = re.search(rf"^```{lang}\n(.*?)^```$", section, re.S | re.M)
    assert m, f"no {lang} block in the section {heading!r} of {path}"
    return m.group(1)


if __name__ == "__main__":
    main()
