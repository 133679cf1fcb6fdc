"""Blobs a backend cannot read are refused by ``init`` with a FormatError naming the backend and
what is wrong: another version, or a weight table that does not match the named data."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
import torch
from crafted import reference_blob, reference_blob_document
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import FormatError, NamedDataMap
from torchdelegate.backends.blob import pack
from torchdelegate.backends.inductor import InductorBackend
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner


@pytest.fixture(scope="module")
def reference_delegate() -> td.LoweredBackendModule:
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner())
    return lowered.delegates()["forward"][0]


def _reference_blob(delegate: td.LoweredBackendModule, change: Any) -> memoryview:
    document = reference_blob_document(delegate.processed_bytes)
    change(document)
    return memoryview(reference_blob(document))


def test_the_reference_blob_as_lowered_is_read(reference_delegate: td.LoweredBackendModule) -> None:
    named_data = NamedDataMap(reference_delegate.named_data_store_output)
    handle = ReferenceBackend.init(_reference_blob(reference_delegate, lambda d: None), [], named_data)
    assert ReferenceBackend.execute(handle, [torch.randn(2, 4)])[0].shape == (2, 4)
    ReferenceBackend.destroy(handle)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(version=3), r"reference blob: version 3; this torchdelegate reads 2"),
        (lambda d: d["tensors"][0].update(mutable="yes"), r"reference blob: a tensor entry's 'mutable' is not a bool"),
        (lambda d: d["tensors"][0].update(key="0" * 64), r"reference blob: weight '\w+\.weight' names missing named"),
        (lambda d: d["tensors"][0].update(name=5), r"reference blob: a weight's name is 5, not a string"),
        (lambda d: d["tensors"][0].pop("dtype"), r"reference blob: a weight entry is malformed: \{"),
    ],
    ids=["version", "mutable", "missing named data", "name", "malformed entry"],
)
def test_a_reference_blob_it_cannot_read_is_refused(
    reference_delegate: td.LoweredBackendModule, change: Any, message: str
) -> None:
    named_data = NamedDataMap(reference_delegate.named_data_store_output)
    blob = _reference_blob(reference_delegate, change)
    with pytest.raises(FormatError, match=message):
        ReferenceBackend.init(blob, [], named_data)
    with pytest.raises(FormatError, match=message):  # a compile cache's entry is checked as the file will be
        ReferenceBackend.check_blob(blob, [], named_data)


def test_a_reference_blob_of_the_version_before_is_read(reference_delegate: td.LoweredBackendModule) -> None:
    document = reference_blob_document(reference_delegate.processed_bytes)
    document["version"] = 1  # one zlib stream for the whole blob, as version 1 wrote it
    named_data = NamedDataMap(reference_delegate.named_data_store_output)
    handle = ReferenceBackend.init(memoryview(zlib.compress(json.dumps(document).encode())), [], named_data)
    x = torch.randn(2, 4)
    assert torch.equal(ReferenceBackend.execute(handle, [x])[0], reference_delegate(x)[0])
    ReferenceBackend.destroy(handle)


def test_a_blob_of_another_version_is_refused_before_its_payload_is_read() -> None:
    blob = pack({"version": 7, "tensors": []}, b"not an AOTInductor package")
    with pytest.raises(FormatError, match=r"inductor blob: version 7; this torchdelegate reads 1"):
        InductorBackend.init(memoryview(blob), [], NamedDataMap())


def test_a_weight_table_naming_missing_named_data_is_refused() -> None:
    table = [{"name": "embed.weight", "key": "ab" * 32, "dtype": "float32", "shape": [4]}]
    blob = pack({"version": 1, "tensors": table}, b"")
    with pytest.raises(FormatError, match=r"inductor blob: weight 'embed.weight' names missing named data 'abab"):
        InductorBackend.init(memoryview(blob), [], NamedDataMap())


def test_an_onnxruntime_blob_naming_a_branch_its_model_lacks_is_refused_at_load_and_by_check_blob() -> None:
    pytest.importorskip("onnxruntime")
    from torchdelegate.backends.onnxruntime import OnnxRuntimeBackend, OnnxRuntimePartitioner
    from torchdelegate.backends.onnxruntime.blob_header import unpacked

    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(OnnxRuntimePartitioner())
    delegate = lowered.delegates()["forward"][0]
    header, model = unpacked(memoryview(delegate.processed_bytes))
    blob = memoryview(pack({**header, "branch": 3}, bytes(model)))
    named_data = NamedDataMap(delegate.named_data_store_output)
    message = r"onnxruntime blob: branch 3 of a model with 1 branches"
    with pytest.raises(FormatError, match=message):
        OnnxRuntimeBackend.init(blob, [], named_data)
    with pytest.raises(FormatError, match=message):
        OnnxRuntimeBackend.check_blob(blob, [], named_data)
