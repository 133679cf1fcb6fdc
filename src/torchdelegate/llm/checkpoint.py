"""A local transformers checkpoint as a program to lower: the model over a static KV cache, exported
as ``prefill`` (a chunk of prompt tokens) and ``decode`` (one token), and the files a program
carries to generate text with it (its tokenizer, its generation config, the settings ``Generator``
needs). Nothing is downloaded.

Exporting needs torch and transformers; what the file carries is read back by ``assets.py``, which
needs neither.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchdelegate.errors import CheckpointError, first_line
from torchdelegate.exported.operator_libraries import operators_called
from torchdelegate.exported.structural_copy import copy_program
from torchdelegate.exported.torch_warnings import import_noise_quieted, loggers_quieted
from torchdelegate.llm.assets import read_chat_template, read_tokenizer
from torchdelegate.llm.checkpoint_code import allowed, checkpoint_code
from torchdelegate.serialize.operator_list import TORCH_NAMESPACES

if TYPE_CHECKING:
    from torch.export import ExportedProgram

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    model: Any  # a transformers PreTrainedModel, built over fake tensors where ``weights`` is given
    assets: dict[str, bytes]
    stop_tokens: list[int]
    max_positions: int | None  # the positions the model was built for (None: its config does not say)
    weights: dict[str, torch.Tensor] | None = None
    """Each of the model's state names (``state_dict``'s) bound to its tensor in the safetensors files, by
    memory map; None where the model was loaded whole (``eager_reason`` says why)."""
    eager_reason: str | None = None

    def cache_length(self, asked: int | None, default: int = 256) -> int:
        """The static cache's length: ``asked``, else ``default``, at most the model's positions."""
        if asked is not None and self.max_positions is not None and asked > self.max_positions:
            raise CheckpointError(
                f"a cache of {asked} positions: {type(self.model).__name__} has positions for {self.max_positions} "
                f"tokens (its config); give --max-cache {self.max_positions} or less"
            )
        if asked is not None:
            return asked
        return default if self.max_positions is None else min(default, self.max_positions)

    def bound(self, programs: dict[str, ExportedProgram]) -> dict[str, ExportedProgram]:
        """``programs`` exported from :attr:`model` with its state bound to the checkpoint's tensors."""
        if self.weights is None:
            return programs
        from torchdelegate.exported.weightless_export import bind_weights

        return bind_weights(programs, self.weights, prefix=EXPORTED_PREFIX)


EXPORTED_PREFIX = "model."
"""The exportable wrapper holds the model as ``model``: its programs' state names start with it."""


def read_checkpoint(
    directory: Path,
    lazily: bool = True,
    trust_remote_code: bool = False,
    notify: Callable[[str], object] | None = None,
) -> Checkpoint:
    """The causal LM in ``directory`` (config, safetensors weights, ``tokenizer.json``), computing in
    float32. ``lazily``: built over fake tensors, its weights bound by memory map (``Checkpoint.weights``)
    where the files allow; else (or not ``lazily``) loaded whole by transformers.

    The checkpoint's own code (its ``auto_map``) runs only where ``trust_remote_code``; else one that
    needs it is a CheckpointError naming it (transformers is never left to ask). ``notify`` is told,
    before transformers reads anything, which of its files will run and which will not."""
    with import_noise_quieted():
        return _read_checkpoint(directory, lazily, trust_remote_code, notify or (lambda line: None))


