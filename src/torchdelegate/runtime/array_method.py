"""One method of a loaded program run on numpy arrays: its call plan, without torch.

A method whose graph only calls delegates (``serialize/call_plan.py``) needs no graph engine: each
call binds the user's arrays beside the program's state, runs the plan's steps over a list of
slots, writes buffer updates back into the state, and returns the outputs in the method's
structure. Inputs are numpy arrays, any DLPack tensor (read without a copy), or torch tensors, in
which case the outputs are torch tensors too, sharing the arrays' memory (as they are for a method
that takes no tensor, in a process that has imported torch).
"""

from __future__ import annotations

import operator
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdelegate.delegate.instance import DelegateInstance
from torchdelegate.errors import FormatError, MethodExecutionError, ProgramInputError, TorchDelegateError
from torchdelegate.runtime.arguments import Dim, bound_arguments, check_sizes, dim_of, sizes_text
from torchdelegate.serialize.arrays import numpy_dtype
from torchdelegate.serialize.call_plan import CallPlan, DelegateCall, PlanInput, SizeRead


@dataclass(frozen=True)
class _Leaf:
    """A user input: a tensor (``dtype`` and ``dims``) or a symbolic ``int``."""

    name: str
    kind: str  # "tensor" or "int"
    dtype: np.dtype | None = None
    dims: tuple[Dim, ...] = ()


class ArrayInputs:
    """Binds a call's arguments to the plan's user inputs, as arrays, checking each one."""

    def __init__(self, method: str, plan: CallPlan) -> None:
        self.method = method
        self._plan = plan
        self.arg_names = list(plan.arg_names)
        self.leaves = [_leaf(i, plan.ranges, method) for i in plan.inputs if i.kind == "user_input"]
        if len(self.leaves) != plan.positional_count + len(plan.keyword_names):
            raise FormatError(f"method {method!r}: its calling convention does not match its {len(self.leaves)} inputs")

    def parameters(self) -> list[str]:
        """Each user input as ``name: float32[1, 8]`` (``s0`` for a symbolic size), in call order."""
        described = []
        for leaf in self.leaves:
            if leaf.kind == "tensor":
                described.append(f"{leaf.name}: {leaf.dtype}[{sizes_text(leaf.dims)}]")
            else:
                described.append(f"{leaf.name}: {leaf.kind}")
        return described

    def describe(self) -> str:
        return f"{self.method}({', '.join(self.arg_names or [leaf.name for leaf in self.leaves])})"

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], bool]:
        """The call's user inputs as arrays (ints for symbolic numbers), checked, and whether the outputs
        are torch tensors: torch tensors came in, and no numpy array did (numpy in, numpy out)."""
        plan = self._plan
        if kwargs or len(args) != plan.positional_count or plan.keyword_names:
            args, kwargs = bound_arguments(
                self.method, self.arg_names, plan.positional_count, plan.keyword_names, args, kwargs, self.describe()
            )
        values = [*args, *(kwargs[k] for k in plan.keyword_names)]
        flat: list[Any] = []
        torch_in = numpy_in = False
        sizes: dict[str, tuple[int, str]] = {}
        for leaf, value in zip(self.leaves, values, strict=True):
            if leaf.kind == "int":
                flat.append(self._integer(leaf, value))
                continue
            array, was_torch = _array(value)
            torch_in |= was_torch
            numpy_in |= isinstance(value, np.ndarray)
            self._check(leaf, array, value, sizes)
            flat.append(array)
        return flat, torch_in and not numpy_in

    def _integer(self, leaf: _Leaf, value: Any) -> int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        raise ProgramInputError(
            f"method {self.method!r}: argument {leaf.name!r} must be a Python int, got {type(value).__name__}"
        )

    def _check(self, leaf: _Leaf, array: np.ndarray | None, value: Any, sizes: dict[str, tuple[int, str]]) -> None:
        where = f"method {self.method!r}: argument {leaf.name!r}"
        if array is None:
            raise ProgramInputError(
                f"{where} must be a tensor (a numpy array, or any DLPack tensor), got {type(value).__name__}"
            )
        if array.dtype != leaf.dtype:
            raise ProgramInputError(f"{where} must have dtype {leaf.dtype}, got {array.dtype}")
        check_sizes(where, leaf.name, array.shape, leaf.dims, sizes)


