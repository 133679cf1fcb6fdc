"""The Python modules whose import registers an operator namespace a program may call, for the
processes that receive a graph without having run the code that made it (compile workers).

A quantized program calls torchao's operators (``torch.ops.torchao.*``), which exist in a process
only once ``torchao.quantization`` is imported; the process that quantized imported it, a worker
compiling one of its partitions has not.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch

from torchdelegate.exported.torch_warnings import import_noise_quieted

LIBRARY_MODULES = {"torchao": "torchao.quantization"}
"""Operator namespace -> the module whose import registers it."""


def library_namespaces(graph: torch.fx.Graph) -> list[str]:
    """The namespaces of ``LIBRARY_MODULES`` that ``graph`` (and the graphs it calls) call operators of, sorted."""
    found = set()
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            found.add(target.namespace)
        if node.op == "get_attr" and isinstance(owner := graph.owning_module, torch.nn.Module):
            called = getattr(owner, str(target), None)
            if isinstance(called, torch.fx.GraphModule):
                found.update(library_namespaces(called.graph))
    return sorted(found & LIBRARY_MODULES.keys())


def import_libraries(namespaces: Iterable[str]) -> None:
    """Import the module that registers each of ``namespaces`` (those ``LIBRARY_MODULES`` names), quietly;
    an ``ImportError`` saying what to install when one is missing."""
    for namespace in sorted(set(namespaces) & LIBRARY_MODULES.keys()):
        module = LIBRARY_MODULES[namespace]
        try:
            with import_noise_quieted():
                importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"the program calls torch.ops.{namespace} operators, which {module} registers, and it cannot be "
                f"imported here ({e}); install it in this environment"
            ) from e
