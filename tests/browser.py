"""A minimal headless-Chromium driver for tests: the Chrome DevTools Protocol over ``--remote-debugging-pipe``.

The pipe transport needs no websocket library: Chromium reads commands from file descriptor 3 and writes replies
and events to descriptor 4, each message one JSON object followed by a NUL byte.  The driver opens one page
target, collects console errors (``console.error``), uncaught exceptions and browser log errors (failed loads,
blocked resources), evaluates JavaScript and takes full-page screenshots.

    with Chromium() as browser:
        page = browser.open(Path("report.html"))
        page.evaluate("document.title"); page.screenshot(Path("report.png")); page.errors
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
_CHROME_READS_FD, _CHROME_WRITES_FD = 3, 4


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH (``$CHROMIUM`` first), or None."""
    explicit = os.environ.get("CHROMIUM")
    if explicit and shutil.which(explicit):
        return shutil.which(explicit)
    return next((shutil.which(name) for name in CHROMIUM_NAMES if shutil.which(name)), None)


class BrowserError(RuntimeError):
    """Chromium did not answer, exited, or returned a protocol error."""


@dataclass
class Page:
    """One attached page target."""

    browser: Chromium
    session_id: str
    errors: list[str] = field(default_factory=list)

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, session_id=self.session_id)

    def evaluate(self, expression: str) -> Any:
        """Value of a JavaScript expression (returned by value, so it must be JSON-serialisable)."""
        reply = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise BrowserError(f"JavaScript error in {expression!r}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page (beyond the viewport) to ``path``."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
        path.write_bytes(base64.b64decode(data["data"]))
        return path


class Chromium:
    """A headless Chromium process driven over the DevTools pipe.

    Args:
        binary: Browser executable (default :func:`find_chromium`).
        timeout: Seconds to wait for any single reply or event before giving up.
        window: Viewport ``(width, height)`` in CSS pixels.
    """

    def __init__(self, binary: str | None = None, *, timeout: float = 30.0, window: tuple[int, int] = (1200, 900)):
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise BrowserError(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}); run "
                               "scripts/install_chromium.sh")
        self.timeout = timeout
        self.window = window
        self._next_id = 0
        self._buffer = b""
        self._pending: list[dict] = []
        self._pages: dict[str, Page] = {}

    def __enter__(self) -> Chromium:
        self._profile = tempfile.TemporaryDirectory(prefix="raycurate-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def place_pipes() -> None:
            # Runs in the child before exec.  Move both pipe ends above 3/4 first so neither dup2 can clobber the
            # other; os.dup2 makes the targets inheritable, every other Python-made fd is close-on-exec.
            reads, writes = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(reads, _CHROME_READS_FD)
            os.dup2(writes, _CHROME_WRITES_FD)

        args = [self.binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--hide-scrollbars", "--mute-audio", f"--window-size={self.window[0]},{self.window[1]}",
                f"--user-data-dir={self._profile.name}", "about:blank"]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=place_pipes, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for fd in (self._to_chrome, self._from_chrome):
            os.close(fd)
        self._profile.cleanup()

    # ---------------------------------------------------------------------------------------- protocol

    def send(self, method: str, params: dict | None = None, *, session_id: str | None = None) -> dict:
        """Send one command and wait for its reply (events that arrive meanwhile are dispatched)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        reply = self._wait(lambda m: m.get("id") == message["id"], f"reply to {method}")
        if "error" in reply:
            raise BrowserError(f"{method} failed: {reply['error']}")
        return reply.get("result", {})

    def _wait(self, matches: Any, what: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for i, message in enumerate(self._pending):
                if matches(message):
                    return self._pending.pop(i)
            message = self._read(deadline, what)
            self._dispatch(message)
            self._pending.append(message)

    def _read(self, deadline: float, what: str) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"Chromium sent no {what} within {self.timeout:.0f} s")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed the DevTools pipe (exit code {self._process.poll()}) "
                                       f"while waiting for {what}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def _dispatch(self, message: dict) -> None:
        page = self._pages.get(message.get("sessionId", ""))
        if page is None:
            return
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            page.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text")
            page.errors.append(f"uncaught exception: {description}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            page.errors.append(f"log {entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())

    # ---------------------------------------------------------------------------------------- pages

    def open(self, path_or_url: str | Path) -> Page:
        """Open a new page, enable error reporting, load ``path_or_url`` and wait for its load event."""
        url = Path(path_or_url).resolve().as_uri() if isinstance(path_or_url, Path) else path_or_url
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self._pages[session] = page
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send("Page.navigate", {"url": url})
        self._wait(lambda m: m.get("sessionId") == session and m.get("method") == "Page.loadEventFired",
                   f"load event for {url}")
        return page

