"""A partition as an ONNX model: torch's exporter, weights read in place, onnxscript's fusions for
ONNX Runtime (undone when they fail), initializers moved out into named data, and the model
checked by loading it into ONNX Runtime before its weights are stored.

What becomes of the model's initializers while it is optimized (weights lifted, read in place, zeros
made at load) is ``initializers``'; the quantized layers' private nodes and their kernels are
``blockwise_translation``'s and ``blockwise``'s.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch.export import ExportedProgram

from torchdelegate.backends.blob import WEIGHT_ALIGNMENT, pack
from torchdelegate.backends.linear_recomposition import recompose_linear
from torchdelegate.backends.onnxruntime.attention import fused_attention
from torchdelegate.backends.onnxruntime.blob_header import initializer_location, unpacked
from torchdelegate.backends.onnxruntime.blockwise import kernel_products
from torchdelegate.backends.onnxruntime.blockwise_translation import translations as blockwise_translations
from torchdelegate.backends.onnxruntime.cache_writes import cache_writes_in_place
from torchdelegate.backends.onnxruntime.initializers import (
    lift_weights,
    read_weights_in_place,
    restore_weights,
    state_by_size,
    zeros_made_at_load,
)
from torchdelegate.backends.onnxruntime.node_sources import onnx_node_handles
from torchdelegate.backends.onnxruntime.packed_attention import packed_attention_inputs
from torchdelegate.backends.onnxruntime.row_blocks import row_block_products
from torchdelegate.backends.onnxruntime.session import Model
from torchdelegate.backends.onnxruntime.settings import BLOB_VERSION, ONNX_TYPES, SMALLEST_SHARED, Options, require
from torchdelegate.backends.onnxruntime.translation import onnx_program_of
from torchdelegate.delegate.backend_details import PreprocessResult
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import PreprocessError, first_line
from torchdelegate.exported.structural_copy import with_identifier_state_names
from torchdelegate.exported.torch_warnings import loggers_quieted
from torchdelegate.quantization.embedding import with_blockwise_embeddings
from torchdelegate.quantization.linear import with_blockwise_linears


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter reports progress on stdout and warns about optional packages; keep it quiet."""
    names = ("torch.onnx", "onnxscript", "onnx_ir", "torch.onnx._internal")
    with loggers_quieted(names, logging.ERROR), warnings.catch_warnings(), contextlib.redirect_stdout(None):  # type: ignore[type-var]
        warnings.simplefilter("ignore")
        yield


def export_partition(
    program: ExportedProgram, compile_specs: list[CompileSpec], store: NamedDataStore, where: str
) -> PreprocessResult:
    """The partition's blob, checked by loading it into ONNX Runtime, with its debug handle map
    (``node_sources.py``); its weights go to ``store``.

    If onnxscript's fusions fail or ONNX Runtime refuses the fused model (a fusion rule
    gone wrong), the partition is exported again unfused, with a warning; an unfused model
    that ONNX Runtime refuses is a ``PreprocessError``.
    """
    try:
        options = Options(compile_specs)
    except ValueError as e:
        raise PreprocessError(f"onnxruntime: {where}: {e}") from None
    program, layers = with_blockwise_linears(cache_writes_in_place(recompose_linear(program)))
    program, lookups = with_blockwise_embeddings(program)
    quantized = layers + lookups
    if options.fusions:
        try:
            return _accepted_blob(program, True, compile_specs, store, where, quantized)
        except Refused as e:
            warnings.warn(
                f"onnxruntime: {where}: {e}; this partition is exported without onnxscript's fusions", stacklevel=2
            )
    try:
        return _accepted_blob(program, False, compile_specs, store, where, quantized)
    except Refused as e:
        raise PreprocessError(f"onnxruntime: {where}: {e}") from e


def warm_up_exporter() -> None:
    """Export and check a one-operation model, so that this process's first partition does not
    pay for what the exporter, onnxscript's fusions and ONNX Runtime build once per process
    (worker processes run it as they start, while the lowering partitions)."""

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x + 1)

    program = torch.export.export(Tiny(), (torch.zeros(2, 2),)).run_decompositions({})
    export_partition(program, [], NamedDataStore(), "a warm-up model")


class Refused(Exception):
    """The partition's model could not be made or loaded this way."""


class FusionError(Refused):
    """onnxscript's fusions raised: the partition is exported without them."""


