"""A delegate at run time: a branch of its model's ``InferenceSession``, one session per model and
settings for every delegate of a loaded program, its weights read in place from named data, or
mapped packed from the machine cache when the program was prepared here (``prepare_model``).
"""

from __future__ import annotations

import json
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from torchdelegate.backends.onnxruntime.blob_header import (
    checked_branch,
    external_keys,
    initializer_files,
    initializer_table,
    model_branches,
    model_key,
    model_of,
    stored_model,
    unpacked,
)
from torchdelegate.backends.onnxruntime.branches import branch_prefix
from torchdelegate.backends.onnxruntime.confinement import confined_model
from torchdelegate.backends.onnxruntime.in_place import in_place_outputs, unread_inputs
from torchdelegate.backends.onnxruntime.kept_binding import KeptBinding, as_array
from torchdelegate.backends.onnxruntime.model_proto import ModelProtoError, read_model
from torchdelegate.backends.onnxruntime.packing_memory import pages_released_while_packing
from torchdelegate.backends.onnxruntime.prepared import PREPARED, prepared_key, prepared_session, save_prepared
from torchdelegate.backends.onnxruntime.settings import ONNX_TYPES, Options, require
from torchdelegate.cache.machine_cache import cache_directory, entry_lock, entry_path, entry_size, find_entry, new_entry
from torchdelegate.cache.store_settings import MAX_BYTES_VARIABLE, max_bytes_setting
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import FormatError
from torchdelegate.exported.freed_memory import return_freed_memory


