"""The HTML report in a real browser (issue 5): headless Chromium opens it
from a file URL; no console errors or exceptions, no request leaves the file,
every panel renders with non-zero size and ink on its canvases, hovering the
mask and the timeline shows their tooltips, and a full-page screenshot is
written.

Driver: the Chrome DevTools protocol over ``--remote-debugging-pipe``
(Chromium reads commands on fd 3 and answers on fd 4, one JSON message per
NUL-terminated chunk). That needs only the standard library: no port to pick
or race for, no websocket client, no chromedriver whose version must match
the browser. Every read has a deadline, and the browser is killed when a test
ends, so a stuck browser fails the test instead of hanging it.

Skipped only when Chromium is absent (``.ci/run`` installs Debian's
``chromium``). As a script it screenshots any report (the README picture)::

    .venv/bin/python tests/test_browser.py out/report.html docs/img/report.png
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = os.environ.get("ATTNPLAN_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


class BrowserError(RuntimeError):
    pass


class Browser:
    """Headless Chromium driven over the DevTools pipe. Use as a context manager."""

    def __init__(self, exe: str = CHROMIUM, timeout: float = 30.0):
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="attnplan-chromium-")
        self._log = open(Path(self._dir.name) / "stderr.log", "wb")  # noqa: SIM115 (closed in close())
        cmd_r, self._cmd_w = os.pipe()   # we write commands; Chromium reads them on fd 3
        self._out_r, out_w = os.pipe()   # Chromium writes answers on fd 4

        def child():  # move the pipe ends to fds 3 and 4 (through fresh fds: they may collide)
            a = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        profile = Path(self._dir.name) / "profile"
        profile.mkdir()
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
                                      "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, close_fds=False,
                                     preexec_fn=child)  # noqa: PLW1509 (tests start no threads; only dup2 runs)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next = 0
        self.responses: dict[int, dict] = {}
        self.events: list[dict] = []

    # -- protocol ----------------------------------------------------------------------------
    def _pump(self, deadline: float) -> None:
        """Read what Chromium has written (waiting at most until ``deadline``)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise BrowserError("timed out waiting for Chromium")
        ready, _, _ = select.select([self._out_r], [], [], left)
        if not ready:
            raise BrowserError("timed out waiting for Chromium")
        chunk = os.read(self._out_r, 1 << 20)
        if not chunk:
            raise BrowserError(f"Chromium closed the pipe (exit {self.proc.poll()}); log: {self.log_tail()}")
        self._buf += chunk
        *msgs, self._buf = self._buf.split(b"\0")
        for m in msgs:
            msg = json.loads(m)
            if "id" in msg:
                self.responses[msg["id"]] = msg
            else:
                self.events.append(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while self._next not in self.responses:
            self._pump(deadline)
        r = self.responses.pop(self._next)
        if "error" in r:
            raise BrowserError(f"{method}: {r['error']}")
        return r.get("result", {})

    def wait_event(self, method: str, session: str | None = None, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        seen = 0
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method and (session is None or e.get("sessionId") == session):
                    return e
            seen = len(self.events)
            self._pump(deadline)

    def evaluate(self, session: str, expr: str):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                      session)
        if "exceptionDetails" in r:
            raise BrowserError(f"evaluate {expr[:60]!r}: {r['exceptionDetails'].get('text')} "
                               f"{r['exceptionDetails'].get('exception', {}).get('description', '')}")
        return r["result"].get("value")

    def log_tail(self) -> str:
        self._log.flush()
        return (Path(self._dir.name) / "stderr.log").read_bytes()[-2000:].decode(errors="replace")

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send("Browser.close", timeout=5)
                except (BrowserError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for fd in (self._cmd_w, self._out_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()
            self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# What the page reports about itself: panel boxes, canvas sizes and ink (non-transparent pixels, sampled).
_INSPECT = """(() => {
  const panels = {};
  document.querySelectorAll('[data-panel]').forEach(e => { const r = e.getBoundingClientRect();
    panels[e.dataset.panel] = [r.width, r.height]; });
  const canvases = [...document.querySelectorAll('canvas')].map(c => {
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let ink = 0;
    for (let i = 3; i < d.length; i += 4 * 5) if (d[i]) ink++;
    const r = c.getBoundingClientRect(); return {cls: c.className, plan: c.dataset.plan, w: r.width, h: r.height, ink}; });
  return {panels, canvases, rendered: window.attnplan ? window.attnplan.rendered : 0, title: document.title,
          scroll_width: document.documentElement.scrollWidth, viewport_width: window.innerWidth};
})()"""

# Client point of the middle of device 0's first compute span in the forward timeline of plan 0.
_TIMELINE_POINT = """(() => {
  const c = document.querySelector('canvas.timeline'); c.scrollIntoView({block: 'center'});
  const S = window.attnplan.data.plans[0].timeline.fwd.spans; let i = 0;
  while (i < S.dev.length && !(S.dev[i] === 0 && S.lane[i] === 0)) i++;
  const b = c.getBoundingClientRect(), g = c._geom, rowH = (c.clientHeight - 34) / window.attnplan.data.plans[0].devices;
  return {x: b.left + g.ox + (S.t0[i] + S.t1[i]) / 2 * g.sx, y: b.top + g.oy + 0.3 * rowH};
})()"""


def inspect_report(browser: Browser, url: str, screenshot: Path | None = None, width: int = 1400,
                   mask_point: tuple[int, int] | None = None) -> dict:
    """Open ``url`` in a new tab, let it render, hover the mask at token
    ``mask_point`` (q, k) and the first forward compute span, and return what
    the page shows: console errors, requests, panel and canvas sizes,
    tooltips; with ``screenshot``, write a full-page PNG there."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page", "Network"):
        browser.send(f"{domain}.enable", session=session)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)
    start = len(browser.events)
    nav = browser.send("Page.navigate", {"url": url}, session)
    if nav.get("errorText"):
        raise BrowserError(f"navigate {url}: {nav['errorText']}")
    browser.wait_event("Page.loadEventFired", session)
    out = browser.evaluate(session, _INSPECT)
    tips = {}
    if mask_point is not None:
        browser.evaluate(session, "document.querySelector('canvas.mask').scrollIntoView({block: 'center'})")
        pt = browser.evaluate(session, f"window.attnplan.maskPoint(0, {mask_point[0]}, {mask_point[1]})")
        browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": pt["x"], "y": pt["y"]}, session)
        tips["mask"] = browser.evaluate(session, "document.getElementById('tip').textContent")
        pt = browser.evaluate(session, _TIMELINE_POINT)
        browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": pt["x"], "y": pt["y"]}, session)
        tips["timeline"] = browser.evaluate(session, "document.getElementById('tip').textContent")
        browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": 0, "y": 0}, session)
        browser.evaluate(session, "window.scrollTo(0, 0)")
    out["tips"] = tips
    if screenshot is not None:
        size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        png = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                                       "clip": clip}, session)["data"])
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        Path(screenshot).write_bytes(png)
        out["screenshot"] = struct.unpack(">II", png[16:24]) if png[:8] == b"\x89PNG\r\n\x1a\n" else None
    ev = [e for e in browser.events[start:] if e.get("sessionId") == session]
    errors = []
    for e in ev:
        m, p = e["method"], e.get("params", {})
        if m == "Runtime.exceptionThrown":
            errors.append(p["exceptionDetails"].get("exception", {}).get("description") or p["exceptionDetails"]["text"])
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            errors.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                              for a in p.get("args", [])))
        elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
            errors.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
    out["errors"] = errors
    out["requests"] = [e["params"]["request"]["url"] for e in ev if e["method"] == "Network.requestWillBeSent"]
    browser.send("Target.closeTarget", {"targetId": target})
    return out


# -- tests ----------------------------------------------------------------------------------------

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                 reason=f"headless Chromium not found at {CHROMIUM} (Debian: apt-get install "
                                        f"chromium; .ci/run installs it; ATTNPLAN_CHROMIUM overrides the path)")]

PANELS = ("summary", "mask", "bars", "heatmap", "timeline", "explain")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    import attnplan
    from attnplan.backends.viz import render_compare_html, render_html

    d = tmp_path_factory.mktemp("browser")
    lens = [3000, 1500, 700, 300, 120, 64]
    a = attnplan.compile(seqlens=lens, mask="causal", devices=4, nodes=2, heads=4, kv_heads=2, head_dim=32,
                         block_size=256)
    b = attnplan.compile(seqlens=lens, mask="causal", devices=4, nodes=2, heads=4, kv_heads=2, head_dim=32,
                         block_size=512)
    single, compare = d / "report.html", d / "compare.html"
    single.write_text(render_html(a), encoding="utf-8")
    compare.write_text(render_compare_html([("block 256", a), ("block 512", b)]), encoding="utf-8")
    return single, compare, a


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def _check_page(r: dict, plans: int):
    assert r["errors"] == [], r["errors"]
    assert r["scroll_width"] <= r["viewport_width"], r  # nothing overflows sideways
    assert all(u.startswith(("file://", "data:")) for u in r["requests"]), r["requests"]
    for p in PANELS:
        w, h = r["panels"][p]
        assert w > 100 and h > 50, (p, w, h)
    kinds = {"mask": 1, "bar": 6, "heat": 1, "timeline": 2}
    for cls, per_plan in kinds.items():
        cs = [c for c in r["canvases"] if c["cls"] == cls]
        assert len(cs) == per_plan * plans, (cls, len(cs))
        for c in cs:
            assert c["w"] > 50 and c["h"] > 50, c
            assert c["ink"] > 100, c  # something was drawn
    assert r["rendered"] == sum(kinds.values()) * plans


def test_report_renders_in_chromium(reports, browser, tmp_path):
    shot = tmp_path / "report.png"
    r = inspect_report(browser, reports[0].as_uri(), screenshot=shot, mask_point=(2000, 100))
    _check_page(r, 1)
    # hovering a causal pair of the first document names its compute block, device, stage and pairs
    g, pl, sched = reports[2].ir.graph, reports[2].ir.placement, reports[2].ir.schedule
    qt, kt = (int(np.searchsorted(g.tb_start, t, "right") - 1) for t in (2000, 100))
    (cb,) = np.flatnonzero((g.cb_q == qt) & (g.cb_k == kt))
    tip = r["tips"]["mask"]
    assert tip.startswith(f"compute block c{cb} · device d{pl.cb_device[cb]} (node {pl.cb_device[cb] // 2}) · "
                          f"stage {sched.cb_stage[cb]}\n"), tip
    assert (f"q tb{qt} [{g.tb_start[qt]:,}, {g.tb_end[qt]:,}) × kv tb{kt} [{g.tb_start[kt]:,}, {g.tb_end[kt]:,})"
            in tip), tip
    assert f"pairs {g.cb_pairs[cb]:,} " in tip and "document #0 (3,000 tokens)" in tip, tip
    assert "on d0 · stage" in r["tips"]["timeline"], r["tips"]
    assert shot.stat().st_size > 20_000
    w, h = r["screenshot"]
    assert w == 1400 and h > 1500, r["screenshot"]  # the whole page, not just the viewport


def test_compare_renders_side_by_side(reports, browser):
    r = inspect_report(browser, reports[1].as_uri(), mask_point=(100, 2000))  # above the diagonal: masked
    _check_page(r, 2)
    assert "masked" in r["tips"]["mask"], r["tips"]
    masks = [c for c in r["canvases"] if c["cls"] == "mask"]
    assert masks[0]["w"] < 700 and abs(masks[0]["w"] - masks[1]["w"]) < 2  # two columns of equal width


def test_harness_sees_errors_and_requests(browser, tmp_path):
    """The checks above can fail: a console error, an exception and a network request are all reported."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><title>bad</title><img src='http://127.0.0.1:9/x.png'>"
                    "<script>console.error('boom'); null.x;</script>")
    r = inspect_report(browser, page.as_uri())
    assert any("boom" in e for e in r["errors"]), r["errors"]
    assert any("TypeError" in e for e in r["errors"]), r["errors"]
    assert "http://127.0.0.1:9/x.png" in r["requests"]


def test_browser_timeout_is_an_error(browser):
    """A protocol call that never answers fails within its deadline instead of hanging."""
    t0 = time.monotonic()
    with pytest.raises(BrowserError):
        browser.wait_event("Never.happens", timeout=0.5)
    assert time.monotonic() - t0 < 5


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="screenshot an attnplan HTML report with headless Chromium")
    ap.add_argument("report")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1400)
    args = ap.parse_args(argv)
    with Browser() as b:
        r = inspect_report(b, Path(args.report).resolve().as_uri(), Path(args.png), args.width)
    print(f"wrote {args.png}: {r['screenshot'][0]}x{r['screenshot'][1]} px; panels "
          + ", ".join(f"{k} {v[0]:.0f}x{v[1]:.0f}" for k, v in r["panels"].items())
          + f"; console errors: {len(r['errors'])}")
    for e in r["errors"]:
        print("  ", e)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
