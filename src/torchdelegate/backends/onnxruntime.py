"""The ONNX Runtime backend: partitions exported to ONNX, run by ONNX Runtime's CPU provider.

Ahead of time each partition is exported with torch's ONNX exporter (dynamo, onnxscript);
every initializer leaves the model and becomes named data keyed by the SHA-256 of its
bytes, so a weight that ``prefill`` and ``decode`` (or two partitions) use is stored once.
A model is a small JSON header (each initializer's key, dtype and shape; each branch's
inputs and outputs) and the ONNX model, whose initializers of 1 KiB or more are external
references (smaller ones, such as the axes of a reshape, stay inside: ONNX Runtime reads
them while loading the model).

Once every partition of every method is compiled, those with equal session settings that
read weights in common become the branches of one model (``onnx_branches``), stored once as named data that their blobs
name: ONNX Runtime packs weights per session, so one session packs each weight once for
every method. At run time the delegates of a program share that model's one
``InferenceSession``. Each external initializer names its named data as its file, which
ONNX Runtime reads in place (a view of the mapped file: no copy); once the session has
packed them, their pages leave the process's resident memory. ``prepare`` keeps a model
optimized and its weights packed for this machine in the machine cache; a session made from
there maps the packed weights from the entry's file instead of packing a copy of its own.
Session options come from
compile specs: ``intra_op_num_threads`` (an integer), ``graph_optimization_level``
(``disable``, ``basic``, ``extended``, ``all``), ``disable_prepacking`` (``1`` reads the
weights as they are; by default ONNX Runtime packs them for speed).

Ahead of time, the exported model is rewritten with onnxscript's fusions for ONNX Runtime
(attention, skip + layer normalization, bias + GELU, rotary embeddings, ...) into the
provider's fused kernels (42 nodes instead of 104 for the benchmark stack). The compile spec
``fusions`` = ``0`` keeps the exporter's model as it is; the fusions applied are recorded
in the blob's header.

Needs ``pip install torchdelegate[onnxruntime]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, TypeGuard

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.backend import SharedDataBackend
from torchdelegate.backends.blob import WEIGHT_ALIGNMENT, pack, table_keys, unpack
from torchdelegate.backends.linear import recompose_linear
from torchdelegate.backends.onnx_branches import SELECTOR, CombineError, combined_model
from torchdelegate.backends.onnx_confinement import confined_model
from torchdelegate.data import NamedDataMap, NamedDataStore
from torchdelegate.errors import FormatError, PreprocessError, first_line
from torchdelegate.lowering.structural_copy import with_identifier_state_names
from torchdelegate.machine_cache import (
    EntryCheck,
    cache_directory,
    entry_key,
    entry_lock,
    entry_path,
    entry_size,
    find_entry,
    new_entry,
)
from torchdelegate.partition.capability import CapabilityPartitioner
from torchdelegate.partition.components import components
from torchdelegate.specs import CompileSpec, DelegationSpec
from torchdelegate.torch_warnings import loggers_quieted

BLOB_VERSION = 2
_UNSUPPORTED_DTYPES = frozenset(
    {torch.bfloat16, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2}
)
# Ops torch.onnx translates into models ONNX Runtime refuses (torch 2.13, onnxruntime 1.32):
# _linalg_det's translation reads a tensor as a sequence.
_TRANSLATIONS_REFUSED = frozenset({torch.ops.aten._linalg_det.default})
_SMALLEST_SHARED = 1024  # bytes: smaller initializers stay inside the model
_EXTRA = "pip install 'torchdelegate[onnxruntime]'"
_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}
_OPTIMIZATION_LEVELS["all"] = "ORT_ENABLE_ALL"
# ONNX element types of the numpy dtypes initializers come in; bfloat16 travels as uint16.
_ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "bool": 9}
_ONNX_TYPES |= {"float16": 10, "float64": 11, "uint32": 12, "uint64": 13, "bfloat16": 16}


def _require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the onnxruntime backend needs {module!r}: {_EXTRA}") from e


class OnnxRuntimeBackend(SharedDataBackend):
    """Runs partitions with ONNX Runtime (CPU provider); weights are shared named data."""

    backend_id = "onnxruntime"
    thread_safe_execute = True  # InferenceSession.run may be called from several threads

    @classmethod
    def is_available(cls) -> bool:
        try:
            ort = importlib.import_module("onnxruntime")
        except ImportError:
            return False
        return "CPUExecutionProvider" in ort.get_available_providers()

    @classmethod
    def compile_partition(
        cls, program: ExportedProgram, compile_specs: list[CompileSpec], store: NamedDataStore, where: str
    ) -> bytes:
        return _export(program, compile_specs, store, where)

    @classmethod
    def link_partitions(
        cls, blobs: list[bytes], compile_specs: list[list[CompileSpec]], store: NamedDataStore
    ) -> list[bytes]:
        """Partitions that run with the same session settings and read weights in common become
        branches of one model, run by one session."""
        parts = [unpack(memoryview(blob), BLOB_VERSION, "onnxruntime") for blob in blobs]
        linked = list(blobs)
        for members in _sharing_groups([header for header, _ in parts], compile_specs):
            if len(members) < 2:
                continue
            try:
                blobs_of_model = _linked([parts[i] for i in members], compile_specs[members[0]], store)
            except _Refused as e:
                warnings.warn(f"onnxruntime: {len(members)} partitions keep one session each: {e}", stacklevel=3)
                continue
            for index, blob in zip(members, blobs_of_model, strict=True):
                linked[index] = blob
        return linked

    @classmethod
    def named_data_keys(cls, processed: memoryview, compile_specs: list[CompileSpec]) -> list[str] | None:
        header = unpack(processed, BLOB_VERSION, "onnxruntime", older=(1,))[0]
        if "model" in header:
            keys = header.get("keys")
            listed = [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []
            model = header["model"]
            return sorted({*listed, model}) if isinstance(model, str) else listed
        initializers = header.get("initializers")
        return table_keys(list(initializers.values()) if isinstance(initializers, dict) else None)

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        return _handle(processed, compile_specs, named_data)

    @classmethod
    def prepare(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
        """The model optimized and its weights packed for this machine, kept in the machine cache: a
        later load maps the packed weights from there instead of packing its own copy."""
        return _prepare(processed, compile_specs, named_data)

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        return handle(inputs)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter reports progress on stdout and warns about optional packages; keep it quiet."""
    names = ("torch.onnx", "onnxscript", "onnx_ir", "torch.onnx._internal")
    with loggers_quieted(names, logging.ERROR), warnings.catch_warnings(), contextlib.redirect_stdout(None):  # type: ignore[type-var]
        warnings.simplefilter("ignore")
        yield


