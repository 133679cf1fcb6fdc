"""Which engine runs a loaded file: array runtimes on numpy (no torch), or torch.

A file runs on arrays when every delegate's backend has an array runtime
(``delegate/array_runtime.py``) and every method's graph is a call plan (``serialize/call_plan.py``).
Then ``load`` never imports torch. Otherwise torch runs the graphs; where torch is not installed,
the error names what needs it and what to install.
"""

from __future__ import annotations

from torchdelegate.delegate.array_runtime import array_runtime
from torchdelegate.errors import TorchRequiredError
from torchdelegate.serialize.arrays import numpy_dtype
from torchdelegate.serialize.call_plan import CallPlan, NeedsTorch, call_plan
from torchdelegate.serialize.reader import ProgramFile

ENGINES = (None, "arrays", "torch")
"""``load(engine=...)``: None picks arrays when the file allows it; ``"arrays"`` requires them;
``"torch"`` runs on torch whatever the file."""


def array_plans(file: ProgramFile) -> tuple[dict[str, CallPlan] | None, list[str]]:
    """Each method's call plan when the whole file runs on array runtimes, else None and why not."""
    reasons = []
    for backend_id in sorted({d.backend_id for d in file.delegates}):
        if array_runtime(backend_id) is None:
            reasons.append(f"backend {backend_id!r} runs its delegates on torch (it declares no array runtime)")
    try:  # dtypes numpy lacks come from ml_dtypes: without it, torch runs the file
        for entry in file.state:
            numpy_dtype(entry.dtype, f"state {entry.name!r}")
    except ImportError as e:
        reasons.append(str(e))
    plans = {}
    for record in file.methods:
        kinds = {i: file.delegates[i].input_kinds for i in record.delegates if 0 <= i < len(file.delegates)}
        try:
            plans[record.name] = plan = call_plan(record.graph, kinds, f"method {record.name!r}")
            for spec in plan.inputs:
                if spec.dtype is not None:
                    numpy_dtype(spec.dtype, f"method {record.name!r}: input {spec.name!r}")
        except (NeedsTorch, ImportError) as e:
            reasons.append(str(e))
    return (None if reasons else plans), reasons


def require_torch(reasons: list[str], where: str) -> None:
    """Nothing when torch can be imported; else a ``TorchRequiredError`` naming what needs it."""
    try:
        import torch  # noqa: F401 - the torch engine runs on it next
    except ImportError:
        pass
    else:
        return
    raise TorchRequiredError(
        f"{where} needs torch to run: {'; '.join(reasons)}. Install it (pip install torchdelegate, which brings "
        "torch), or lower the model so that every node runs in a delegate of a backend with an array runtime "
        "(ONNX Runtime's)"
    )
