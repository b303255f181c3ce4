"""Open a page in a real headless Chromium, collect its errors and take a screenshot.

Drives Debian's `chromium` (installed by `make setup`) over the DevTools protocol on a
pipe (`--remote-debugging-pipe`: JSON messages ended by a NUL byte, read from fd 3 and
written to fd 4), so it needs no driver, no websocket library and no browser download.
Flags keep it offline and quiet: the network is closed here, and without them Chromium
waits on background connections.
"""

from __future__ import annotations

import base64
import contextlib
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

__all__ = ["PageResult", "find_chromium", "open_page"]

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageResult:
    errors: list[str] = field(default_factory=list)
    """Console errors, uncaught exceptions and error log entries."""
    requests: list[str] = field(default_factory=list)
    """Every URL the page asked for (the page itself included)."""
    value: Any = None
    """What `check` (a JavaScript expression) evaluated to."""
    screenshot: Path | None = None


class _Pipe:
    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int, read_fd: int) -> None:
        self.proc, self.write_fd, self.read_fd = proc, write_fd, read_fd
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self.read_fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.read_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe (exit {self.proc.poll()})")
                self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        data: dict[str, Any] = json.loads(message)
        return data

    def call(
        self, method: str, timeout: float = 30.0, session: str | None = None, **params: Any
    ) -> Any:
        self.next_id += 1
        request: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = session
        os.write(self.write_fd, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self._read(deadline)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if any(e.get("method") == method for e in self.events):
            return True
        while time.monotonic() < deadline:
            try:
                message = self._read(deadline)
            except TimeoutError:
                return False
            self.events.append(message)
            if message.get("method") == method:
                return True
        return False


def open_page(
    url: str,
    *,
    check: str = "true",
    screenshot: Path | None = None,
    width: int = 1200,
    settle_s: float = 1.0,
    timeout: float = 60.0,
    chromium: str | None = None,
) -> PageResult:
    """Load `url`, wait for its load event (+ `settle_s`), evaluate `check`, screenshot."""
    binary = chromium or find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium on PATH (make setup installs Debian's chromium)")
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    # Chromium puts a unix socket in TMPDIR, whose path may be at most 107 bytes: a
    # test's TMPDIR (its tmp_path, longer still under a pytest-xdist worker) is too
    # long, and Chromium aborts. Its profile and its TMPDIR are a short directory of /tmp.
    profile = tempfile.mkdtemp(prefix="scaletrain-chromium-", dir="/tmp")

    def child_fds() -> None:
        # Copies first: a pipe end may itself be fd 3 or 4. The copies are in order, so
        # the first is below the second and neither dup2 overwrites the other's source.
        a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
        for source, target in ((a, 3), (b, 4)):
            os.dup2(source, target)
            os.set_inheritable(target, True)

    proc = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},900", "about:blank"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=child_fds,
        close_fds=False,
        env={**os.environ, "TMPDIR": profile},
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    pipe = _Pipe(proc, to_chrome_w, from_chrome_r)
    result = PageResult()
    try:
        target = pipe.call("Target.createTarget", timeout=timeout, url="about:blank")["targetId"]
        session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.call("Page.navigate", session=session, url=url)
        if not pipe.wait_for("Page.loadEventFired", timeout):
            result.errors.append(f"the page did not finish loading in {timeout:.0f} s")
        time.sleep(settle_s)
        evaluated = pipe.call(
            "Runtime.evaluate",
            session=session,
            expression=check,
            returnByValue=True,
            awaitPromise=True,
            timeout=timeout,
        )
        if "exceptionDetails" in evaluated:
            result.errors.append(f"check raised: {evaluated['exceptionDetails']}")
        result.value = evaluated.get("result", {}).get("value")
        if screenshot is not None:
            height = pipe.call(
                "Runtime.evaluate",
                session=session,
                expression="document.documentElement.scrollHeight",
                returnByValue=True,
            )["result"]["value"]
            pipe.call(
                "Emulation.setDeviceMetricsOverride",
                session=session,
                width=width,
                height=int(height),
                deviceScaleFactor=1,
                mobile=False,
            )
            shot = pipe.call(
                "Page.captureScreenshot", session=session, format="png", timeout=timeout
            )
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            result.screenshot = screenshot
        for event in pipe.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = [a.get("value", a.get("description")) for a in params.get("args", [])]
                result.errors.append(f"console.error: {args}")
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                result.errors.append(
                    f"uncaught: {details.get('exception', {}).get('description', details)}"
                )
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                result.errors.append(
                    f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}"
                )
            elif method == "Network.requestWillBeSent":
                result.requests.append(params.get("request", {}).get("url", ""))
    finally:
        with contextlib.suppress(OSError):
            os.close(to_chrome_w)
        with contextlib.suppress(OSError):
            os.close(from_chrome_r)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return result
