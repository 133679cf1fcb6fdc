"""Program files an attacker would write: real `save` output whose delegate blobs reach outside the file.

Each helper lowers a tiny model for real, swaps one delegate's blob for a crafted one and
saves through `save`, so the container, manifest and checksums are all valid: only the blob lies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate.backends.blob import pack, unpack
from torchdelegate.serialize.container import HEADER


def manifest_bytes(data: bytes) -> bytes:
    """A program file's manifest, as its header delimits it."""
    length = HEADER.unpack_from(data)[3]
    return data[HEADER.size : HEADER.size + length]


def with_a_segment_byte_flipped(
    original: bytes, choose: Callable[[list[dict[str, Any]]], dict[str, Any]], at: int = 0
) -> bytes:
    """A program file whose segment ``choose(segments)`` (manifest entries) has its byte ``at`` flipped."""
    data = bytearray(original)
    segment = choose(json.loads(manifest_bytes(original))["segments"])
    data[HEADER.unpack_from(original)[4] + segment["offset"] + at] ^= 0xFF
    return bytes(data)


def with_a_segment_rewritten(original: bytes, choose: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> bytes:
    """A sound program file whose segment ``choose(segments)`` has other bytes (its fourth flipped: the sign
    and exponent of a float32), under the same named-data keys: its checksum, and every record naming it, say so."""
    flipped = bytearray(with_a_segment_byte_flipped(original, choose, at=3))
    segment = choose(json.loads(manifest_bytes(original))["segments"])
    start = HEADER.unpack_from(original)[4] + segment["offset"]
    digest = hashlib.sha256(flipped[start : start + segment["length"]]).hexdigest()
    manifest = json.loads(manifest_bytes(original))
    for record in (*manifest["segments"], *manifest["named_data"], *manifest["state"]):
        for field in ("sha256", "data"):
            if record.get(field) == segment["sha256"]:
                record[field] = digest
    return with_manifest(bytes(flipped), json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def with_manifest(original: bytes, manifest: bytes) -> bytes:
    """A program file with a new manifest (and a correct checksum), its data area moved after it."""
    magic, version, reserved, _, data_offset, _ = HEADER.unpack_from(original)
    data = original[data_offset:]
    new_offset = -(-(HEADER.size + len(manifest)) // 64) * 64
    header = HEADER.pack(magic, version, reserved, len(manifest), new_offset, hashlib.sha256(manifest).digest())
    return header + manifest + b"\0" * (new_offset - HEADER.size - len(manifest)) + data


def lowered_with_blob(partitioner: td.Partitioner, rewrite: Callable[[bytes], bytes], path: Path) -> Path:
    """TwoLinears lowered whole by ``partitioner``; its delegate's blob replaced by ``rewrite(blob)``; saved."""
    program = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partitioner).exported_program()
    (delegate,) = td.lowered_modules(program)
    delegate.processed_bytes = rewrite(delegate.processed_bytes)
    td.EdgeProgramManager({"forward": program}).save(path)
    return path


def _onnx_blob_header(blob: bytes) -> tuple[dict[str, Any], list[str], list[str]]:
    """The header of a one-partition onnxruntime blob, its model's inputs and outputs."""
    from torchdelegate.backends.onnxruntime.blob_header import unpacked

    header, _ = unpacked(memoryview(blob))
    (branch,) = header["branches"]
    return header, branch["inputs"], branch["outputs"]


def _onnx_model_blob(header: dict[str, Any], model: bytes) -> bytes:
    from torchdelegate.backends.onnxruntime.blob_header import model_blob

    return model_blob(header, model)


def _onnx_blob_header_with(header: dict[str, Any], inputs: list[str], outputs: list[str]) -> dict[str, Any]:
    """The header of a crafted model with these inputs and outputs, which reads no named data."""
    return dict(header, initializers={}, branches=[{"inputs": inputs, "outputs": outputs}])


def onnx_reading(location: str, *, where: str = "initializer", length: int = 16) -> Callable[[bytes], bytes]:
    """An onnxruntime blob whose model returns ``length`` bytes of the file at ``location``.

    ``where``: the external tensor is a graph initializer, a Constant node's attribute, a
    tensor inside an If node's branch, or one inside a model-local function's body.
    """
    from onnx import TensorProto, helper

    def rewrite(blob: bytes) -> bytes:
        header, inputs, outputs = _onnx_blob_header(blob)
        stolen = TensorProto(name="stolen", data_type=TensorProto.UINT8, dims=[length])
        stolen.data_location = TensorProto.EXTERNAL
        stolen.external_data.add(key="location", value=location)
        stolen.external_data.add(key="length", value=str(length))
        initializers: list[Any] = []
        if where == "initializer":
            nodes = [helper.make_node("Identity", ["stolen"], [outputs[0]])]
            initializers = [stolen]
        elif where == "constant":
            nodes = [helper.make_node("Constant", [], [outputs[0]], value=stolen)]
        elif where == "function":
            body = [helper.make_node("Constant", [], ["inner"], value=stolen)]
            steal = helper.make_function("local", "Steal", [], ["inner"], body, [helper.make_opsetid("", 18)])
            nodes = [helper.make_node("Steal", [], [outputs[0]], domain="local")]
        else:
            branch = helper.make_graph(
                [helper.make_node("Constant", [], ["inner"], value=stolen)],
                "branch",
                [],
                [helper.make_tensor_value_info("inner", TensorProto.UINT8, [length])],
            )
            always = helper.make_tensor("always", TensorProto.BOOL, [], [True])
            nodes = [
                helper.make_node("Constant", [], ["cond"], value=always),
                helper.make_node("If", ["cond"], [outputs[0]], then_branch=branch, else_branch=branch),
            ]
        graph = helper.make_graph(
            nodes,
            "crafted",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
            [helper.make_tensor_value_info(outputs[0], TensorProto.UINT8, [length])],
            initializers,
        )
        opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid("local", 1)] if where == "function" else [])
        model = helper.make_model(graph, opset_imports=opsets, functions=[steal] if where == "function" else [])
        return _onnx_model_blob(_onnx_blob_header_with(header, inputs, outputs[:1]), model.SerializeToString())

    return rewrite


