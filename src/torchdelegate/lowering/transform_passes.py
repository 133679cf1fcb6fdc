"""Transforms on a manager's methods (``EdgeProgramManager.transform``): passes run on a private copy.

A pass is a callable on an ExportedProgram (returning a new one, or None after editing the one
given) or a torch.fx ``PassBase`` run on its graph. The caller's program is never edited; a program
a pass edited in place is verified again, and a pass that broke it, or returned something else, is
named with the method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from torch.export import ExportedProgram
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from torchdelegate.errors import first_line
from torchdelegate.exported.structural_copy import copy_program, rebuilt

Pass = Callable[[ExportedProgram], ExportedProgram | None] | PassBase
"""A transform: a callable on an ExportedProgram (returning a new one, or None after editing
the one given, which is always a private copy), or a torch.fx PassBase run on its graph."""


def run_passes(method: str, program: ExportedProgram, passes: Sequence[Pass]) -> ExportedProgram:
    current = copy_program(program)
    for transform in passes:
        name = getattr(transform, "__name__", type(transform).__name__)
        if isinstance(transform, type) and issubclass(transform, PassBase):
            raise TypeError(f"transform: got the class {name}; pass an instance: {name}()")
        if isinstance(transform, PassBase):
            result = transform(current.graph_module)
            graph_module = result.graph_module if isinstance(result, PassResult) else current.graph_module
            current = _rebuilt_after(name, method, current, graph_module)
            continue
        if not callable(transform):
            raise TypeError(f"transform: {name} is not callable; a pass takes an ExportedProgram")
        returned = cast(Callable[[ExportedProgram], Any], transform)(current)
        if returned is None or returned is current:
            current = _rebuilt_after(name, method, current, current.graph_module)
        elif isinstance(returned, ExportedProgram):
            current = copy_program(returned) if returned is program else returned
        else:
            raise TypeError(
                f"transform: pass {name} returned {type(returned).__name__} for method {method!r}; "
                "return an ExportedProgram, or None after editing the one given"
            )
    return current


def _rebuilt_after(name: str, method: str, program: ExportedProgram, graph_module: GraphModule) -> ExportedProgram:
    """The program a pass edited in place, verified again; a pass that broke it is named."""
    try:
        graph_module.recompile()
        return rebuilt(program, graph_module)
    except Exception as e:
        raise ValueError(
            f"transform: pass {name} made method {method!r} an invalid program ({type(e).__name__}: {first_line(e)}); "
            "a pass must leave a graph torch.export accepts"
        ) from e
