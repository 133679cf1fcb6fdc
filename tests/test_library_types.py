"""Programs whose outputs are a library's types (transformers' ``ModelOutput``), lowered from
Python and with the command, then run in fresh processes: one where transformers cannot be
imported at all (outputs come back as dicts of the same fields), one that imports its module
(outputs come back as its types)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from zoo.models import DECODER_CONFIG, ENCODER, T5, from_config, tokens  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.reference import ReferencePartitioner  # noqa: E402

OUTPUTS_MODULE = "transformers.modeling_outputs"
# A process in which ``import transformers`` raises ImportError, as on a machine without it.
WITHOUT_TRANSFORMERS = "import sys\nsys.modules['transformers'] = None\n"

# method name -> a model returning its ModelOutput as it is, from the zoo's tiny configs, and the
# lengths of its token inputs: an encoder, a decoder-only LM, an encoder-decoder
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any], dict[str, int]]] = {
    "encode": ("BertModel", "BertConfig", ENCODER, {"input_ids": 8}),
    "generate": ("LlamaForCausalLM", "LlamaConfig", {**DECODER_CONFIG, "use_cache": False}, {"input_ids": 8}),
    "translate": (
        "T5ForConditionalGeneration",
        "T5Config",
        {**T5, "use_cache": False},
        {"input_ids": 8, "decoder_input_ids": 5},
    ),
}


class Built:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}
        self.eager: dict[str, Any] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Each model exported with keyword inputs (``.pt2``, for the command), its eager outputs, and
    one program file of all three methods lowered from Python with onnxruntime then reference."""
    result = Built(tmp_path_factory.mktemp("library-types"))
    programs = {}
    for method, (model_class, config_class, config, lengths) in ARCHITECTURES.items():
        torch.manual_seed(0)
        model = from_config(model_class, config_class, **config)
        inputs = {name: tokens(length=length) for name, length in lengths.items()}
        with torch.no_grad():
            result.eager[method] = model(**inputs)
        programs[method] = torch.export.export(model, (), inputs)
        torch.export.save(programs[method], result.directory / f"{method}.pt2")
        result.inputs[method] = inputs
        for name, value in inputs.items():
            np.save(result.directory / f"{method}.{name}.npy", value.numpy())
    lowered = td.to_edge_transform_and_lower(programs, partitioner=[OnnxRuntimePartitioner(), ReferencePartitioner()])
    lowered.save(result.directory / "models.tdp")
    torch.save(result.inputs, result.directory / "inputs.pt")
    return result


def _python(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=600, check=False
    )


RUN_ALL = """
import json, torch, torchdelegate
inputs = torch.load("inputs.pt", weights_only=True)
seen = {}
with torchdelegate.load("models.tdp") as program:
    for method, kwargs in inputs.items():
        out = program.run(method, **kwargs)
        seen[method] = {
            "type": f"{type(out).__module__}.{type(out).__qualname__}",
            "keys": list(out.keys()),
            "output_type": program.method(method).output_type,
        }
        torch.save(dict(out), f"{method}.out.pt")
    seen["plain_types"] = program.plain_types
print(json.dumps(seen))
"""


