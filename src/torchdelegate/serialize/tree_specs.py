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

from torchdelegate.errors import FormatError, located
from torchdelegate.serialize.bounded_json import JsonLimitError, bounded_json

PLAIN_DICT, PLAIN_TUPLE = "builtins.dict", "builtins.tuple"
_NAMEDTUPLE, _DEFAULTDICT = "collections.namedtuple", "collections.defaultdict"
_PROTOCOL = 1  # the tree-spec JSON protocol torch writes (torch.utils._pytree.treespec_dumps)
_SPEC_KEYS = ("in_spec", "out_spec")
MAX_SPEC_CHARACTERS = 1 << 24  # a tree spec (a JSON string inside the graph's JSON)
# What a defaultdict's saved default factory may be: torch's reader imports the module it names.
_DEFAULT_FACTORIES = frozenset({"list", "dict", "set", "tuple", "int", "float", "str", "bool", "bytes", "frozenset"})


def container_type_name(node: Mapping[str, Any]) -> str | None:
    """The type a tree-spec node names (a named tuple's own class name), None for a leaf."""
    name = node.get("type")
    if name == _NAMEDTUPLE:  # its context is the named tuple's own serialized name, not JSON
        context = node.get("context")
        return context if isinstance(context, str) else name
    return name if isinstance(name, str) else None


def check_tree_specs(document: Any, where: str) -> None:
    """Refuse (``FormatError``) a tree spec whose reading would import or call what the file names.

    torch's reader imports the module of an enum named in a context and of a defaultdict's
    default factory, and rebuilds a named tuple with whatever class its context names: a
    saved spec may hold no enum, only a builtin type as a default factory, and only named
    tuple classes as named tuples.
    """
    with located(where):
        for spec in _module_call_specs(document):
            _checked_root(spec)


def _checked_root(spec: str) -> Any:
    """The root node of a serialized tree spec, every node of it checked (:func:`check_tree_specs`)."""
    root = _spec_root(spec)
    for node in _nodes(root):
        _check_node(node)
    return root


def _check_node(node: Any) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("children_spec", []), list):
        raise FormatError("a tree spec node is not an object with a list of children")
    name, context = node.get("type"), node.get("context")
    if name is not None and not isinstance(name, str):
        raise FormatError(f"a tree spec names the type {name!r:.80}, which is not a string")
    if _names_an_enum(_json(context) if isinstance(context, str) else context):
        raise FormatError("a tree spec names an enum, which a saved graph may not (reading it imports)")
    if name == _DEFAULTDICT:
        factory = context if isinstance(context, dict) else {}
        module, factory_name = factory.get("default_factory_module"), factory.get("default_factory_name")
        if module != "builtins" or factory_name not in _DEFAULT_FACTORIES:
            raise FormatError(
                f"a tree spec makes {module!s:.80}.{factory_name!s:.80} a defaultdict's default factory; "
                "a saved graph may name only a builtin type"
            )
    if name == _NAMEDTUPLE:
        from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE, is_namedtuple_class

        cls = SERIALIZED_TYPE_TO_PYTHON_TYPE.get(context) if isinstance(context, str) else None
        if cls is not None and not is_namedtuple_class(cls):
            raise FormatError(f"a tree spec rebuilds {context!r:.80} as a named tuple, which it is not")


def unregistered_types(document: Any, where: str) -> list[str]:
    """The container types a program document's specs name (any module call's) that this process
    cannot rebuild, sorted."""
    with located(where):
        return sorted({name for spec in _module_call_specs(document) for name in _unregistered(_spec_root(spec))})


def _unregistered(root: Any) -> list[str]:
    """The container types a spec names that this process cannot rebuild."""
    names = (container_type_name(node) for node in _nodes(root) if isinstance(node, dict))
    return [name for name in names if not _registered(name) and name is not None]