def delegate_handle(processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> _Delegate:
    """A delegate's branch of its model's session: the one every blob naming that model shares."""
    header, payload = unpacked(processed)
    branch = header.get("branch")
    key = header.get("model")
    if key is None:
        model = Model(header, payload, compile_specs, named_data)
    else:
        model = _shared_model(model_key(key, named_data), compile_specs, named_data)
    return _Delegate(model, checked_branch(branch, len(model.branches)))


def check_blob(processed: memoryview, named_data: NamedDataMap) -> None:
    """What making a session checks before ONNX Runtime sees the model, without making one: the
    header's branches, selector and branch number, the named data of every initializer it supplies, and the model
    confined (``confinement.py``)."""
    header, model = model_of(processed, named_data)
    branches, _ = model_branches(header)
    checked_branch(unpacked(processed)[0].get("branch"), len(branches))
    initializers = initializer_table(header)
    keys = external_keys(initializers)
    missing = [key for key in keys if key not in named_data]
    if missing:
        raise FormatError(f"onnxruntime blob: initializer data {missing[0]!r:.80} is not in the program")
    _, supplied = initializer_files(initializers, {key: named_data.get_data(key) for key in keys})
    confined_model(bytes(model), supplied, "onnxruntime blob")


class _ProgramModels:
    """The models of one loaded program's named data: each one's session while a delegate uses it,
    and a lock per model, so two delegates never build one session twice and other models need not wait."""

    def __init__(self) -> None:
        self.sessions: weakref.WeakValueDictionary[Any, Model] = weakref.WeakValueDictionary()
        self.building: dict[Any, threading.Lock] = {}


_PROGRAM_MODELS: weakref.WeakKeyDictionary[NamedDataMap, _ProgramModels] = weakref.WeakKeyDictionary()
_PROGRAM_MODELS_LOCK = threading.Lock()


def _shared_model(key: str, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Model:
    """The session of the model stored as named data ``key``: one per named data and settings, while used."""
    settings = Options(compile_specs).session_settings()
    with _PROGRAM_MODELS_LOCK:
        models = _PROGRAM_MODELS.setdefault(named_data, _ProgramModels())
        building = models.building.setdefault((key, settings), threading.Lock())
    with building:
        model = models.sessions.get((key, settings))
        if model is None:
            model = Model(*stored_model(key, named_data), compile_specs, named_data)
            with _PROGRAM_MODELS_LOCK:
                models.sessions[(key, settings)] = model
        return model


class Model:
    """One InferenceSession over a model of one or several branches: from the machine cache when the
    program was prepared here, else with its initializers read in place from named data."""

    def __init__(
        self,
        header: dict[str, Any],
        model: memoryview,
        compile_specs: list[CompileSpec],
        named_data: NamedDataMap,
        pack_weights: bool = True,
    ) -> None:
        ort = require("onnxruntime")
        self.branches, self._selector = model_branches(header)
        settings = Options(compile_specs)
        prepared = None
        if pack_weights and settings.prepacking and cache_directory() is not None:
            prepared = find_entry(PREPARED, prepared_key(header, model, settings, named_data))
        session = None
        if prepared is not None:  # the entry stands in for the file's weights, which must still be sound
            with named_data.reading(external_keys(initializer_table(header)), unread=True):
                session = prepared_session(ort, prepared, settings)
        self._files: dict[str, memoryview] = {}
        parsed = None  # the model as confinement read it, when this process checked it
        if session is None:
            session, self._files, parsed = _built_session(header, model, settings, named_data, pack_weights)
        self._session = session  # self._files: the session reads them, keep them alive as long as it lives
        return_freed_memory()
        # The binding's run, without the Python wrapper's per-call checks of names we already know.
        self._run = self._session._sess.run
        _check_names(self._session, self.branches, self._selector)
        self._unread = _unread_inputs(self._session, self._selector)
        parsed, bindable = parsed if parsed is not None else _parsed(model), _numpy_typed(self._session)
        self.in_place = (
            in_place_outputs(parsed, self.branches, self._selector) if bindable else [{} for _ in self.branches]
        )
        """Per branch, the outputs (by position) that may be written into an input's memory, and that input."""
        self.unread = unread_inputs(parsed, self.branches) if bindable else [frozenset() for _ in self.branches]
        """Per branch, the inputs no node reads: any output may be written into their memory."""
        self._unread_values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self._unread.items()}
        self._profiling = settings.profile
        self._node_seconds: dict[str, float] | None = None
        self._profile_lock = threading.Lock()
        self._profile_readers: dict[int, _Delegate] = {}
        if self._profiling:  # a profile never read is still ended and its trace deleted
            self._unread_profile = weakref.finalize(self, _discard_profile, self._session)

    def node_seconds(self) -> dict[str, float] | None:
        """Seconds per ONNX node over every call so far, from ONNX Runtime's profiler (the session made
        with the ``profile`` option; None without it). The first ask ends the recording: later ones get
        the same answer."""
        if not self._profiling:
            return None
        with self._profile_lock:
            if self._node_seconds is None:
                self._unread_profile.detach()
                path = self._session.end_profiling()
                self._node_seconds = kernel_seconds(Path(path)) if path else {}
            return dict(self._node_seconds)

    def reports_branch(self, delegate: _Delegate) -> bool:
        """Whether ``delegate`` reports its branch's profile: the first of its delegates to ask. A branch
        several methods run (an LLM's prefill and decode) is timed as one: it is counted once."""
        with self._profile_lock:
            return self._profile_readers.setdefault(delegate.branch, delegate) is delegate

    def run(self, branch: int, inputs: list[Any]) -> list[np.ndarray]:
        names, outputs = self.branches[branch]
        feed = dict(self._unread)
        feed.update((name, as_array(value)) for name, value in zip(names, inputs, strict=True))
        if self._selector is not None:
            feed[self._selector] = np.array(branch, dtype=np.int64)
        return list(self._run(outputs, feed, None))

    def same_types(self, branch: int) -> set[tuple[int, int]]:
        """The (input, output) positions of ``branch`` whose types, element type and static sizes, are equal."""
        names, outputs = self.branches[branch]
        types = {v.name: (v.type, tuple(v.shape)) for v in (*self._session.get_inputs(), *self._session.get_outputs())}
        return {(j, k) for j, a in enumerate(names) for k, b in enumerate(outputs) if types[a] == types[b]}

    def kept_binding(self, branch: int, written: dict[int, int]) -> KeptBinding:
        """A binding for calls of ``branch`` that write ``written`` outputs into their inputs' memory."""
        selector = None if self._selector is None else (self._selector, np.array(branch, dtype=np.int64))
        return KeptBinding(self._session, self.branches[branch], self._unread_values, selector, written)


def _built_session(
    header: dict[str, Any],
    model: memoryview,
    settings: Options,
    named_data: NamedDataMap,
    pack_weights: bool = True,
    prepared_into: Path | None = None,
) -> tuple[Any, dict[str, memoryview], Any]:
    """A session of ``model``, the views of named data it reads (in place: keep them while it lives) and
    the model as confinement read it.

    ``prepared_into``: a directory where ONNX Runtime also writes the optimized model and its packed weights.
    """
    ort = require("onnxruntime")
    initializers = initializer_table(header)
    with named_data.reading(external_keys(initializers)) as data:  # checksums checked meanwhile
        files, supplied = initializer_files(initializers, data)
        model_bytes, parsed = confined_model(bytes(model), supplied, "onnxruntime blob")
        options = settings.session_options(pack_weights)
        if prepared_into is not None:
            save_prepared(options, prepared_into)
        with pages_released_while_packing(named_data, list(data)):  # read to fold or check, if not packed
            session = _session(ort, model_bytes, options, files, folds=pack_weights)
    return session, files, parsed


def kernel_seconds(trace: Path) -> dict[str, float]:
    """Seconds per node from an ONNX Runtime profile (a Chrome trace), which is then deleted."""
    try:
        events = json.loads(trace.read_text())
    finally:
        trace.unlink(missing_ok=True)
    seconds: dict[str, float] = {}
    for event in events if isinstance(events, list) else []:
        name = event.get("name", "") if isinstance(event, dict) else ""
        if event.get("cat") == "Node" and name.endswith(_KERNEL_TIME):
            # A node ONNX Runtime made of several at load is "fused <the first one's name>".
            node = name.removesuffix(_KERNEL_TIME).removeprefix("fused ")
            seconds[node] = seconds.get(node, 0.0) + float(event.get("dur", 0)) / 1e6
    return dict(sorted(seconds.items()))


_KERNEL_TIME = "_kernel_time"  # ONNX Runtime's event of a node's kernel: "<node name>_kernel_time"


def _discard_profile(session: Any) -> None:
    path = session.end_profiling()
    if path:
        Path(path).unlink(missing_ok=True)


class _Delegate:
    """One delegate: a branch of a model's session, called on numpy arrays (ints for symbolic sizes)."""

    def __init__(self, model: Model, branch: int) -> None:
        self.model, self.branch = model, branch
        self._arity = len(model.branches[branch][0])
        self.written: dict[int, int] = {}
        """Outputs written into a donated input's memory (``accept_donated_inputs``): output: input."""
        self._binding: KeptBinding | None = None

    def accept(self, donated: dict[int, int]) -> None:
        """Of the donated inputs (input: output), those the model may write in place."""
        possible = self.model.in_place[self.branch]
        unread, same = self.model.unread[self.branch], self.model.same_types(self.branch)
        self.written = {
            k: j for j, k in sorted(donated.items()) if possible.get(k) == j or (j in unread and (j, k) in same)
        }
        self._binding = self.model.kept_binding(self.branch, self.written) if self.written else None

    def __call__(self, inputs: list[Any]) -> list[np.ndarray]:
        """The outputs; an output written in place (``written``) is its input array itself."""
        if len(inputs) != self._arity:
            raise ValueError(f"expected {self._arity} inputs, got {len(inputs)}")
        binding = self._binding
        if binding is None:
            return self.model.run(self.branch, inputs)
        with binding.lock:
            outputs = binding.run(inputs)
        return self.model.run(self.branch, inputs) if outputs is None else outputs


def _parsed(model: memoryview) -> Any:
    try:
        return read_model(bytes(model))
    except ModelProtoError as e:
        raise FormatError(f"onnxruntime blob: the ONNX model cannot be read ({e})") from None


def _numpy_typed(session: Any) -> bool:
    """Whether numpy can describe every input and output of ``session`` (not bfloat16): an IO binding's."""
    types = {value.name: value.type for value in (*session.get_inputs(), *session.get_outputs())}
    return all(kind in _NUMPY_TYPES for kind in types.values())


def _check_names(session: Any, branches: list[tuple[list[str], list[str]]], selector: str | None) -> None:
    """Every name the header gives is one of the model's inputs or outputs, and every input of the model is
    one the header names (a branch's, or the selector): a ``FormatError`` now, not at a call."""
    inputs, outputs = {v.name for v in session.get_inputs()}, {v.name for v in session.get_outputs()}
    missing = [name for names, _ in branches for name in names if name not in inputs]
    missing += [name for _, names in branches for name in names if name not in outputs]
    missing += [selector] if selector is not None and selector not in inputs else []
    if missing:
        raise FormatError(
            f"onnxruntime blob: its header names {missing[0]!r:.80}, which the model neither takes nor returns"
        )
    named = {name for names, _ in branches for name in names} | {selector}
    unnamed = sorted(inputs - named)
    if unnamed:
        raise FormatError(
            f"onnxruntime blob: its model takes {unnamed[0]!r:.80}, which its header does not name (no call feeds it)"
        )


# The numpy dtype of each input type ONNX Runtime names ("tensor(float)"); numpy has no bfloat16.
_ORT_NAMES = {"float32": "float", "float64": "double"}
_NUMPY_TYPES = {f"tensor({_ORT_NAMES.get(n, n)})": np.dtype(n) for n in ONNX_TYPES if n != "bfloat16"}


def _unread_inputs(session: Any, selector: str | None) -> dict[str, np.ndarray]:
    """A value for every input of a model of several branches, for the branches a call does not take.

    ``If`` never reads them; zeros of a size that is never touched (a symbolic size is 0).
    """
    if selector is None:
        return {}
    unread = {}
    for value in session.get_inputs():
        if value.name == selector:
            continue
        dtype = _NUMPY_TYPES.get(value.type)
        if dtype is None:
            raise FormatError(f"onnxruntime blob: input {value.name!r} is a {value.type}, which no delegate can feed")
        unread[value.name] = np.zeros([d if isinstance(d, int) else 0 for d in value.shape], dtype)
    return unread


def _session(ort: ModuleType, model: bytes, options: Any, files: dict[str, memoryview], folds: bool = True) -> Any:
    """An InferenceSession of ``model`` whose external tensors are read in place from ``files``.

    ``folds=False`` (a session only checked, never run): no constant folding, whose float copies of
    converted weights (a bfloat16 checkpoint's, say) would cost their size for nothing."""
    if files:
        # No copy, whatever their number: the session reads the views it is given.
        options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        options.add_external_initializers_from_files_in_memory(
            list(files), list(files.values()), [len(view) for view in files.values()]
        )
    # Settings come from compile specs only, never from the model's metadata (ORT_LOAD_CONFIG_FROM_MODEL).
    disabled = [] if folds else ["ConstantFolding"]
    return ort.InferenceSession(
        model, options, providers=["CPUExecutionProvider"], read_config_from_model=0, disabled_optimizers=disabled
    )


def prepare_model(processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
    """Optimize the blob's model and pack its weights for this machine, into the machine cache."""
    settings = Options(compile_specs)
    if not settings.prepacking:
        return None
    header, payload = model_of(processed, named_data)
    key = prepared_key(header, payload, settings, named_data)
    weights = sum(len(named_data.get_data(k)) for k in external_keys(initializer_table(header)))
    bound = max_bytes_setting()
    if weights > bound:  # the entry holds the weights packed: about their size
        return (
            f"onnxruntime model {key[:12]}: not prepared: its packed weights (about {weights / 1e9:,.1f} GB) would "
            f"not fit the machine cache's bound of {bound / 1e9:,.1f} GB; each load packs them instead (raise "
            f"{MAX_BYTES_VARIABLE} to prepare it)"
        )
    with entry_lock(PREPARED, key):  # another process preparing this model: its entry is used
        place = find_entry(PREPARED, key, verify=True, quiet=True)  # a damaged one is written again
        if place is None:
            with new_entry(PREPARED, key) as scratch:
                _built_session(header, payload, settings, named_data, prepared_into=scratch)
            return_freed_memory()
            place = entry_path(PREPARED, key)
        size = entry_size(place) / 1e6
    return f"onnxruntime model {key[:12]}, optimized and packed for this machine: {size:,.1f} MB in {place}"


def branch_seconds(delegate: _Delegate) -> dict[str, float] | None:
    """The profile of ``delegate``'s branch: its model's nodes that this branch runs (all of a model of one)."""
    seconds = delegate.model.node_seconds()
    if seconds is None:
        return None
    if not delegate.model.reports_branch(delegate):
        return {}  # another delegate of this branch reports its time, every method's calls included
    if len(delegate.model.branches) == 1:
        return seconds
    prefix = branch_prefix(delegate.branch)
    return {node: time for node, time in seconds.items() if node.startswith(prefix)}
