"""Input and output containers whose type the loading process lacks come back plain, fields named.

A module returns one container of each kind torch can register (a dict-like type, a
``register_dataclass`` type, a named tuple, a type with an opaque context); the program is
lowered and saved while they are registered, then loaded while their names are unknown to
deserialization, as in a process that never imported the library defining them.
"""

from __future__ import annotations

import copy
import json
import re
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from crafted import manifest_bytes, with_manifest

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.errors import FormatError
from torchdelegate.serialize.tree_specs import output_type_name, with_plain_containers


class Keyed:
    """A container flattened like a dict, as transformers' ModelOutput is."""

    def __init__(self, **fields: torch.Tensor) -> None:
        self.fields = fields


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor | None


Point = namedtuple("Point", ["x", "y"])


class Opaque:
    """A container whose context is not a list of field names."""

    def __init__(self, *values: torch.Tensor) -> None:
        self.values = values


NAMES = {Keyed: "somelib.Keyed", Pair: "somelib.Pair", Point: "somelib.Point", Opaque: "somelib.Opaque"}


def _register() -> None:
    pytree.register_pytree_node(
        Keyed,
        lambda k: (list(k.fields.values()), list(k.fields)),
        lambda values, keys: Keyed(**dict(zip(keys, values, strict=True))),
        serialized_type_name=NAMES[Keyed],
    )
    pytree.register_dataclass(Pair, serialized_type_name=NAMES[Pair])
    pytree._register_namedtuple(Point, serialized_type_name=NAMES[Point])
    pytree.register_pytree_node(
        Opaque,
        lambda o: (list(o.values), {"count": len(o.values)}),
        lambda values, context: Opaque(*values),
        serialized_type_name=NAMES[Opaque],
    )


_register()


@contextmanager
def _forgotten() -> Iterator[None]:
    """The types unknown to deserialization, as in a process that never imported their library."""
    known = {name: pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.pop(name) for name in NAMES.values()}
    try:
        yield
    finally:
        pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.update(known)


