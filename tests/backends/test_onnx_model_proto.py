"""The run path reads a blob's ONNX model without the onnx package, as protobuf reads it, or refuses it."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from torchdelegate.backends.onnxruntime.model_proto import MAX_DEPTH, ModelProtoError, read_model  # noqa: E402


def _model() -> onnx.ModelProto:
    """A graph with an If whose branch holds a constant, an external initializer, a function and metadata."""
    branch = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["c"], name="inner", value=helper.make_tensor("k", TensorProto.FLOAT, [1], [2.0])
            )
        ],
        "then",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])],
    )
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="data-key")
    nodes = [
        helper.make_node("If", ["flag"], ["c"], name="choose", then_branch=branch, else_branch=branch),
        helper.make_node("Add", ["c", "w"], ["y"], name="add"),
        helper.make_node("Twice", ["y"], ["z"], name="mine", domain="local"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
        [weight],
    )
    function = helper.make_function("local", "Twice", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])], [])
    model = helper.make_model(graph, functions=[function], opset_imports=[helper.make_opsetid("", 18)])
    helper.set_model_props(model, {"author": "tests"})
    return model


def test_the_fields_read_are_the_ones_onnx_reads() -> None:
    expected = _model()
    model = read_model(expected.SerializeToString())
    assert [(n.name, n.op_type, n.domain, list(n.input), list(n.output)) for n in model.graph.node] == [
        (n.name, n.op_type, n.domain, list(n.input), list(n.output)) for n in expected.graph.node
    ]
    (weight,) = model.graph.initializer
    assert (weight.name, weight.data_location, [(e.key, e.value) for e in weight.external_data]) == (
        "w",
        TensorProto.EXTERNAL,
        [("location", "data-key")],
    )
    then = next(a for a in model.graph.node[0].attribute if a.name == "then_branch")
    assert then.HasField("g") and not then.HasField("t")
    assert then.g.node[0].attribute[0].t.name == "k" and then.g.output[0].name == "c"
    assert [(f.domain, f.name, len(f.node)) for f in model.functions] == [("local", "Twice", 1)]
    assert [o.domain for o in model.opset_import] == [""] and model.metadata_props[0].key == "author"
    assert model.graph.sparse_initializer == [] and model.training_info == []


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = bytes([number << 3 | wire]) if number < 16 else bytes([(number << 3 | wire) & 0x7F | 0x80, number >> 4])
    return key + (bytes([len(payload)]) + payload if wire == 2 else payload)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_field(7, 2, b"") + _field(7, 2, b""), "ModelProto.graph is given twice"),
        (_field(7, 0, b"\x01"), "ModelProto.graph has wire type 0, not 2"),
        (_field(7, 2, _field(5, 2, _field(14, 0, b"\x07"))), "TensorProto.data_location is 7"),
        (_field(7, 2, _field(1, 2, _field(3, 2, b"\xff\xfe"))), "NodeProto.name is not UTF-8"),
        (bytes([7 << 3 | 2, 50]) + b"short", "runs past the end"),
        (bytes([9 << 3 | 3]), "wire type 3, which ONNX never writes"),
        (b"\x80" * 11, "longer than 64 bits"),
        (b"\xba\x80\x80\x80\x10\x00", "key is longer than protobuf reads"),  # field 7 to protobuf
    ],
    ids=["twice", "wire type", "data location", "utf-8", "truncated", "group", "varint", "long key"],
)
def test_what_protobuf_could_read_otherwise_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ModelProtoError, match=message):
        read_model(data)


def test_nesting_is_bounded() -> None:
    graph = helper.make_graph([], "leaf", [], [])
    for _ in range(MAX_DEPTH // 3 + 1):  # a graph, its node and the attribute holding the next: 3 levels each
        node = helper.make_node("If", ["c"], ["o"], then_branch=graph)
        graph = helper.make_graph([node], "g", [], [])
    with pytest.raises(ModelProtoError, match="nested deeper than"):
        read_model(helper.make_model(graph).SerializeToString())


def test_fields_it_does_not_read_are_skipped_whatever_their_wire_type() -> None:
    model = _model()
    model.graph.node[1].doc_string = "a doc string"
    model.ir_version = 9
    model.graph.initializer[0].float_data.extend([1.0, 2.0])  # packed floats
    model.graph.initializer[0].dims.extend([3])
    assert [n.name for n in read_model(model.SerializeToString()).graph.node] == ["choose", "add", "mine"]
