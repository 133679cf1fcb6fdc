"""The exporter's translation of ``torchdelegate::linear_blockwise`` and ``embedding_blockwise``: each
call becomes one private node of the ``torchdelegate`` domain (``LinearBlockwise``,
``EmbeddingBlockwise``), whose schema is registered with onnx here.

torch's exporter knows neither operator: the translations here are handed to it, and the private nodes
carry a layer's integers, scales and zero points as they are through the optimizer and fusions, until
``blockwise.kernel_products`` rewrites them into ONNX Runtime's integer kernels. No private node
reaches ONNX Runtime.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from torchdelegate.backends.onnxruntime.settings import require
from torchdelegate.quantization.embedding import embedding_blockwise
from torchdelegate.quantization.linear import linear_blockwise

DOMAIN = "torchdelegate"
LINEAR_NODE = "LinearBlockwise"
LOOKUP_NODE = "EmbeddingBlockwise"


@cache
def translations() -> dict[Any, Any]:
    """The exporter's translation of ``linear_blockwise``: one private node, rewritten later."""
    onnx = require("onnx")
    values = require("onnxscript.values")
    schema = onnx.defs.OpSchema
    optional = schema.FormalParameterOption.Optional
    onnx.defs.register_schema(
        schema(
            LINEAR_NODE,
            DOMAIN,
            1,
            doc="torchdelegate's quantized linear layer, rewritten to MatMulNBits before a model is stored",
            inputs=[
                schema.FormalParameter("x", "T"),
                schema.FormalParameter("qdata", "Q"),
                schema.FormalParameter("scale", "T"),
                schema.FormalParameter("zero_point", "Z", param_option=optional),
                schema.FormalParameter("bias", "T", param_option=optional),
            ],
            outputs=[schema.FormalParameter("y", "T")],
            type_constraints=[
                ("T", ["tensor(float)"], "float activations, scales and bias"),
                ("Q", ["tensor(int8)"], "the integers, one per int8"),
                ("Z", ["tensor(int8)", "tensor(int16)", "tensor(int32)", "tensor(int64)"], "integer zero points"),
            ],
            attributes=[
                schema.Attribute("group_size", schema.AttrType.INT, "values per scale along a row"),
                schema.Attribute("dynamic_int8_activation", schema.AttrType.INT, "1: activations quantized to int8"),
            ],
        )
    )
    onnx.defs.register_schema(
        schema(
            LOOKUP_NODE,
            DOMAIN,
            1,
            doc="torchdelegate's quantized embedding, rewritten to GatherBlockQuantized before a model is stored",
            inputs=[
                schema.FormalParameter("indices", "I"),
                schema.FormalParameter("qdata", "Q"),
                schema.FormalParameter("scale", "T"),
                schema.FormalParameter("zero_point", "Z", param_option=optional),
            ],
            outputs=[schema.FormalParameter("y", "T")],
            type_constraints=[
                ("I", ["tensor(int32)", "tensor(int64)"], "the rows read"),
                ("T", ["tensor(float)"], "float scales and rows"),
                ("Q", ["tensor(int8)"], "the integers, one per int8"),
                ("Z", ["tensor(int8)", "tensor(int16)", "tensor(int32)", "tensor(int64)"], "integer zero points"),
            ],
            attributes=[schema.Attribute("group_size", schema.AttrType.INT, "values per scale along a row")],
        )
    )
    node = values.Op(values.Opset(DOMAIN, 1), LINEAR_NODE)
    lookup = values.Op(values.Opset(DOMAIN, 1), LOOKUP_NODE)

    def translate_lookup(indices: Any, qdata: Any, scale: Any, zero_point: Any = None, group_size: int = 32) -> Any:
        return lookup(indices, qdata, scale, zero_point, group_size=group_size)

    def translate(
        x: Any,
        qdata: Any,
        scale: Any,
        zero_point: Any = None,
        bias: Any = None,
        group_size: int = 32,
        dynamic_int8_activation: bool = False,
    ) -> Any:
        activation = int(dynamic_int8_activation)
        return node(x, qdata, scale, zero_point, bias, group_size=group_size, dynamic_int8_activation=activation)

    return {linear_blockwise(): translate, embedding_blockwise(): translate_lookup}