def _export(program: ExportedProgram, compile_specs: list[CompileSpec], store: NamedDataStore, where: str) -> bytes:
    """The partition's blob, checked by loading it into ONNX Runtime; its weights go to ``store``.

    If onnxscript's fusions fail or ONNX Runtime refuses the fused model (a fusion rule
    gone wrong), the partition is exported again unfused, with a warning; an unfused model
    that ONNX Runtime refuses is a ``PreprocessError``.
    """
    try:
        options = _Options(compile_specs)
    except ValueError as e:
        raise PreprocessError(f"onnxruntime: {where}: {e}") from None
    program = recompose_linear(program)
    if options.fusions:
        try:
            return _accepted_blob(program, True, compile_specs, store, where)
        except _Refused as e:
            warnings.warn(
                f"onnxruntime: {where}: {e}; this partition is exported without onnxscript's fusions", stacklevel=2
            )
    try:
        return _accepted_blob(program, False, compile_specs, store, where)
    except _Refused as e:
        raise PreprocessError(f"onnxruntime: {where}: {e}") from e


class _Refused(Exception):
    """The partition's model could not be made or loaded this way."""


class _FusionError(_Refused):
    """onnxscript's fusions raised: the partition is exported without them."""


def _accepted_blob(
    program: ExportedProgram, fuse: bool, compile_specs: list[CompileSpec], store: NamedDataStore, where: str
) -> bytes:
    """The blob, once ONNX Runtime has loaded it as ``init`` will; only then do its weights join ``store``.

    The check packs no weights: a packed copy of every weight would double the lowering's memory.
    """
    attempt = NamedDataStore()
    blob = _exported_blob(program, fuse, attempt, where)
    output = attempt.get_named_data_store_output()
    try:
        header, payload = unpack(memoryview(blob), BLOB_VERSION, "onnxruntime")
        _Model(header, payload, compile_specs, NamedDataMap(output), pack_weights=False)
    except Exception as e:  # any refusal is reported with the partition it concerns
        raise _Refused(f"ONNX Runtime refused the model ({first_line(e)})") from e
    store.merge(output)
    return blob