class Containers(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (
            Keyed(logits=x + 1, hidden=x * 2),
            Pair(first=x - 1, second=None),
            Point(x=x.sin(), y=x.cos()),
            [Opaque(x * 3, x * 4)],
        )


def test_unregistered_containers_come_back_plain_with_their_fields_named(tmp_path: Path) -> None:
    x = torch.randn(2, 3)
    program = torch.export.export(Containers(), (x,))
    lowered = td.to_edge_transform_and_lower({"forward": program}, partitioner=[ReferencePartitioner()])
    lowered.save(tmp_path / "containers.tdp")
    with td.load(tmp_path / "containers.tdp") as loaded:  # registered: the types themselves
        keyed, pair, point, (opaque,) = loaded.run("forward", x)
        assert (type(keyed), type(pair), type(point), type(opaque)) == (Keyed, Pair, Point, Opaque)
        assert loaded.plain_types == {}
    with _forgotten(), td.load(tmp_path / "containers.tdp") as loaded:
        keyed, pair, point, (opaque,) = loaded.run("forward", x)
        assert loaded.plain_types == {
            "somelib.Keyed": "dict",
            "somelib.Opaque": "tuple",
            "somelib.Pair": "dict",
            "somelib.Point": "dict",
        }
        assert loaded.method("forward").output_type == "builtins.tuple"
    assert list(keyed) == ["logits", "hidden"]
    torch.testing.assert_close(keyed["logits"], x + 1)
    torch.testing.assert_close(keyed["hidden"], x * 2)
    assert list(pair) == ["first"]  # a field that was None holds nothing: the spec does not keep it
    torch.testing.assert_close(pair["first"], x - 1)
    assert list(point) == ["x", "y"]
    torch.testing.assert_close(point["y"], x.cos())
    assert isinstance(opaque, tuple) and len(opaque) == 2
    torch.testing.assert_close(opaque[1], x * 4)


def test_a_method_whose_outputs_are_one_library_type_names_it() -> None:
    document = _document('[1, {"type": "somelib.Output", "context": "[\\"a\\"]", "children_spec": [' + LEAF + "]}]")
    assert output_type_name(document) == "somelib.Output"
    assert output_type_name(_document(f"[1, {LEAF}]")) is None


LEAF = '{"type": null, "context": null, "children_spec": []}'


def _document(out_spec: str) -> dict[str, Any]:
    signature = {"in_spec": '[1, {"type": "builtins.tuple", "context": "null", "children_spec": []}]'}
    signature["out_spec"] = out_spec
    return {"graph_module": {"module_call_graph": [{"fqn": "", "signature": signature}]}}


def _plain(document: dict[str, Any], where: str) -> tuple[Any, dict[str, str]]:
    """The document to deserialize, and the types of its root call made plain."""
    replaced: dict[str, str] = {}
    return with_plain_containers(document, where, replaced), replaced


def test_the_document_read_is_not_changed() -> None:
    document = _document('[1, {"type": "somelib.Output", "context": "[\\"a\\"]", "children_spec": [' + LEAF + "]}]")
    before = copy.deepcopy(document)
    plain, replaced = _plain(document, "test")
    assert replaced == {"somelib.Output": "dict"}
    assert document == before
    assert '"type": "builtins.dict"' in plain["graph_module"]["module_call_graph"][0]["signature"]["out_spec"]
    registered = _document(f'[1, {{"type": "builtins.tuple", "context": "null", "children_spec": [{LEAF}]}}]')
    assert _plain(registered, "test") == (registered, {})


@pytest.mark.parametrize(
    "context",
    ['[\\"a\\", \\"a\\"]', '[\\"a\\"]', "{}", "not json"],
    ids=["repeated names", "too few names", "a mapping", "not JSON"],
)
def test_a_context_that_does_not_name_each_child_once_gives_a_tuple(context: str) -> None:
    spec = f'[1, {{"type": "somelib.Output", "context": "{context}", "children_spec": [{LEAF}, {LEAF}]}}]'
    _, replaced = _plain(_document(spec), "test")
    assert replaced == {"somelib.Output": "tuple"}


def test_a_spec_that_is_not_json_is_a_format_error() -> None:
    with pytest.raises(FormatError, match=r"^where: a tree spec cannot be read: not JSON"):
        _plain(_document("[1, {"), "where")


@pytest.mark.parametrize("depth", [40, 450, 5000])
def test_a_deeply_nested_spec_is_read_or_refused_as_a_format_error(depth: int) -> None:
    """The bounded reader takes 128 levels of JSON: 63 levels of containers (each an object and its list)."""
    spec = LEAF
    for _ in range(depth):
        spec = f'{{"type": "somelib.Output", "context": "null", "children_spec": [{spec}]}}'
    if depth < 63:
        _, replaced = _plain(_document(f"[1, {spec}]"), "where")
        assert replaced == {"somelib.Output": "tuple"}
        return
    with pytest.raises(FormatError, match=r"^where: a tree spec cannot be read: JSON nesting deeper than 128 levels"):
        _plain(_document(f"[1, {spec}]"), "where")


class Mapping2(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x + 1}


PLANTED = "planted_by_a_file"


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on the path that leaves a marker when imported: nothing a file names may import it."""
    (tmp_path / f"{PLANTED}.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\nfactory = list\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "imported"


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            '{"type": "builtins.dict", "context": "[{\\"__enum__\\": true, \\"fqn\\": \\"' + PLANTED + ':E\\", '
            '\\"name\\": \\"A\\"}]", "children_spec": [LEAF]}',
            "names an enum, which a saved graph may not",
        ),
        (
            '{"type": "collections.defaultdict", "context": {"default_factory_module": "' + PLANTED + '", '
            '"default_factory_name": "factory", "dict_context": "[\\"a\\"]"}, "children_spec": [LEAF]}',
            f"makes {PLANTED}.factory a defaultdict's default factory; a saved graph may name only a builtin type",
        ),
        (
            '{"type": "collections.namedtuple", "context": "builtins.dict", "children_spec": [LEAF]}',
            "rebuilds 'builtins.dict' as a named tuple, which it is not",
        ),
        ('{"type": 7, "context": null, "children_spec": [LEAF]}', "names the type 7, which is not a string"),
    ],
    ids=["enum", "defaultdict factory", "namedtuple of another type", "type not a string"],
)
def test_a_spec_whose_reading_would_import_or_call_what_it_names_is_refused(
    tmp_path: Path, planted: Path, node: str, message: str
) -> None:
    x = torch.randn(3)
    td.to_edge({"forward": torch.export.export(Mapping2(), (x,))}).save(tmp_path / "m.tdp")
    data = (tmp_path / "m.tdp").read_bytes()
    manifest = json.loads(manifest_bytes(data))
    signature = manifest["methods"][0]["graph"]["graph_module"]["module_call_graph"][0]["signature"]
    signature["out_spec"] = f"[1, {node.replace('LEAF', LEAF)}]"
    (tmp_path / "crafted.tdp").write_bytes(with_manifest(data, json.dumps(manifest).encode()))
    with pytest.raises(FormatError, match=re.escape(message)):
        td.load(tmp_path / "crafted.tdp")
    assert not planted.exists()