def _leaf(spec: PlanInput, ranges: Mapping[str, tuple[int | None, int | None]], method: str) -> _Leaf:
    if spec.scalar is not None:
        return _Leaf(spec.name, spec.scalar)
    dims = tuple(dim_of(size, ranges) for size in spec.sizes)
    return _Leaf(spec.name, "tensor", numpy_dtype(str(spec.dtype), f"method {method!r}: input {spec.name!r}"), dims)


def _array(value: Any) -> tuple[np.ndarray | None, bool]:
    """``value`` as an array sharing its memory, and whether it was a torch tensor (None: not a tensor)."""
    if isinstance(value, np.ndarray):
        return value, False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            raise ProgramInputError(
                f"a tensor on {tensor.device} was given; this program runs on the CPU: move it there"
            )
        return tensor_array(tensor), True
    if hasattr(value, "__dlpack__") and not isinstance(value, type):
        return np.from_dlpack(value), False
    return None, False


def tensor_array(tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as an array, no copy (bfloat16, which numpy lacks, as ml_dtypes's: the same bits)."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16", "a bfloat16 tensor"))
    return tensor.numpy()  # type: ignore[no-any-return]


def as_torch(array: Any) -> Any:
    """An array as a torch tensor over its memory (torch is imported: a tensor came in); anything else as it is.
    A read-only array (a view of the file's state) gives a tensor the caller must not write, as the
    torch engine's state tensors are."""
    import torch

    if not isinstance(array, np.ndarray):
        return array
    with warnings.catch_warnings():  # a view of the file's state, as the torch engine hands out
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


class ArrayMethod:
    """A callable method of a program run on array runtimes."""

    def __init__(
        self,
        name: str,
        plan: CallPlan,
        state: Mapping[str, np.ndarray],
        delegates: Mapping[int, DelegateInstance],
        mutable: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self.inputs = ArrayInputs(name, plan)
        # Without a tensor in to say which kind comes out, a process that uses torch gets torch's.
        self._no_tensor_inputs = all(leaf.kind != "tensor" for leaf in self.inputs.leaves)
        slots: dict[str, int] = {}
        self._template: list[Any] = []
        self._user_slots: list[int] = []
        for spec in plan.inputs:
            slots[spec.name] = len(self._template)
            if spec.kind == "user_input":
                self._user_slots.append(len(self._template))
                self._template.append(None)
            else:
                self._template.append(state[spec.target])  # type: ignore[index]

        def slot(name: str) -> int:
            if name not in slots:
                slots[name] = len(self._template)
                self._template.append(None)
            return slots[name]

        self._steps: list[tuple[Any, Any, list[int]]] = []
        for step in plan.steps:
            if isinstance(step, SizeRead):
                self._steps.append((step.dim, [slots[step.source]], [slot(step.name)]))
                continue
            delegate = delegates[step.delegate]
            if len(step.results) != delegate.output_count:
                raise FormatError(
                    f"method {name!r}: the graph expects delegate {step.delegate} to return {len(step.results)} "
                    f"values; its table entry says {delegate.output_count}"
                )
            arguments: list[int | tuple[int]] = [slots[a] if isinstance(a, str) else (a,) for a in step.arguments]
            self._steps.append((delegate, _gathered(arguments), [slot(r) for r in step.results]))
        self._buffer_updates = [(slots[o.value], state[o.target]) for o in plan.outputs if o.kind == "buffer_mutation"]  # type: ignore[index]
        self._user_outputs = [slots[o.value] for o in plan.outputs if o.kind == "user_output"]
        self._container, self._keys = plan.output_container, plan.output_keys
        if plan.output_count != len(self._user_outputs):
            raise FormatError(
                f"method {name!r}: its output structure has {plan.output_count} values, the graph returns "
                f"{len(self._user_outputs)}"
            )
        self.writes = frozenset(o.target for o in plan.outputs if o.kind == "buffer_mutation" and o.target)
        reads = {s.target for s in plan.inputs if s.kind == "buffer"}
        self.uses_mutable_state = bool(self._buffer_updates) or not reads.isdisjoint(mutable)
        for index, donated in _donated_inputs(plan).items():
            delegates[index].donate(donated)

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run with the exported module's calling convention; outputs in its structure."""
        flat, torch_in = self.inputs.flatten(args, kwargs)
        outputs = self.run_user_outputs(flat)
        if torch_in or (self._no_tensor_inputs and "torch" in sys.modules):
            outputs = [as_torch(o) for o in outputs]
        if self._container is None:
            return outputs[0]
        if self._container == "dict":
            return dict(zip(self._keys, outputs, strict=True))
        return tuple(outputs) if self._container == "tuple" else outputs

    def run_user_outputs(self, user_inputs: Sequence[Any]) -> list[Any]:
        """Run on checked flat user inputs; the flat user outputs (buffers updated). What fails outside
        the delegates (a size read, a buffer update of a file that lies) is a ``MethodExecutionError``."""
        try:
            return self._run(user_inputs)
        except TorchDelegateError:
            raise
        except Exception as error:
            raise MethodExecutionError(
                f"method {self.name!r}: a size read or a buffer update (outside any delegate) failed: "
                f"{type(error).__name__}: {error}; re-export and save the program if the file was altered"
            ) from error

    def _run(self, user_inputs: Sequence[Any]) -> list[Any]:
        values = list(self._template)
        for slot, value in zip(self._user_slots, user_inputs, strict=True):
            values[slot] = value
        for target, arguments, results in self._steps:
            if type(target) is int:  # a size read
                values[results[0]] = values[arguments[0]].shape[target]  # type: ignore[index]
                continue
            outputs = target.execute(arguments(values))
            for slot, output in zip(results, outputs, strict=True):
                values[slot] = output
        for slot, buffer in self._buffer_updates:
            if values[slot] is not buffer:  # a delegate that wrote it in place returns the buffer
                np.copyto(buffer, values[slot])
        return [values[slot] for slot in self._user_outputs]


def _gathered(arguments: list[int | tuple[int]]) -> Callable[[list[Any]], list[Any]]:
    """A step's arguments from the method's values: slot numbers read, constants (``(value,)``) as they are;
    one C-level gather when every argument is a slot (a decode step's hundred inputs, each call)."""
    slots = [a for a in arguments if type(a) is int]
    if len(slots) == len(arguments) > 1:
        gather = operator.itemgetter(*slots)
        return lambda values: list(gather(values))
    return lambda values: [values[a] if type(a) is int else a[0] for a in arguments]  # type: ignore[index]


def _donated_inputs(plan: CallPlan) -> dict[int, dict[int, int]]:
    """Per delegate called once, the inputs whose memory its outputs may take (``{input: output}``): a
    buffer that call alone reads, which the method replaces with one of the call's results nothing else uses."""
    uses: dict[str, int] = {}
    for step in plan.steps:
        for argument in step.arguments if isinstance(step, DelegateCall) else (step.source,):
            if isinstance(argument, str):
                uses[argument] = uses.get(argument, 0) + 1
    for output in plan.outputs:
        uses[output.value] = uses.get(output.value, 0) + 1
    calls: dict[int, int] = {}
    for step in plan.steps:
        if isinstance(step, DelegateCall):
            calls[step.delegate] = calls.get(step.delegate, 0) + 1
    buffers = {spec.name: spec.target for spec in plan.inputs if spec.kind == "buffer"}
    written = {o.target: o.value for o in plan.outputs if o.kind == "buffer_mutation"}
    donated: dict[int, dict[int, int]] = {}
    for step in plan.steps:
        if not isinstance(step, DelegateCall) or calls[step.delegate] != 1:
            continue
        for position, argument in enumerate(step.arguments):
            if not isinstance(argument, str) or argument not in buffers or uses.get(argument) != 1:
                continue
            result = written.get(buffers[argument])
            if result in step.results and uses.get(result) == 1:  # type: ignore[operator]
                donated.setdefault(step.delegate, {})[position] = step.results.index(result)  # type: ignore[arg-type]
    return {index: dict(sorted(d.items())) for index, d in sorted(donated.items())}
