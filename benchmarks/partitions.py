"""How many delegates the shipped partitioners make, model by model: the figure that says a change to
partitioning gave no model more delegate calls.

Every zoo model (tests/zoo) and the tiny transformers Llama and GPT-2 of the backend tests
(logits over a sequence) are exported and lowered with each list of shipped partitioners:
``reference``, ``onnxruntime`` then ``reference``, and ``inductor`` (counted from its partitioner's
tags, since an AOTInductor compile takes tens of seconds). The counts go to a JSON file; given
two such files, the script prints the models whose counts differ.

    python benchmarks/partitions.py --json counts.json [MODEL ...]
    python benchmarks/partitions.py --compare before.json after.json

Run it with the ``torchdelegate`` to measure first on ``PYTHONPATH`` (a worktree's ``src``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.reference import ReferencePartitioner  # noqa: E402

LISTS = ("reference", "onnxruntime+reference", "inductor")


def partitioner_list(name: str) -> list[td.Partitioner]:
    if name == "reference":
        return [ReferencePartitioner()]
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

    return [OnnxRuntimePartitioner(), ReferencePartitioner()]


def inductor_tags(edge: td.EdgeProgramManager) -> dict[str, int]:
    """Partitions the AOTInductor partitioner proposes per method (its tags), without compiling."""
    from torchdelegate.backends.inductor import InductorPartitioner
    from torchdelegate.exported.structural_copy import copy_program

    counts = {}
    for method in edge.methods:
        program = copy_program(edge.exported_program(method))
        counts[method] = len(InductorPartitioner().partition(program).partition_tags)
    return counts


def counts_of(programs: dict[str, torch.export.ExportedProgram]) -> dict[str, Any]:
    edge = td.to_edge(programs)
    found: dict[str, Any] = {}
    for name in LISTS:
        try:
            if name == "inductor":
                found[name] = inductor_tags(edge)
            else:
                lowered = edge.to_backend(partitioner_list(name))
                found[name] = {m: len(d) for m, d in lowered.delegates().items()}
        except Exception as error:  # noqa: BLE001 - a failure is a result too
            found[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return found


def transformers_models() -> dict[str, Callable[[], dict[str, torch.export.ExportedProgram]]]:
    from language_models import Logits, tiny_gpt2, tiny_llama

    def logits(build: Callable[[], torch.nn.Module]) -> Callable[[], dict[str, torch.export.ExportedProgram]]:
        def export() -> dict[str, torch.export.ExportedProgram]:
            ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                return {"forward": torch.export.export(Logits(build()), (ids,))}

        return export

    return {"transformers-llama-logits": logits(tiny_llama), "transformers-gpt2-logits": logits(tiny_gpt2)}


def measure(names: Sequence[str]) -> dict[str, Any]:
    from zoo.models import ZOO
    from zoo.run import export, quiet_transformers

    quiet_transformers()
    builds: dict[str, Callable[[], dict[str, torch.export.ExportedProgram]]] = {
        model.name: (lambda model=model: export(model.build())) for model in ZOO
    }
    builds.update(transformers_models())
    results = {}
    for name, build in builds.items():
        if names and name not in names:
            continue
        try:
            results[name] = counts_of(build())
        except Exception as error:  # noqa: BLE001
            results[name] = {"export": f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        print(name, json.dumps(results[name]), flush=True)
    return results


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Print the models whose delegate counts changed; 1 if any model got more."""
    more = fewer = same = 0
    for model in sorted(set(before) | set(after)):
        for name in LISTS:
            old, new = before.get(model, {}).get(name), after.get(model, {}).get(name)
            if old == new:
                same += 1
                continue
            if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
                grew = any(new[m] > old[m] for m in old)
                more += grew
                fewer += not grew
                verdict = "MORE" if grew else "fewer"
            else:
                verdict = "changed"
                more += 1
            print(f"{verdict:7} {model:28} {name:22} {old} -> {new}")
    print(f"{same} unchanged, {fewer} with fewer delegates, {more} with more or changed")
    return 1 if more else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    warnings.simplefilter("ignore")
    results = measure(args.models)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
