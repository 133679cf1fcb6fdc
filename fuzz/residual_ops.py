"""Fuzz the operators a saved graph may call: no crash, and no output that depends on memory
outside the inputs.

Each input is a small graph: up to three calls of operators from the allow-list, each with
arguments built from the operator's schema, hostile ones included (negative, huge and boundary
sizes, NaN and infinities, sizes and strides that do not fit), a call's tensors taken from the
graph's inputs or from earlier calls. Each operator is called as a loaded graph calls it: through
``allowed_call_target`` and behind its argument contract and the check that its tensors are given (``checked_call``).

Every input tensor is a view into the middle of a larger buffer. The graph runs twice, with the
memory around the inputs filled with two different patterns: a kernel that reads past its inputs
gives different outputs, which fails the input. A kernel's own refusal (any exception) is fine.

    python fuzz/residual_ops.py --seed-corpus fuzz/corpus_residual --runs 500           # inputs to start from
    python fuzz/residual_ops.py fuzz/corpus_residual -max_total_time=600 -max_len=256 -len_control=0   # atheris
    python fuzz/residual_ops.py --runs 2000 --seed 0                                 # seeded, no atheris

``check_one`` is what tests/serialize/test_residual_ops_fuzz.py runs, in a subprocess.
"""

from __future__ import annotations

# coverage feedback for the fuzzer (not for seeded runs or writing seeds)
if __name__ == "__main__" and not {"--runs", "--seed-corpus"} & set(__import__("sys").argv):  # noqa: E501
    import atheris

    with atheris.instrument_imports(include=["torchdelegate"]):
        import torchdelegate  # noqa: F401

import argparse
import hashlib
import math
import random
import resource
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchdelegate.exported.freed_memory import return_freed_memory
from torchdelegate.serialize.allow_list import allowed_call_target
from torchdelegate.serialize.node_checks import checked_call, tensor_arguments
from torchdelegate.serialize.operator_list import ATEN_OPERATORS

OPERATORS = [
    op
    for entry in sorted(ATEN_OPERATORS)
    if allowed_call_target(op := getattr(getattr(torch.ops.aten, entry.split(".")[0]), entry.split(".")[1]))
]
_INTS = (-(2**63), -(2**31), -65536, -2, -1, 0, 0, 1, 1, 2, 2, 3, 4, 7, 64, 65536, 2**31 - 1, 2**62)
_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e30, -1e-30)
_DTYPES = (
    torch.float32,
    torch.float32,
    torch.int64,
    torch.bool,
    torch.float64,
    torch.int32,
    torch.uint8,
    torch.complex64,
)
_STRINGS = ("none", "mean", "sum", "prod", "amax", "amin", "tanh", "left", "right", "floor", "trunc", "reflect", "")
_GUARD = 4096  # elements around each input
_PATTERNS = (0x5A, 0xA5)
_SAMPLED = 1 << 22  # elements compared whole
OUTCOMES: Counter[str] = Counter()
VERBOSE = False  # each graph on standard error before it runs (--verbose): the last one names a crash


class ReadOutside(AssertionError):
    """An operator's output changed with the memory around its inputs."""


class Draws:
    """Choices made from an input: its bytes seed a generator, so that any input, however short, is a
    whole graph, and the same input is the same graph. (torch's kernels are not instrumented: coverage
    tells the fuzzer little, and the inputs it keeps are few and short.)"""

    def __init__(self, data: bytes) -> None:
        self.generator = random.Random(hashlib.sha256(data).digest())

    def byte(self) -> int:
        return self.generator.randrange(256)

    def pick(self, options: Any) -> Any:
        return options[self.byte() % len(options)]

    def chance(self, out_of_256: int) -> bool:
        return self.byte() < out_of_256


def _tensor_spec(draws: Draws) -> tuple[torch.dtype, list[int], list[float]]:
    shape = [draws.byte() % 6 for _ in range(draws.byte() % 5)]
    count = math.prod(shape)
    return draws.pick(_DTYPES), shape, [float(draws.byte() % 17 - 8) for _ in range(count)]


