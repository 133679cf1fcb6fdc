"""The code blocks of a Markdown page, read and run as a reader would run them, in order.

A page's blocks share one working directory and, for Python, one namespace, so a later block
uses what an earlier one made. What runs:

- ```` ```python ````: executed; what it prints is its output;
- ```` ```sh ````: one ``bash -euo pipefail`` script; its output is stdout and stderr as a
  terminal shows them. A ``pip install`` line is resolved in the clone as a dry run (CI installs
  the built wheel and its extras for real);
- ```` ```console ````: each ``$ `` line a command, the lines under it the output it must print.

A ```` ```text ```` block right after a ``python`` or ``sh`` block is the output that block must
print. Outputs are compared with measured quantities masked (durations, rates, speed-ups, tiny
errors). Blocks of other languages (``json``, ``toml``, ``text`` elsewhere) are data, and
```` ```{toctree} ```` and its kind are the site's directives: neither is an example.

Run as a script, this module executes one page and prints the outputs as JSON: a page runs in a
process of its own, as a reader's session would.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import traceback
import types
from dataclasses import asdict, dataclass
from pathlib import Path

EXECUTED = ("python", "sh", "console")
DATA = ("text", "json", "toml", "jinja", "")
_FENCE = re.compile(r"^```(\{[\w-]+\}|[\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MEASURED = [
    (re.compile(r"\b\d+(\.\d+)? ?(ms|s|µs)\b"), "<time>"),
    (re.compile(r"\b\d+(\.\d+)? tokens/s\b"), "<rate>"),
    (re.compile(r"\b\d+(\.\d+)? x\b"), "<ratio>"),
    (re.compile(r"\b\d+(\.\d+)?e-\d+\b"), "<small>"),
]


@dataclass
class Block:
    """One fenced block: its language, code, the line it starts on, and the output shown after it."""

    language: str
    code: str
    line: int
    shown: str | None = None


def page_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` in order; an output block is attached to the block it follows."""
    blocks: list[Block] = []
    end = 0
    for match in _FENCE.finditer(text):
        language, code = match.group(1), match.group(2)
        between = text[end : match.start()]
        follows = blocks[-1] if blocks and blocks[-1].language in ("python", "sh") and not between.strip() else None
        end = match.end()
        if language == "text" and follows is not None and follows.shown is None:
            follows.shown = code
            continue
        blocks.append(Block(language, code, text.count("\n", 0, match.start()) + 1))
    return blocks


def masked(output: str) -> str:
    """``output`` with what changes from run to run replaced, and trailing spaces dropped."""
    for pattern, name in _MEASURED:
        output = pattern.sub(name, output)
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


def console_steps(code: str) -> list[tuple[str, str]]:
    """A console block's ``(command, output shown)`` pairs."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return [(command, "\n".join(shown)) for command, shown in steps]


def installs_resolved(script: str) -> str:
    """``script`` with each ``pip install`` line made a dry run in the clone (``$TORCHDELEGATE_CLONE``):
    it resolves every requirement, extra and constraint it names, and installs nothing."""
    lines = []
    for line in script.splitlines():
        if line.startswith("pip install "):
            arguments = line.removeprefix("pip install ").split(" # ")[0].strip()
            line = f'(cd "$TORCHDELEGATE_CLONE" && python -m pip install --dry-run --quiet {arguments})'
        lines.append(line)
    return "\n".join(lines)


def _shell(command: str) -> str:
    returncode, printed = _in_own_group(["bash", "-euo", "pipefail", "-c", installs_resolved(command)])
    if returncode:
        raise RuntimeError(f"exit code {returncode}:\n{printed}")
    return printed


def _in_own_group(arguments: list[str]) -> tuple[int, str]:
    """Run ``arguments`` in a process group of its own, stdout and stderr together; whatever it
    started (a server an example runs in the background) is killed when it ends or times out."""
    process = subprocess.Popen(
        arguments, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        printed, _ = process.communicate(timeout=600)
        return process.returncode, printed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_page(page: Path) -> list[dict[str, object]]:
    """Run every executed block of ``page`` in order in this process and its working directory:
    per block, what it printed (console blocks: per command) or the error it raised."""
    reader = types.ModuleType("__main__")  # the page's own __main__: torch.export looks names up there
    reader.__file__ = str(page)
    sys.modules["__main__"] = reader
    namespace = reader.__dict__
    results: list[dict[str, object]] = []
    for block in page_blocks(page.read_text(encoding="utf-8")):
        if block.language not in EXECUTED:
            continue
        result: dict[str, object] = {"block": asdict(block)}
        try:
            if block.language == "python":
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(block.code, f"{page.name}:{block.line}", "exec"), namespace)
                result["printed"] = printed.getvalue()
            elif block.language == "sh":
                result["printed"] = _shell(block.code)
            else:
                result["printed"] = [_console(command) for command, _ in console_steps(block.code)]
        except Exception:
            result["error"] = traceback.format_exc(limit=8)
        results.append(result)
        if "error" in result:
            break
    return results


def _console(command: str) -> str:
    """What ``command`` prints, stdout and stderr as a terminal shows them, whatever its exit code."""
    return _in_own_group(["bash", "-c", installs_resolved(command)])[1]


if __name__ == "__main__":
    print(json.dumps(run_page(Path(sys.argv[1]))))
