"""The zoo's catalogue: architectures no one here wrote, from tiny configs with random weights.

Each :class:`ZooModel` names a model, its kind and family, and builds a :class:`Case`: the
module each method exports and the calls to run, in order (the first call of a method is its
export example). Nothing is downloaded: transformers models come from configs, ``torch.nn``
ones from their constructors, all seeded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TEXT, DECODER, SEQ2SEQ, VISION, AUDIO, TORCH_NN = (
    "text encoder",
    "decoder LM",
    "encoder-decoder",
    "vision",
    "audio",
    "torch.nn",
)
KINDS = (TEXT, DECODER, SEQ2SEQ, VISION, AUDIO, TORCH_NN)

VOCAB, TOKENS = 128, 8  # transformers text models: vocabulary and sequence length
PROMPT, DECODE_STEPS, CACHE = 6, 3, 16  # static-cache LMs: prompt length, decode calls, cache length
PREFILL_DECODE = ("prefill", "decode")


@dataclass(frozen=True)
class Call:
    """One call of a method, with the arguments the exported module takes."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """A built model: the module behind each method (one instance may serve several) and its calls."""

    modules: dict[str, nn.Module]
    calls: list[Call]
    strict: bool = False  # export with TorchDynamo (torch.export's strict mode) instead of non-strict

    def example(self, method: str) -> Call:
        """The first call of ``method``: what it is exported with."""
        return next(call for call in self.calls if call.method == method)


@dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str
    family: str
    build: Callable[[], Case]
    note: str = ""  # what is special about it (ModelOutput kept, input named ``input``, ...)
    methods: tuple[str, ...] = ("forward",)


def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Case:
    """One ``forward`` method called once with ``args``; the module in eval mode."""
    return Case({"forward": module.eval()}, [Call("forward", args, kwargs)])


class Field(nn.Module):
    """A transformers model's output reduced to plain tensors: one field of its ModelOutput.

    ``fixed`` keyword arguments are passed on every call (``use_cache=False``), so the
    exported program's inputs are only the tensors.
    """

    def __init__(self, model: nn.Module, name: str, **fixed: Any) -> None:
        super().__init__()
        self.model, self.name, self.fixed = model, name, fixed

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(*args, **kwargs, **self.fixed), self.name)


def tokens(batch: int = 1, length: int = TOKENS, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length))


def seeded(build: Callable[[], Case]) -> Callable[[], Case]:
    """``build`` with the global seed set first: weights and inputs are the same on every run."""

    def run() -> Case:
        torch.manual_seed(0)
        with torch.no_grad():
            return build()

    run.__name__ = build.__name__
    run.__doc__ = build.__doc__
    return run


# ---------------------------------------------------------------- transformers text encoders


def from_config(model_class: str, config_class: str, **config: Any) -> nn.Module:
    """A transformers model with random weights from a config: nothing is downloaded."""
    import transformers

    return getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).eval()


ENCODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def bert() -> Case:
    """BERT with an attention mask, its ModelOutput returned as it is."""
    import transformers

    model = transformers.BertModel(transformers.BertConfig(**ENCODER))
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    return forward(model, ids, attention_mask=mask)


def text_encoder(prefix: str, **config: Any) -> Callable[[], Case]:
    """transformers' ``{prefix}Model`` from ``{prefix}Config``: its ``last_hidden_state`` for random token ids."""

    def build() -> Case:
        model = from_config(f"{prefix}Model", f"{prefix}Config", **ENCODER, **config)
        return forward(Field(model, "last_hidden_state"), tokens())

    build.__name__ = prefix.lower()
    return build


def distilbert() -> Case:
    import transformers

    config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB)
    return forward(Field(transformers.DistilBertModel(config), "last_hidden_state"), tokens())


# ---------------------------------------------------------------- decoder-only language models

DECODER_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def logits(model: nn.Module) -> Case:
    """A causal LM's logits over a whole sequence, without a cache."""
    return forward(Field(model, "logits", use_cache=False), tokens())


