"""Headless Chromium driven over the DevTools protocol on a pipe: open a page, run script in it,
send real mouse and keyboard input, take screenshots, and collect every script error.

The pipe (``--remote-debugging-pipe``: commands on fd 3, answers on fd 4, each a JSON message
ended by a NUL byte) needs no port, no websocket and nothing beyond the standard library.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--hide-scrollbars",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
]


WEBGL = ["--use-angle=swiftshader", "--enable-unsafe-swiftshader"]  # WebGL on the CPU, for pages that draw with it


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> None:
    """Skip the test calling this where Chromium is not installed, or fail it where CI asks for
    Chromium (``TORCHDELEGATE_REQUIRE_CHROMIUM``)."""
    import pytest

    if chromium_path() is None:
        if os.environ.get("TORCHDELEGATE_REQUIRE_CHROMIUM"):
            pytest.fail("Chromium is required here (TORCHDELEGATE_REQUIRE_CHROMIUM) but is not installed")
        pytest.skip("Chromium is not installed (apt-get install chromium)")


class ChromiumError(RuntimeError):
    pass


def _above_four(fd: int) -> int:
    """``fd`` moved to a number above 4, so that putting the pipes on 3 and 4 never overwrites one."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Chromium:
    """One headless browser with one page; ``errors`` holds every uncaught exception and console error."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 120.0, webgl: bool = False) -> None:
        path = chromium_path()
        if path is None:
            raise ChromiumError("Chromium is not installed")
        self.timeout = timeout
        self.profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        self._log = tempfile.TemporaryFile()
        commands_read, self._commands = (_above_four(fd) for fd in os.pipe())
        self._answers, answers_write = (_above_four(fd) for fd in os.pipe())
        flags = [*FLAGS, *WEBGL] if webgl else [*FLAGS, "--disable-gpu"]
        arguments = [*flags, "--remote-debugging-pipe", f"--user-data-dir={self.profile.name}", "about:blank"]
        # Chromium reads commands on fd 3 and answers on fd 4; bash puts the pipes there (dash: one digit only).
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{commands_read} 4>&{answers_write}', path, *arguments],
            pass_fds=(commands_read, answers_write),
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(commands_read)
        os.close(answers_write)
        self._buffer = b""
        self._next_id = 0
        self._loaded = False  # the page's load event has come since the last open()
        self.errors: list[str] = []
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise ChromiumError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self._event(answer)

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise ChromiumError("Chromium did not answer in time")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                self._log.seek(0)
                raise ChromiumError(f"Chromium closed the pipe: {self._log.read()[-3000:].decode(errors='replace')}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _event(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "?"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(params["entry"].get("text", "?"))
        self._loaded = self._loaded or method == "Page.loadEventFired"

    def open(self, page: Path | str, ready: str = "document.body.dataset.ready === '1'") -> float:
        """Load ``page`` (a file or a URL) and wait until ``ready`` is true; the seconds it took."""
        started = time.monotonic()
        self._loaded = False
        url = page.resolve().as_uri() if isinstance(page, Path) else page
        self.call("Page.navigate", session=True, url=url)
        deadline = started + self.timeout
        while not self._loaded:
            self._event(self._read(deadline))
        while not self.evaluate(f"Boolean({ready})"):
            if time.monotonic() > deadline:
                raise ChromiumError(f"{page}: never ready ({ready})")
            time.sleep(0.05)
        return time.monotonic() - started

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (a promise is awaited); a thrown error is a ChromiumError."""
        result = self.call(
            "Runtime.evaluate", session=True, expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise ChromiumError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def mouse(self, kind: str, x: float, y: float, **extra: Any) -> None:
        """A real input event: ``mouseMoved``, ``mousePressed``, ``mouseReleased`` or ``mouseWheel``."""
        self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y, **extra)

    def click(self, x: float, y: float) -> None:
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.mouse(kind, x, y, button="left", clickCount=1)

    def type_text(self, text: str) -> None:
        self.call("Input.insertText", session=True, text=text)

    def press(self, key: str) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", session=True, type=kind, key=key, code=key, windowsVirtualKeyCode=13)

    def screenshot(self, path: Path, selector: str | None = None) -> Path:
        """The page as it shows now, or only the element ``selector`` names (scrolled into view)."""
        params: dict[str, Any] = {"format": "png"}
        if selector is not None:
            self.evaluate(f"document.querySelector({json.dumps(selector)}).scrollIntoView()")
            box = self.evaluate(
                f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height, scale: 1}; })()"
            )
            params["clip"] = box
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, **params)["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except ChromiumError:
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        self.profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