def _accepted_blob(
    program: ExportedProgram,
    fuse: bool,
    compile_specs: list[CompileSpec],
    store: NamedDataStore,
    where: str,
    quantized: int = 0,
) -> PreprocessResult:
    """The blob, once ONNX Runtime has loaded it as ``init`` will; only then do its weights join ``store``.

    The check packs no weights: a packed copy of every weight would double the lowering's memory.
    """
    attempt = NamedDataStore()
    blob, handles = _exported_blob(program, fuse, attempt, where, quantized)
    output = attempt.get_named_data_store_output()
    try:
        header, payload = unpacked(memoryview(blob))
        Model(header, payload, compile_specs, NamedDataMap(output), pack_weights=False)
    except Exception as e:  # any refusal is reported with the partition it concerns
        raise Refused(f"ONNX Runtime refused the model ({first_line(e)})") from e
    store.merge(output)
    return PreprocessResult(blob, debug_handle_map=dict(handles) or None)


def _exported_blob(
    program: ExportedProgram, fuse: bool, store: NamedDataStore, where: str, quantized: int
) -> tuple[bytes, dict[str, tuple[int, ...]]]:
    """The partition as an ONNX model whose initializers are named data, with its header; and each
    ONNX node's debug handles.

    ``quantized``: how many ``linear_blockwise`` and ``embedding_blockwise`` calls it makes (``blockwise.py``
    translates them)."""
    ir = require("onnx_ir")
    require("onnxscript")
    try:
        with quiet_exporter():
            exportable, _ = with_identifier_state_names(program)  # initializers are keyed by content, not name
            translations = blockwise_translations() if quantized else None
            onnx_program = onnx_program_of(exportable, translations)
            assert onnx_program is not None
            model = onnx_program.model
            read_weights_in_place(ir, model)
            lifted = lift_weights(model, state_by_size(exportable))
            _optimize(model)
    except Exception as e:
        raise PreprocessError(f"onnxruntime: {where}: torch's ONNX exporter failed: {_root_cause(e)}") from e
    try:
        attention, unfused = fused_attention(ir, model) if fuse else (0, [])
        fusions = fuse_for_ort(model) if fuse else {}
    finally:
        restore_weights(model, lifted)
    if attention:
        fusions = dict(sorted({**fusions, "GroupQueryAttention": attention}.items()))
    before = set(model.graph.initializers)
    try:
        products = kernel_products(ir, model)
    except ValueError as e:
        raise PreprocessError(f"onnxruntime: {where}: {e}") from e
    packed = packed_attention_inputs(model) if attention else 0
    if packed:
        products["packed_qkv"] = packed
    blocks = row_block_products(ir, model) if fuse else {}
    if blocks:
        products["row_blocks"] = len(blocks)
    fusions = dict(sorted({**fusions, **products}.items()))
    initializers = {}
    shared = {value.name for value, _ in lifted} | set(blocks)
    zeros_made_at_load(ir, model, shared | (set(model.graph.initializers) - before))  # weights are not read
    weight_keys: dict[str, str] = {}  # each blocked weight's key, stored (and hashed) once
    for name, value in sorted(model.graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or (tensor.nbytes < SMALLEST_SHARED and name not in shared):
            continue  # shape-like constants stay in the model: ONNX Runtime reads them while loading it
        block = blocks.get(name)
        if block is None:
            key = _stored(ir, tensor, store)
        else:
            if block.weight not in weight_keys:
                weight_keys[block.weight] = _stored(ir, block.tensor, store)
            key = weight_keys[block.weight]
        dtype = "bfloat16" if tensor.dtype == ir.DataType.BFLOAT16 else str(tensor.dtype.numpy())
        if dtype not in ONNX_TYPES:
            raise PreprocessError(f"onnxruntime: {where}: initializer {name!r} has unsupported dtype {dtype}")
        entry: dict[str, Any] = {"key": key, "dtype": dtype, "shape": list(tensor.shape.numpy())}
        if block is not None:
            entry["offset"] = block.offset
        initializers[name] = entry
        value.const_value = ir.ExternalTensor(
            location=initializer_location(entry), offset=0, length=tensor.nbytes, dtype=tensor.dtype,
            shape=tensor.shape, name=name,
        )  # fmt: skip
    traced = onnx_program.exported_program
    handles = onnx_node_handles(ir, model, traced, program) if traced is not None else {}
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
    if unfused:  # why attention over a cache was left unfused, for the lowering's report
        header["unfused"] = {"GroupQueryAttention": unfused}
    # Not compressed: the compile cache swaps the weights' keys where the blob names them in the clear.
    return pack(header, ir.to_proto(model).SerializeToString()), handles


def _stored(ir: ModuleType, tensor: Any, store: NamedDataStore) -> str:
    """The key of ``tensor``'s bytes as named data, stored once by content: a view of the exporter's
    array (bfloat16's bytes seen as 16-bit integers), or a copy of bytes numpy cannot view."""
    array = np.ascontiguousarray(tensor.numpy())
    if tensor.dtype == ir.DataType.BFLOAT16:
        array = array.view(np.uint16)
    viewable = array.size and array.dtype.kind in "biuf" and array.dtype.itemsize in (1, 2, 4, 8)
    return store.add_by_content(torch.from_numpy(array) if viewable else array.tobytes(), alignment=WEIGHT_ALIGNMENT)


def _optimize(model: Any) -> None:
    """What the exporter's ``optimize=True`` does: constant folding, clean-up and ONNX's own fusions.

    onnxscript's ``optimize_ir``, pass for pass, with its default rewrite rules (:func:`_rewrite_rules`)."""
    ir = require("onnx_ir")
    common_passes = require("onnx_ir.passes.common")
    rewriter = require("onnxscript.rewriter")
    constant_folding = require("onnxscript.optimizer._constant_folding")
    onnx_fusions = require("onnxscript.rewriter.onnx_fusions")
    folding = constant_folding.FoldConstantsPass(
        shape_inference=True,
        input_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        should_fold=lambda node: None,
    )
    rounds = ir.passes.PassManager(
        [
            folding,
            rewriter.RewritePass(_rewrite_rules(rewriter)),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
        ],
        steps=2,
        early_stop=True,
    )
    ir.passes.Sequential(
        common_passes.InlinePass(),
        rounds,
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)
    onnx_fusions.fuse(model)


def _rewrite_rules(rewriter: ModuleType) -> tuple[Any, ...]:
    """onnxscript's default rewrite rules, each rule of several output nodes tried only on the nodes its
    first output node can be (``SlicesSplit``): onnxscript lists the whole graph before it looks at
    the node, for every node, which made the optimizer quadratic in the model's nodes (4.5 of 6.4 s
    on a 200M Llama). The same rewrites, in the same order."""
    return tuple(
        rule if rule._target_pattern.has_single_output_node else _FirstNodeFiltered(rule)
        for rule in rewriter._DEFAULT_REWRITE_RULES
    )


class _FirstNodeFiltered:
    """A rewrite rule that answers no match at once for a node its pattern's first output node
    cannot match (another operator or domain), as its matcher would after listing the graph."""

    def __init__(self, rule: Any) -> None:
        self._rule = rule
        self._first = rule._target_pattern.output_nodes[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rule, name)

    def __repr__(self) -> str:
        return repr(self._rule)

    def try_rewrite(self, model: Any, graph_or_function: Any, node: Any, **options: Any) -> Any:
        if not (self._first.op.matches(node.op_type) and self._first.domain.matches(node.domain)):
            return None
        return self._rule.try_rewrite(model, graph_or_function, node, **options)


def _root_cause(error: BaseException) -> str:
    """The root of an exporter error's chain, on one line: the exporter wraps it in pages of advice."""
    for _ in range(16):
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if cause is None:
            break
        error = cause
    return f"{type(error).__name__}: {first_line(error)}"


def fuse_for_ort(model: Any) -> dict[str, int]:
    """Rewrite ``model`` in place into ONNX Runtime's fused kernels; the count of each fusion applied."""
    ort_fusions = require("onnxscript.rewriter.ort_fusions")
    try:
        with quiet_exporter():
            _, counts = ort_fusions.optimize_for_ort(model)
    except Exception as e:
        raise FusionError(f"onnxscript's fusions for ONNX Runtime failed ({type(e).__name__}: {e})") from e
    return {name: count for name, count in sorted(counts.items()) if count}


def _strip_debug_metadata(ir: ModuleType, model: Any) -> None:
    """Drop the exporter's per-node stack traces and module paths: most of a model's bytes."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
        for value in node.outputs:
            value.metadata_props.clear()
    for value in (*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()):
        value.metadata_props.clear()
