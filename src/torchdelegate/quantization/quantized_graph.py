"""The graph surgery of quantizing an exported program: new placeholders for each quantized weight's
integers, scales and zero points, read through torchao's ops where the float weight was read.

``quantization.recipes`` decides which layers are quantized and how; this module only rewrites.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument
from torch.fx import Graph, Node

_aten = torch.ops.aten


def weight_placeholder(weight: Node) -> Node:
    """The placeholder a linear layer's weight reads: itself, or the one a conversion to float32
    reads (a weight bound as a bfloat16 checkpoint stores it)."""
    if weight.op == "call_function" and weight.target is _aten._to_copy.default and isinstance(weight.args[0], Node):
        source = weight.args[0]
        if source.op == "placeholder" and set(weight.kwargs) <= {"dtype"}:
            return source
    return weight


class QuantizedGraph:
    """The new placeholders, nodes and state of one program, added layer by layer: each quantized
    layer's weight read through torchao's ``dequantize_affine`` of its integers (and its input through
    torchao's per-token int8 quantization for dynamic activations), as a program exported after
    torchao's ``quantize_`` reads it."""

    def __init__(self, graph: Graph, signature: ExportGraphSignature, state: dict[str, Any], ops: Any) -> None:
        self.graph, self.state, self.ops = graph, state, ops
        self.specs = list(signature.input_specs)
        self.outputs = list(signature.output_specs)
        self.new_specs: list[InputSpec] = []
        self.placeholders: dict[str, Node] = {}
        self.sources: dict[str, torch.Tensor] = {}  # each new placeholder's tensor, as quantizing made it
        self.replaced: set[str] = set()
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        kinds = [s.kind for s in self.specs]
        last = max((i for i, k in enumerate(kinds) if k == InputKind.PARAMETER), default=-1)
        self.anchor = placeholders[last + 1] if last + 1 < len(placeholders) else None
        self.fake_mode = next(
            (n.meta["val"].fake_mode for n in placeholders if hasattr(n.meta.get("val"), "fake_mode")), None
        )

    def _placeholder(self, target: str, tensor: torch.Tensor) -> Node:
        node = self.placeholders.get(target)
        if node is not None:
            return node
        name = "p_" + target.replace(".", "_")
        if self.anchor is not None:
            with self.graph.inserting_before(self.anchor):
                node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_after(self._last_placeholder()):
                node = self.graph.placeholder(name)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True) if self.fake_mode else tensor
        self.state[target] = torch.nn.Parameter(tensor, requires_grad=False)
        self.new_specs.append(InputSpec(InputKind.PARAMETER, TensorArgument(node.name), target, None))
        self.placeholders[target] = node
        self.sources[target] = tensor
        return node

    def _stem(self, weight_name: str, integers: torch.Tensor, otherwise: str) -> str:
        """The names' stem of a weight's quantized tensors: the weight's own, unless a layer or table
        that reads it quantized it otherwise (a tied head and table): then ``otherwise``."""
        made = self.sources.get(f"{weight_name}_{_PARTS[0]}")
        return weight_name if made is None or made is integers else otherwise

    def _last_placeholder(self) -> Node:
        return [n for n in self.graph.nodes if n.op == "placeholder"][-1]

    def _call(self, target: Any, args: tuple[Any, ...], like: Node) -> Node:
        node = self.graph.call_function(target, args)
        for key in ("nn_module_stack", "source_fn_stack", "stack_trace", "torch_fn"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        values = [a.meta["val"] if isinstance(a, Node) else a for a in args]
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*values)
        return node

    def layer(
        self, linear: Node, weight_name: str, tensors: tuple[torch.Tensor, ...], group: int, bits: int, dynamic: bool
    ) -> None:
        """``linear`` reading its weight from ``tensors`` (integers, scales, zero points) in groups of
        ``group``, its input quantized to int8 per token first when ``dynamic``."""
        stem = self._stem(weight_name, tensors[0], f"{weight_name}_{bits}bit")
        nodes = [self._placeholder(f"{stem}_{part}", t) for part, t in zip(_PARTS, tensors, strict=True)]
        source, weight = linear.args[0], linear.args[1]
        assert isinstance(source, Node) and isinstance(weight, Node)
        bounds = (-8, 7) if bits == 4 else (-128, 127)
        with self.graph.inserting_before(linear):
            if dynamic:
                source = self._activation(source, linear)
            dequantized = self._call(
                self.ops[2], (nodes[0], [1, group], nodes[1], nodes[2], torch.int8, *bounds), linear
            )
        linear.args = (source, dequantized, *linear.args[2:])
        self.replaced.add(weight.name)

    def lookup(
        self, embedding: Node, weight_name: str, tensors: tuple[torch.Tensor, ...], group: int, bits: int
    ) -> None:
        """An embedding's table read through its integers' dequantization (``quantization.embedding``)."""
        stem = self._stem(weight_name, tensors[0], f"{weight_name}_embedding")
        nodes = [self._placeholder(f"{stem}_{part}", t) for part, t in zip(_PARTS, tensors, strict=True)]
        weight = embedding.args[0]
        assert isinstance(weight, Node)
        bounds = (-8, 7) if bits == 4 else (-128, 127)
        with self.graph.inserting_before(embedding):
            dequantized = self._call(
                self.ops[2], (nodes[0], [1, group], nodes[1], nodes[2], torch.int8, *bounds), embedding
            )
        embedding.args = (dequantized, *embedding.args[1:])
        self.replaced.add(weight.name)

    def _activation(self, source: Node, linear: Node) -> Node:
        """torchao's per-token asymmetric int8 quantization of ``source`` and back."""
        choose, quantize, dequantize = self.ops
        block = [1] * (source.meta["val"].dim() - 1) + [int(source.meta["val"].shape[-1])]
        bounds = (torch.int8, -128, 127)
        chosen = self._call(choose, (source, "ASYMMETRIC", block, *bounds, None, None, torch.int8), linear)
        scale = self._call(operator.getitem, (chosen, 0), linear)
        zero_point = self._call(operator.getitem, (chosen, 1), linear)
        quantized = self._call(quantize, (source, block, scale, zero_point, *bounds), linear)
        return self._call(dequantize, (quantized, block, scale, zero_point, *bounds), linear)

    def finish(self) -> None:
        """Float weights no layer reads any more leave the program (and their conversions)."""
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.name in self.replaced and not node.users:
                source = weight_placeholder(node)
                self.graph.erase_node(node)
                self.replaced.add(source.name)
        for node in list(self.graph.nodes):
            if node.op == "placeholder" and node.name in self.replaced and not node.users:
                spec = next(s for s in self.specs if s.arg.name == node.name)
                self.specs.remove(spec)
                if spec.target is not None:
                    self.state.pop(spec.target, None)
                self.graph.erase_node(node)
        self.graph.lint()

    def signature(self) -> ExportGraphSignature:
        """The input specs in the order of the graph's placeholders, the new ones included."""
        by_name = {spec.arg.name: spec for spec in (*self.specs, *self.new_specs)}
        specs = [by_name[node.name] for node in self.graph.nodes if node.op == "placeholder"]
        return ExportGraphSignature(input_specs=specs, output_specs=self.outputs)


_PARTS = ("qdata", "scale", "zero_point")
