"""Warnings torch raises about its own internals, silenced where torchdelegate calls into them.

torch's program rewrites (``run_decompositions``, the export serializer) copy tree specs
through an API torch itself deprecated; the warning names nothing the user wrote or can change.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def torch_internal_warnings_silenced() -> Iterator[None]:
    """Within this block, torch's deprecated tree-spec warnings are not shown; other warnings are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec.*", category=FutureWarning)
        yield
