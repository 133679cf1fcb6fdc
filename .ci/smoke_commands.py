"""The installed ``torchdelegate`` command as the smoke tests call it, importing nothing but the
standard library: shared by smoke.py (torch installed) and smoke_runtime.py (torch not installed).
Both run in the directory the files are written to, with the environment's interpreter."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import IO

HERE = Path.cwd()
COMMAND = str(Path(sys.executable).parent / "torchdelegate")


def command(*args: str, stdin: str | None = None) -> str:
    """What ``torchdelegate ARGS`` printed on stdout; an AssertionError with all it printed if it failed."""
    done = subprocess.run([COMMAND, *args], input=stdin, capture_output=True, text=True, timeout=600, cwd=HERE)
    assert done.returncode == 0, f"torchdelegate {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
    print(f"torchdelegate {' '.join(args)}: ok")
    return done.stdout


def refused(*args: str) -> str:
    """The one line ``torchdelegate ARGS`` printed on stderr as it failed; an AssertionError if it
    succeeded or printed more (a traceback)."""
    done = subprocess.run([COMMAND, *args], capture_output=True, text=True, timeout=600, cwd=HERE)
    said = done.stderr.strip()
    assert done.returncode != 0, f"torchdelegate {' '.join(args)} succeeded:\n{done.stdout}"
    assert said and "\n" not in said, f"torchdelegate {' '.join(args)}: not one line on stderr:\n{done.stderr}"
    print(f"torchdelegate {' '.join(args)}: refused: {said}")
    return said


def serve(file: str) -> None:
    """``llm serve FILE``: it answers /health and a completion, and stops on SIGTERM."""
    server = subprocess.Popen(
        [COMMAND, "llm", "serve", file, "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=HERE
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_into, args=(server.stdout, lines), daemon=True).start()
        line = ""
        while not line.startswith("serving "):
            line = lines.get(timeout=120)  # queue.Empty: the server never said it serves
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        assert found, line
        with urllib.request.urlopen(f"{found.group(1)}/health", timeout=30) as answer:
            assert answer.status == 200
        body = b'{"model": "demo", "prompt": "The teacher said", "max_tokens": 4, "temperature": 0}'
        asked = urllib.request.Request(f"{found.group(1)}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(asked, timeout=60) as answer:
            assert b'"text_completion"' in answer.read()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        print(f"serve {file}: answered /health and a completion, stopped on SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()


def _read_into(stream: IO[str] | None, lines: queue.Queue[str]) -> None:
    for line in stream or []:
        lines.put(line)
