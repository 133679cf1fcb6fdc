"""Where the store is and how much it may hold, from the environment (and the command's ``--cache``).

``TORCHDELEGATE_CACHE``, when set, names a directory (a relative path is taken from the current
directory) or an fsspec URL (``s3://bucket/cache``); ``off``, ``0``, ``no``, ``false`` or ``none`` turn
every cache off; unset, it is ``$XDG_CACHE_HOME/torchdelegate``, else ``~/.cache/torchdelegate``.
``TORCHDELEGATE_CACHE_MAX_BYTES`` bounds the store (16 GiB by default); no file of an entry larger than
twice the bound is read (:func:`read_cap`).
"""

from __future__ import annotations

import os

CACHE_VARIABLE = "TORCHDELEGATE_CACHE"
MAX_BYTES_VARIABLE = "TORCHDELEGATE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 16 << 30
_OFF = ("off", "0", "none", "false", "no")


def turned_off(value: str) -> bool:
    """Whether a cache setting (``TORCHDELEGATE_CACHE``, ``--cache``) turns the caches off."""
    return value.strip().lower() in _OFF


def default_location() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "torchdelegate")


def cache_location() -> str | None:
    """Where ``TORCHDELEGATE_CACHE`` puts the store (absolute, or a URL), or None when it turns it off."""
    chosen = os.environ.get(CACHE_VARIABLE, "").strip()
    if turned_off(chosen):
        return None
    return normalized(chosen) if chosen else default_location()


def normalized(location: str) -> str:
    """A local path made absolute (``~`` expanded); a URL as it is."""
    return location if "://" in location else os.path.abspath(os.path.expanduser(location))


def max_bytes_setting() -> int:
    """The store's bound: ``TORCHDELEGATE_CACHE_MAX_BYTES`` if set, else 16 GiB."""
    value = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        bound = int(value)
    except ValueError:
        bound = -1
    if bound < 0:
        raise ValueError(f"{MAX_BYTES_VARIABLE}={value!r}: give a number of bytes >= 0")
    return bound


def read_cap() -> int:
    """The most one file of an entry may hold to be read: twice the store's bound (an entry holds the
    weights beside their packed form), the default bound's if the setting is not a number."""
    try:
        return 2 * max_bytes_setting()
    except ValueError:
        return 2 * DEFAULT_MAX_BYTES