def _read_checkpoint(directory: Path, lazily: bool, trust: bool, notify: Callable[[str], object]) -> Checkpoint:
    if not directory.is_dir():
        raise CheckpointError(f"{str(directory)!r} is not a directory; give a transformers checkpoint directory")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: no config.json; give the directory save_pretrained wrote")
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{directory}: no tokenizer.json (the tokenizers library's file, written by a fast tokenizer's "
            "save_pretrained); the program carries it to turn text into tokens"
        )
    transformers = quiet_transformers()
    for line in allowed(checkpoint_code(directory), transformers, trust):
        notify(line)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=trust)
    except Exception as e:
        raise CheckpointError(f"{directory}/config.json cannot be read ({type(e).__name__}: {first_line(e)})") from e
    own_model = trust and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    causal = own_model or type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if not causal or config.is_encoder_decoder:
        raise CheckpointError(
            f"{directory}: {type(config).__name__} ({', '.join(config.architectures or ['no architecture'])}) is not a "
            "decoder-only language model transformers can load as AutoModelForCausalLM"
        )
    assets = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
    read_tokenizer(assets["tokenizer.json"], f"{directory}/tokenizer.json")  # refused before the weights load
    if "chat_template.jinja" in assets:
        read_chat_template(assets["chat_template.jinja"], f"{directory}/chat_template.jinja")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    positions = positions if isinstance(positions, int) else None
    reason = "asked to" if not lazily else None
    if lazily:
        from torchdelegate.llm.lazy_checkpoint import weightless_model

        built, reason = weightless_model(transformers, directory, config, trust)
        if built is not None:
            model, weights = built
            stop = _stop_tokens(model, _generation_config(transformers, directory))
            return Checkpoint(directory, model, assets, stop, positions, weights)
    try:
        model, loading = transformers.AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=torch.float32, output_loading_info=True, trust_remote_code=trust
        )
    except Exception as e:
        raise CheckpointError(f"{directory}: its weights cannot be loaded ({type(e).__name__}: {first_line(e)})") from e
    missing = sorted(loading.get("missing_keys") or [])
    if missing:  # transformers would make them random: a file that generates noise
        raise CheckpointError(
            f"{directory}: its weights hold no tensor for {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            + f" of {type(model).__name__}; save the checkpoint with this model's save_pretrained (its tensor names)"
        )
    return Checkpoint(directory, model.eval(), assets, _stop_tokens(model), positions, None, reason)


PREFILL_LOGITS = ("last", "all")
"""What prefill returns: the logits after the prompt's last token only ([1, 1, vocabulary]; all a
generation reads), or those after each of its tokens ([1, n, vocabulary]; to score a prompt)."""


def export_methods(
    model: Any, max_cache: int, chunk: int | None, prefill_logits: str = "last"
) -> dict[str, ExportedProgram]:
    """``prefill`` and ``decode`` (one token) over a static cache of ``max_cache`` positions, exported
    as transformers' exportable wrapper exports them (strict). Prefill takes a prompt of any length from
    1 to ``max_cache - 1`` tokens, or exactly ``chunk`` tokens for backends that need static shapes.

    Without ``chunk``, decode is prefill's program (a structural copy), run one token at a time: the
    steps of lowering do their work once for both (``lowering/equal_programs``), and a backend that
    finds two methods' partitions equal builds and packs them once (ONNX Runtime: one branch, not two
    that each pack every weight). With ``chunk``, decode is exported for one token.

    ``prefill_logits`` ``"last"`` runs the head on the last position only (the model's
    ``logits_to_keep``), which spares a prompt-long product with the vocabulary and its buffer;
    a model whose forward has no ``logits_to_keep`` returns every position's (:func:`logits_given`
    says which the program gives). The hook that passes it is removed after, export failed or not."""
    import torch.export

    with import_noise_quieted():  # transformers' models import torchao where installed
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    if chunk is not None and not 1 <= chunk < max_cache:
        raise CheckpointError(f"prefill chunk {chunk}: give 1 or more tokens, fewer than the cache's {max_cache}")
    if max_cache < 3:
        raise CheckpointError(f"a cache of {max_cache} positions: give 3 or more")
    if prefill_logits not in PREFILL_LOGITS:
        raise CheckpointError(f"prefill logits {prefill_logits!r}: give one of {', '.join(PREFILL_LOGITS)}")
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    example = chunk or min(8, max_cache - 1)
    prompt = {"input_ids": torch.zeros(1, example, dtype=torch.long), "cache_position": torch.arange(example)}
    token = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([example])}
    length = torch.export.Dim("prompt", min=1, max=max_cache - 1)
    dynamic = None if chunk else {"input_ids": {1: length}, "cache_position": {0: length}}
    try:
        module = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache).model
        quiet = loggers_quieted(["torch._subclasses.fake_tensor", "torch._dynamo", "torch.export"], logging.CRITICAL)
        with torch.no_grad(), warnings.catch_warnings(), quiet:
            warnings.simplefilter("ignore")  # dynamo's notes on transformers' own side effects
            with exportable_experts(model):
                with _last_logits_only(model, prefill_logits == "last"):
                    prefill = torch.export.export(module, (), prompt, dynamic_shapes=dynamic, strict=True)
                if chunk is None:  # a graph of its own, the tensors shared: lowering one never touches the other
                    decode = copy_program(prefill)
                else:
                    decode = torch.export.export(module, (), token, strict=True)
    except Exception as e:
        raise CheckpointError(
            f"{type(model).__name__} does not export with a static cache ({type(e).__name__}: {first_line(e)}); "
            "this architecture is not supported by transformers' exportable wrapper"
        ) from e
    methods = {"prefill": prefill, "decode": decode}
    _refuse_library_operators(type(model).__name__, methods)
    return methods


