"""The delegate: a compiled partition, and the graph operator that calls it.

In a lowered program each delegate is a :class:`LoweredBackendModule` attached to its graph
module as ``lowered_module_N`` (a ``get_attr`` node), invoked by one ``call_delegate`` node
whose outputs ``getitem`` nodes read. Calling the module runs the blob on its backend:
``init`` once (lazily, thread-safe), ``execute`` per call, ``destroy`` when the module goes
away. Inside :func:`run_original_subprograms` the original sub-programs run instead, to
compare numerics.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._higher_order_ops.utils import register_fake
from torch._ops import HigherOrderOperator
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    get_proxy_slot,
    track_tensor_tree,
)

from torchdelegate.delegate.backend_details import get_backend
from torchdelegate.delegate.delegate_meta import DelegateMeta
from torchdelegate.delegate.instance import DelegateInstance
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore, NamedDataStoreOutput
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.exported.programs import state_value

_mode = threading.local()


@contextlib.contextmanager
def run_original_subprograms() -> Iterator[None]:
    """Within this block (in this thread) delegates run their original sub-programs with torch."""
    previous = getattr(_mode, "original", False)
    _mode.original = True
    try:
        yield
    finally:
        _mode.original = previous


def _user_output_count(program: ExportedProgram) -> int:
    return sum(1 for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT)


class LoweredBackendModule(torch.nn.Module):
    """A partition compiled by a backend; calling it runs the blob (flat inputs, flat outputs)."""

    def __init__(
        self,
        backend_id: str,
        processed_bytes: bytes,
        compile_specs: Sequence[CompileSpec],
        original_module: ExportedProgram,
        named_data_store_output: NamedDataStoreOutput | None = None,
        *,
        named_data: NamedDataStoreOutput | NamedDataStore | None = None,
        meta: dict[str, Any] | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.backend_id = backend_id
        self.processed_bytes = processed_bytes
        self.compile_specs = list(compile_specs)
        self.original_module = original_module
        self.named_data_store_output = named_data_store_output
        self.meta = DelegateMeta(meta or {})
        self.name = name or backend_id
        # Named data visible at run time: the whole lowering's store (live while the lowering
        # runs its stages), so partitions and methods share data only one result added.
        self._named_data = named_data if named_data is not None else named_data_store_output
        self._lock = threading.Lock()
        self._instance = self._new_instance()
        self._original_runner: _OriginalRunner | None = None
        call_spec = original_module.call_spec
        self._in_spec, self._out_spec = call_spec.in_spec, call_spec.out_spec
        self._call = _graph_call(self)

    def _new_instance(self) -> DelegateInstance:
        return DelegateInstance(
            get_backend(self.backend_id),
            self.processed_bytes,
            self.compile_specs,
            self._named_data_map,
            name=self.name,
            output_count=_user_output_count(self.original_module),
        )

    @property
    def meta(self) -> dict[str, Any]:
        """What lowering recorded: ``method``, ``tag``, ``debug_handle_map``, the backend's
        ``delegate_info`` (also readable as ExecuTorch's ``_delegate_info_meta``: one value), ..."""
        return self._meta

    @meta.setter
    def meta(self, value: dict[str, Any]) -> None:
        self._meta = value if isinstance(value, DelegateMeta) else DelegateMeta(value)

    @property
    def named_data(self) -> NamedDataStoreOutput:
        """The named data this delegate reads at run time: its own, and its lowering's."""
        named = self._named_data
        if isinstance(named, NamedDataStore):
            return named.get_named_data_store_output()
        return named if named is not None else NamedDataStoreOutput()

    def _named_data_map(self) -> NamedDataMap:
        named = self._named_data
        return named.data_map() if isinstance(named, NamedDataStore) else NamedDataMap(self.named_data)

    def __deepcopy__(self, memo: dict[int, Any]) -> LoweredBackendModule:
        # The blob and sub-program are immutable: share them; the copy inits its own handle.
        return LoweredBackendModule(
            self.backend_id,
            self.processed_bytes,
            self.compile_specs,
            self.original_module,
            self.named_data_store_output,
            named_data=self._named_data,
            meta=dict(self.meta),
            name=self.name,
        )

    def extra_repr(self) -> str:
        return f"backend_id={self.backend_id!r}, name={self.name!r}, blob={len(self.processed_bytes)} bytes"

    def release(self) -> None:
        """Destroy the backend handle now (it is re-created on the next call)."""
        self._instance.release()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the delegate with the sub-program's calling convention: its arguments, its outputs' structure.

        The call goes through the ``call_delegate`` operator, so a module that calls a lowered
        module exports (strict or not) as a delegate call, not as the backend's Python code.
        """
        outputs = self._call(*self.flat_inputs(args, kwargs))
        return outputs if self._out_spec is None else pytree.tree_unflatten(list(outputs), self._out_spec)

    def flat_inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """The call's arguments as the blob takes them: flat, in the order of the sub-program's signature."""
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            flat = _reordered(flat, spec, self._in_spec, self.name)
        return flat

    def run_flat(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """Run the blob (or, in :func:`run_original_subprograms`, the sub-program) on flat inputs."""
        if getattr(_mode, "original", False):
            return self._run_original(tuple(inputs))
        return tuple(self._instance.execute(list(inputs)))

    def _run_original(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        with self._lock:
            if self._original_runner is None:
                self._original_runner = _OriginalRunner(self.original_module)
        return self._original_runner(inputs)


def delegates_held_by(module: torch.nn.Module) -> list[LoweredBackendModule]:
    """The delegates a (graph) module holds as attributes, its sub-graphs' included: what a file must carry.

    :func:`torchdelegate.report.inspection.lowered_modules` lists the delegates a program calls, in graph order.
    """
    return [m for m in module.modules() if isinstance(m, LoweredBackendModule)]


def delegates_named_data(
    named_data: NamedDataStoreOutput | None, delegates: Iterable[LoweredBackendModule]
) -> NamedDataStoreOutput:
    """``named_data`` with the named data of every delegate merged in, each distinct content once.

    A delegate carries its named data wherever it goes, so a program assembled from lowered
    modules (wrapped in a manager, exported inside another module) holds all that its
    delegates read. A key stored with two contents is a ``NamedDataConflictError`` naming both.
    """
    # Delegates of one lowering share its store: each source is merged once.
    sources: dict[int, tuple[LoweredBackendModule, NamedDataStoreOutput | NamedDataStore]] = {}
    for delegate in delegates:
        for source in (delegate.named_data_store_output, delegate._named_data):
            if source is not None and len(source) and source is not named_data:
                sources.setdefault(id(source), (delegate, source))
    if not sources:
        return named_data if named_data is not None else NamedDataStoreOutput()
    store = NamedDataStore()
    if named_data is not None:
        store.merge(named_data)
    for delegate, source in sources.values():
        output = source.get_named_data_store_output() if isinstance(source, NamedDataStore) else source
        store.merge(output, owner=None if output.owners else f"delegate {delegate.name!r}")
    return store.get_named_data_store_output()


def _interpret(program: ExportedProgram, user_inputs: Sequence[Any], state: Callable[[str], Any]) -> list[Any]:
    """Run ``program``'s graph: user inputs in order, state from ``state(fqn)``; every output."""
    user = iter(user_inputs)
    arguments = [
        next(user) if spec.kind == InputKind.USER_INPUT else state(spec.target)  # type: ignore[arg-type]
        for spec in program.graph_signature.input_specs
    ]
    return list(torch.fx.Interpreter(program.graph_module).run(*arguments))


class _OriginalRunner:
    """Runs a sub-program with torch, keeping its mutated buffers as private state."""

    def __init__(self, program: ExportedProgram) -> None:
        self._program = program
        signature = program.graph_signature
        mutated = set(signature.buffers_to_mutate.values())
        self._state: dict[str, Any] = {}
        for spec in signature.input_specs:
            if spec.kind == InputKind.USER_INPUT or spec.target is None:
                continue
            value = state_value(program, spec.target)
            self._state[spec.target] = value.clone() if spec.target in mutated else value

    def __call__(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        signature = self._program.graph_signature
        user_names = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]  # type: ignore[union-attr]
        by_name = dict(zip(user_names, inputs, strict=True))
        outputs = _interpret(self._program, inputs, self._state.__getitem__)
        results = []
        for spec, value in zip(signature.output_specs, outputs, strict=True):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                self._state[spec.target].copy_(value)  # type: ignore[index]
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                by_name[spec.target].copy_(value)  # type: ignore[index]
            elif spec.kind == OutputKind.USER_OUTPUT:
                results.append(value)
        return tuple(results)


def _fake_outputs(lowered: LoweredBackendModule, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Outputs of a delegate call under fake tensors, by interpreting the sub-program."""
    program = lowered.original_module
    mode = torch._guards.detect_fake_mode(args)

    def fake_state(fqn: str) -> Any:
        value = state_value(program, fqn)
        if mode is not None and isinstance(value, torch.Tensor):
            return mode.from_tensor(value, static_shapes=True)
        return value

    outputs = _interpret(program, args, fake_state)
    specs = program.graph_signature.output_specs
    return tuple(v for s, v in zip(specs, outputs, strict=True) if s.kind == OutputKind.USER_OUTPUT)


class CallDelegate(HigherOrderOperator):
    """``call_delegate(lowered_module, *inputs) -> tuple``: run one delegate, its outputs flat.

    Inputs given as lists, tuples or dicts (the sub-program's own structure, as ExecuTorch's
    ``executorch_call_delegate`` takes them) are flattened first, as calling the module does.
    """

    def __init__(self) -> None:
        super().__init__("torchdelegate_call_delegate")

    def __call__(self, lowered_module: LoweredBackendModule, *args: Any) -> Any:
        if any(isinstance(arg, (list, tuple, dict)) for arg in args):
            args = tuple(lowered_module.flat_inputs(args, {}))
        return super().__call__(lowered_module, *args)


call_delegate = CallDelegate()
# A delegate may own state (a KV cache) and return nothing: never dead code.
torch.fx.node.has_side_effect(call_delegate)
for _key in (
    torch._C.DispatchKey.PythonDispatcher,
    torch._C.DispatchKey.PythonTLSSnapshot,
    torch._C.DispatchKey.ADInplaceOrView,
    torch._C.DispatchKey.AutocastCPU,
):
    call_delegate.fallthrough(_key)


def _graph_call(lowered_module: LoweredBackendModule) -> Callable[..., tuple[Any, ...]]:
    """``call_delegate`` bound to ``lowered_module``, which dynamo writes into a graph as one call.

    Strict export then traces it without dynamo, so the graph gets a delegate call node rather
    than the backend's Python code. The module is held weakly: no reference cycle.
    """
    module = weakref.ref(lowered_module)

    def call(*flat: Any) -> tuple[Any, ...]:
        lowered = module()
        assert lowered is not None, "a delegate's call outlived its module"
        return call_delegate(lowered, *flat)

    return torch._dynamo.allow_in_graph(call)


def _reordered(flat: list[Any], spec: pytree.TreeSpec, expected: pytree.TreeSpec, name: str) -> list[Any]:
    """Flat inputs in the order of the sub-program's signature: keyword arguments given in another order,
    dicts in another key order, a list where it took a tuple or the other way round."""
    args, kwargs = pytree.tree_unflatten(flat, spec)
    expected_args, expected_kwargs = pytree.tree_unflatten([None] * expected.num_leaves, expected)
    if len(args) == len(expected_args) and set(kwargs) == set(expected_kwargs):
        shaped = _shaped_like((tuple(args), kwargs), (tuple(expected_args), expected_kwargs))
        reordered, again = pytree.tree_flatten(shaped)
        if again == expected:
            return reordered
    raise TypeError(
        f"delegate {name!r} takes (args, kwargs) structured as {pytree.treespec_pprint(expected)} (* a tensor or "
        f"number); got {pytree.treespec_pprint(spec)}. Call it as its sub-program is called (the same positional "
        "and keyword arguments, lists, tuples and dicts)"
    )


def _shaped_like(value: Any, like: Any) -> Any:
    """``value`` with the containers of ``like`` wherever the two agree in kind and size: lists and
    tuples for each other, dicts in ``like``'s key order; anything else as it is."""
    if isinstance(like, (list, tuple)) and isinstance(value, (list, tuple)) and len(value) == len(like):
        items = [_shaped_like(v, w) for v, w in zip(value, like, strict=True)]
        return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)
    if isinstance(like, dict) and isinstance(value, dict) and set(value) == set(like):
        return {key: _shaped_like(value[key], like[key]) for key in like}
    return value


@call_delegate.py_impl(torch._C.DispatchKey.CompositeExplicitAutograd)
def _call_delegate_dense(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    return lowered_module.run_flat(args)


@call_delegate.py_autograd_impl
def _call_delegate_autograd(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    # Delegates are inference-only: run below autograd; outputs carry no grad_fn.
    with torch._C._AutoDispatchBelowAutograd():
        return call_delegate(lowered_module, *args)


@register_fake(call_delegate, skip_cache=True)
def _call_delegate_fake(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    return _fake_outputs(lowered_module, args)


@call_delegate.py_impl(ProxyTorchDispatchMode)
def _call_delegate_trace(mode: ProxyTorchDispatchMode, lowered_module: LoweredBackendModule, *args: Any) -> Any:
    with disable_proxy_modes_tracing():
        out = call_delegate(lowered_module, *args)
    root = mode.tracer.root  # type: ignore[union-attr]
    index = 0
    while hasattr(root, f"lowered_module_{index}"):
        if getattr(root, f"lowered_module_{index}") is lowered_module:
            break
        index += 1
    else:
        root.add_module(f"lowered_module_{index}", lowered_module)

    def unwrap(value: Any) -> Any:
        if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat)):
            return get_proxy_slot(value, mode.tracer, value, lambda e: e.proxy)
        return value

    proxy_args = pytree.tree_map(unwrap, (lowered_module, *args))
    out_proxy = mode.tracer.create_proxy("call_function", call_delegate, proxy_args, {}, name="call_delegate")
    return track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


@call_delegate.py_functionalize_impl
def _call_delegate_functionalize(ctx: Any, lowered_module: LoweredBackendModule, *args: Any) -> Any:
    unwrapped = tuple(ctx.unwrap_tensors(a) for a in args)
    with ctx.redispatch_to_next():
        return ctx.wrap_tensors(call_delegate(lowered_module, *unwrapped))