def static_cache(model: nn.Module) -> Case:
    """``prefill`` (the prompt) and ``decode`` (one token at a time) over one static KV cache.

    Both methods are the same :class:`TorchExportableModuleForDecoderOnlyLM` module, so they
    share its weights and cache; decode's tokens are fixed (teacher forcing), so the calls
    do not depend on the outputs. Exported strictly, as that class's ``export`` does: a
    non-strict export of it fails in torch's own ``run_decompositions`` (torch 2.13:
    "expected compiled_fn to be GraphModule").
    """
    from language_models import static_cache_module

    module = static_cache_module(model, CACHE)
    prompt = tokens(length=PROMPT)
    calls = [Call("prefill", kwargs={"input_ids": prompt, "cache_position": torch.arange(PROMPT)})]
    for step in range(DECODE_STEPS):
        token = tokens(length=1)
        calls.append(Call("decode", kwargs={"input_ids": token, "cache_position": torch.tensor([PROMPT + step])}))
    return Case({"prefill": module, "decode": module}, calls, strict=True)


def llama_model() -> nn.Module:
    from language_models import tiny_llama

    return tiny_llama(vocab_size=VOCAB)


def gpt2_model() -> nn.Module:
    from language_models import tiny_gpt2

    return tiny_gpt2(vocab_size=VOCAB)


_WITHOUT_GQA = {k: v for k, v in DECODER_CONFIG.items() if k != "num_key_value_heads"}

CAUSAL_LMS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama_model,
    "qwen2": lambda: from_config("Qwen2ForCausalLM", "Qwen2Config", **DECODER_CONFIG, use_sliding_window=False),
    "gemma": lambda: from_config("GemmaForCausalLM", "GemmaConfig", **DECODER_CONFIG, head_dim=16),
    "phi3": lambda: from_config("Phi3ForCausalLM", "Phi3Config", **DECODER_CONFIG, pad_token_id=0),
    "gpt2": gpt2_model,
    "mistral": lambda: from_config("MistralForCausalLM", "MistralConfig", **DECODER_CONFIG, sliding_window=None),
    "phi": lambda: from_config("PhiForCausalLM", "PhiConfig", **_WITHOUT_GQA),
    "opt": lambda: from_config(
        "OPTForCausalLM",
        "OPTConfig",
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    ),
    "gpt-neox": lambda: from_config("GPTNeoXForCausalLM", "GPTNeoXConfig", **_WITHOUT_GQA),
    "falcon": lambda: from_config(
        "FalconForCausalLM",
        "FalconConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=VOCAB,
        new_decoder_architecture=False,
        multi_query=True,
        alibi=False,
    ),
    "qwen3": lambda: from_config("Qwen3ForCausalLM", "Qwen3Config", **DECODER_CONFIG, head_dim=16),
}
"""The zoo's decoder-only language models, each from a tiny config with random weights (seed it first)."""


def llama() -> Case:
    return static_cache(CAUSAL_LMS["llama"]())


def qwen2() -> Case:
    return static_cache(CAUSAL_LMS["qwen2"]())


def gemma() -> Case:
    return static_cache(CAUSAL_LMS["gemma"]())


def phi3() -> Case:
    return static_cache(CAUSAL_LMS["phi3"]())


def gpt2() -> Case:
    """GPT-2 returning its CausalLMOutputWithCrossAttentions as it is (no cache)."""
    return forward(CAUSAL_LMS["gpt2"](), tokens(), use_cache=False)


def mistral() -> Case:
    return logits(CAUSAL_LMS["mistral"]())


def phi() -> Case:
    return logits(CAUSAL_LMS["phi"]())


def opt() -> Case:
    return logits(CAUSAL_LMS["opt"]())


def gpt_neox() -> Case:
    return logits(CAUSAL_LMS["gpt-neox"]())


def falcon() -> Case:
    return logits(CAUSAL_LMS["falcon"]())


def qwen3() -> Case:
    return logits(CAUSAL_LMS["qwen3"]())


# ---------------------------------------------------------------- encoder-decoders


def seq2seq(model: nn.Module) -> Case:
    """The full forward: encoder over the source, decoder over the target prefix; logits, no cache."""
    return forward(Field(model, "logits", use_cache=False), tokens(), decoder_input_ids=tokens(length=5))