def _refuse_library_operators(architecture: str, methods: dict[str, ExportedProgram]) -> None:
    """A ``CheckpointError`` when an exported method calls an operator another library registers (one
    transformers defines for its own kernels): a file calling it would run only where that library is
    imported, and ``llm generate`` in a fresh process could not run it."""
    for method, program in methods.items():
        called = operators_called(program.graph_module)
        foreign = sorted(str(operator) for operator in called if operator.namespace not in TORCH_NAMESPACES)
        if foreign:
            raise CheckpointError(
                f"{architecture}'s exported {method} calls {', '.join(foreign)}, which another library registers: "
                "a file calling it would run only where that library is imported; this architecture's export is "
                "not supported yet"
            )


@contextlib.contextmanager
def _last_logits_only(model: Any, wanted: bool) -> Iterator[None]:
    """``model`` called with ``logits_to_keep=1`` while the block runs, where ``wanted`` and its
    forward has that parameter. A keyword pre-hook rather than a new ``forward``, so the exported
    modules keep their own paths; removed after, whatever happens."""
    if not wanted or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        yield
        return

    def keep(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, "logits_to_keep": 1}

    hook = model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


EXPORTED_EXPERTS = "batched_mm"
"""transformers' experts path a mixture-of-experts model is exported with: the weights of each token's
chosen experts gathered and applied in one batched product, core ATen only. Its default path calls,
under export, an operator transformers registers (``transformers::grouped_mm_fallback``), which a file
could not run without importing transformers."""


@contextlib.contextmanager
def exportable_experts(model: Any) -> Iterator[None]:
    """``model``'s experts (where it has transformers' switchable experts) computed by
    :data:`EXPORTED_EXPERTS` while the block runs; its own choice back after, whatever happens."""
    switchable = getattr(model, "_can_set_experts_implementation", None)
    if switchable is None or not switchable():
        yield
        return
    chosen = model.get_experts_implementation()
    model.set_experts_implementation(EXPORTED_EXPERTS)
    try:
        yield
    finally:
        model.set_experts_implementation(chosen)


def logits_given(prefill: ExportedProgram) -> str:
    """``"last"`` where the exported prefill gives one position's logits, ``"all"`` where it gives
    each prompt token's (as :data:`PREFILL_LOGITS` names them)."""
    (logits, *_) = prefill.graph_module.graph.output_node().args[0]
    return "last" if logits.meta["val"].shape[1] == 1 else "all"


def _stop_tokens(model: Any, generation_config: Any = None) -> list[int]:
    found: Any = getattr(generation_config or model.generation_config, "eos_token_id", None)
    if found is None:
        found = getattr(model.config, "eos_token_id", None)
    tokens = found if isinstance(found, (list, tuple)) else [] if found is None else [found]
    return sorted({int(t) for t in tokens})


def _generation_config(transformers: Any, directory: Path) -> Any:
    """The checkpoint's generation config as from_pretrained reads it: its file, else one from the model's config.
    JSON only, no code (given ``trust_remote_code``, it would keep it as a setting)."""
    if not (directory / "generation_config.json").is_file():
        return None
    try:
        return transformers.GenerationConfig.from_pretrained(directory, local_files_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{directory}/generation_config.json cannot be read ({type(e).__name__}: {first_line(e)})"
        ) from e


def quiet_transformers() -> Any:
    """transformers, without its logs and progress bars."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers
