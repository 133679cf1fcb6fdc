"""Bad files end in a documented refusal: the fuzzer's harness over the regressions it found
and over systematic damage to real files (truncations, flipped bytes, edited manifests).

The harness is fuzz/load_and_run.py's ``check_one``: a file as given and with its manifest
checksum recomputed, loaded and each method run; anything but success, FormatError (or an
unknown backend or an operator of a library not here at load, a backend refusing its delegate at
run) propagates and fails here.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchdelegate as td
from torchdelegate import FormatError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fuzz"))
from load_and_run import HEADER, check_one, reseal  # noqa: E402

REGRESSIONS = Path(__file__).parent / "fuzz_regressions"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    directory = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(ROOT / "fuzz" / "seeds.py"), str(directory)], check=True, capture_output=True)
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _manifest(data: bytes) -> dict:
    (length,) = struct.unpack_from("<Q", data, 16)
    return json.loads(data[HEADER : HEADER + length])


def _with_manifest(data: bytes, manifest: dict) -> bytes:
    """``data`` with another manifest in the header's padding before the data area, resealed."""
    length, offset = struct.unpack_from("<QQ", data, 16)
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    assert HEADER + len(text) <= offset, "the edit must fit before the data area"
    header = data[:16] + struct.pack("<QQ", len(text), offset) + data[32:HEADER]
    resealed = reseal(header + text + bytes(offset - HEADER - len(text)) + data[offset:])
    assert resealed is not None
    return resealed


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("*")), ids=lambda p: p.name)
def test_inputs_the_fuzzer_found_are_refused_cleanly(path: Path) -> None:
    check_one(path.read_bytes())


def test_every_seed_runs_and_every_crafted_one_is_refused(seeds: dict[str, bytes]) -> None:
    """Crafted seeds (`crafted-*`: blobs reaching for files, custom ops or Python) are refused before they run."""
    assert set(seeds) >= {"cond.tdp", "decoder-reference.tdp", "partly.tdp"}
    for name, data in seeds.items():
        expected = "refused at run (FormatError)" if name.startswith("crafted-") else "ran"
        assert check_one(data)[0] == expected, name


def test_truncated_files_are_format_errors(seeds: dict[str, bytes]) -> None:
    for data in seeds.values():
        for cut in sorted({0, 7, 8, 63, 64, 65, len(data) // 3, len(data) // 2, len(data) - 1}):
            assert check_one(data[:cut])[0] == "refused at load (FormatError)"


def test_a_truncated_file_says_so_and_what_to_do(seeds: dict[str, bytes], tmp_path: Path) -> None:
    """Whichever check a cut trips first (header, manifest, data), the message says the file is truncated
    and to copy it again; bytes appended are named as such."""
    data = seeds["partly.tdp"]
    path = tmp_path / "cut.tdp"
    for cut in (10, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(FormatError, match=r"it is truncated; copy it again, or save it again"):
            td.load(path)
    path.write_bytes(data + b"extra")
    with pytest.raises(FormatError, match=r"bytes were appended to it; copy it again"):
        td.load(path)


def test_flipped_bytes_are_refused_or_harmless(seeds: dict[str, bytes]) -> None:
    data = seeds["partly.tdp"]
    for index in range(0, len(data), max(1, len(data) // 400)):
        damaged = bytearray(data)
        damaged[index] ^= 0x41
        for outcome in check_one(bytes(damaged)):
            assert "refused" in outcome or outcome.endswith("ran"), outcome


def _edits(manifest: dict) -> dict[str, dict]:
    """Plausible, wrong manifests: each one field made inconsistent with the rest."""
    edits = {}

    def edited(name: str, change) -> None:  # type: ignore[no-untyped-def]
        copy = json.loads(json.dumps(manifest))
        change(copy)
        if copy != manifest:  # an edit of a table the file does not have changes nothing
            edits[name] = copy

    edited("segment offset past the end", lambda m: m["segments"][0].update(offset=10**9))
    edited("segment length zero", lambda m: m["segments"][0].update(length=0))
    edited("alignment not a power of two", lambda m: m["segments"][0].update(alignment=96))
    edited("data length short", lambda m: m.update(data_length=1))
    edited("no methods", lambda m: m.update(methods=[]))
    edited("delegate index out of range", lambda m: m["methods"][0].update(delegates=[99]))
    edited("method is not an object", lambda m: m["methods"].__setitem__(0, 5))
    edited("state shape wrong", lambda m: m["state"][0].update(shape=[3, 3]) if m["state"] else None)
    edited("state dtype unknown", lambda m: m["state"][0].update(dtype="float99") if m["state"] else None)
    edited("graph missing", lambda m: m["methods"][0].pop("graph"))
    edited("graph nodes not a list", lambda m: m["methods"][0]["graph"]["graph_module"]["graph"].update(nodes=7))
    edited("format name", lambda m: m.update(format="torchdelegate.other"))
    edited(
        "unknown backend", lambda m: m["delegates"][0].update(backend_id="NoSuchBackend") if m["delegates"] else None
    )
    return edits


def test_edited_manifests_are_refused_cleanly(seeds: dict[str, bytes]) -> None:
    for name in ("decoder-reference.tdp", "partly.tdp", "cond.tdp"):
        data = seeds[name]
        for edit, manifest in _edits(_manifest(data)).items():
            outcomes = check_one(_with_manifest(data, manifest))
            if edit == "no methods":  # a valid, useless file
                assert outcomes == ["ran"]
            else:
                error = "BackendNotFoundError" if edit == "unknown backend" else "FormatError"
                assert outcomes[0].startswith("refused") and f"({error})" in outcomes[0], (name, edit, outcomes)


def _drop_calling_convention(manifest: dict) -> None:
    manifest["methods"][0]["graph"]["graph_module"]["module_call_graph"] = []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: m["delegates"][0].update(inputs="TTT"),
            r"method 'forward': the call of delegate 0 passes 2 tensors and 0 sizes; the delegate table says 'TTT'",
        ),
        (
            lambda m: m["delegates"][0].update(outputs=2),
            r"method 'forward': the graph expects delegate 0 to return 1 values; its table entry says 2",
        ),
        (
            lambda m: m["methods"][0].update(delegates=[0]),
            r"method 'forward' calls delegate 1, which the method does not list",
        ),
        (_drop_calling_convention, r"method 'forward': the graph has no calling convention"),
    ],
    ids=["call arguments", "output count", "unlisted delegate", "calling convention"],
)
def test_a_graph_that_disagrees_with_its_tables_is_a_format_error_naming_the_method(
    seeds: dict[str, bytes], tmp_path: Path, change: Any, message: str
) -> None:
    data = seeds["partly.tdp"]
    manifest = _manifest(data)
    change(manifest)
    (tmp_path / "edited.tdp").write_bytes(_with_manifest(data, manifest))
    with pytest.raises(FormatError, match=message):
        with td.load(tmp_path / "edited.tdp") as program:
            program.run("forward", torch.randn(2, 4))