def onnx_taking(extra: str) -> Callable[[bytes], bytes]:
    """An onnxruntime blob whose model takes an input ``extra`` beside those its header names."""
    from onnx import TensorProto, helper

    def rewrite(blob: bytes) -> bytes:
        header, inputs, outputs = _onnx_blob_header(blob)
        graph = helper.make_graph(
            [helper.make_node("Add", [inputs[0], extra], outputs[:1])],
            "crafted",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in [*inputs, extra]],
            [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        return _onnx_model_blob(_onnx_blob_header_with(header, inputs, outputs[:1]), model.SerializeToString())

    return rewrite


def onnx_calling(domain: str, op_type: str) -> Callable[[bytes], bytes]:
    """An onnxruntime blob whose model calls ``domain.op_type`` (a custom-op library's operator)."""
    from onnx import TensorProto, helper

    def rewrite(blob: bytes) -> bytes:
        header, inputs, outputs = _onnx_blob_header(blob)
        graph = helper.make_graph(
            [helper.make_node(op_type, inputs[:1], outputs[:1], domain=domain)],
            "crafted",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
            [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, None)],
        )
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        return _onnx_model_blob(_onnx_blob_header_with(header, inputs, outputs[:1]), model.SerializeToString())

    return rewrite


def reference_blob_document(blob: bytes | memoryview) -> dict[str, Any]:
    """A reference blob as one document: its header (version, tensors) and its inflated graph part."""
    import zlib

    header, payload = unpack(memoryview(blob), 2, "reference")
    return {**json.loads(zlib.decompress(payload)), **header}


def reference_blob(document: dict[str, Any]) -> bytes:
    """The blob of a document :func:`reference_blob_document` gave (changed or not)."""
    import zlib

    header = {key: document[key] for key in ("version", "tensors") if key in document}
    program_part = {key: value for key, value in document.items() if key not in header}
    return pack(header, zlib.compress(json.dumps(program_part).encode()))


def reference_calling(target: str) -> Callable[[bytes], bytes]:
    """A reference blob whose graph calls ``target`` (say ``builtins.eval``) where it called ``aten.addmm``."""

    def rewrite(blob: bytes) -> bytes:
        document = reference_blob_document(blob)
        text = json.dumps(document).replace('"torch.ops.aten.addmm.default"', f'"{target}"')
        assert target in text, "the graph has no addmm to replace"
        return reference_blob(json.loads(text))

    return rewrite
