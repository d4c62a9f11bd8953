"""A real headless Chromium driven over the DevTools protocol, on a pipe (``--remote-debugging-pipe``).

The browser reads commands from its file descriptor 3 and writes answers and events to 4, each message
JSON ending in a NUL byte; nothing here needs a WebDriver or a package beyond the standard library.
:func:`find_chromium` names Debian's ``chromium`` (``scripts/test`` installs it).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable on PATH, if any."""
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or a wait ran out."""


class Chromium:
    """One headless browser with one page (a tab) attached; use as a context manager."""

    def __init__(self, executable: str, *, width: int = 1366, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="dbqueue-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child_fds() -> None:  # runs in the child, before exec: the protocol's fds are 3 and 4
            r, w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--remote-debugging-pipe",
                "--no-sandbox",  # as root, Chromium's sandbox refuses to start
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,  # noqa: PLW1509 - only dup2 calls, before exec
            close_fds=False,
        )
        os.close(cmd_r)
        os.close(out_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.page("Page.enable")
        self.page("Runtime.enable")
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # -- the protocol ------------------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError("the browser did not answer in time")
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise BrowserError(f"the browser closed its pipe (exit status {self.proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params: Any) -> Any:
        """Send one command (to the browser, or to ``session``) and return its result."""
        self._next_id += 1
        ident = self._next_id
        msg: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") != ident:
                self.events.append(answer)
                continue
            if "error" in answer:
                raise BrowserError(f"{method}: {answer['error']}")
            return answer.get("result", {})

    def page(self, method: str, **params: Any) -> Any:
        """Send one command to the attached page."""
        return self.call(method, session=self.session, **params)

    # -- what a test does --------------------------------------------------------------------------------

    def set_cookie(self, url: str, name: str, value: str) -> None:
        self.page("Network.setCookie", url=url, name=name, value=value, path="/")

    def goto(self, url: str, timeout: float = 20.0) -> None:
        """Load ``url`` and wait until its document has loaded (its scripts have run)."""
        answer = self.page("Page.navigate", url=url)
        if answer.get("errorText"):
            raise BrowserError(f"{url}: {answer['errorText']}")
        self.wait_for(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'", timeout=timeout
        )

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.page("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll until the expression is truthy in the page; return its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise BrowserError(f"{expression!r} stayed {value!r} for {timeout}s")

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page."""
        data = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(BrowserError, OSError):
                    self.call("Browser.close", timeout=5)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for fd in (self._cmd_w, self._out_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
