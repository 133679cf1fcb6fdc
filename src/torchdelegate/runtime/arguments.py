"""A call's arguments bound the way the exported module binds them, and a tensor's sizes checked against
the export's, whichever engine runs the method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Dim:
    """One size of a tensor input: a fixed value, or a symbol with its range (None: unchecked)."""

    value: int | None
    symbol: str | None = None
    lower: int | None = None
    upper: int | None = None


def sizes_text(dims: Sequence[Dim]) -> str:
    """``1, s0, 8``: each fixed size, or the symbol of one the export let vary (for signatures)."""
    return ", ".join(str(d.value) if d.value is not None else str(d.symbol) for d in dims)


def dim_of(size: int | str | None, ranges: Mapping[str, tuple[int | None, int | None]]) -> Dim:
    """The size a graph records (an int, a symbol's name, None for a derived one such as 2*s0, which
    the symbols guarantee) with its symbol's range."""
    if isinstance(size, int) or size is None:
        return Dim(size)
    lower, upper = ranges.get(size, (None, None))
    return Dim(None, size, lower, upper)


def check_sizes(
    where: str, name: str, shape: Sequence[int], dims: Sequence[Dim], sizes: dict[str, tuple[int, str]]
) -> None:
    """A ``ProgramInputError`` naming ``where`` unless ``shape`` (of input ``name``) has the export's rank,
    static sizes, ranges, and the sizes ``sizes`` recorded for the same symbols earlier in the call."""
    if len(shape) != len(dims):
        raise ProgramInputError(f"{where} must have {len(dims)} dimensions, got {len(shape)} (shape {tuple(shape)})")
    for axis, (size, dim) in enumerate(zip(shape, dims, strict=True)):
        if dim.value is not None:
            if size != dim.value:
                raise ProgramInputError(
                    f"{where}: dimension {axis} must be {dim.value} (static when exported), got {size}"
                )
            continue
        if dim.symbol is None:
            continue
        if (dim.lower is not None and size < dim.lower) or (dim.upper is not None and size > dim.upper):
            upper = "inf" if dim.upper is None else dim.upper
            raise ProgramInputError(
                f"{where}: dimension {axis} is {size}, outside the range [{dim.lower}, {upper}] exported for it"
            )
        seen = sizes.setdefault(dim.symbol, (size, f"{name!r} dimension {axis}"))
        if seen[0] != size:
            raise ProgramInputError(f"{where}: dimension {axis} is {size} but must equal {seen[1]}, which is {seen[0]}")
