"""Methods whose programs are equal, worked on once.

An LLM's ``decode`` is exported as its ``prefill`` is (one program, run a token at a time), so a
step that rewrites each method on its own (quantizing, decomposing) would do the same work twice
on equal graphs. Two programs are equal here when a backend could not tell them apart, as the
compile cache decides (``compile/key_form``: every node, the signature, the shape ranges), and
they hold the very same tensors. The step runs on the first method of each kind; the others get
a structural copy of its result: a graph of their own, its tensors shared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from torch.export import ExportedProgram

from torchdelegate.compile.key_form import Unkeyable, key_form
from torchdelegate.exported.programs import state_value
from torchdelegate.exported.structural_copy import copy_program


def first_equal(programs: Mapping[str, ExportedProgram], also: Mapping[str, Hashable] | None = None) -> dict[str, str]:
    """Each method, and the first method (in the mapping's order) whose program is equal to its
    own and whose ``also`` value (what else the step reads, per method) is the same; a method
    with no earlier equal is its own."""
    if len(programs) < 2:  # nothing to compare: no form is made
        return {method: method for method in programs}
    first: dict[tuple[Any, ...], str] = {}
    found = {}
    for method, program in programs.items():
        identity = _identity(program)
        if identity is None:
            found[method] = method
            continue
        extra = None if also is None else also[method]
        found[method] = first.setdefault((identity, extra), method)
    return found


def once_per_program(
    programs: Mapping[str, ExportedProgram],
    step: Callable[[str, ExportedProgram], ExportedProgram],
    also: Mapping[str, Hashable] | None = None,
) -> dict[str, ExportedProgram]:
    """``{method: step(method, program)}``, ``step`` run once per kind of equal programs
    (:func:`first_equal`), the other methods of a kind given a structural copy of its result."""
    first = first_equal(programs, also)
    done: dict[str, ExportedProgram] = {}
    for method, program in programs.items():
        source = first[method]
        done[method] = step(method, program) if source == method else copy_program(done[source])
    return done


def _identity(program: ExportedProgram) -> tuple[Any, ...] | None:
    """The program's form, rendered as text, and the ids of the tensors it holds (None: a program
    holding what the form does not cover, or cannot read, is never taken for another). Ids compare the programs
    passed in one call, and never reach a name or a file."""
    try:
        form = key_form(program)
    except Unkeyable:
        return None
    except Exception:  # a tensor subclass held in the graph whose bytes cannot be read (torchao's)
        return None
    tensors = tuple(
        (spec.target, id(state_value(program, spec.target)))
        for spec in program.graph_signature.input_specs
        if spec.target is not None
    )
    return (repr(form), tensors)
