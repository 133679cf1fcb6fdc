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


def operators_called(root: torch.fx.GraphModule) -> set[torch._ops.OpOverload]:
    """The operators ``root``'s graph and the graphs it holds (control-flow branches) call."""
    return {
        node.target
        for module in root.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    }


def library_namespaces(root: torch.fx.GraphModule) -> list[str]:
    """The namespaces of ``LIBRARY_MODULES`` whose operators ``root`` calls, sorted."""
    return sorted({operator.namespace for operator in operators_called(root)} & LIBRARY_MODULES.keys())


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
