"""ExecuTorch 1.5.1's documented LLM export flow on a Hugging Face Llama checkpoint, for
``bigger_than_ram.py`` (run by the ExecuTorch environment's Python).

The flow ``examples/models/llama/README.md`` documents: the checkpoint converted to a Meta-format
``.pth`` beside a ``params.json``, then ``extension.llm.export.export_llm`` with its XNNPACK
configuration (KV cache, SDPA with the cache, fp32, extended ops; ``--quantize``: ``8da4w`` in groups
of 32). The documented converter for Hugging Face Llama checkpoints goes through torchtune, which this
environment lacks; ExecuTorch's own ``examples.models.qwen3.convert_weights`` (a superset of Llama's
names, a separate head allowed) converts without it, leaving q/k unpermuted (``use_hf_rope``). Each
step is a process of its own; the caller measures them together.

    python executorch_llama_flow.py CKPT OUT.pte --float|--quantize
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def params(config: dict) -> dict:
    """ExecuTorch's ``params.json`` for a transformers Llama config."""
    rope = config.get("rope_parameters") or {}
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "hidden_dim": config["intermediate_size"],
        "ffn_dim_multiplier": 1,
        "vocab_size": config["vocab_size"],
        "norm_eps": config["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "use_scaled_rope": False,
        "use_hf_rope": True,
        "attention_qkv_bias": config.get("attention_bias", False),
    }


def main() -> None:
    checkpoint, output, mode = Path(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3]
    with tempfile.TemporaryDirectory(prefix="et-llama-") as work:
        directory = Path(work)
        (directory / "params.json").write_text(json.dumps(params(json.loads((checkpoint / "config.json").read_text()))))
        converted = directory / "consolidated.pth"
        convert = "executorch.examples.models.qwen3.convert_weights"
        subprocess.run([sys.executable, "-m", convert, str(checkpoint), str(converted)], check=True)
        settings = [
            "base.model_class=llama3",
            f"base.checkpoint={converted}",
            f"base.params={directory / 'params.json'}",
            "model.use_kv_cache=True",
            "model.use_sdpa_with_kv_cache=True",
            "model.dtype_override=fp32",
            "backend.xnnpack.enabled=True",
            "backend.xnnpack.extended_ops=True",
            "export.max_seq_length=256",
            "export.max_context_length=256",
            f"export.output_name={output}",
        ]
        if mode == "--quantize":
            settings += ["quantization.qmode=8da4w", "quantization.group_size=32"]
        export = [sys.executable, "-m", "executorch.extension.llm.export.export_llm", *settings]
        subprocess.run(export, check=True, cwd=work)
    print(json.dumps({"file_bytes": output.stat().st_size}))


if __name__ == "__main__":
    main()
