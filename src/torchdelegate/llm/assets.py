"""What a file ``llm export`` wrote carries besides its programs, read as generating reads it: the
generation settings, the tokenizer and the chat template.

This module imports neither torch nor transformers: ``llm generate``, ``llm chat`` and ``llm serve``
read a file's assets through it in an environment that has neither (``checkpoint.py``, which
exports, needs both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from torchdelegate.errors import CheckpointError, first_line
from torchdelegate.serialize.bounded_json import JsonLimitError, bounded_json

SETTINGS = "torchdelegate_llm.json"
"""The asset that says how the program generates: cache length, prefill chunk, prefill logits, stop tokens."""


def settings_asset(max_cache: int, chunk: int | None, stop_tokens: list[int], prefill_logits: str = "last") -> bytes:
    """The generation settings a program carries (``SETTINGS``); ``prefill_chunk`` null: any length."""
    settings = {
        "max_cache": max_cache,
        "prefill_chunk": chunk,
        "prefill_logits": prefill_logits,
        "stop_tokens": stop_tokens,
    }
    return json.dumps(settings, sort_keys=True).encode()


def read_tokenizer(data: bytes, where: str) -> Any:
    """``tokenizer.json``'s bytes as a tokenizers ``Tokenizer``; CheckpointError naming ``where`` if unreadable."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:
        raise CheckpointError(
            f"{where} cannot be read by the tokenizers library ({type(e).__name__}: {first_line(e)})"
        ) from e


def chat_template_text(assets: Mapping[str, bytes]) -> str | None:
    """The chat template among a checkpoint's tokenizer files: ``chat_template.jinja``, else the
    ``chat_template`` string of ``tokenizer_config.json``; None if neither has one."""
    if assets.get("chat_template.jinja", b"").strip():
        return assets["chat_template.jinja"].decode("utf-8", "replace")
    config = asset_json(assets, "tokenizer_config.json", {})
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) and template.strip() else None


MAX_ASSET_JSON = 64 << 20


def asset_json(assets: Mapping[str, bytes], name: str, default: Any) -> Any:
    """The JSON asset ``name`` (``default`` when absent), read by the bounded reader: a file's assets
    come from whoever wrote it. A ``CheckpointError`` when it is not JSON within the reader's bounds."""
    if name not in assets:
        return default
    try:
        return bounded_json(assets[name], MAX_ASSET_JSON)
    except JsonLimitError as e:
        raise CheckpointError(f"{name} cannot be read: {e}") from None


def read_chat_template(text: bytes | str, where: str) -> Any:
    """A chat template compiled as ``llm serve`` and ``llm chat`` compile it: in jinja2's immutable
    sandbox, bounded in steps, time and sizes (compiling evaluates constant expressions too);
    CheckpointError naming ``where`` if unreadable or past a bound."""
    from torchdelegate.llm.chat_template import bounded_template

    try:
        source = text.decode("utf-8") if isinstance(text, bytes) else text
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where} is not a template jinja2 reads ({e})") from e
    return bounded_template(source, where)
