"""A backend's map from what its blob runs to the graph's debug handles (ExecuTorch's builder).

A backend names each unit of its blob that a profiler reports (an ONNX node, a kernel call) by an
*identifier*, an int or a str, and gives the debug handles of the graph nodes that unit computes
(``exported/debug_handles.py``: numbers given at ``to_edge``). ``preprocess`` returns
``get_delegate_mapping()`` as ``PreprocessResult.debug_handle_map``; lowering keeps it with the
delegate, ``save`` writes it, and a loaded program returns it as
``Program.delegates[i].debug_handle_map``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Node

from torchdelegate.exported.debug_handles import node_debug_handles

Identifier = int | str


class DelegateMappingBuilder:
    """Entries ``identifier -> debug handles``, the identifiers either the backend's own or numbered
    0, 1, ... here (``generated_identifiers=True``), never both."""

    def __init__(self, generated_identifiers: bool = False) -> None:
        self._generated = generated_identifiers
        self._entries: dict[Identifier, set[int]] = {}

    def insert_delegate_mapping_entry(
        self,
        nodes: Node | Iterable[Node] | None = None,
        handles: int | Iterable[int | None] | None = None,
        identifier: Identifier | None = None,
    ) -> Identifier:
        """Add the handles of ``nodes`` (their ``meta["debug_handle"]``) or the ``handles`` given (one of
        the two) under ``identifier``, or the next generated one; returns the identifier. A node or
        handle that is None is skipped; an entry with none left is an error, as is an identifier given twice."""
        if (nodes is None) == (handles is None):
            raise ValueError("insert_delegate_mapping_entry takes nodes or handles: exactly one of the two")
        identifier = self._identifier(identifier)
        found = _handles_of_nodes(nodes) if nodes is not None else _given_handles(handles)
        if not found:
            raise ValueError(
                f"delegate mapping entry {identifier!r}: no debug handle among what was given; number the "
                "program's nodes first (to_edge does), or give handles"
            )
        self._entries[identifier] = found
        return identifier

    def get_delegate_mapping(self) -> dict[Identifier, tuple[int, ...]]:
        """``identifier -> sorted handles``, in the order the entries were inserted."""
        return {key: tuple(sorted(handles)) for key, handles in self._entries.items()}

    def _identifier(self, identifier: Identifier | None) -> Identifier:
        if self._generated:
            if identifier is not None:
                raise ValueError(
                    f"this builder numbers its identifiers (generated_identifiers=True); {identifier!r} was given"
                )
            return len(self._entries)
        if identifier is None:
            raise ValueError("give each entry an identifier, or build with generated_identifiers=True")
        if isinstance(identifier, bool) or not isinstance(identifier, (int, str)):
            raise TypeError(f"a delegate mapping identifier is an int or a str, got {type(identifier).__name__}")
        if identifier in self._entries:
            raise ValueError(f"delegate mapping identifier {identifier!r} was inserted already")
        return identifier


def _handles_of_nodes(nodes: Node | Iterable[Node]) -> set[int]:
    found: set[int] = set()
    for node in [nodes] if isinstance(nodes, Node) else nodes:
        if node is not None:
            found.update(node_debug_handles(node))
    return found


def _given_handles(handles: int | Iterable[int | None] | None) -> set[int]:
    given = [handles] if isinstance(handles, int) else list(handles or ())
    for handle in given:
        if handle is not None and (isinstance(handle, bool) or not isinstance(handle, int)):
            raise TypeError(f"a debug handle is an int, got {handle!r}")
    return {handle for handle in given if handle is not None}
