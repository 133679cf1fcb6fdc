"""transformers language models from tiny configs, random weights (nothing is downloaded).

Import after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers


class Logits(torch.nn.Module):
    """A causal LM's logits for a whole sequence (no cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


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


def tiny_qwen2(intermediate_size: int = 96, vocab_size: int = 512) -> torch.nn.Module:
    """A 2-layer Qwen2 (biased q/k/v projections); 96 MLP inputs by default, not a power of two."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        use_sliding_window=False,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_qwen2_moe() -> torch.nn.Module:
    """A 2-layer Qwen2-MoE: 4 experts, 2 per token, and the shared expert beside them."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        use_sliding_window=False,
    )
    return transformers.Qwen2MoeForCausalLM(config).eval()


def tiny_mixtral() -> torch.nn.Module:
    """A 2-layer Mixtral: 4 experts, 2 per token."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(config).eval()


def tiny_gpt2(vocab_size: int = 512) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab_size, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def static_cache_module(model: torch.nn.Module, max_cache_len: int, batch_size: int = 1) -> torch.nn.Module:
    """The module transformers' ``TorchExportableModuleForDecoderOnlyLM`` exports: ``model`` over a
    static KV cache held as buffers, called as ``(input_ids=..., cache_position=...)``.

    Exporting it twice (a prompt, then one token) gives ``prefill`` and ``decode`` that share
    the weights and the cache; ``TorchExportableModuleForDecoderOnlyLM.export`` does the same
    with strict export.
    """
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len).model


def transformers_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """The ``new`` token ids transformers' ``generate`` chooses greedily after ``prompt``, with no stop token."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()
