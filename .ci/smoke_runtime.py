"""The torch-free install (the torchdelegate-runtime distribution) as a user meets it: run by .ci/package
in the directory the files go to.

    python smoke_runtime.py prepare    # in an environment with torch: the files, and what they must give
    python smoke_runtime.py check      # in torchdelegate-runtime's: torch absent, the files run, lowering refused
    python smoke_runtime.py serve      # there too, with the serve extra: llm serve answers
    python smoke_runtime.py size       # there: the environment on disk, at most 200 MiB

``prepare`` lowers a small model to ONNX Runtime alone and exports the demo language model (with a chat
template), and records what eager torch and the torch environment's commands give; ``check`` runs the
same files with numpy and ONNX Runtime only and compares.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import smoke_commands
from smoke_commands import HERE, command, refused

LOWERING_NEEDS = ("torch", "transformers", "onnx", "onnxscript", "torchao")
"""Distributions the runtime environment must not hold: lowering's, never running's."""
MOST_MIB = 200
PROMPT = ("-p", "The teacher said", "--max-new-tokens", "8", "--ids")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
CHAT_LINES = "hello there\nand then?\n"


def prepare() -> None:
    """model.tdp (ONNX Runtime only) with x.npy and eager's expected.npy, and model.pt2 as exported; demo.tdp
    (the demo language model, with a chat template) with what llm generate and llm chat print here."""
    import numpy as np
    import torch
    from smoke import _Model

    import torchdelegate as td
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

    torch.manual_seed(0)
    model, x = _Model().eval(), torch.randn(4, 64)
    exported = torch.export.export(model, (x,))
    torch.export.save(exported, HERE / "model.pt2")  # what lower is asked to lower without torch
    td.to_edge_transform_and_lower(exported, partitioner=[OnnxRuntimePartitioner()]).save(HERE / "model.tdp")
    np.save(HERE / "x.npy", x.numpy())
    with torch.no_grad():
        np.save(HERE / "expected.npy", model(x).numpy())
    command("demo", "--checkpoint", "checkpoint")
    (HERE / "checkpoint" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    command("llm", "export", "checkpoint", "-o", "demo.tdp", "--max-cache", "64")
    (HERE / "generate.txt").write_text(command("llm", "generate", "demo.tdp", *PROMPT))
    chatted = command("llm", "chat", "demo.tdp", "--max-new-tokens", "6", "--ids", stdin=CHAT_LINES)
    (HERE / "chat.txt").write_text(chatted)


def check() -> None:
    """Torch cannot be imported; the files run through the Python API and the commands and give what the torch
    environment gave; lowering says in one line that it needs torch."""
    _lowering_is_not_installed()
    _python_api_runs_numpy()
    expected = _array("expected.npy")
    command("run", "model.tdp", "-i", "x.npy", "--save", "out.npz")
    _close(_array("out.npz", "output_0"), expected, "torchdelegate run")
    assert "onnxruntime" in command("inspect", "model.tdp"), "inspect does not name the file's backend"
    _refused_for_torch("lower", "--backend", "onnxruntime", "-o", "lowered.tdp", "forward=model.pt2")
    _refused_for_torch("llm", "export", "checkpoint", "-o", "exported.tdp")
    generated = command("llm", "generate", "demo.tdp", *PROMPT)
    assert generated.startswith(" that he"), generated  # the demo model's greedy continuation
    _same_ids(generated, (HERE / "generate.txt").read_text(), "llm generate")
    chatted = command("llm", "chat", "demo.tdp", "--max-new-tokens", "6", "--ids", stdin=CHAT_LINES)
    _same_ids(chatted, (HERE / "chat.txt").read_text(), "llm chat")
    assert "torch" not in sys.modules


def serve() -> None:
    smoke_commands.serve("demo.tdp")


def size() -> None:
    """The environment (``sys.prefix``) on disk, and its five largest distributions; fails above MOST_MIB."""
    total = _disk_bytes(Path(sys.prefix))
    print(f"runtime environment: {total / 2**20:.1f} MiB on disk (at most {MOST_MIB}), of which:")
    for name, used in _by_distribution()[:5]:
        print(f"  {name}: {used / 2**20:.1f} MiB")
    assert total <= MOST_MIB * 2**20, f"the runtime environment takes {total / 2**20:.1f} MiB, over {MOST_MIB}"


def _lowering_is_not_installed() -> None:
    import importlib.util

    present = [name for name in LOWERING_NEEDS if importlib.util.find_spec(name) is not None]
    assert not present, f"the runtime environment holds {present}"
    try:
        import torch  # noqa: F401
    except ImportError:
        print("import torch: fails, as it should")
    else:
        raise AssertionError("import torch succeeded in the runtime environment")


def _python_api_runs_numpy() -> None:
    """``load`` and ``run`` with a numpy array in: a numpy array out, as eager torch computed."""
    import numpy as np

    import torchdelegate as td

    with td.load(HERE / "model.tdp") as program:
        got = program.run("forward", np.load(HERE / "x.npy"))
    assert isinstance(got, np.ndarray), f"run returned {type(got).__name__}, not a numpy array"
    _close(got, _array("expected.npy"), "Program.run")
    _refused_for_torch_in_python()


def _refused_for_torch_in_python() -> None:
    """The Python lowering API, asked for: an error in one line naming torch and what to install."""
    import torchdelegate as td

    try:
        td.to_edge_transform_and_lower(HERE / "model.pt2")  # type: ignore[arg-type]  # no program without torch
    except Exception as e:  # noqa: BLE001 - which error the API raises is its own; the message is checked
        said = str(e)
    else:
        raise AssertionError("to_edge_transform_and_lower ran without torch")
    assert _says_install_torch(said) and "\n" not in said, f"the lowering API's error: {said!r}"
    print(f"to_edge_transform_and_lower: refused: {said}")


def _refused_for_torch(*args: str) -> None:
    said = refused(*args)
    assert _says_install_torch(said), f"torchdelegate {' '.join(args)}: the refusal names no install of torch: {said}"


def _says_install_torch(said: str) -> bool:
    """Whether an error names torch and says what to install: the full distribution."""
    return "torch" in said and "pip install torchdelegate" in said


def _array(file: str, name: str | None = None) -> Any:
    import numpy as np

    loaded = np.load(HERE / file)
    return loaded[name] if name is not None else loaded


def _close(got: Any, expected: Any, what: str) -> None:
    import numpy as np

    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4, err_msg=what)
    print(f"{what}: equal to eager torch")


def _same_ids(printed: str, expected: str, what: str) -> None:
    """The token ids ``printed`` lists are those the torch environment printed for the same file."""
    ids, wanted = re.findall(r"token ids: \[[0-9, ]*\]", printed), re.findall(r"token ids: \[[0-9, ]*\]", expected)
    assert ids and ids == wanted, f"{what}: {ids} without torch, {wanted} with it"
    print(f"{what}: the same tokens as with torch")


def _disk_bytes(root: Path) -> int:
    """Bytes ``root``'s files take on disk, each file once (hard links), symbolic links not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            found = os.lstat(os.path.join(folder, name))
            if (found.st_dev, found.st_ino) not in seen:
                seen.add((found.st_dev, found.st_ino))
                total += found.st_blocks * 512
    return total


def _by_distribution() -> list[tuple[str, int]]:
    """Each installed distribution's disk use, largest first: the top-level entries of site-packages its
    files lie in (with the bytecode written since), and its metadata."""
    used: dict[str, int] = {}
    for distribution in metadata.distributions():
        where = Path(str(distribution.locate_file("")))
        tops = {Path(str(file)).parts[0] for file in distribution.files or []}
        name = distribution.metadata["Name"]
        used[name] = sum(_entry_bytes(where / top) for top in tops if top not in ("..", "__pycache__"))
    return sorted(used.items(), key=lambda item: -item[1])


def _entry_bytes(path: Path) -> int:
    if path.is_symlink() or not path.exists():
        return 0
    return _disk_bytes(path) if path.is_dir() else path.lstat().st_blocks * 512


if __name__ == "__main__":
    globals()[sys.argv[1]]()
