"""A checkpoint's own code: the Python files that the ``auto_map`` of its ``config.json`` and
``tokenizer_config.json`` name, which transformers imports to read the checkpoint when told to
trust it (and, not told, may ask about on standard input).

It is never run unless the user says so: before transformers reads anything, :func:`allowed`
refuses a checkpoint that needs its own code, says when transformers' own classes read it
instead, and, where the user trusts it, names every file that will run. A checkpoint's tokenizer
code never runs at all: a program carries ``tokenizer.json``, which the tokenizers library reads.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdelegate.errors import CheckpointError, first_line
from torchdelegate.serialize.bounded_json import JsonLimitError, bounded_json

RUN_WHEN_TRUSTED = ("AutoConfig", "AutoModelForCausalLM")
"""The auto_map entries reading a causal LM imports; the others (tokenizers, other heads) never run."""
NOT_RUN_BECAUSE = "the model as AutoModelForCausalLM, and the tokenizer from tokenizer.json with the tokenizers library"


@dataclass(frozen=True)
class CheckpointCode:
    """The ``auto_map`` entries of a checkpoint directory: file name -> {auto class: class references}."""

    directory: Path
    entries: dict[str, dict[str, list[str]]]

    @property
    def needed(self) -> dict[str, list[str]]:
        """config.json's entries that reading the model would run (:data:`RUN_WHEN_TRUSTED`)."""
        model = self.entries.get("config.json", {})
        return {name: model[name] for name in RUN_WHEN_TRUSTED if name in model}

    def named(self, only_unused: bool = False) -> str:
        """The entries, file by file: ``config.json's auto_map: AutoConfig: configuration_x.XConfig, ...``;
        ``only_unused``: only those that never run."""
        described = []
        for file, entries in self.entries.items():
            shown = {
                name: references
                for name, references in entries.items()
                if not (only_unused and file == "config.json" and name in RUN_WHEN_TRUSTED)
            }
            if shown:
                described.append(f"{file}'s auto_map: {_listed(shown)}")
        return "; ".join(described)

    def to_run(self) -> list[str]:
        """Each file that trusting the checkpoint runs, with what it defines or who imports it;
        a CheckpointError where an entry names code outside the directory or a file it lacks."""
        run: dict[Path, str] = {}
        for name, references in self.needed.items():
            for reference in references:
                run.setdefault(self._module_file(reference), f"{name}: {reference.rpartition('.')[2]}")
        from transformers.dynamic_module_utils import get_relative_import_files

        for module in list(run):
            for imported in map(Path, get_relative_import_files(module)):
                if not imported.is_file():
                    raise CheckpointError(
                        f"{self.directory}: {module.name} imports {imported.stem}, and there is no {imported.name} "
                        "in the directory"
                    )
                run.setdefault(imported, f"imported by {module.name}")
        return [f"{path} ({what})" for path, what in run.items()]

    def _module_file(self, reference: str) -> Path:
        module, dot, name = reference.partition(".")
        if "--" in reference or not (dot and module.isidentifier() and name.isidentifier()):
            raise CheckpointError(
                f"{self.directory}: config.json's auto_map names {reference}, which is not a class of a file in the "
                "checkpoint directory (module.Class); llm export runs no code from elsewhere"
            )
        path = self.directory / f"{module}.py"
        if not path.is_file():
            raise CheckpointError(
                f"{self.directory}: config.json's auto_map names {reference}, and there is no {path.name} in the "
                "directory; copy the checkpoint whole"
            )
        return path


def checkpoint_code(directory: Path) -> CheckpointCode:
    """The ``auto_map`` entries of ``directory``'s config.json and tokenizer_config.json, read as JSON
    (nothing imported); a CheckpointError where either file is not a JSON object."""
    entries = {}
    for file in ("config.json", "tokenizer_config.json"):
        found = _auto_map(directory / file)
        if found:
            entries[file] = found
    return CheckpointCode(directory, entries)


MAX_CONFIG_BYTES = 64 << 20


def checkpoint_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as an object: a regular file (a FIFO is never waited for) of at most
    :data:`MAX_CONFIG_BYTES`, read by the bounded reader; a ``CheckpointError`` saying what is wrong."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(descriptor, "rb") as file:
            status = os.fstat(file.fileno())
            if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_CONFIG_BYTES:
                raise CheckpointError(f"{path} is not a JSON file of at most {MAX_CONFIG_BYTES} bytes")
            content = bounded_json(file.read(MAX_CONFIG_BYTES + 1), MAX_CONFIG_BYTES)
    except (JsonLimitError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {first_line(e)})") from e
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} is not a JSON object; give the file save_pretrained wrote")
    return content


def _auto_map(path: Path) -> dict[str, list[str]]:
    if not path.exists():
        return {}
    content = checkpoint_json(path)
    found = content.get("auto_map") or {}
    if isinstance(found, list):  # an old tokenizer_config.json: the slow and fast tokenizer classes
        found = {"AutoTokenizer": found}
    if not isinstance(found, dict):
        return {"auto_map": [repr(found)]}
    return {str(name): _references(value) for name, value in found.items()}


def _references(value: Any) -> list[str]:
    """An auto_map value (a class reference, or a list of them with None for none) as its references."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(v) for v in values if v is not None]


def allowed(code: CheckpointCode, transformers: Any, trusted: bool) -> list[str]:
    """What to tell the user before transformers reads the checkpoint: the files that will run
    (``trusted``), the entries that will not. A CheckpointError, naming every entry, where the
    checkpoint needs its own code and the user did not say to trust it."""
    unused = code.named(only_unused=True)
    lines = [f"not run: {unused} (llm export reads {NOT_RUN_BECAUSE})"] if unused else []
    if not code.needed:
        return lines
    if trusted:
        return [f"running the checkpoint's own code (--trust-remote-code): {', '.join(code.to_run())}", *lines]
    own = _transformers_own_class(transformers, code.directory / "config.json")
    if own is None:
        files = sorted({f"{reference.partition('.')[0]}.py" for refs in code.needed.values() for reference in refs})
        raise CheckpointError(
            f"{code.directory} holds code of its own, which transformers would run to read it ({code.named()}); "
            f"llm export runs no checkpoint's code unless told to: read its {', '.join(files)}; if you trust "
            "them, give --trust-remote-code"
        )
    return [
        f"the checkpoint's own code is not run (config.json's auto_map: {_listed(code.needed)}): transformers' "
        f"own {own} reads it "
        "(--trust-remote-code would run the checkpoint's instead)",
        *lines,
    ]


def _listed(entries: dict[str, list[str]]) -> str:
    return ", ".join(f"{name}: {' or '.join(references)}" for name, references in entries.items())


def _transformers_own_class(transformers: Any, config_file: Path) -> str | None:
    """The name of transformers' own causal-LM class for the config's ``model_type``, if it has one."""
    model_type = checkpoint_json(config_file).get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        return None
    config_class = transformers.CONFIG_MAPPING[model_type]
    if config_class not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    return str(transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__name__)
