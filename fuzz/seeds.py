"""Write the fuzzer's starting corpus: real program files, small, covering the format's parts.

    python fuzz/seeds.py fuzz/corpus

A tiny decoder's two methods sharing weights and a KV cache (reference backend), a control-flow program, a
program partly delegated (a residual graph with delegate calls), and the same decoder on
ONNX Runtime when it is installed, with crafted ONNX blobs that reach for files or custom ops
(tests/crafted.py, named `crafted-*`): the loader must refuse each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from backends_for_tests import OpSetPartitioner  # noqa: E402  (the tests' models, partitioners and crafted files)
from crafted import lowered_with_blob, onnx_calling, onnx_reading, reference_calling  # noqa: E402
from models import Cond, TinyDecoder, TwoLinears, decoder_methods, export  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.reference import ReferencePartitioner  # noqa: E402


def main() -> None:
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else HERE / "corpus")
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    decoder = decoder_methods(TinyDecoder(vocab=16, d=8, max_len=8), prompt_length=4)
    td.to_edge(decoder).to_backend(ReferencePartitioner()).save(directory / "decoder-reference.tdp")
    td.to_edge(export(Cond(), torch.randn(4, 4))).to_backend(ReferencePartitioner()).save(directory / "cond.tdp")
    lowered_with_blob(
        ReferencePartitioner(), reference_calling("builtins.eval"), directory / "crafted-reference-eval.tdp"
    )
    partly = OpSetPartitioner({torch.ops.aten.addmm.default}, backend_id="reference")
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partly).save(directory / "partly.tdp")
    try:
        from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    except ImportError:
        pass
    else:
        td.to_edge(decoder).to_backend(OnnxRuntimePartitioner()).save(directory / "decoder-onnxruntime.tdp")
        # Files an attacker would write: valid containers whose ONNX models reach for files or custom ops.
        for name, rewrite in [
            ("crafted-onnx-external-relative", onnx_reading("secret.txt")),
            ("crafted-onnx-external-parent", onnx_reading("../secret.txt")),
            ("crafted-onnx-external-in-branch", onnx_reading("sub/secret.txt", where="branch")),
            ("crafted-onnx-external-in-function", onnx_reading("secret.txt", where="function")),
            ("crafted-onnx-custom-domain", onnx_calling("ai.evil", "Run")),
        ]:
            lowered_with_blob(OnnxRuntimePartitioner(), rewrite, directory / f"{name}.tdp")
    for path in sorted(directory.iterdir()):
        print(f"{path.name}: {path.stat().st_size} B")


if __name__ == "__main__":
    main()
