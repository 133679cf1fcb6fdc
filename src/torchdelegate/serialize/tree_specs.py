"""Container types in saved tree specs, and what a process that lacks one reads instead.

A method's inputs and outputs are flattened and rebuilt by torch's pytree; a saved graph
names each container type by its serialized name (``builtins.dict``,
``transformers.modeling_outputs.CausalLMOutputWithPast``). A type the loading process has
not registered (its library is not installed, or not imported) is read as a plain
container that keeps its fields' names and order:

- a container flattened like a dict, whose context is its field names (transformers'
  ``ModelOutput``) becomes a ``dict`` of those fields;
- a ``torch.utils._pytree.register_dataclass`` type becomes a ``dict`` of the fields that
  were not None (the ones the spec holds);
- a named tuple becomes a ``dict`` of its fields when the file records them, else a ``tuple``;
- any other container becomes a ``tuple`` of its children, in order.

Nothing is ever imported: a file does not make the process load a module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE

from torchdelegate.errors import FormatError

PLAIN_DICT, PLAIN_TUPLE = "builtins.dict", "builtins.tuple"
_NAMEDTUPLE = "collections.namedtuple"
_PROTOCOL = 1  # the tree-spec JSON protocol torch writes (torch.utils._pytree.treespec_dumps)
_SPEC_KEYS = ("in_spec", "out_spec")


def container_type_name(node: Mapping[str, Any]) -> str | None:
    """The type a tree-spec node names (a named tuple's own class name), None for a leaf."""
    name = node.get("type")
    if name == _NAMEDTUPLE:  # its context is the named tuple's own serialized name, not JSON
        context = node.get("context")
        return context if isinstance(context, str) else name
    return name if isinstance(name, str) else None


def is_registered(name: str) -> bool:
    return name in SERIALIZED_TYPE_TO_PYTHON_TYPE


def spec_types(spec: str, where: str) -> list[str]:
    """Every container type a serialized tree spec names, in order met, each once."""
    return _types(_spec_root(spec, where))


def _types(root: Any) -> list[str]:
    found: dict[str, None] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        name = container_type_name(node)
        if name is not None:
            found[name] = None
        children = node.get("children_spec")
        stack.extend(reversed(children) if isinstance(children, list) else ())
    return list(found)


def module_call_specs(document: Any) -> list[str]:
    """The serialized tree specs of a program document's module call graph (inputs and outputs)."""
    specs = (signature.get(key) for _, signature in _signatures(document) for key in _SPEC_KEYS)
    return [spec for spec in specs if isinstance(spec, str)]


def output_type_name(document: Any) -> str | None:
    """The container type a program document's outputs come in (its root call's ``out_spec``).

    None when the program returns a single value.
    """
    for fqn, signature in _signatures(document):
        spec = _json(signature.get("out_spec")) if fqn == "" else None
        if isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], dict):
            return container_type_name(spec[1])
    return None


def _signatures(document: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Each module call of a program document: its module path and its signature."""
    module = document.get("graph_module") if isinstance(document, dict) else None
    entries = module.get("module_call_graph") if isinstance(module, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        signature = entry.get("signature") if isinstance(entry, dict) else None
        if isinstance(signature, dict):
            yield entry.get("fqn"), signature


def with_plain_containers(document: Any, where: str) -> tuple[Any, dict[str, str]]:
    """``document`` with each container type this process has not registered made plain.

    Returns the document to deserialize (``document`` itself, unchanged, when every type is
    registered) and each replaced type's name with the plain type it became (``"dict"`` or
    ``"tuple"``), sorted by name.
    """
    module = document.get("graph_module") if isinstance(document, dict) else None
    if not isinstance(module, dict) or not isinstance(entries := module.get("module_call_graph"), list):
        return document, {}
    fields = _namedtuple_fields(module)
    replaced: dict[str, str] = {}
    try:
        rewritten = [_plain_entry(entry, fields, replaced, where) for entry in entries]
    except RecursionError as error:
        raise FormatError(f"{where}: a tree spec nests too deeply to read") from error
    if not replaced:
        return document, {}
    return {**document, "graph_module": {**module, "module_call_graph": rewritten}}, dict(sorted(replaced.items()))


def _plain_entry(entry: Any, fields: Mapping[str, list[str]], replaced: dict[str, str], where: str) -> Any:
    signature = entry.get("signature") if isinstance(entry, dict) else None
    if not isinstance(signature, dict):
        return entry
    plain = dict(signature)
    for key in _SPEC_KEYS:
        spec = signature.get(key)
        root = _spec_root(spec, where) if isinstance(spec, str) else None
        if root is not None and not all(map(is_registered, _types(root))):
            plain[key] = json.dumps([_PROTOCOL, _plain_node(root, fields, replaced)])
    return {**entry, "signature": plain}


def _plain_node(node: Any, fields: Mapping[str, list[str]], replaced: dict[str, str]) -> Any:
    if not isinstance(node, dict):
        return node
    children = node.get("children_spec")
    children = [_plain_node(child, fields, replaced) for child in children] if isinstance(children, list) else children
    name = container_type_name(node)
    if name is None or is_registered(name):
        return {**node, "children_spec": children}
    keys = _field_names(node, name, fields, len(children) if isinstance(children, list) else -1)
    replaced[name] = "tuple" if keys is None else "dict"
    if keys is None:
        return {"type": PLAIN_TUPLE, "context": "null", "children_spec": children}
    return {"type": PLAIN_DICT, "context": json.dumps(keys), "children_spec": children}


def _field_names(node: Mapping[str, Any], name: str, fields: Mapping[str, list[str]], count: int) -> list[Any] | None:
    """The names of a container's children, when its spec says them; None when it does not."""
    context = _json(node.get("context"))
    if node.get("type") == _NAMEDTUPLE:
        candidates: Any = fields.get(name)
    elif isinstance(context, list) and len(context) == 2 and all(isinstance(part, list) for part in context):
        candidates = context[0]  # register_dataclass: [names of the fields held, names of those that were None]
    else:
        candidates = context
    if not isinstance(candidates, list) or len(candidates) != count:
        return None
    if not all(isinstance(key, (str, int)) and not isinstance(key, bool) for key in candidates):
        return None
    return candidates if len(set(candidates)) == len(candidates) else None


def _namedtuple_fields(module: Mapping[str, Any]) -> dict[str, list[str]]:
    recorded = module.get("treespec_namedtuple_fields")
    fields = {}
    for name, definition in recorded.items() if isinstance(recorded, dict) else ():
        names = definition.get("field_names") if isinstance(definition, dict) else None
        if isinstance(names, list):
            fields[name] = names
    return fields


def _spec_root(spec: str, where: str) -> Any:
    """The root node of a serialized tree spec; None for a protocol other than the one read here
    (torch's own reader then decides)."""
    try:
        parsed = json.loads(spec)
    except (ValueError, RecursionError) as error:
        raise FormatError(f"{where}: a tree spec is not JSON ({type(error).__name__}: {error})") from error
    if isinstance(parsed, list) and len(parsed) == 2 and parsed[0] == _PROTOCOL:
        return parsed[1]
    return None


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None
