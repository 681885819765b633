"""A minimal Chrome DevTools Protocol client for the browser tests (Debian's chromium, headless).

Only what the tests need: start Chromium with a DevTools port on 127.0.0.1, open a page target,
call methods, evaluate JavaScript, click at an element's centre with real input events, and take
screenshots. No browser download (playwright cannot fetch one here): ``/usr/bin/chromium``.
"""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 120.0


class CdpError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with a DevTools port (``with Chromium(tmp, 1400, 900) as page: ...``)."""

    def __init__(self, profile_dir: Path, width: int = 1400, height: int = 900) -> None:
        if CHROMIUM is None:
            raise CdpError("chromium is not installed")
        self.profile_dir, self.width, self.height = Path(profile_dir), width, height
        self.proc: subprocess.Popen | None = None
        self.page: Page | None = None

    def __enter__(self) -> Page:
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.profile_dir / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-extensions", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile_dir}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise CdpError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                                    timeout=30).read())
        page = next(t for t in targets if t.get("type") == "page")
        self.page = Page(page["webSocketDebuggerUrl"])
        self.page.call("Page.enable")
        self.page.call("Runtime.enable")
        self.page.call("Emulation.setDeviceMetricsOverride", width=self.width,
                       height=self.height, deviceScaleFactor=1, mobile=False)
        # A headless page has no window focus until an input event gives it one, and until then
        # element.focus() fires no focus event: JupyterLab's shell, which tracks the current
        # widget by focus events, has none, so its notebook commands (Run All) are disabled.
        # The page behaves as a focused window, as it would for a person at a desktop.
        self.page.call("Emulation.setFocusEmulationEnabled", enabled=True)
        return self.page

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


class Page:
    """One page target's DevTools session."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self.next_id = 0

    def close(self) -> None:
        self.ws.close()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise CdpError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited; JSON-able values)."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise CdpError(f"JavaScript failed: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def goto(self, url: str, *, ready: str = "document.readyState === 'complete'",
             timeout_s: float = 60.0) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(ready, timeout_s=timeout_s, what=f"{url} to load")

    def wait_for(self, expression: str, *, timeout_s: float, what: str,
                 interval_s: float = 0.5) -> Any:
        """Poll ``expression`` until it is truthy; raise naming ``what`` on timeout."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.eval(expression)
            except CdpError as exc:  # page navigating: try again
                last = str(exc)
            if last and not isinstance(last, str):
                return last
            time.sleep(interval_s)
        raise CdpError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")

    def click(self, selector: str) -> None:
        """A real mouse click (DevTools input events) at the centre of ``selector``'s element."""
        rect = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                         f" if (!e) return null; e.scrollIntoView({{block: 'nearest'}});"
                         f" const r = e.getBoundingClientRect();"
                         f" return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }})()")
        if not rect:
            raise CdpError(f"no element {selector!r} to click")
        for kind, extra in (("mouseMoved", {}), ("mousePressed", {"button": "left", "clickCount": 1}),
                            ("mouseReleased", {"button": "left", "clickCount": 1})):
            self.call("Input.dispatchMouseEvent", type=kind, x=rect["x"], y=rect["y"], **extra)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path
