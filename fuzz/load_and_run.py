"""Fuzz the loader: any bytes given to ``torchdelegate.load`` and ``run`` end in success or a
documented refusal, never another exception.

Each input is tried twice: as given, and *resealed* (the header's manifest checksum
recomputed), so that mutations of the manifest reach the parser and the checks behind it
instead of stopping at the checksum. Each method of a program that loads is then run once
with zero inputs shaped by its signature.

    python fuzz/seeds.py fuzz/corpus                      # real files to start from
    python fuzz/load_and_run.py fuzz/corpus -max_total_time=120 -artifact_prefix=fuzz/crashes/

``check_one`` is also what the regression test runs over tests/serialize/fuzz_regressions/.
"""

from __future__ import annotations

if __name__ == "__main__":  # coverage feedback for the fuzzer: instrument the package as it is imported
    import atheris

    with atheris.instrument_imports(include=["torchdelegate"]):
        import torchdelegate  # noqa: F401

import hashlib
import os
import re
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import torchdelegate as td
from torchdelegate.errors import (
    BackendNotFoundError,
    DelegateExecutionError,
    FormatError,
    MethodExecutionError,
    OperatorNotFoundError,
    UntrustedCodeError,
)

# What a bad file may end in: refused at load, or (for a file whose structure is valid but
# whose delegates or graph ops are not what was saved) refused when run. A resealed manifest that
# names an operator of a namespace no library here registers reads as a file needing that library.
REFUSED_AT_LOAD = (FormatError, BackendNotFoundError, OperatorNotFoundError, UntrustedCodeError)
REFUSED_AT_RUN = (FormatError, DelegateExecutionError, MethodExecutionError, OperatorNotFoundError, UntrustedCodeError)
HEADER = 64
SCRATCH = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
OUTCOMES: Counter[str] = Counter()
_DTYPES = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")
}
_TENSOR = re.compile(r"^\w+: (\w+)\[(.*)\](?: on (\w+))?$")


def reseal(data: bytes) -> bytes | None:
    """``data`` with the manifest checksum recomputed, when the header gives a manifest length."""
    if len(data) < HEADER:
        return None
    (length,) = struct.unpack_from("<Q", data, 16)
    if HEADER + length > len(data):
        return None
    digest = hashlib.sha256(data[HEADER : HEADER + length]).digest()
    return data[:32] + digest + data[HEADER:]


def zero_inputs(signature: list[str]) -> list[Any] | None:
    """Inputs for a method from ``BoundMethod.signature()``: zeros of each tensor's dtype, sizes
    (2 for a symbolic size) and device, 1 for a number; None when the signature is not understood
    or names a device this machine does not have."""
    values: list[Any] = []
    for parameter in signature:
        tensor = _TENSOR.match(parameter)
        if tensor and tensor.group(1) in _DTYPES:
            sizes = [int(s) if s.strip().isdigit() else 2 for s in tensor.group(2).split(",") if s.strip()]
            try:
                values.append(torch.zeros(sizes, dtype=_DTYPES[tensor.group(1)], device=tensor.group(3) or "cpu"))
            except RuntimeError:  # a device torch knows but this machine lacks
                return None
        elif parameter.endswith((": int", ": float", ": bool")):
            values.append(1)
        elif " = " in parameter:
            continue  # a constant the exported call fixed: not passed
        else:
            return None
    return values


def _load_and_run(data: bytes) -> str:
    with tempfile.NamedTemporaryFile(dir=SCRATCH, suffix=".tdp") as file:
        file.write(data)
        file.flush()
        try:
            program = td.load(file.name)
        except REFUSED_AT_LOAD as error:
            return f"refused at load ({type(error).__name__})"
        with program:
            for method in program.method_names:
                inputs = zero_inputs(program.method(method).signature())
                if inputs is None:
                    return "loaded (inputs not understood)"
                try:
                    with torch.no_grad():
                        program.run(method, *inputs)
                except REFUSED_AT_RUN as error:
                    return f"refused at run ({type(error).__name__})"
        return "ran"


def check_one(data: bytes) -> list[str]:
    """The outcomes of ``data`` as given and resealed; an undocumented exception propagates."""
    outcomes = [_load_and_run(data)]
    resealed = reseal(data)
    if resealed is not None and resealed != data:
        outcomes.append("resealed: " + _load_and_run(resealed))
    OUTCOMES.update(outcomes)
    return outcomes


def main() -> None:
    def test_one(data: bytes) -> None:
        check_one(data)
        if sum(OUTCOMES.values()) % 20000 < 2:  # libFuzzer exits without returning: report as we go
            print("outcomes:", dict(sorted(OUTCOMES.items())), file=sys.stderr, flush=True)

    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