T5 = dict(
    d_model=32,
    d_ff=64,
    d_kv=16,
    num_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    vocab_size=VOCAB,
    decoder_start_token_id=0,
)


def t5() -> Case:
    return seq2seq(from_config("T5ForConditionalGeneration", "T5Config", **T5))


BART = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def bart() -> Case:
    return seq2seq(from_config("BartForConditionalGeneration", "BartConfig", **BART))


def marian() -> Case:
    special = dict(pad_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return seq2seq(from_config("MarianMTModel", "MarianConfig", **BART, **special))


# ---------------------------------------------------------------- vision


def image(size: int = 32, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def vision(model_class: str, config_class: str, name: str = "last_hidden_state", **config: Any) -> Case:
    return forward(Field(from_config(model_class, config_class, **config), name), image(config.get("image_size", 32)))


VIT = dict(
    image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
)


def vit() -> Case:
    """ViT returning its BaseModelOutputWithPooling as it is."""
    import transformers

    return forward(transformers.ViTModel(transformers.ViTConfig(**VIT)), image())


def deit() -> Case:
    return vision("DeiTModel", "DeiTConfig", **VIT)


def dinov2() -> Case:
    return vision("Dinov2Model", "Dinov2Config", **VIT)


def swin() -> Case:
    config = dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return vision("SwinModel", "SwinConfig", **config)


def convnext() -> Case:
    config = dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])
    return vision("ConvNextModel", "ConvNextConfig", "pooler_output", **config)


def resnet() -> Case:
    config = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck")
    return vision("ResNetModel", "ResNetConfig", "pooler_output", **config)


def mobilenet_v2() -> Case:
    config = dict(image_size=32, depth_multiplier=0.25, min_depth=4)
    return vision("MobileNetV2Model", "MobileNetV2Config", "pooler_output", **config)


def efficientnet() -> Case:
    config = dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.2, hidden_dim=320)  # 1280 x width
    return vision("EfficientNetModel", "EfficientNetConfig", "pooler_output", **config)


def regnet() -> Case:
    config = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)
    return vision("RegNetModel", "RegNetConfig", "pooler_output", **config)


# ---------------------------------------------------------------- audio

WAV2VEC2 = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
)


def wav2vec2() -> Case:
    """Wav2Vec2 returning its Wav2Vec2BaseModelOutput as it is."""
    import transformers

    model = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(**WAV2VEC2))
    return forward(model, torch.randn(1, 800))


def hubert() -> Case:
    model = from_config("HubertModel", "HubertConfig", **WAV2VEC2)
    return forward(Field(model, "last_hidden_state"), torch.randn(1, 800))


