"""Who wrote a cache entry: entries signed with a key the team shares, and where unsigned ones may be used.

A cache is written by whoever can write where it is, and an entry decides what a lowering compiles
or a load runs. With a key (``TORCHDELEGATE_CACHE_KEY``, or the file ``TORCHDELEGATE_CACHE_KEY_FILE``
names), every entry this process writes is signed (HMAC-SHA256 over the digest of its contents), and
an entry is used only when it carries a signature made with that key. Without a key, entries are
unsigned, and used only where this user alone can write: a local directory owned by the user that
neither its group nor others can write, in parents that others cannot rename it out of (the default
``~/.cache/torchdelegate`` is made so). At an fsspec URL, whose writers this process cannot see,
entries without a key are used as written by the user alone, with one warning per process: a shared
location without a key is for a single writer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

KEY_VARIABLE = "TORCHDELEGATE_CACHE_KEY"
KEY_FILE_VARIABLE = "TORCHDELEGATE_CACHE_KEY_FILE"
UNSIGNED = bytes(32)
"""The signature field of an entry written without a key."""
_MIN_KEY_BYTES = 16
_MAX_KEY_FILE_BYTES = 4096
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"
_warned_locations: set[str] = set()


def configured_key() -> bytes | None:
    """The team's key: ``TORCHDELEGATE_CACHE_KEY``'s text, or the contents of the file
    ``TORCHDELEGATE_CACHE_KEY_FILE`` names (surrounding white space left out); None when neither is
    set. A ``ValueError`` when both are, or the key is too short to keep a secret."""
    text = os.environ.get(KEY_VARIABLE, "").strip()
    file_name = os.environ.get(KEY_FILE_VARIABLE, "").strip()
    if text and file_name:
        raise ValueError(f"set {KEY_VARIABLE} or {KEY_FILE_VARIABLE}, not both: they are one key")
    if file_name:
        key, where = _key_file(Path(file_name).expanduser()), f"{KEY_FILE_VARIABLE}={file_name!r}"
    elif text:
        key, where = text.encode(), KEY_VARIABLE
    else:
        return None
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(
            f"{where}: the cache key has {len(key)} bytes; give at least {_MIN_KEY_BYTES} (a random one: {_MAKE_KEY})"
        )
    return key


def _key_file(path: Path) -> bytes:
    """A key file's key: a small regular file, read whole."""
    try:
        with open(path, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ValueError(f"{KEY_FILE_VARIABLE}: {path} is not a regular file")
            data = file.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{KEY_FILE_VARIABLE}: {path} cannot be read ({e.strerror or e})") from e
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ValueError(f"{KEY_FILE_VARIABLE}: {path} holds more than {_MAX_KEY_FILE_BYTES} bytes; is it a key?")
    return data.strip()


def others_can_write(location: str) -> str | None:
    """Why users other than this one could change what is at ``location`` (a local directory, or a URL),
    or None when only this user (or the system's administrator) can."""
    if "://" in location and not location.startswith("file://"):
        return f"{location} is at a URL, whose writers this process cannot see"
    place = Path(location.removeprefix("file://"))
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is None:
        return None  # no owners to compare (Windows): the user's own profile is taken as theirs
    for index, folder in enumerate((place, *place.parents)):
        try:
            status = folder.stat()
        except OSError:
            continue  # not made yet: whoever makes it makes it user-only
        if status.st_uid not in (uid, 0):
            return f"{folder} belongs to another user (uid {status.st_uid})"
        writable = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and (index == 0 or not status.st_mode & stat.S_ISVTX):
            return f"{folder} can be written by its group or by others (mode {stat.filemode(status.st_mode)})"
    return None


@dataclass(frozen=True)
class EntrySigner:
    """How entries at one location are signed and checked: with ``key``, or unsigned; ``unsigned_refused``
    says why unsigned entries are not used there (None: they are)."""

    location: str
    key: bytes | None
    unsigned_refused: str | None

    def signature(self, kind: str, digest: bytes) -> bytes:
        """The signature of an entry of ``kind`` whose contents have this SHA-256 (``UNSIGNED`` without a key)."""
        if self.key is None:
            return UNSIGNED
        return hmac.new(
            self.key, b"torchdelegate cache entry\0" + kind.encode() + b"\0" + digest, hashlib.sha256
        ).digest()

    def problem(self, kind: str, digest: bytes, signature: bytes) -> str | None:
        """Why an entry with this digest and signature is not to be used here, or None."""
        if self.key is None:
            return self.unsigned_refused
        if hmac.compare_digest(signature, UNSIGNED):
            return "it is not signed (written without a key, or by an older torchdelegate)"
        if not hmac.compare_digest(signature, self.signature(kind, digest)):
            return "its signature is not made with this key (another key, or changed since it was signed)"
        return None

    def advice(self) -> str:
        """What to do about entries refused for their signature."""
        if self.key is None:
            return (
                f"To share a cache, give every writer the same key: {KEY_VARIABLE} (or {KEY_FILE_VARIABLE}, a file "
                f"holding it; a random one: {_MAKE_KEY}); or keep the cache where only you can write "
                f"(chmod go-w {self.location})"
            )
        return (
            f"Entries are written again, signed with this key; give every writer of {self.location} the same "
            f"{KEY_VARIABLE} (or {KEY_FILE_VARIABLE})"
        )


def signer_for(location: str) -> EntrySigner:
    """The signer of entries at ``location``: the configured key, and the location's writers when there is none
    (at a URL, a warning once per process that unsigned entries there are taken as the user's own)."""
    key = configured_key()
    if key is not None:
        return EntrySigner(location, key, None)
    why = others_can_write(location)
    if why is None:
        return EntrySigner(location, None, None)
    if "://" in location and not location.startswith("file://"):
        if location not in _warned_locations:
            _warned_locations.add(location)
            warnings.warn(
                f"cache at {location}: no {KEY_VARIABLE} is set, so its entries are used unsigned, as written by "
                f"you alone; anyone who can write there decides what your lowerings compute. A shared location "
                f"without a key is for a single writer: set {KEY_VARIABLE} (or {KEY_FILE_VARIABLE}) to a key your "
                "team shares",
                stacklevel=3,
            )
        return EntrySigner(location, None, None)
    return EntrySigner(location, None, f"{why}, and no {KEY_VARIABLE} is set to tell its writers apart")
