"""The ONNX Runtime backend: partitions exported to ONNX, run by ONNX Runtime's CPU provider.

Ahead of time each partition is exported with torch's ONNX exporter (dynamo, onnxscript);
every initializer leaves the model and becomes named data keyed by the SHA-256 of its
bytes, so a weight that ``prefill`` and ``decode`` (or two partitions) use is stored once.
A model is a small JSON header (each initializer's key, dtype and shape; each branch's
inputs and outputs) and the ONNX model, whose weights are external references: the float
parameters and persistent buffers whatever their size, other initializers of 1 KiB or more
(smaller ones, such as the axes of a reshape, stay inside: ONNX Runtime reads them while
loading the model).

Once every partition of every method is compiled, those with equal session settings that
read weights in common become the branches of one model (``branches``), stored once as named
data that their blobs name: ONNX Runtime packs weights per session, so one session packs each
weight once for every method. At run time the delegates of a program share that model's one
``InferenceSession``. Each external initializer names its named data as its file, which ONNX
Runtime reads in place (a view of the mapped file: no copy); once the session has packed them,
their pages leave the process's resident memory. ``prepare`` keeps a model optimized and its
weights packed for this machine in the machine cache; a session made from there maps the packed
weights from the entry's file instead of packing a copy of its own. Session options come from
compile specs: ``intra_op_num_threads`` (an integer), ``graph_optimization_level``
(``disable``, ``basic``, ``extended``, ``all``), ``disable_prepacking`` (``1`` reads the
weights as they are; by default ONNX Runtime packs them for speed).

Ahead of time, the exported model is rewritten with onnxscript's fusions for ONNX Runtime
(attention, skip + layer normalization, bias + GELU, rotary embeddings, ...) into the
provider's fused kernels (42 nodes instead of 104 for the benchmark stack). The compile spec
``fusions`` = ``0`` keeps the exporter's model as it is; the fusions applied are recorded
in the blob's header.

Needs ``pip install torchdelegate[onnxruntime]``.

The package's modules, in the order a blob meets them: ``settings`` (the id its delegates are
filed under, compile specs, the blob version, the optional dependencies), ``partitioner``,
``cache_writes`` (a KV cache's writes where it lies), ``attention`` (attention over that cache on
``GroupQueryAttention``), ``onnx_export`` (a partition's model: ``blockwise_translation``
exports quantized layers as private nodes, ``initializers`` keeps the weights out of what the optimizer
computes, ``blockwise`` and ``nbits_packing`` put the private nodes on the integer kernels),
``linking`` and ``branches`` (partitions joined into one model), ``blob_header`` (what a blob
names, checked), ``confinement`` (what a model may reach), ``in_place`` (the outputs a session
writes into its inputs' memory), ``kept_binding`` (those calls' IO binding), ``session`` (a
delegate's session),
``prepared`` (the machine cache's entries) and ``packing_memory`` (the pages and heap packing
leaves behind); ``array_hooks`` joins the run-time ones behind :class:`OnnxRuntimeArrays` (numpy arrays,
no torch) and ``backend`` all of them behind :class:`OnnxRuntimeBackend`.
"""

import importlib
from typing import TYPE_CHECKING, Any

from torchdelegate.backends.onnxruntime.settings import BLOB_VERSION

if TYPE_CHECKING:
    from torchdelegate.backends.onnxruntime.backend import OnnxRuntimeBackend
    from torchdelegate.backends.onnxruntime.partitioner import OnnxRuntimePartitioner

# Imported when asked for: the backend's class and partitioner import torch, which a process running a
# file on ``array_hooks`` (numpy arrays) never does.
_LAZY = {
    "OnnxRuntimeBackend": "torchdelegate.backends.onnxruntime.backend",
    "OnnxRuntimePartitioner": "torchdelegate.backends.onnxruntime.partitioner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["BLOB_VERSION", "OnnxRuntimeBackend", "OnnxRuntimePartitioner"]