def whisper_encoder() -> Case:
    """Whisper's encoder over log-mel features (2 x max_source_positions frames)."""
    config = dict(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=16,
        vocab_size=VOCAB,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    encoder = from_config("WhisperModel", "WhisperConfig", **config).get_encoder()
    return forward(Field(encoder, "last_hidden_state"), torch.randn(1, 16, 32))


# ---------------------------------------------------------------- classic torch.nn programs


def mlp() -> Case:
    """``nn.Sequential``: its forward's input is named ``input``."""
    return forward(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(4, 16)
    )


class Recurrent(nn.Module):
    """An LSTM or GRU over a batch-first sequence, then a linear head on every step."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU]) -> None:
        super().__init__()
        self.rnn = cell(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def lstm() -> Case:
    return forward(Recurrent(nn.LSTM), torch.randn(2, 5, 16))


def gru() -> Case:
    return forward(Recurrent(nn.GRU), torch.randn(2, 5, 16))


class CausalTransformer(nn.Module):
    """``nn.Transformer`` (encoder and decoder), batch first, with a causal target mask.

    The mask is said to be causal (``tgt_is_causal``): otherwise ``nn.Transformer`` compares it
    with a causal mask it builds, a data-dependent branch that ``torch.export`` refuses.
    """

    def __init__(self, target_length: int = 5) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=32,
            nhead=2,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=64,
            dropout=0.0,
            batch_first=True,
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(target_length))

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.transformer(source, target, tgt_mask=self.mask, tgt_is_causal=True)


def transformer() -> Case:
    return forward(CausalTransformer(), torch.randn(2, 7, 32), torch.randn(2, 5, 32))


def transformer_encoder() -> Case:
    """``nn.TransformerEncoder`` with a padding mask (pre-norm layers, GELU)."""
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, -3:] = True
    return forward(model, torch.randn(2, 7, 32), src_key_padding_mask=padding)


class Conv1dNet(nn.Module):
    """Conv1d, BatchNorm1d, ReLU, MaxPool1d, then AdaptiveAvgPool1d and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(4, 16, 5, padding=2),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(16, 16, 3),
            nn.AdaptiveAvgPool1d(1),
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Conv2dNet(nn.Module):
    """Conv2d (strided, depthwise), GroupNorm, BatchNorm2d, AvgPool2d, MaxPool2d, AdaptiveAvgPool2d."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.group_norm = nn.GroupNorm(4, 16)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.batch_norm = nn.BatchNorm2d(16)
        self.pointwise = nn.Conv2d(16, 32, 1)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.group_norm(self.stem(x)))
        x = F.avg_pool2d(F.relu(self.batch_norm(self.depthwise(x))), 2)
        x = F.max_pool2d(self.pointwise(x), 2, ceil_mode=True)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def with_batch_norm_statistics(module: nn.Module) -> nn.Module:
    """Random running statistics, so that eval-mode batch norm is not the identity."""
    for norm in module.modules():
        if isinstance(norm, nn.modules.batchnorm._BatchNorm):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return module


def conv1d() -> Case:
    return forward(with_batch_norm_statistics(Conv1dNet()), torch.randn(2, 4, 32))


def conv2d() -> Case:
    return forward(with_batch_norm_statistics(Conv2dNet()), torch.randn(2, 3, 32, 32))


class LayerNormMLP(nn.Module):
    """LayerNorm, GELU MLP with a residual, and a softmax: a transformer's feed-forward half."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.down(F.gelu(self.up(self.norm(x))))).softmax(-1)


def layer_norm_mlp() -> Case:
    return forward(LayerNormMLP(), torch.randn(2, 6, 32))


class Embeddings(nn.Module):
    """An ``Embedding`` lookup and an ``EmbeddingBag`` (mean over bags given by offsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16, padding_idx=0)
        self.bag = nn.EmbeddingBag(50, 16, mode="mean")

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).sum(1) + self.bag(bag_ids, offsets)


def embeddings() -> Case:
    return forward(Embeddings(), torch.randint(0, 50, (3, 4)), torch.randint(0, 50, (9,)), torch.tensor([0, 2, 5]))


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16, padding_idx=0)
        self.proj = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embedding(ids))


def embedding() -> Case:
    return forward(Embedding(), torch.randint(0, 50, (3, 4)))


class SortTopK(nn.Module):
    """Scores from a linear layer, sorted, their top 3 (values and indices) and an argmax."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scores = self.score(x)
        ordered, order = scores.sort(dim=-1, descending=True)
        top, where = scores.topk(3, dim=-1)
        return ordered, order, top, where, scores.argmax(-1)


def sort_topk() -> Case:
    return forward(SortTopK(), torch.randn(4, 8))


class Interpolate(nn.Module):
    """A feature map upsampled nearest (x2) and bilinear (to 24 x 24, corners aligned and not)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        nearest = F.interpolate(y, scale_factor=2, mode="nearest")
        bilinear = F.interpolate(y, size=(24, 24), mode="bilinear", align_corners=False)
        aligned = F.interpolate(y, size=(24, 24), mode="bilinear", align_corners=True)
        return nearest, bilinear, aligned


def interpolate() -> Case:
    return forward(Interpolate(), torch.randn(1, 3, 10, 10))


# ---------------------------------------------------------------- the catalogue


def _zoo() -> list[ZooModel]:
    models = [
        ZooModel("bert", TEXT, "BERT", bert, "attention mask; ModelOutput kept"),
        ZooModel("roberta", TEXT, "RoBERTa", text_encoder("Roberta", pad_token_id=1)),
        ZooModel("distilbert", TEXT, "DistilBERT", distilbert),
        ZooModel("albert", TEXT, "ALBERT", text_encoder("Albert", embedding_size=16)),
        ZooModel("electra", TEXT, "ELECTRA", text_encoder("Electra", embedding_size=16)),
        ZooModel("deberta-v2", TEXT, "DeBERTa-v2", text_encoder("DebertaV2")),
        ZooModel("mpnet", TEXT, "MPNet", text_encoder("MPNet")),
        ZooModel(
            "xlm-roberta",
            TEXT,
            "XLM-RoBERTa",
            text_encoder("XLMRoberta", pad_token_id=1),
        ),
        ZooModel("llama", DECODER, "Llama", llama, "static cache", PREFILL_DECODE),
        ZooModel("qwen2", DECODER, "Qwen2", qwen2, "static cache", PREFILL_DECODE),
        ZooModel("gemma", DECODER, "Gemma", gemma, "static cache", PREFILL_DECODE),
        ZooModel("phi3", DECODER, "Phi-3", phi3, "static cache", PREFILL_DECODE),
        ZooModel("gpt2", DECODER, "GPT-2", gpt2, "ModelOutput kept"),
        ZooModel("mistral", DECODER, "Mistral", mistral),
        ZooModel("phi", DECODER, "Phi", phi),
        ZooModel("opt", DECODER, "OPT", opt),
        ZooModel("gpt-neox", DECODER, "GPT-NeoX", gpt_neox),
        ZooModel("falcon", DECODER, "Falcon", falcon),
        ZooModel("qwen3", DECODER, "Qwen3", qwen3),
        ZooModel("t5", SEQ2SEQ, "T5", t5),
        ZooModel("bart", SEQ2SEQ, "BART", bart),
        ZooModel("marian", SEQ2SEQ, "Marian", marian),
        ZooModel("vit", VISION, "ViT", vit, "ModelOutput kept"),
        ZooModel("deit", VISION, "DeiT", deit),
        ZooModel("dinov2", VISION, "DINOv2", dinov2),
        ZooModel("swin", VISION, "Swin", swin),
        ZooModel("convnext", VISION, "ConvNeXt", convnext),
        ZooModel("resnet", VISION, "ResNet", resnet),
        ZooModel("mobilenet-v2", VISION, "MobileNetV2", mobilenet_v2),
        ZooModel("efficientnet", VISION, "EfficientNet", efficientnet),
        ZooModel("regnet", VISION, "RegNet", regnet),
        ZooModel("wav2vec2", AUDIO, "Wav2Vec2", wav2vec2, "ModelOutput kept"),
        ZooModel("hubert", AUDIO, "HuBERT", hubert),
        ZooModel("whisper-encoder", AUDIO, "Whisper", whisper_encoder),
        ZooModel("sequential-mlp", TORCH_NN, "nn.Sequential", mlp, "input named `input`"),
        ZooModel("lstm", TORCH_NN, "nn.LSTM", lstm),
        ZooModel("gru", TORCH_NN, "nn.GRU", gru),
        ZooModel("nn-transformer", TORCH_NN, "nn.Transformer", transformer),
        ZooModel("transformer-encoder", TORCH_NN, "nn.TransformerEncoder", transformer_encoder),
        ZooModel("conv1d-batchnorm-maxpool", TORCH_NN, "conv/pool/norm", conv1d),
        ZooModel("conv2d-groupnorm-avgpool", TORCH_NN, "conv/pool/norm", conv2d),
        ZooModel("layernorm-mlp", TORCH_NN, "conv/pool/norm", layer_norm_mlp),
        ZooModel("embedding", TORCH_NN, "embeddings", embedding),
        ZooModel("embedding-bag", TORCH_NN, "embeddings", embeddings),
        ZooModel("sort-topk", TORCH_NN, "sort/topk", sort_topk),
        ZooModel("interpolate", TORCH_NN, "interpolation", interpolate),
    ]
    return [ZooModel(m.name, m.kind, m.family, seeded(m.build), m.note, m.methods) for m in models]


ZOO: list[ZooModel] = _zoo()
BY_NAME: dict[str, ZooModel] = {model.name: model for model in ZOO}