def _placed(spec: tuple[torch.dtype, list[int], list[float]], pattern: int, guards: list[torch.Tensor]) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view into the middle of a buffer filled with ``pattern``;
    the buffer's guard regions, before and after it, added to ``guards``."""
    dtype, shape, values = spec
    count = len(values)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.full(((2 * _GUARD + count) * item,), pattern, dtype=torch.uint8)
    guards += [raw[: _GUARD * item], raw[(_GUARD + count) * item :]]
    buffer = raw.view(dtype)
    middle = buffer[_GUARD : _GUARD + count]
    middle.copy_(torch.tensor(values, dtype=torch.float64).to(dtype) if count else middle)
    return middle.view(shape)


def _tensor_reference(draws: Draws, produced: list[int]) -> tuple[str, int | None, int]:
    """An earlier call's output (an item of it, when it is a tuple), or a new input tensor."""
    return ("tensor", draws.pick(produced), draws.byte() % 4) if produced and draws.chance(160) else ("new", None, 0)


def _value(kind: str, name: str, draws: Draws, produced: list[int]) -> Any:
    if kind.startswith("Optional[") and kind.endswith("]"):
        return None if draws.chance(64) else _value(kind[len("Optional[") : -1], name, draws, produced)
    if name in ("dtype", "out_dtype") or kind == "ScalarType":
        return draws.pick(_DTYPES)
    if name in ("layout", "device", "memory_format", "pin_memory", "generator"):
        return None  # their defaults: strided, the CPU, contiguous
    if kind.startswith("List[") and kind.endswith("]"):
        inner = kind[len("List[") : -1]
        return [_value(inner, name, draws, produced) for _ in range(draws.byte() % (3 if "Tensor" in inner else 5))]
    if kind == "Tensor":
        return _tensor_reference(draws, produced)
    if kind in ("int", "SymInt"):
        return draws.pick(_INTS) if draws.chance(96) else draws.byte() % 8 - 2
    if kind == "float":
        return draws.pick(_FLOATS)
    if kind == "bool":
        return draws.chance(128)
    if kind in ("number", "Scalar"):
        return draws.pick(_FLOATS) if draws.chance(128) else draws.pick(_INTS)
    if kind == "str":
        return draws.pick(_STRINGS)
    return None


def _graph(draws: Draws) -> list[tuple[Any, list[Any], dict[str, Any]]]:
    calls = []
    produced: list[int] = []
    for _ in range(1 + draws.byte() % 3):
        op = draws.pick(OPERATORS)
        args, kwargs = [], {}
        for argument in op._schema.arguments:
            if argument.kwarg_only and argument.has_default_value() and draws.chance(180):
                continue
            value = _value(str(argument.type), argument.name, draws, produced)
            if argument.kwarg_only:
                kwargs[argument.name] = value
            else:
                args.append(value)
        calls.append((op, args, kwargs))
        produced.append(len(calls) - 1)
    return calls


