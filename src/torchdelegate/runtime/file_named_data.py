"""Named data read from a program file: the ``NamedDataMap`` a loaded program's backends get.

Each key is a view of the mapped file, never a copy; a segment's checksum is checked on its first read
(``reading`` checks many on a thread while the backend starts on the views, and stops the block if one
fails). Pages a backend has made its own form of may be released, but never a state tensor's: those
may be written by the program's methods. Bytes a backend does not read (a machine-cache entry stands in
for them) are checked all the same, unless ``prepare`` recorded that it checked this very file unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from torchdelegate.cache.machine_cache import file_checked
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.serialize.reader import ProgramFile


class FileNamedDataMap(NamedDataMap):
    """Named data read from a program file: zero-copy views of the mapping, checked on first use."""

    def __init__(self, file: ProgramFile) -> None:
        super().__init__()
        self._file = file
        self._digests = {record.key: record.data for record in file.named_data}
        self._state_segments = frozenset(record.data for record in file.state if record.data is not None)

    def get_data(self, key: str) -> memoryview:
        return self._file.data(self.digest(key), f"named data {key!r}").toreadonly()

    def digest(self, key: str) -> str:
        digest = self._digests.get(key)
        if digest is None:
            raise KeyError(f"no named data {key!r} in {self._file.path} ({len(self._digests)} keys are stored)")
        return digest

    @contextlib.contextmanager
    def reading(self, keys: Iterable[str], *, unread: bool = False) -> Iterator[dict[str, memoryview]]:
        keys = list(keys)
        views = {key: self._file.data(self.digest(key), f"named data {key!r}", verify=False) for key in keys}
        failed: list[BaseException] = []

        def check() -> None:
            try:
                for key in keys:
                    digest = self.digest(key)
                    release = unread and digest not in self._state_segments  # state tensors may be written
                    self._file.data(digest, f"named data {key!r}", release=release)
            except BaseException as e:  # whatever stops the check stops the block: no unchecked bytes run
                failed.append(e)

        checking = threading.Thread(target=check, name="torchdelegate-checksums", daemon=True)
        checked_before = unread and file_checked(self._file.identity())  # by prepare: this very file, unchanged
        if not checked_before:
            checking.start()
        try:
            yield {key: view.toreadonly() for key, view in views.items()}
        finally:
            if not checked_before:
                checking.join()
            if failed:
                raise failed[0]

    def release_pages(self, key: str) -> None:
        digest = self._digests.get(key)
        if digest is not None and digest not in self._state_segments:  # state tensors may be written
            self._file.release_pages(digest)

    def keys(self) -> Iterator[str]:
        return iter(sorted(self._digests))

    def __contains__(self, key: object) -> bool:
        return key in self._digests

    def __len__(self) -> int:
        return len(self._digests)
