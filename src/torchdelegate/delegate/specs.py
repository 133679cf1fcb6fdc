"""What a partitioner asks of a backend: its id and the options it is compiled with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileSpec:
    """One backend option: a key and an opaque value the backend decodes itself."""

    key: str
    value: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.key, str):
            raise TypeError(f"CompileSpec key must be a str, got {type(self.key).__name__}")
        if not isinstance(self.value, bytes):
            raise TypeError(
                f"CompileSpec {self.key!r}: value must be bytes, got "
                f"{type(self.value).__name__}; encode it, e.g. str(x).encode()"
            )


@dataclass(frozen=True)
class DelegationSpec:
    """Which backend a partition goes to, and with which compile specs."""

    backend_id: str
    compile_specs: Sequence[CompileSpec] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.backend_id, str) or not self.backend_id:
            raise TypeError(f"DelegationSpec backend_id must be a non-empty str, got {self.backend_id!r}")
        specs = tuple(self.compile_specs)
        for spec in specs:
            if not isinstance(spec, CompileSpec):
                raise TypeError(
                    f"DelegationSpec({self.backend_id!r}): compile_specs must hold CompileSpec, "
                    f"got {type(spec).__name__}"
                )
        object.__setattr__(self, "compile_specs", specs)
