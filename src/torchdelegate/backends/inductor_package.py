"""An AOTInductor package as an ``inductor`` blob holds it, checked before anything of it is loaded.

Loading a package extracts its files and loads its library into the process, so a package from
elsewhere (a shared compile cache's entry) is checked for being one this backend makes: one folder
holding the package's markers and, per model, its library and the library's metadata, nothing
else (no links, no names reaching out of the folder, nothing past a size bound), every file whole
(CRC), each library a shared object for this machine's binary format and processor, and the
serialization id the digest of the rest, as ``_compact_package`` writes it (a package changed after
it was compiled no longer matches). These checks say that a blob is a package of the form we make;
whether its code is what its writer compiled is the trust the caller gives the backend.
"""

from __future__ import annotations

import hashlib
import io
import stat
import sys
import zipfile
import zlib
from functools import cache

from torchdelegate.errors import FormatError

SERIALIZATION_ID = "/.data/serialization_id"
_MARKERS = {"archive_format", "archive_version", "byteorder", ".data/version", SERIALIZATION_ID[1:]}
_MODEL_FOLDER = ("data", "aotinductor")
_MODEL_FILES = (".so", ".json")  # a model's library and its metadata
_MAX_BYTES = 1 << 32
_ELF, _MACH_O = b"\x7fELF", (b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe")
_ELF_SHARED_OBJECT = 3


def serialization_id(files: list[tuple[str, bytes]]) -> bytes:
    """The serialization id of a package of these files (name, bytes), in order: a digest of all but itself."""
    content = hashlib.sha256(b"".join(data for name, data in files if not name.endswith(SERIALIZATION_ID)))
    return str(int(content.hexdigest()[:32], 16)).encode()


def checked_package(package: memoryview) -> None:
    """A ``FormatError`` saying how ``package`` is not an AOTInductor package of the form this backend makes."""
    try:
        with zipfile.ZipFile(io.BytesIO(bytes(package))) as archive:
            members = archive.infolist()
            _check_members(members)
            files = [(member.filename, archive.read(member)) for member in members]  # each checked by its CRC
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        raise FormatError(f"inductor blob: its package is not a whole zip archive ({e})") from None
    libraries = [(name, data) for name, data in files if name.endswith(".so")]
    if not libraries:
        raise FormatError("inductor blob: its package holds no compiled library")
    for name, data in libraries:
        _check_library(name, data)
    identity = [data for name, data in files if name.endswith(SERIALIZATION_ID)]
    if identity != [serialization_id(files)]:
        raise FormatError(
            "inductor blob: its package's serialization id is not the digest of its contents (changed after it "
            "was compiled)"
        )


def _check_members(members: list[zipfile.ZipInfo]) -> None:
    """Every member a regular file of a package's form, under one folder, within the size bound."""
    folders = {member.filename.split("/", 1)[0] for member in members}
    if len(folders) != 1:
        raise FormatError(f"inductor blob: its package holds {len(folders)} top folders, not one")
    total = 0
    for member in members:
        name = member.filename
        parts = name.split("/")
        if "\\" in name or any(part in ("", ".", "..") for part in parts):
            raise FormatError(f"inductor blob: its package names {name!r:.120}, which reaches outside its folder")
        if stat.S_ISLNK(member.external_attr >> 16) or member.is_dir():
            raise FormatError(f"inductor blob: its package's {name!r:.120} is not a regular file")
        inner = "/".join(parts[1:])
        model_file = tuple(parts[1:3]) == _MODEL_FOLDER and len(parts) == 5 and parts[-1].endswith(_MODEL_FILES)
        if inner not in _MARKERS and not model_file:
            raise FormatError(f"inductor blob: its package holds {name!r:.120}, which no compiled package holds")
        total += member.file_size
    if total > _MAX_BYTES:
        raise FormatError(f"inductor blob: its package unpacks to {total} bytes, more than {_MAX_BYTES}")


def _check_library(name: str, data: bytes) -> None:
    """A library of this machine: an ELF shared object of this interpreter's class, byte order and
    processor (a Mach-O one of its processor on macOS)."""
    ours = _interpreter_header()
    if len(ours) < 20:
        return  # this interpreter's own format unknown: nothing to compare with
    if ours[:4] == _ELF:
        if data[:4] != _ELF or len(data) < 20:
            raise FormatError(f"inductor blob: its package's {name!r:.120} is not an ELF library")
        kind = int.from_bytes(data[16:18], "little" if data[5] == 1 else "big")
        if data[4:6] != ours[4:6] or data[18:20] != ours[18:20] or kind != _ELF_SHARED_OBJECT:
            raise FormatError(
                f"inductor blob: its package's {name!r:.120} is not a shared object for this machine (ELF class, "
                "byte order or processor differ, or it is not a shared object)"
            )
    elif ours[:4] in _MACH_O:
        if data[:8] != ours[:8]:
            raise FormatError(f"inductor blob: its package's {name!r:.120} is not a library for this processor")
    elif data[:4] != ours[:4]:
        raise FormatError(f"inductor blob: its package's {name!r:.120} is not of this machine's binary format")


@cache
def _interpreter_header() -> bytes:
    """The first bytes of this Python's own executable: the binary format and processor libraries must share."""
    try:
        with open(sys.executable, "rb") as executable:
            return executable.read(20)
    except OSError:
        return b""