def _exported_blob(program: ExportedProgram, fuse: bool, store: NamedDataStore, where: str) -> bytes:
    """The partition as an ONNX model whose initializers are named data, with its header."""
    ir = _require("onnx_ir")
    _require("onnxscript")
    try:
        with _quiet_exporter():
            exportable, _ = with_identifier_state_names(program)  # initializers are keyed by content, not name
            onnx_program = torch.onnx.export(exportable, (), dynamo=True, optimize=False, verbose=False)
            assert onnx_program is not None
            model = onnx_program.model
            _read_weights_in_place(ir, model)
            _optimize(model)
    except Exception as e:
        raise PreprocessError(f"onnxruntime: {where}: torch's ONNX exporter failed: {_root_cause(e)}") from e
    fusions = _fuse(model) if fuse else {}
    initializers = {}
    for name, value in sorted(model.graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or tensor.nbytes < _SMALLEST_SHARED:
            continue  # shape-like constants stay in the model: ONNX Runtime reads them while loading it
        array = np.ascontiguousarray(tensor.numpy())
        # A tensor over the exporter's array is stored as a view; other dtypes (bfloat16) are copied.
        viewable = array.size and array.dtype.kind in "biuf" and array.dtype.itemsize in (1, 2, 4, 8)
        data = torch.from_numpy(array) if viewable else array.tobytes()
        key = store.add_by_content(data, alignment=WEIGHT_ALIGNMENT)
        dtype = "bfloat16" if tensor.dtype == ir.DataType.BFLOAT16 else str(array.dtype)
        if dtype not in _ONNX_TYPES:
            raise PreprocessError(f"onnxruntime: {where}: initializer {name!r} has unsupported dtype {dtype}")
        initializers[name] = {"key": key, "dtype": dtype, "shape": list(array.shape)}
        value.const_value = ir.ExternalTensor(
            location=key, offset=0, length=array.nbytes, dtype=tensor.dtype, shape=tensor.shape, name=name
        )
    _strip_debug_metadata(ir, model)
    branch = {"inputs": [v.name for v in model.graph.inputs], "outputs": [v.name for v in model.graph.outputs]}
    header = {
        "version": BLOB_VERSION,
        "initializers": initializers,
        "selector": None,
        "branches": [branch],
        "branch": 0,
        "fusions": fusions,
    }
    return pack(header, ir.to_proto(model).SerializeToString())


def _sharing_groups(headers: list[dict[str, Any]], compile_specs: list[list[CompileSpec]]) -> list[list[int]]:
    """The partitions that may share a session, as lists of indices: equal session settings, and
    connected by the weights they read. Every call of a model runs each branch's selection, so
    partitions that share nothing are not made to pay for one another."""
    first_reader: dict[tuple[Any, str], int] = {}
    pairs = []
    for index, (header, specs) in enumerate(zip(headers, compile_specs, strict=True)):
        settings = _Options(specs).session_settings()
        for entry in header["initializers"].values():
            pairs.append((index, first_reader.setdefault((settings, entry["key"]), index)))
    return components(range(len(headers)), pairs)


def _linked(
    parts: list[tuple[dict[str, Any], memoryview]], compile_specs: list[CompileSpec], store: NamedDataStore
) -> list[bytes]:
    """The partitions' blobs (each unpacked) as branches of one model, stored as named data that each blob names.

    The combined model is loaded into ONNX Runtime (packing nothing) before it is accepted; a
    ``_Refused`` if it cannot be made or loaded.
    """
    onnx = _require("onnx")
    table: dict[str, dict[str, Any]] = {}
    external = []
    for header, _ in parts:
        names = {}
        for name, entry in header["initializers"].items():
            shared = f"{entry['key']}.{entry['dtype']}.{'x'.join(map(str, entry['shape']))}"
            names[name], table[shared] = shared, entry
        external.append(names)
    try:
        model, branches = combined_model(onnx, [bytes(payload) for _, payload in parts], external)
    except CombineError as e:
        raise _Refused(str(e)) from e
    except Exception as e:  # a model this combination does not foresee: the partitions stay apart
        raise _Refused(f"they cannot be combined ({type(e).__name__}: {first_line(e)})") from e
    header = {
        "version": BLOB_VERSION,
        "initializers": dict(sorted(table.items())),
        "selector": SELECTOR,
        "branches": [{"inputs": branch.inputs, "outputs": branch.outputs} for branch in branches],
    }
    onnx_bytes = model.SerializeToString()
    try:
        _Model(header, memoryview(onnx_bytes), compile_specs, store.data_map(), pack_weights=False)
    except Exception as e:
        raise _Refused(f"ONNX Runtime refused the combined model ({first_line(e)})") from e
    key = store.add_by_content(pack(header, onnx_bytes))
    keys = sorted({key, *(entry["key"] for entry in table.values())})
    linked = {"version": BLOB_VERSION, "model": key, "keys": keys}
    return [pack(linked | {"branch": i, "fusions": h.get("fusions", {})}, b"") for i, (h, _) in enumerate(parts)]


def _read_weights_in_place(ir: ModuleType, model: Any) -> None:
    """Each product with a transposed float weight, ``MatMul(x, Transpose(w))``, becomes
    ``FusedMatMul(x, w, transB=1)``: the optimizer would fold the transpose into a transposed
    copy of ``w`` (ONNX Runtime too, at every session), where ONNX Runtime's kernel reads ``w``
    as it is.
    """
    for node in list(model.graph):
        transpose = _weight_transpose(ir, node)
        if transpose is None:
            continue
        attributes = {"transA": 0, "transB": 1, "alpha": 1.0}
        product = ir.node("FusedMatMul", [node.inputs[0], transpose.inputs[0]], attributes, domain="com.microsoft")
        model.graph.insert_before(node, product)
        old, new = node.outputs[0], product.outputs[0]
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        name, old.name = old.name, None  # two values may not hold one name at once
        new.name, new.shape, new.type = name, old.shape, old.type
        model.graph.remove(node, safe=True)
        if not transpose.outputs[0].uses():
            model.graph.remove(transpose, safe=True)
        model.opset_imports.setdefault("com.microsoft", 1)


def _weight_transpose(ir: ModuleType, node: Any) -> Any:
    """The ``Transpose`` of a 2-D float weight (an initializer of 1 KiB or more) whose result
    ``node``, a ``MatMul``, multiplies by; None if it is not such a product."""
    standard = ("", "ai.onnx")
    if node.op_type != "MatMul" or node.domain not in standard or len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    transpose = node.inputs[1].producer()
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in standard:
        return None
    weight, perm = transpose.inputs[0], transpose.attributes.get("perm")
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    if tensor.nbytes < _SMALLEST_SHARED or (perm is not None and list(perm.as_ints()) != [1, 0]):
        return None
    return transpose


def _optimize(model: Any) -> None:
    """What the exporter's ``optimize=True`` does: constant folding, clean-up and ONNX's own fusions."""
    optimizer = _require("onnxscript.optimizer")
    onnx_fusions = _require("onnxscript.rewriter.onnx_fusions")
    optimizer.optimize_ir(model)
    onnx_fusions.fuse(model)


def _root_cause(error: BaseException) -> str:
    """The root of an exporter error's chain, on one line: the exporter wraps it in pages of advice."""
    for _ in range(16):
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if cause is None:
            break
        error = cause
    return f"{type(error).__name__}: {first_line(error)}"


def _fuse(model: Any) -> dict[str, int]:
    """Rewrite ``model`` in place into ONNX Runtime's fused kernels; the count of each fusion applied."""
    ort_fusions = _require("onnxscript.rewriter.ort_fusions")
    try:
        with _quiet_exporter():
            _, counts = ort_fusions.optimize_for_ort(model)
    except Exception as e:
        raise _FusionError(f"onnxscript's fusions for ONNX Runtime failed ({type(e).__name__}: {e})") from e
    return {name: count for name, count in sorted(counts.items()) if count}


def _strip_debug_metadata(ir: ModuleType, model: Any) -> None:
    """Drop the exporter's per-node stack traces and module paths: most of a model's bytes."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
        for value in node.outputs:
            value.metadata_props.clear()
    for value in (*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()):
        value.metadata_props.clear()


class _Options:
    """The backend's compile specs, parsed and checked: an unknown key or a bad value is a ``ValueError``."""

    _KEYS = ("disable_prepacking", "fusions", "graph_optimization_level", "intra_op_num_threads")

    def __init__(self, compile_specs: list[CompileSpec]) -> None:
        values = {spec.key: spec.value.decode("utf-8", "replace") for spec in compile_specs}
        unknown = sorted(set(values) - set(self._KEYS))
        if unknown:
            raise ValueError(f"unknown compile spec {', '.join(map(repr, unknown))}: the keys are {list(self._KEYS)}")
        self.threads = _integer(values, "intra_op_num_threads", 0)
        self.level = values.get("graph_optimization_level", "all")
        if self.level not in _OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization_level {self.level!r}: use one of {sorted(_OPTIMIZATION_LEVELS)}")
        self.fusions = _flag(values, "fusions", True)
        self.prepacking = not _flag(values, "disable_prepacking", False)

    def session_settings(self) -> tuple[int, str, bool]:
        """What a session is made with: delegates whose specs give equal settings may share one."""
        return self.threads, self.level, self.prepacking

    def session_options(self, pack_weights: bool = True) -> Any:
        """``pack_weights=False``: no packed copies, whatever the specs say (a session only checked)."""
        ort = _require("onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPTIMIZATION_LEVELS[self.level])
        options.add_session_config_entry("session.disable_prepacking", "0" if self.prepacking and pack_weights else "1")
        options.add_session_config_entry("session.load_model_format", "ONNX")  # never ORT's own format
        return options


def _integer(values: dict[str, str], key: str, default: int) -> int:
    text = values.get(key)
    if text is None:
        return default
    if not text.isdigit():
        raise ValueError(f"{key} {text!r}: use a number of threads (0: one per core)")
    return int(text)


def _flag(values: dict[str, str], key: str, default: bool) -> bool:
    text = values.get(key)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{key} {text!r}: use '0' or '1'")
    return text == "1"


def _handle(processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> _Delegate:
    """A delegate's branch of its model's session: the one every blob naming that model shares."""
    header, payload = _unpacked(processed)
    branch = header.get("branch")
    key = header.get("model")
    if key is None:
        model = _Model(header, payload, compile_specs, named_data)
    else:
        model = _shared_model(_model_key(key, named_data), compile_specs, named_data)
    if type(branch) is not int or not 0 <= branch < len(model.branches):
        raise FormatError(f"onnxruntime blob: branch {branch!r:.80} of a model with {len(model.branches)} branches")
    return _Delegate(model, branch)


def _unpacked(processed: memoryview) -> tuple[dict[str, Any], memoryview]:
    """A blob's header and payload, a version-1 blob's header in version 2's terms."""
    header, payload = unpack(processed, BLOB_VERSION, "onnxruntime", older=(1,))
    if header["version"] == 1:  # one partition's model: inputs and outputs in the header
        header = {
            "initializers": header.get("initializers"),
            "selector": None,
            "branch": 0,
            "branches": [{"inputs": header.get("inputs"), "outputs": header.get("outputs")}],
        }
    return header, payload


def _model_key(key: Any, named_data: NamedDataMap) -> str:
    """The named data a blob names as its model, checked to be in the program."""
    if not isinstance(key, str):
        raise FormatError(f"onnxruntime blob: its model is named by {key!r:.80}, not a named-data key")
    if key not in named_data:
        raise FormatError(f"onnxruntime blob: its model, named data {key!r:.80}, is not in the program")
    return key


def _model_of(processed: memoryview, named_data: NamedDataMap) -> tuple[dict[str, Any], memoryview]:
    """The model a blob runs, in the blob or in the named data it names: its header and its ONNX bytes."""
    header, payload = _unpacked(processed)
    if header.get("model") is None:
        return header, payload
    return _stored_model(_model_key(header["model"], named_data), named_data)


def _stored_model(key: str, named_data: NamedDataMap) -> tuple[dict[str, Any], memoryview]:
    """The model stored as named data ``key``: its header and its ONNX bytes."""
    return unpack(named_data.get_data(key), BLOB_VERSION, "onnxruntime model")


class _ProgramModels:
    """The models of one loaded program's named data: each one's session while a delegate uses it,
    and a lock per model, so two delegates never build one session twice and other models need not wait."""

    def __init__(self) -> None:
        self.sessions: weakref.WeakValueDictionary[Any, _Model] = weakref.WeakValueDictionary()
        self.building: dict[Any, threading.Lock] = {}


_PROGRAM_MODELS: weakref.WeakKeyDictionary[NamedDataMap, _ProgramModels] = weakref.WeakKeyDictionary()
_PROGRAM_MODELS_LOCK = threading.Lock()


def _shared_model(key: str, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> _Model:
    """The session of the model stored as named data ``key``: one per named data and settings, while used."""
    settings = _Options(compile_specs).session_settings()
    with _PROGRAM_MODELS_LOCK:
        models = _PROGRAM_MODELS.setdefault(named_data, _ProgramModels())
        building = models.building.setdefault((key, settings), threading.Lock())
    with building:
        model = models.sessions.get((key, settings))
        if model is None:
            model = _Model(*_stored_model(key, named_data), compile_specs, named_data)
            with _PROGRAM_MODELS_LOCK:
                models.sessions[(key, settings)] = model
        return model


class _Model:
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
        ort = _require("onnxruntime")
        self._selector = header.get("selector")
        self.branches = _branches(header.get("branches"))
        if not (self._selector is None and len(self.branches) == 1 or isinstance(self._selector, str)):
            count, selector = len(self.branches), self._selector
            raise FormatError(f"onnxruntime blob: {count} branches and the selector {selector!r:.80}")
        settings = _Options(compile_specs)
        prepared = None
        if pack_weights and settings.prepacking and cache_directory() is not None:
            prepared = find_entry(_PREPARED, _prepared_key(header, model, settings, named_data))
        session = _prepared_session(ort, prepared, settings) if prepared is not None else None
        self._files: dict[str, memoryview] = {}
        if session is None:
            session, self._files = _built_session(header, model, settings, named_data, pack_weights)
        self._session = session  # self._files: the session reads them, keep them alive as long as it lives
        _return_freed_memory()
        # The binding's run, without the Python wrapper's per-call checks of names we already know.
        self._run = self._session._sess.run
        _check_names(self._session, self.branches, self._selector)
        self._unread = _unread_inputs(self._session, self._selector)

    def run(self, branch: int, inputs: list[Any]) -> list[torch.Tensor]:
        names, outputs = self.branches[branch]
        feed = dict(self._unread)
        feed.update((name, _as_numpy(value)) for name, value in zip(names, inputs, strict=True))
        if self._selector is not None:
            feed[self._selector] = np.array(branch, dtype=np.int64)
        return [torch.from_numpy(array) for array in self._run(outputs, feed, None)]


def _built_session(
    header: dict[str, Any],
    model: memoryview,
    settings: _Options,
    named_data: NamedDataMap,
    pack_weights: bool = True,
    prepared_into: Path | None = None,
) -> tuple[Any, dict[str, memoryview]]:
    """A session of ``model`` and the views of named data it reads (in place: keep them while it lives).

    ``prepared_into``: a directory where ONNX Runtime also writes the optimized model and its packed weights.
    """
    ort = _require("onnxruntime")
    initializers = _initializer_table(header)
    packing = pack_weights and settings.prepacking
    with named_data.reading(_external_keys(initializers)) as files:  # checksums checked meanwhile
        supplied = {name: (entry["key"], len(files[entry["key"]])) for name, entry in initializers.items()}
        model_bytes = confined_model(_require("onnx"), bytes(model), supplied, "onnxruntime blob")
        options = settings.session_options(pack_weights)
        if prepared_into is not None:
            _save_prepared(options, prepared_into)
        with _pages_released_while_packing(named_data, list(files) if packing else []):
            session = _session(ort, model_bytes, options, files)
    return session, files


class _Delegate:
    """One delegate: a branch of a model's session."""

    def __init__(self, model: _Model, branch: int) -> None:
        self.model, self.branch = model, branch
        self._arity = len(model.branches[branch][0])

    def __call__(self, inputs: list[Any]) -> list[torch.Tensor]:
        if len(inputs) != self._arity:
            raise ValueError(f"expected {self._arity} inputs, got {len(inputs)}")
        return self.model.run(self.branch, inputs)


def _branches(table: Any) -> list[tuple[list[str], list[str]]]:
    """Each branch's input and output names, checked to be lists of names."""
    branches = []
    for entry in table if isinstance(table, list) and table else [None]:
        inputs, outputs = (entry.get(field) if isinstance(entry, dict) else None for field in ("inputs", "outputs"))
        if not (_names(inputs) and _names(outputs)):
            raise FormatError(f"onnxruntime blob: a branch is not lists of input and output names: {entry!r:.200}")
        branches.append((inputs, outputs))
    return branches


def _names(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _check_names(session: Any, branches: list[tuple[list[str], list[str]]], selector: str | None) -> None:
    """Every name the header gives is one of the model's inputs or outputs: a ``FormatError`` now, not at a call."""
    inputs, outputs = {v.name for v in session.get_inputs()}, {v.name for v in session.get_outputs()}
    missing = [name for names, _ in branches for name in names if name not in inputs]
    missing += [name for _, names in branches for name in names if name not in outputs]
    missing += [selector] if selector is not None and selector not in inputs else []
    if missing:
        raise FormatError(
            f"onnxruntime blob: its header names {missing[0]!r:.80}, which the model neither takes nor returns"
        )


# The numpy dtype of each input type ONNX Runtime names ("tensor(float)"); numpy has no bfloat16.
_ORT_NAMES = {"float32": "float", "float64": "double"}
_NUMPY_TYPES = {f"tensor({_ORT_NAMES.get(n, n)})": np.dtype(n) for n in _ONNX_TYPES if n != "bfloat16"}


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


_RELEASE_INTERVAL = 0.02  # seconds between releases of the pages a packing session has read
_TRIMS_EVERY = 10  # releases between two returns of the heap (a walk of all of it)


@contextlib.contextmanager
def _pages_released_while_packing(named_data: NamedDataMap, keys: list[str]) -> Iterator[None]:
    """While ONNX Runtime packs the weights ``keys`` name (reading each once), and when it is done,
    let the pages it has read go, so the process never holds the file's pages and the packed copy
    together: the first call's peak stays near the packed copy's size, not twice it. A page read
    again comes back from the file."""
    if not keys:
        yield
        return
    done = threading.Event()

    def release() -> None:
        sweeps = 0
        while not done.wait(_RELEASE_INTERVAL):
            for key in keys:
                named_data.release_pages(key)
            sweeps += 1
            if sweeps % _TRIMS_EVERY == 0:  # each reading kernel packs its own copy; all but one are dropped
                _return_freed_memory()

    releasing = threading.Thread(target=release, name="torchdelegate-release-pages", daemon=True)
    releasing.start()
    try:
        yield
    finally:
        done.set()
        releasing.join()
        for key in keys:  # the packed copies are read now; the rest come back when read
            named_data.release_pages(key)


@cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl has none
    except Exception:
        return None


def _return_freed_memory() -> None:
    """Hand the heap memory a session's creation freed back to the system.

    Packing weights frees weight-sized temporaries, which glibc keeps in the process (its
    threshold for mapping large blocks on their own rises as they are freed): without this a
    program of two methods stays resident at about 1.5 times its weights instead of one.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# The machine cache's entries of models optimized and their weights packed on this machine.
_PREPARED = "onnxruntime"
_PREPARED_MODEL, _PREPARED_WEIGHTS = "model.onnx", "weights.data"


def _prepare(processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
    """Optimize the blob's model and pack its weights for this machine, into the machine cache."""
    settings = _Options(compile_specs)
    if not settings.prepacking:
        return None
    header, payload = _model_of(processed, named_data)
    key = _prepared_key(header, payload, settings, named_data)
    with entry_lock(_PREPARED, key):  # another process preparing this model: its entry is used
        place = find_entry(_PREPARED, key, verify=True, quiet=True)  # a damaged one is written again
        if place is None:
            with new_entry(_PREPARED, key) as scratch:
                _built_session(header, payload, settings, named_data, prepared_into=scratch)
            _return_freed_memory()
            place = entry_path(_PREPARED, key)
        size = entry_size(place) / 1e6
    return f"onnxruntime model {key[:12]}, optimized and packed for this machine: {size:,.1f} MB in {place}"


def _prepared_key(header: dict[str, Any], model: memoryview, settings: _Options, named_data: NamedDataMap) -> str:
    """What a prepared model is made from: the model, every weight's bytes (by digest: a model names its
    weights by key, and a file's key says nothing of its bytes), the settings and ONNX Runtime's build."""
    ort = _require("onnxruntime")
    content = {
        "onnxruntime": [ort.__version__, ort.get_build_info()],
        "optimization": settings.level,
        "header": header,
        "model": hashlib.sha256(model).hexdigest(),
        "weights": {key: named_data.digest(key) for key in _external_keys(_initializer_table(header))},
    }
    return entry_key(_PREPARED, content)


def _prepared_session(ort: ModuleType, place: Path, settings: _Options) -> Any | None:
    """A session of the model ``prepare`` optimized, its packed weights mapped from the entry's file (the
    process packs none of its own), once the entry's digests are checked (while ONNX Runtime loads it);
    None, with a warning, if the entry is damaged or ONNX Runtime refuses it."""
    options = settings.session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized when prepared
    check = EntryCheck(place)
    try:
        session = ort.InferenceSession(
            str(place / _PREPARED_MODEL), options, providers=["CPUExecutionProvider"], read_config_from_model=0
        )
    except Exception as e:
        check.problem()
        why: str | None = f"ONNX Runtime refused it ({first_line(e)})"
    else:
        why = check.problem()
    if why is None:
        return session
    warnings.warn(
        f"onnxruntime: the prepared model in {place} is not used: {why}; the weights are packed again; "
        "`torchdelegate prepare FILE` writes it again",
        stacklevel=2,
    )
    return None


def _save_prepared(options: Any, directory: Path) -> None:
    """Have the session being built also write its optimized model and packed weights into ``directory``."""
    options.optimized_model_filepath = str(directory / _PREPARED_MODEL)
    options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", _PREPARED_WEIGHTS)
    smallest = str(_SMALLEST_SHARED)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", smallest)
    options.log_severity_level = 3  # not its warning that the model suits this machine only: the entry is keyed so


def _initializer_table(header: dict[str, Any]) -> dict[str, Any]:
    """A model's header's initializers: name -> entry naming its named data."""
    initializers = header.get("initializers")
    if not isinstance(initializers, dict):
        raise FormatError("onnxruntime blob: its initializers are not a table")
    return initializers


def _external_keys(initializers: dict[str, Any]) -> list[str]:
    """The named data the model's external tensors name as their files, sorted."""
    keys = set()
    for name, entry in initializers.items():
        key = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key, str):
            raise FormatError(f"onnxruntime blob: initializer {name!r} names no named-data key")
        keys.add(key)
    return sorted(keys)


def _session(ort: ModuleType, model: bytes, options: Any, files: dict[str, memoryview]) -> Any:
    """An InferenceSession of ``model`` whose external tensors are read in place from ``files``."""
    if files:
        # No copy, whatever their number: the session reads the views it is given.
        options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        options.add_external_initializers_from_files_in_memory(
            list(files), list(files.values()), [len(view) for view in files.values()]
        )
    # Settings come from compile specs only, never from the model's metadata (ORT_LOAD_CONFIG_FROM_MODEL).
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"], read_config_from_model=0)


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            value = value.detach()
        return (value if value.is_contiguous() else value.contiguous()).numpy()
    return np.asarray(value, dtype=np.int64)


@cache
def _onnx_registry() -> Any:
    with _quiet_exporter():
        registration = importlib.import_module("torch.onnx._internal.exporter._registration")
        return registration.ONNXRegistry.from_torchlib()


class OnnxRuntimePartitioner(CapabilityPartitioner):
    """Claims the ops torch's ONNX exporter can translate: the capability partitioner over
    :meth:`operator_support`.

    The exporter's own registry decides (no hard-coded list); partitions with fewer than
    ``min_partition_size`` computations are left to later partitioners, since each
    delegate call costs a session run. A subclass narrows what it claims by overriding
    :meth:`operator_support`.
    """

    def __init__(self, min_partition_size: int = 1, compile_specs: list[CompileSpec] | None = None) -> None:
        _require("onnxruntime")
        spec = DelegationSpec(OnnxRuntimeBackend.backend_id, list(compile_specs or []))
        super().__init__(self.operator_support, spec, min_partition_size=min_partition_size)

    def operator_support(self, node: Node) -> bool | str:
        """True if the exporter translates this node's op, every value it makes is a tensor, and
        every tensor it reads or makes has a dtype that ONNX Runtime's CPU provider and numpy
        share; otherwise why not."""
        if not isinstance(node.target, torch._ops.OpOverload) or not _onnx_registry().is_registered(node.target):
            return f"torch.onnx has no translation for {node.target}"
        if node.target in _TRANSLATIONS_REFUSED:
            return f"torch.onnx's translation of {node.target} makes a model ONNX Runtime refuses"
        value = node.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if not isinstance(v, torch.Tensor):
                return f"makes a non-tensor value ({type(v).__name__})"
            if v.dtype in _UNSUPPORTED_DTYPES:
                return f"makes {v.dtype}, which the CPU provider does not run"
        for source in node.all_input_nodes:
            v = source.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype in _UNSUPPORTED_DTYPES:
                return f"reads {v.dtype} ({source.name}), which the CPU provider does not run"
        return True
