"""A call's arguments bound the way the exported module binds them, whichever engine runs the method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchdelegate.errors import ProgramInputError


def bound_arguments(
    method: str,
    names: Sequence[str],
    positional_count: int,
    keyword_names: Sequence[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    signature: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` rearranged to the exported split between positional and keyword, by the
    forward's parameter ``names``; a ``ProgramInputError`` naming ``signature`` when they do not fit."""
    if len(args) > len(names):
        raise ProgramInputError(
            f"method {method!r} takes {len(names)} argument{'' if len(names) == 1 else 's'}, "
            f"got {len(args)} positional: {signature}"
        )
    bound = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in names:
            raise ProgramInputError(f"method {method!r} has no argument {key!r}: {signature}")
        if key in bound:
            raise ProgramInputError(f"method {method!r}: argument {key!r} given twice")
        bound[key] = value
    positional = list(names[:positional_count])
    missing = [n for n in [*positional, *keyword_names] if n not in bound]
    if missing:
        raise ProgramInputError(f"method {method!r}: missing argument {', '.join(map(repr, missing))}: {signature}")
    extra = [n for n in bound if n not in positional and n not in keyword_names]
    if extra:
        raise ProgramInputError(
            f"method {method!r}: argument {', '.join(map(repr, extra))} was not an input when the method was exported"
        )
    return tuple(bound[n] for n in positional), {k: bound[k] for k in keyword_names}
