"""A delegate's ``meta`` as ExecuTorch code reads it as well as ours: one value under two keys."""

from __future__ import annotations

from typing import Any

DELEGATE_INFO = "delegate_info"
EXECUTORCH_DELEGATE_INFO = "_delegate_info_meta"


class DelegateMeta(dict[str, Any]):
    """A delegate's ``meta``: a dict in which ExecuTorch's key for what the backend said of the delegate,
    ``"_delegate_info_meta"``, is another name for ours, ``"delegate_info"``.

    Code written for either reads, writes, tests and removes the one value through its own spelling;
    the value is stored once, under ``"delegate_info"`` (which is what iterating, ``len`` and a copy
    see), so the two can never disagree.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(_our_key(key))

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(_our_key(key), value)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(_our_key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_our_key(key) if isinstance(key, str) else key)

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(_our_key(key), default)

    def pop(self, key: str, *default: Any) -> Any:
        return super().pop(_our_key(key), *default)

    def setdefault(self, key: str, default: Any = None) -> Any:
        return super().setdefault(_our_key(key), default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def _our_key(key: str) -> str:
    return DELEGATE_INFO if key == EXECUTORCH_DELEGATE_INFO else key
