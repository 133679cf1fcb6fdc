"""The demo model as a transformers checkpoint, so ``torchdelegate llm export`` has one that speaks.

The demo model is GPT-2's architecture at a small size: learned positions, pre-LayerNorm
blocks, one fused query/key/value projection, an exact-GELU MLP, an untied head without bias.
So its trained weights are written as a ``GPT2LMHeadModel`` (GPT-2 stores its projections
transposed, as ``Conv1D``), beside a byte-level tokenizer whose token ids are the bytes, as the
demo model reads text. Needs the ``llm`` extra (transformers, tokenizers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchdelegate.demo.model import DecoderLM
from torchdelegate.exported.torch_warnings import import_noise_quieted


def save_transformers_checkpoint(model: DecoderLM, directory: Path) -> None:
    """``model`` in ``directory`` as ``save_pretrained`` writes a GPT-2, with its tokenizer."""
    with import_noise_quieted():
        _save(model, directory)


def _save(model: DecoderLM, directory: Path) -> None:
    from torchdelegate.llm.checkpoint import quiet_transformers

    transformers = quiet_transformers()

    config = model.config
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.max_len,
            n_embd=config.d_model,
            n_layer=config.n_layers,
            n_head=config.n_heads,
            n_inner=config.mlp_ratio * config.d_model,
            activation_function="gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    missing = gpt2.load_state_dict(_gpt2_weights(model), strict=False).missing_keys
    if missing:
        raise ValueError(f"GPT-2 weights the demo model does not give: {missing}")
    gpt2.generation_config.eos_token_id = None
    gpt2.eval().save_pretrained(directory)
    byte_tokenizer().save(str(directory / "tokenizer.json"))


def _gpt2_weights(model: DecoderLM) -> dict[str, torch.Tensor]:
    ours = {name: p.detach() for name, p in model.named_parameters()}
    weights = {
        "transformer.wte.weight": ours["tok_emb.weight"],
        "transformer.wpe.weight": ours["pos_emb.weight"],
        "transformer.ln_f.weight": ours["ln_f.weight"],
        "transformer.ln_f.bias": ours["ln_f.bias"],
        "lm_head.weight": ours["head.weight"],
    }
    names = {"ln1": "ln_1", "ln2": "ln_2", "qkv": "attn.c_attn", "proj": "attn.c_proj", "fc1": "mlp.c_fc"}
    names["fc2"] = "mlp.c_proj"
    for i in range(model.config.n_layers):
        for layer, theirs in names.items():
            weight, bias = ours[f"blocks.{i}.{layer}.weight"], ours[f"blocks.{i}.{layer}.bias"]
            transposed = not layer.startswith("ln")  # Conv1D holds [inputs, outputs]
            weights[f"transformer.h.{i}.{theirs}.weight"] = weight.t().contiguous() if transposed else weight
            weights[f"transformer.h.{i}.{theirs}.bias"] = bias
    return weights


def byte_tokenizer() -> Any:
    """A tokenizers ``Tokenizer`` whose token id for each byte is the byte's value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    tokenizer = Tokenizer(models.BPE(vocab={symbol: _byte_of(symbol) for symbol in alphabet}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_of(symbol: str) -> int:
    """The byte ByteLevel's alphabet shows as ``symbol`` (printable bytes as themselves, the rest shifted
    past 255 in order)."""
    code = ord(symbol)
    if code < 256:
        return code
    unprintable = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return unprintable[code - 256]