def _run(
    calls: list[tuple[Any, list[Any], dict[str, Any]]], specs: list[Any], pattern: int
) -> list[Any] | BaseException:
    made = iter(specs)
    outputs: list[Any] = []
    guards: list[torch.Tensor] = []

    def resolved(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
            earlier = outputs[value[1]]
            return earlier[value[2] % len(earlier)] if isinstance(earlier, (tuple, list)) and earlier else earlier
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "new":
            return _placed(next(made), pattern, guards)
        if isinstance(value, list):
            return [resolved(v) for v in value]
        return value

    torch.manual_seed(0)
    try:
        for op, args, kwargs in calls:
            call = checked_call(op, tensor_arguments(op))  # as a graph calls it on values read from tuples
            outputs.append(call(*resolved(args), **{k: resolved(v) for k, v in kwargs.items()}))
    except Exception as error:  # a kernel's or a contract's refusal
        outputs = error  # type: ignore[assignment]
    if any(bool((guard != pattern).any()) for guard in guards):
        raise ReadOutside(f"{calls!r}: wrote into the memory around its inputs")
    return outputs


def _tensor_specs(calls: list[Any], draws: Draws) -> list[Any]:
    count = 0

    def visit(value: Any) -> None:
        nonlocal count
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "new":
            count += 1
        elif isinstance(value, list):
            for v in value:
                visit(v)

    for _, args, kwargs in calls:
        visit(args)
        visit(list(kwargs.values()))
    return [_tensor_spec(draws) for _ in range(count)]


def _same(first: Any, second: Any) -> bool:
    """Bit for bit: the same graph on the same inputs, one thread, one seed."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if first.dtype != second.dtype or tuple(first.shape) != tuple(second.shape):
            return False
        return first.numel() == 0 or torch.equal(_bits(first), _bits(second))
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    return type(first) is type(second) and (first == second or repr(first) == repr(second))  # NaN, complex NaN


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, strides 1; for a view of more elements than memory holds (an expanded
    one), the bytes of 4,096 elements spread over it."""
    tensor = tensor.detach()
    if tensor.numel() > _SAMPLED:
        picks = torch.linspace(0, tensor.numel() - 1, 4096, dtype=torch.float64).to(torch.int64)
        tensor = torch.stack([tensor[torch.unravel_index(pick, tensor.shape)] for pick in picks])
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return torch.view_as_real(flat).reshape(-1).view(torch.uint8) if flat.is_complex() else flat.view(torch.uint8)


def _invalid(outputs: Any) -> str | None:
    """What is wrong with a tensor a kernel made, if anything: sizes no tensor may have."""
    if isinstance(outputs, torch.Tensor):
        return f"a tensor of sizes {list(outputs.shape)}" if any(s < 0 for s in outputs.shape) else None
    if isinstance(outputs, (list, tuple)):
        return next((found for output in outputs if (found := _invalid(output))), None)
    return None


def _out_of_memory(outcome: Any) -> bool:
    return isinstance(outcome, MemoryError) or (
        isinstance(outcome, RuntimeError) and "can't allocate memory" in str(outcome)
    )


def check_one(data: bytes) -> str:
    """Run the graph ``data`` describes twice, with different memory around its inputs: the outcome
    ("ran" or "refused"), or :class:`ReadOutside` raised when the outputs differ."""
    draws = Draws(data)
    calls = _graph(draws)
    specs = _tensor_specs(calls, draws)
    names = ", ".join(f"aten.{op._opname}.{op._overloadname}" for op, _, _ in calls)
    if VERBOSE:
        print(names, calls, specs, file=sys.stderr, flush=True)
    first, second = (_run(calls, specs, pattern) for pattern in _PATTERNS)
    return_freed_memory()  # what a big graph freed, handed back: the process stays its own size
    if _out_of_memory(first) or _out_of_memory(second):
        OUTCOMES["out of memory"] += 1  # a refused allocation depends on what else is allocated
        return "out of memory"
    if isinstance(first, BaseException) or isinstance(second, BaseException):
        if isinstance(first, BaseException) != isinstance(second, BaseException):
            raise ReadOutside(
                f"{names}: refused with one surrounding memory and not the other ({first!r} / {second!r})"
            )
        OUTCOMES["refused"] += 1
        return "refused"
    if (wrong := _invalid(first)) is not None:
        raise ReadOutside(f"{names}: made {wrong} ({calls!r})")
    if not _same(first, second):
        raise ReadOutside(f"{names}: outputs depend on the memory around the inputs ({calls!r})")
    OUTCOMES["ran"] += 1
    return "ran"


def bounded_process(address_space_gib: int = 2) -> None:
    """Refused allocations instead of a machine out of memory: huge sizes are part of the input
    (and a graph that fills a gigabyte is slow, however valid)."""
    limit = address_space_gib << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)


def seeded(runs: int, seed: int, report: Callable[[str], None] = print) -> Counter[str]:
    """``runs`` inputs from a seeded generator, each through :func:`check_one`."""
    generator = random.Random(seed)
    for _ in range(runs):
        check_one(generator.randbytes(16))
    report(f"{runs} graphs: {dict(sorted(OUTCOMES.items()))}")
    return OUTCOMES


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--only", help="a comma-separated list of operators (name.overload) to draw from")
    parser.add_argument("--seed-corpus", type=Path, help="write --runs seeded inputs into this directory, then stop")
    known, _ = parser.parse_known_args()
    global VERBOSE, OPERATORS
    VERBOSE = known.verbose
    if known.only:
        OPERATORS = [op for op in OPERATORS if f"{op._opname}.{op._overloadname}" in known.only.split(",")]
    bounded_process()
    if known.seed_corpus is not None:
        generator = random.Random(known.seed)
        known.seed_corpus.mkdir(parents=True, exist_ok=True)
        for number in range(known.runs or 500):
            (known.seed_corpus / f"seed-{number:05d}").write_bytes(generator.randbytes(16))
        return
    if known.runs is not None:
        seeded(known.runs, known.seed)
        return
    atheris.Setup(sys.argv, check_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
