"""Load saved programs and run their calls in a process that built none of them.

``python fresh.py JOBS.json``: each job names a program file, its calls (``torch.save``d list of
``{"method", "args", "kwargs"}``) and where to write what the calls returned: their outputs
flattened to tensors and each output's structure, or the error's first line. Only torch and
torchdelegate are imported here, as in a deployment: the model's own library (transformers)
is not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import torchdelegate
from torchdelegate.errors import first_line


def run_calls(program_path: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Every call's flattened outputs and structure, the calls made in order on one loaded program."""
    outputs, structures = [], []
    with torchdelegate.load(program_path) as program:
        for call in calls:
            result = program.run(call["method"], *call["args"], **call["kwargs"])
            leaves, spec = pytree.tree_flatten(result)
            outputs.append([leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
            structures.append(str(spec))
    return {"outputs": outputs, "structures": structures}


def run_job(job: dict[str, str]) -> None:
    """One program: its outputs or its error, written to ``job["outputs"]``; never raises."""
    try:
        calls = torch.load(job["calls"], weights_only=True)
        answer = run_calls(job["program"], calls)
    except Exception as error:  # noqa: BLE001 - the zoo records every failure and goes on
        answer = {"error": f"{type(error).__name__}: {first_line(error)}"}
    torch.save(answer, job["outputs"])


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    for job in json.loads(Path(argv[1]).read_text()):
        run_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
