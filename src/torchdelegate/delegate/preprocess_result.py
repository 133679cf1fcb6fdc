"""What a backend's ``preprocess`` returns for one partition, and results whose weights are named data.

:class:`PreprocessResult` is the blob with what travels beside it (a debug handle map, named data,
the backend's ``delegate_info``). :func:`with_named_data` makes one whose weights went to a store of
its own; :func:`shared_named_data` joins every result of a lowering over one store (a ``link_results``).
This module sits below ``backend_details.py``, which re-exports its names (their documented home),
so the checks of a result (``preprocess_checks.py``) and the compile cache need not import the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, replace
from typing import Any

from torchdelegate.delegate.named_data import NamedDataStore, NamedDataStoreOutput


@dataclass
class PreprocessResult:
    """What ``preprocess`` returns for one partition.

    ``processed_bytes`` is the blob the runtime hands back to ``init``;
    ``debug_handle_map`` maps what the blob runs (an identifier: an ONNX node name, a kernel number) to
    the debug handles of the graph nodes it computes (``DelegateMappingBuilder`` makes it);
    ``data_store_output`` carries named data (typically weights) stored beside the blob;
    ``delegate_info`` is the backend's own description of this delegate (what it fused, which
    kernels it chose...) as any JSON value: str, int, float (finite), bool, lists, and dicts with
    str keys of those (None: nothing to say). Lowering checks it, keeps it in the delegate's
    ``meta["delegate_info"]`` and saves it in the file, where a loaded program's ``delegates`` and
    ``torchdelegate inspect`` show it. ExecuTorch's spelling, ``_delegate_info_meta=``, is accepted
    as a keyword and an attribute: it is the same field.
    """

    processed_bytes: bytes = b""
    debug_handle_map: dict[Any, Any] | None = None
    data_store_output: NamedDataStoreOutput | None = None
    delegate_info: Any = None
    _delegate_info_meta: InitVar[Any] = None

    def __post_init__(self, _delegate_info_meta: Any) -> None:
        if self.delegate_info is None:  # given both (``dataclasses.replace`` passes both), delegate_info wins
            self.delegate_info = _delegate_info_meta


def _delegate_info_meta(result: PreprocessResult) -> Any:
    return result.delegate_info


def _set_delegate_info_meta(result: PreprocessResult, info: Any) -> None:
    result.delegate_info = info


# ExecuTorch's attribute, read and written as ``delegate_info`` (set after the dataclass took its default).
PreprocessResult._delegate_info_meta = property(_delegate_info_meta, _set_delegate_info_meta)  # type: ignore[attr-defined]


def shared_named_data(
    results: list[PreprocessResult], rewrite: Callable[[list[bytes], NamedDataStore], list[bytes]] | None = None
) -> list[PreprocessResult]:
    """Every result's named data merged, in order, into one store that all the results then hold,
    so a weight several partitions or methods use is stored once: a ``link_results`` for backends
    whose blobs keep their weights in named data. ``rewrite(blobs, store)`` may then change the
    blobs knowing that store (ONNX Runtime's makes partitions that share weights one model)."""
    store = NamedDataStore()
    for result in results:
        if result.data_store_output is not None:
            store.merge(result.data_store_output)
    blobs = [result.processed_bytes for result in results]
    if rewrite is not None:
        blobs = rewrite(blobs, store)
    output = store.get_named_data_store_output()
    # one store: the lowering merges it once
    return [
        replace(result, processed_bytes=blob, data_store_output=output)
        for result, blob in zip(results, blobs, strict=True)
    ]


def with_named_data(compile: Callable[[NamedDataStore], bytes | PreprocessResult]) -> PreprocessResult:
    """The blob ``compile(store)`` returns (or its result: a debug handle map, an info), with the named
    data it put in ``store``: a ``preprocess`` whose partition keeps its weights in named data (joined
    across partitions by :func:`~torchdelegate.shared_named_data`)."""
    store = NamedDataStore()
    made = compile(store)
    result = made if isinstance(made, PreprocessResult) else PreprocessResult(made)
    return replace(result, data_store_output=store.get_named_data_store_output())