def _assert_same_fields(eager: Any, loaded: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(eager.keys())
    for name, value in eager.items():
        torch.testing.assert_close(loaded[name], value, atol=1e-5, rtol=1e-4)


def test_a_process_without_transformers_gets_dicts_of_the_same_fields(built: Built) -> None:
    done = _python(WITHOUT_TRANSFORMERS + "import transformers\n", built.directory)
    assert "import of transformers halted" in done.stderr  # the check below runs where transformers truly cannot load
    done = _python(WITHOUT_TRANSFORMERS + RUN_ALL, built.directory)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    expected_types = {method: f"{type(out).__module__}.{type(out).__name__}" for method, out in built.eager.items()}
    assert seen.pop("plain_types") == {name: "dict" for name in sorted(set(expected_types.values()))}
    for method, eager in built.eager.items():
        expected = {"type": "builtins.dict", "keys": list(eager.keys()), "output_type": expected_types[method]}
        assert seen[method] == expected
        _assert_same_fields(eager, torch.load(built.directory / f"{method}.out.pt", weights_only=True))
    assert list(built.eager["encode"].keys()) == ["last_hidden_state", "pooler_output"]
    assert "encoder_last_hidden_state" in built.eager["translate"].keys()


def test_a_process_that_imports_the_outputs_module_gets_its_types(built: Built) -> None:
    done = _python(f"import {OUTPUTS_MODULE}\n" + RUN_ALL, built.directory)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen.pop("plain_types") == {}
    for method, eager in built.eager.items():
        assert seen[method]["type"] == f"{type(eager).__module__}.{type(eager).__qualname__}"
        _assert_same_fields(eager, torch.load(built.directory / f"{method}.out.pt", weights_only=True))


COMMANDS = """
import contextlib, io, json, sys
from torchdelegate.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    answers.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(answers))
"""


def _commands(commands: list[list[str]], cwd: Path, prelude: str = "") -> list[dict[str, Any]]:
    """Each command's exit code and output, all run by ``main`` in one fresh process, in order, as for a
    user who has not set ``TORCHDELEGATE_CACHE`` (so no compile cache and no cache column)."""
    done = subprocess.run(
        [sys.executable, "-c", prelude + COMMANDS, json.dumps(commands)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "TORCHDELEGATE_CACHE": "off"},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answers: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def _last_error_line(answer: dict[str, Any]) -> str:
    return str(answer["stderr"]).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def lowered_by_command(built: Built) -> list[dict[str, Any]]:
    """In one process that has not imported transformers: lower without ``--import`` (refused), with
    an ``--import`` of no module, a file naming a planted module's type, then with ``--import``."""
    methods = [f"{method}={method}.pt2" for method in ARCHITECTURES]
    planted = built.directory / "planted"
    planted.mkdir()
    (planted / "planted.py").write_text(f"open({str(planted / 'imported')!r}, 'w').close()\n")
    enum = {"__enum__": True, "fqn": "planted:Kind", "name": "A"}  # torch's reader would import planted
    for name, edit in (
        ("typed", lambda root: root.update(type="planted.Output")),
        ("enum", lambda root: root.update(context=json.dumps([enum, "pooler_output"]))),
    ):
        shutil.copy(built.directory / "encode.pt2", planted / f"{name}.pt2")
        _edit_outputs(planted / f"{name}.pt2", edit)
    commands = [
        ["lower", *methods, "-b", "reference", "-o", "cli.tdp"],
        ["lower", "encode=encode.pt2", "-b", "reference", "-o", "x.tdp", "--import", "transformerz"],
        ["lower", "encode=planted/typed.pt2", "-b", "reference", "-o", "x.tdp"],
        ["lower", "encode=planted/enum.pt2", "-b", "reference", "-o", "x.tdp"],
        ["lower", *methods, "-b", "reference", "-o", "cli.tdp", "--import", OUTPUTS_MODULE],
    ]
    # planted.py sits in the working directory's planted/, on sys.path if anything imported it by name
    return _commands(commands, built.directory, prelude=f"import sys\nsys.path.insert(0, {str(planted)!r})\n")


def test_the_command_names_the_missing_type_and_suggests_import(lowered_by_command: list[dict[str, Any]]) -> None:
    refused = lowered_by_command[0]
    assert refused["code"] == 1
    error = _last_error_line(refused)
    assert "transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions" in error
    assert "which this process has not registered; import what defines it" in error
    assert error.endswith("--import transformers.modeling_outputs")
    assert "is not a torch.export.save file" not in error


def test_import_of_a_module_that_does_not_exist_is_a_usage_error(lowered_by_command: list[dict[str, Any]]) -> None:
    answer = lowered_by_command[1]
    assert answer["code"] == 2
    message = "--import transformerz: no module named 'transformerz' in this environment or the current directory"
    assert _last_error_line(answer).endswith(message)


def test_a_file_never_makes_the_command_import_a_module(built: Built, lowered_by_command: list[dict[str, Any]]) -> None:
    typed, enum = lowered_by_command[2:4]
    assert typed["code"] == 1
    assert "needs planted.Output" in typed["stderr"] and "--import planted" in typed["stderr"]
    assert enum["code"] == 1
    assert (
        "a tree spec names an enum, which a saved graph may not (reading it imports); the file is not read"
        in (enum["stderr"])
    )
    assert not (built.directory / "planted" / "imported").exists()


def test_with_import_the_command_lowers_them_and_runs_them_without_transformers(
    built: Built, lowered_by_command: list[dict[str, Any]]
) -> None:
    assert lowered_by_command[4]["code"] == 0, lowered_by_command[4]["stderr"]
    runs = [
        ["run", "cli.tdp", "-m", method, *[a for name in inputs for a in ("-i", f"{name}={method}.{name}.npy")]]
        + ["--save", f"{method}.npz"]
        for method, inputs in built.inputs.items()
    ]
    inspected, *ran = _commands([["inspect", "cli.tdp"], *runs], built.directory, prelude=WITHOUT_TRANSFORMERS)
    assert inspected["code"] == 0, inspected["stderr"]
    assert (
        "  translate(input_ids: int64[1, 8], decoder_input_ids: int64[1, 5]) -> "
        "transformers.modeling_outputs.Seq2SeqLMOutput (read as a dict here)  delegates: #2 reference"
    ) in inspected["stdout"]
    for method, answer in zip(built.inputs, ran, strict=True):
        assert answer["code"] == 0, answer["stderr"]
        eager = built.eager[method]
        name = f"{type(eager).__module__}.{type(eager).__name__}"
        assert f", a {name} (returned as a dict: not registered in this process)" in answer["stdout"]
        saved = np.load(built.directory / f"{method}.npz")
        for index, (field, value) in enumerate(eager.items()):
            assert f"  output_{index} {field}: float32[{', '.join(map(str, value.shape))}]" in answer["stdout"]
            np.testing.assert_allclose(saved[f"output_{index}"], value.numpy(), atol=1e-5, rtol=1e-4)


def _edit_outputs(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite an archive's model JSON: ``edit`` changes the root node of its outputs' tree spec."""
    with zipfile.ZipFile(path) as archive:
        members = {member: archive.read(member) for member in archive.namelist()}
    (model,) = [member for member in members if member.endswith("/models/model.json")]
    document = json.loads(members[model])
    signature = document["graph_module"]["module_call_graph"][0]["signature"]
    protocol, root = json.loads(signature["out_spec"])
    edit(root)
    signature["out_spec"] = json.dumps([protocol, root])
    members[model] = json.dumps(document).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
