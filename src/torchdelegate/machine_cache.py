"""The machine cache: what a backend derives from a blob for this machine, kept between processes.

Some of the work a backend does when it loads a blob depends on the machine as well as the
blob (ONNX Runtime packs weights into the layout of this CPU's kernels), so lowering cannot
do it for every machine a file will run on, and the file cannot carry it without growing by
the weights' size. :meth:`Program.prepare` (``torchdelegate prepare FILE``) does that work
once on a machine and keeps the result here; a later load finds it by a key that covers the
blob's content, the backend runtime's version and this machine's CPU. Nothing is written here
unless asked.

The directory is ``TORCHDELEGATE_CACHE`` if set (``off``: no cache), else
``$XDG_CACHE_HOME/torchdelegate``, else ``~/.cache/torchdelegate``. An entry is a directory
under its kind, named by its key, with a manifest of its files and their sizes; it is written
whole beside its place and renamed into it, so a reader sees a whole entry or none. An entry
whose files do not match its manifest is not used. Entries are the user's own files, trusted
as the rest of their home directory is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

ENVIRONMENT = "TORCHDELEGATE_CACHE"
_OFF = ("off", "0", "none")
_MANIFEST = "manifest.json"
_FORMAT = 1


def cache_directory() -> Path | None:
    """Where entries live, or None when the cache is turned off."""
    chosen = os.environ.get(ENVIRONMENT)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF or not chosen.strip() else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchdelegate"


@cache
def machine_identity() -> dict[str, str]:
    """What a derived form may depend on besides its source: the architecture and the CPU's features."""
    features = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    features = " ".join(sorted(line.partition(":")[2].split()))
                    break
    features = features or platform.processor()
    return {"machine": platform.machine(), "cpu": hashlib.sha256(features.encode()).hexdigest()[:32]}


def entry_key(kind: str, content: dict[str, Any]) -> str:
    """The key of an entry derived from ``content`` (JSON values) on this machine."""
    described = {"format": _FORMAT, "kind": kind, "machine": machine_identity(), "content": content}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def entry_path(kind: str, key: str) -> Path:
    """Where the entry ``key`` of ``kind`` is (or would be); a ``ValueError`` when the cache is off."""
    root = cache_directory()
    if root is None:
        value = os.environ.get(ENVIRONMENT)
        raise ValueError(f"the machine cache is off ({ENVIRONMENT}={value!r}): set it to a directory to keep entries")
    return root / kind / key


def find_entry(kind: str, key: str) -> Path | None:
    """The directory of a whole entry, or None: absent, cache off, or not what its manifest says (a warning)."""
    if cache_directory() is None:
        return None
    place = entry_path(kind, key)
    if not place.exists():
        return None
    why = _unusable(place)
    if why is not None:
        warnings.warn(
            f"the machine cache entry {place} is not used: {why}; `torchdelegate prepare FILE` writes it again",
            stacklevel=2,
        )
        return None
    return place


def _unusable(place: Path) -> str | None:
    """Why an entry's directory cannot be used, or None."""
    try:
        manifest = json.loads((place / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return "its manifest lists no files"
    for name, size in sorted(files.items()):
        path = place / name
        if os.path.basename(name) != name or not path.is_file() or path.stat().st_size != size:
            return f"{name!r} is missing or not {size} bytes"
    return None


@contextlib.contextmanager
def new_entry(kind: str, key: str) -> Iterator[Path]:
    """A fresh directory to write an entry's files into; at the block's end the entry takes its place.

    If the block fails, or another process put the entry in place first, nothing is left behind.
    """
    place = entry_path(kind, key)
    place.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", suffix=".partial", dir=place.parent))
    try:
        yield scratch
        files = {path.name: path.stat().st_size for path in sorted(scratch.iterdir()) if path.is_file()}
        (scratch / _MANIFEST).write_text(json.dumps({"files": files}, sort_keys=True), encoding="utf-8")
        if place.exists():
            if _unusable(place) is None:  # another process was first
                return
            shutil.rmtree(place, ignore_errors=True)
        try:
            os.rename(scratch, place)
        except OSError:
            if not place.exists() or _unusable(place) is not None:
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def entry_size(place: Path) -> int:
    """The bytes an entry's files take."""
    return sum(path.stat().st_size for path in place.iterdir() if path.is_file())