def _names_an_enum(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "__enum__" in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _nodes(root: Any) -> Iterator[Any]:
    """Every node of a spec, parents first; nothing for a protocol this module does not read."""
    stack = [] if root is None else [root]
    while stack:
        node = stack.pop()
        yield node
        children = node.get("children_spec") if isinstance(node, dict) else None
        stack.extend(reversed(children) if isinstance(children, list) else ())


def _module_call_specs(document: Any) -> list[str]:
    specs = (signature.get(key) for _, signature in _signatures(document) for key in _SPEC_KEYS)
    return [spec for spec in specs if isinstance(spec, str)]


def output_type_name(document: Any) -> str | None:
    """The container type a program document's outputs come in (its root call's ``out_spec``).

    None when the program returns a single value.
    """
    for fqn, signature in _signatures(document):
        if fqn != "":
            continue
        spec = _json(signature.get("out_spec"))
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


def with_plain_containers(document: Any, where: str, plain_types: dict[str, str]) -> Any:
    """``document`` with its tree specs checked (:func:`check_tree_specs`) and each container type
    this process has not registered made plain; ``document`` itself when there is none.

    Each type replaced in the root call (the method's own inputs and outputs) is added to
    ``plain_types`` with the plain type it became, ``"dict"`` or ``"tuple"``; a type read as a
    tuple anywhere stays a tuple there. The document is not changed.
    """
    module = document.get("graph_module") if isinstance(document, dict) else None
    if not isinstance(module, dict) or not isinstance(entries := module.get("module_call_graph"), list):
        return document
    fields = _namedtuple_fields(module)
    inside: dict[str, str] = {}  # replaced in calls of sub-modules, which a caller never sees
    with located(where):
        rewritten = [_plain_entry(entry, fields, plain_types if _is_root(entry) else inside) for entry in entries]
    if all(new is old for new, old in zip(rewritten, entries, strict=True)):
        return document
    return {**document, "graph_module": {**module, "module_call_graph": rewritten}}


def _plain_entry(entry: Any, fields: Mapping[str, list[str]], replaced: dict[str, str]) -> Any:
    signature = entry.get("signature") if isinstance(entry, dict) else None
    if not isinstance(signature, dict):
        return entry
    plain = dict(signature)
    for key in _SPEC_KEYS:
        spec = signature.get(key)
        root = _checked_root(spec) if isinstance(spec, str) else None
        if _unregistered(root):
            plain[key] = json.dumps([_PROTOCOL, _plain_tree(root, fields, replaced)])
    return {**entry, "signature": plain} if plain != signature else entry


def _plain_tree(root: Any, fields: Mapping[str, list[str]], replaced: dict[str, str]) -> Any:
    """``root`` with every unregistered container made plain, children before their parents."""
    built: list[Any] = []
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_built = stack.pop()
        children = node.get("children_spec") if isinstance(node, dict) else None
        if not isinstance(children, list):
            built.append(node)
        elif not children_built:
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children))
        else:
            start = len(built) - len(children)
            node = _plain_node(node, built[start:], fields, replaced)
            del built[start:]
            built.append(node)
    return built[0]


def _plain_node(
    node: dict[str, Any], children: list[Any], fields: Mapping[str, list[str]], replaced: dict[str, str]
) -> Any:
    name = container_type_name(node)
    if _registered(name):
        return {**node, "children_spec": children}
    assert name is not None
    keys = _field_names(node, name, fields, len(children))
    replaced[name] = "tuple" if keys is None or replaced.get(name) == "tuple" else "dict"  # the weaker form
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


def _is_root(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("fqn") == ""


def _registered(name: str | None) -> bool:
    """Whether this process can rebuild the container ``name`` (a leaf, None, always)."""
    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE

    return name is None or name in SERIALIZED_TYPE_TO_PYTHON_TYPE


def _namedtuple_fields(module: Mapping[str, Any]) -> dict[str, list[str]]:
    recorded = module.get("treespec_namedtuple_fields")
    fields = {}
    for name, definition in recorded.items() if isinstance(recorded, dict) else ():
        names = definition.get("field_names") if isinstance(definition, dict) else None
        if isinstance(names, list):
            fields[name] = names
    return fields


def _spec_root(spec: str) -> Any:
    """The root node of a serialized tree spec; None for a protocol other than the one read here
    (torch's own reader then decides)."""
    try:
        parsed = bounded_json(spec, MAX_SPEC_CHARACTERS)
    except JsonLimitError as error:
        raise FormatError(f"a tree spec cannot be read: {error}") from error
    if isinstance(parsed, list) and len(parsed) == 2 and parsed[0] == _PROTOCOL:
        return parsed[1]
    return None


def _json(text: Any) -> Any:
    try:
        return bounded_json(text, MAX_SPEC_CHARACTERS) if isinstance(text, str) else None
    except JsonLimitError:
        return None
