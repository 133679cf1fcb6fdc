"""Load saved programs and run their calls in a process that built none of them.

``python fresh.py JOBS.json``: each job names a program file, its calls (``torch.save``d list of
``{"method", "args", "kwargs"}``), where to write what the calls returned (their outputs
flattened to tensors and each output's structure, or the error's first line) and the modules
that define its output types (``imports``: ``transformers.modeling_outputs`` for a model that
returns a ``ModelOutput``). Only torch and torchdelegate are imported at first, as in a
deployment; programs with ``imports`` are run once like that (their outputs come back as plain
containers; what they returned is recorded as ``bare``), then those modules are imported, as a
caller that uses the types has them, and the calls run again.
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


def answer_of(job: dict[str, Any]) -> dict[str, Any]:
    """The job's calls' outputs and structures, or its error; never raises."""
    try:
        return run_calls(job["program"], torch.load(job["calls"], weights_only=True))
    except Exception as error:  # noqa: BLE001 - the zoo records every failure and goes on
        return {"error": describe(error)}


def run_job(job: dict[str, Any], bare: dict[str, Any] | None) -> None:
    """One program: its outputs or its error, written to ``job["outputs"]``."""
    answer = answer_of(job)
    if bare is not None:
        answer["bare"] = bare
    torch.save(answer, job["outputs"])


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    jobs = json.loads(Path(argv[1]).read_text())
    bare = {index: answer_of(job) for index, job in enumerate(jobs) if job.get("imports")}
    for module in sorted({module for job in jobs for module in job.get("imports", [])}):
        importlib.import_module(module)
    for index, job in enumerate(jobs):
        run_job(job, bare.get(index))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
