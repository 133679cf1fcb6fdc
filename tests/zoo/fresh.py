"""Load saved programs and run their calls in a process that built none of them.

``python fresh.py JOBS.json``: each job names a program file, its calls (``torch.save``d list of
``{"method", "args", "kwargs"}``), where to write what the calls returned (their outputs
flattened to tensors and each output's structure, or the error's first line) and the modules
that define its output types (``imports``: ``transformers.modeling_outputs`` for a model that
returns a ``ModelOutput``). Only torch and torchdelegate are imported at first, as in a
deployment; programs with ``imports`` are loaded once like that (what happens is recorded as
``bare_load``), then those modules are imported, as a caller that uses the types has them,
and the calls run.
"""

from __future__ import annotations

import importlib
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


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"


def bare_load(program_path: str) -> str:
    """The error of loading ``program_path`` with only torch and torchdelegate imported, or ""."""
    try:
        torchdelegate.load(program_path).close()
    except Exception as error:  # noqa: BLE001 - recorded, not raised
        return describe(error)
    return ""


def run_job(job: dict[str, Any], bare: str | None) -> None:
    """One program: its outputs or its error, written to ``job["outputs"]``; never raises."""
    try:
        calls = torch.load(job["calls"], weights_only=True)
        answer = run_calls(job["program"], calls)
    except Exception as error:  # noqa: BLE001 - the zoo records every failure and goes on
        answer = {"error": describe(error)}
    if bare is not None:
        answer["bare_load"] = bare
    torch.save(answer, job["outputs"])


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    jobs = json.loads(Path(argv[1]).read_text())
    bare = {index: bare_load(job["program"]) for index, job in enumerate(jobs) if job.get("imports")}
    for module in sorted({module for job in jobs for module in job.get("imports", [])}):
        importlib.import_module(module)
    for index, job in enumerate(jobs):
        run_job(job, bare.get(index))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
