"""transformers language models from tiny configs, random weights (nothing is downloaded).

Import after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers


def tiny_llama(hidden_size: int = 64, vocab_size: int = 512) -> torch.nn.Module:
    """A 2-layer Llama with grouped-query attention, ready to export with a static cache."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return model


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()
