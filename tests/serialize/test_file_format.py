"""The file: deterministic bytes, storage shared across methods and files, and bad files refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from crafted import manifest_bytes, reference_blob_document, with_a_segment_byte_flipped, with_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import TwoLinears, export
from programs import PROMPT, eager_generation, fresh_decoder, lowered_decoder, program_generation, save_decoder

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.serialize.container import HEADER, SegmentSource, layout_segments

TESTS = Path(__file__).parent.parent


def test_two_lowerings_write_the_same_bytes(tmp_path: Path) -> None:
    first = save_decoder(tmp_path / "a.tdp").read_bytes()
    second = save_decoder(tmp_path / "b.tdp").read_bytes()
    assert first == second


def test_the_bytes_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from pathlib import Path
        from programs import save_decoder
        save_decoder(Path(sys.argv[1]))
        """
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{seed}.tdp")], check=True, env=env, timeout=300)
    assert (tmp_path / "1.tdp").read_bytes() == (tmp_path / "2.tdp").read_bytes()


def test_the_file_holds_json_and_raw_bytes_only(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp")
    data = path.read_bytes()
    _, _, _, length, data_offset, _ = HEADER.unpack_from(data)
    manifest = json.loads(data[HEADER.size : HEADER.size + length])
    assert manifest["format"] == "torchdelegate.program"
    assert [m["name"] for m in manifest["methods"]] == ["prefill", "decode"]
    assert {d["backend_id"] for d in manifest["delegates"]} == {"reference"}
    segments = {s["sha256"]: s for s in manifest["segments"]}
    for segment in segments.values():
        assert segment["offset"] % 64 == 0 and (data_offset + segment["offset"]) % segment["alignment"] == 0
    for delegate in manifest["delegates"]:  # the reference backend's blobs: a header, then compressed JSON
        blob = segments[delegate["blob"]]
        reference_blob_document(data[data_offset + blob["offset"] : data_offset + blob["offset"] + blob["length"]])
    # The partition report: compressed JSON.
    report = segments[manifest["report_segment"]]
    start = data_offset + report["offset"]
    assert isinstance(json.loads(zlib.decompress(data[start : start + report["length"]])), dict)
    # Every other segment is raw tensor bytes, named by the state or named-data table.
    named = {e["data"] for e in manifest["named_data"]} | {e["data"] for e in manifest["state"] if e["data"]}
    assert set(segments) == named | {d["blob"] for d in manifest["delegates"]} | {manifest["report_segment"]}
    # The caches (all zeros) are stored as shapes; the weights once for both methods.
    state = {s["name"]: s for s in manifest["state"]}
    assert state["k_cache"]["data"] is None and state["k_cache"]["mutable"]


def test_external_data_is_shared_by_a_base_program_and_its_variant(tmp_path: Path) -> None:
    weights = tmp_path / "weights.tdd"
    base = lowered_decoder()
    base.save(tmp_path / "base.tdp", external_data_path=weights)
    after_base = weights.stat().st_size
    torch.manual_seed(1234)
    variant_model = fresh_decoder()
    with torch.no_grad():
        variant_model.head.weight.mul_(-1)  # a fine-tuned head; everything else is the base's
    from models import decoder_methods

    variant = td.to_edge(decoder_methods(variant_model)).to_backend(ReferencePartitioner())
    variant.save(tmp_path / "variant.tdp", external_data_path=weights)
    head = variant_model.head.weight.numel() * 4
    assert after_base <= weights.stat().st_size <= after_base + head + 64 * 1024
    for name in ("base.tdp", "variant.tdp"):
        assert (tmp_path / name).stat().st_size < 128 * 1024  # graphs and blobs, no weights
    with td.load(tmp_path / "base.tdp") as program:  # finds weights.tdd beside it
        for got, expected in zip(program_generation(program), eager_generation(), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    moved = tmp_path / "elsewhere.tdd"
    weights.rename(moved)
    with pytest.raises(FileNotFoundError, match="external_data_path"):
        td.load(tmp_path / "variant.tdp")
    with td.load(tmp_path / "variant.tdp", external_data_path=moved) as program:
        with torch.no_grad():
            expected = variant_model(PROMPT, torch.arange(len(PROMPT)))
        torch.testing.assert_close(program.run("prefill", PROMPT, torch.arange(len(PROMPT))), expected)


def test_a_data_file_that_lacks_a_segment_is_refused(tmp_path: Path) -> None:
    lowered_decoder().save(tmp_path / "a.tdp", external_data_path=tmp_path / "a.tdd")
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner()).save(
        tmp_path / "b.tdp", external_data_path=tmp_path / "b.tdd"
    )
    with pytest.raises(td.FormatError, match=r"b.tdd lacks the .*-byte segment"):
        td.load(tmp_path / "a.tdp", external_data_path=tmp_path / "b.tdd")


def test_saving_never_overwrites_a_file_that_is_not_a_data_file(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(td.SerializationError, match="not a torchdelegate data file"):
        lowered_decoder().save(tmp_path / "a.tdp", external_data_path=precious)
    assert precious.read_text() == "keep me"


def test_a_segment_cannot_ask_for_more_alignment_than_the_format_allows() -> None:
    data = b"\0" * 8
    with pytest.raises(ValueError, match=r"alignment 131072 is larger than the format allows \(65536\)"):
        layout_segments([SegmentSource(data, hashlib.sha256(data).digest(), alignment=1 << 17)])


# --- bad files -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "m.tdp"
    torch.manual_seed(0)
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner()).save(path)
    return path.read_bytes()


def _load_and_run(data: bytes, path: Path) -> None:
    """Load ``data`` and run it: success or FormatError, nothing else."""
    path.write_bytes(data)
    try:
        with td.load(path) as program:
            program.run("forward", torch.randn(2, 4))
    except td.FormatError:
        pass


def _refused(data: bytes, path: Path, match: str | None = None) -> None:
    path.write_bytes(data)
    with pytest.raises(td.FormatError, match=match):
        with td.load(path) as program:
            program.run("forward", torch.randn(2, 4))


def test_a_valid_small_file_runs(small_file: bytes, tmp_path: Path) -> None:
    (tmp_path / "m.tdp").write_bytes(small_file)
    with td.load(tmp_path / "m.tdp") as program:
        assert program.run("forward", torch.randn(2, 4)).shape == (2, 4)


def test_saving_into_a_missing_directory_names_the_directory(tmp_path: Path) -> None:
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner())
    with pytest.raises(FileNotFoundError, match=r"its directory '.*nodir' does not exist; create it first"):
        lowered.save(tmp_path / "nodir" / "m.tdp")
    assert not (tmp_path / "nodir").exists()


def test_a_file_whose_graph_calls_delegates_by_their_name_before_the_rename_runs(tmp_path: Path) -> None:
    """Files written before the saved operator took the in-memory name call it ``delegate_call``."""
    torch.manual_seed(0)
    model, x = TwoLinears().eval(), torch.randn(2, 4)
    td.to_edge(export(model, x)).to_backend(ReferencePartitioner()).save(tmp_path / "new.tdp")
    manifest = manifest_bytes((tmp_path / "new.tdp").read_bytes())
    assert b'"torch.ops.torchdelegate.call_delegate.default"' in manifest
    old = manifest.replace(b".torchdelegate.call_delegate.", b".torchdelegate.delegate_call.")
    (tmp_path / "old.tdp").write_bytes(with_manifest((tmp_path / "new.tdp").read_bytes(), old))
    with td.load(tmp_path / "old.tdp") as program:
        torch.testing.assert_close(program.run("forward", x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("keep", [0, 7, 63, 64, 200, -1000, -64, -1])
def test_truncation_is_refused(small_file: bytes, tmp_path: Path, keep: int) -> None:
    _refused(small_file[:keep], tmp_path / "t.tdp")


def test_every_flipped_header_byte_is_refused(small_file: bytes, tmp_path: Path) -> None:
    for offset in range(HEADER.size):
        data = bytearray(small_file)
        data[offset] ^= 0x01
        _refused(bytes(data), tmp_path / "h.tdp")


def test_flipped_manifest_bytes_are_refused(small_file: bytes, tmp_path: Path) -> None:
    _, _, _, length, _, _ = HEADER.unpack_from(small_file)
    for offset in range(HEADER.size, HEADER.size + length, max(1, length // 97)):
        data = bytearray(small_file)
        data[offset] ^= 0x20
        _refused(bytes(data), tmp_path / "m.tdp", "checksum")


def test_a_flipped_blob_byte_is_refused_on_first_use(small_file: bytes, tmp_path: Path) -> None:
    data_offset = HEADER.unpack_from(small_file)[4]
    manifest = json.loads(manifest_bytes(small_file))
    blob = next(s for s in manifest["segments"] if s["length"] > 1000)
    data = bytearray(small_file)
    data[data_offset + blob["offset"] + 10] ^= 0xFF
    _refused(bytes(data), tmp_path / "b.tdp", "checksum mismatch in segment")


def test_wrong_version_and_absurd_lengths_are_refused(small_file: bytes, tmp_path: Path) -> None:
    magic, version, reserved, length, data_offset, digest = HEADER.unpack_from(small_file)
    rest = small_file[HEADER.size :]
    _refused(HEADER.pack(magic, 2, reserved, length, data_offset, digest) + rest, tmp_path / "v.tdp", "version 2")
    _refused(HEADER.pack(magic, version, reserved, 1 << 60, data_offset, digest) + rest, tmp_path / "l.tdp", "length")
    _refused(HEADER.pack(magic, version, reserved, length, 1 << 62, digest) + rest, tmp_path / "o.tdp", "data offset")


def test_random_bytes_are_refused(tmp_path: Path) -> None:
    for seed in range(20):
        _refused(os.urandom(64 * seed + 1), tmp_path / "r.tdp")
    _refused(b"\x89TDP\r\n\x1a\n" + os.urandom(200), tmp_path / "r.tdp")


def test_a_manifest_that_names_a_python_function_is_refused(small_file: bytes, tmp_path: Path) -> None:
    """A checksum proves integrity, not good intent: the loader still refuses what a graph may not call."""
    manifest = manifest_bytes(small_file)
    text = manifest.replace(b'"torch.ops.torchdelegate.call_delegate.default"', b'"torch.ops.aten.from_file.default"')
    _refused(with_manifest(small_file, text), tmp_path / "e.tdp", "not an operator a saved graph may call")
    text = manifest.replace(b'"torch.ops.torchdelegate.call_delegate.default"', b'"builtins.eval"')
    _refused(with_manifest(small_file, text), tmp_path / "e.tdp", "not an operator a saved graph may call")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_of_a_file_loads_and_runs_or_is_a_format_error(
    small_file: bytes, tmp_path: Path, data: st.DataObject
) -> None:
    mutated = bytearray(small_file)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]), label="kind")
        at = data.draw(st.integers(0, max(0, len(mutated) - 1)), label="at")
        if kind == "flip" and mutated:
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del mutated[at:]
        elif kind == "insert":
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del mutated[at : at + data.draw(st.integers(1, 16))]
        elif kind == "overwrite" and mutated:
            chunk = data.draw(st.binary(min_size=1, max_size=8))
            mutated[at : at + len(chunk)] = chunk
    _load_and_run(bytes(mutated), tmp_path / "fuzz.tdp")


def test_struct_layout_is_64_bytes() -> None:
    assert HEADER.size == 64 == struct.calcsize("<8sIIQQ32s")


def test_a_symbolic_size_that_would_take_forever_to_evaluate_is_refused(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torch.export.export(TwoLinears(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    td.to_edge(program).to_backend(ReferencePartitioner()).save(tmp_path / "d.tdp")
    data = (tmp_path / "d.tdp").read_bytes()
    manifest = manifest_bytes(data)
    symbol = re.search(rb"Symbol\('s\d+', positive=True, integer=True\)", manifest)
    assert symbol is not None
    hostile = manifest.replace(symbol.group(0), b"9**9**9**9", 1)
    _refused(with_manifest(data, hostile), tmp_path / "p.tdp", "raises to a power")


def test_a_graph_that_reads_state_the_file_lacks_is_refused_at_load(small_file: bytes, tmp_path: Path) -> None:
    manifest = json.loads(manifest_bytes(small_file))
    manifest["methods"][0]["graph"]["graph_module"]["signature"]["input_specs"].insert(
        0, {"buffer": {"arg": {"name": "b_extra"}, "buffer_name": "extra", "persistent": True}}
    )
    refused = with_manifest(small_file, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    _refused(refused, tmp_path / "s.tdp", "not stored")


def test_a_corrupt_weight_never_runs_however_often_it_is_called(tmp_path: Path) -> None:
    model = TwoLinears()
    x = torch.randn(2, 4)
    td.to_edge(export(model, x)).save(tmp_path / "plain.tdp")  # no delegates: weights are the program's state
    flipped = with_a_segment_byte_flipped((tmp_path / "plain.tdp").read_bytes(), lambda segments: segments[0])
    (tmp_path / "bad.tdp").write_bytes(flipped)
    with td.load(tmp_path / "bad.tdp") as program:
        for _ in range(3):
            with pytest.raises(td.FormatError, match="checksum mismatch"):
                program.run("forward", x)


def test_negative_zero_is_not_stored_as_zeros(tmp_path: Path) -> None:
    class NegativeZero(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("z", torch.tensor([-0.0, -0.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / self.z

    x = torch.ones(2)
    td.to_edge(export(NegativeZero(), x)).save(tmp_path / "z.tdp")
    with td.load(tmp_path / "z.tdp") as program:
        assert program.run("forward", x).tolist() == [float("-inf")] * 2


def test_a_weight_changed_in_place_after_lowering_is_refused_at_save(tmp_path: Path) -> None:
    model = TwoLinears()
    lowered = td.to_edge(export(model, torch.randn(2, 4))).to_backend(ReferencePartitioner())
    with torch.no_grad():
        model.l1.weight.mul_(2)  # the lowered program shares this tensor: its named data changed
    with pytest.raises(td.SerializationError, match="changed after it was lowered"):
        lowered.save(tmp_path / "m.tdp")
    assert not (tmp_path / "m.tdp").exists()


def test_a_program_needing_more_alignment_than_the_data_file_has_gets_it(tmp_path: Path) -> None:
    program = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).exported_program()
    weights = tmp_path / "shared.tdd"
    for name, alignment in (("a.tdp", 64), ("b.tdp", 4096)):
        store = td.NamedDataStore()
        store.add_named_data("table", bytes(range(256)) * 8, alignment=alignment)
        td.EdgeProgramManager({"forward": program}, store.get_named_data_store_output()).save(
            tmp_path / name, external_data_path=weights
        )
    for name in ("a.tdp", "b.tdp"):
        with td.load(tmp_path / name) as loaded:
            view = loaded.named_data.get_data("table")
            assert bytes(view) == bytes(range(256)) * 8
    with td.load(tmp_path / "b.tdp") as loaded:
        import numpy as np

        assert np.frombuffer(loaded.named_data.get_data("table"), np.uint8).ctypes.data % 4096 == 0


def _with_graph_nodes(small_file: bytes, edit: object) -> bytes:
    """``small_file`` whose method graph ``edit(graph)`` changed, resealed (checksums valid)."""
    manifest = json.loads(manifest_bytes(small_file))
    edit(manifest["methods"][0]["graph"]["graph_module"]["graph"])  # type: ignore[operator]
    return with_manifest(small_file, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _positional(arg: dict) -> dict:
    return {"name": "", "arg": arg, "kind": 1}


def test_a_name_that_is_python_source_is_refused_before_torch_fx_writes_it(
    small_file: bytes, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """torch.fx writes keyword names into the source it runs: a name must be an identifier."""
    payload = "a=1)\rprint('the file ran code')\rdef _rest():\r    print(b"

    def inject(graph: dict) -> None:
        arguments = [_positional({"as_bool": False}), _positional({"as_operator": "torch.ops.aten.relu.default"})]
        node = {"target": "torch.ops.higher_order.wrap_with_set_grad_enabled", "name": "evil", "metadata": {}}
        node |= {"inputs": [*arguments, {"name": payload, "arg": {"as_int": 1}, "kind": 2}]}
        graph["nodes"].insert(0, node | {"outputs": [{"as_none": True}], "is_hop_single_tensor_return": None})

    _refused(_with_graph_nodes(small_file, inject), tmp_path / "e.tdp", "which is not an identifier")
    assert "the file ran code" not in capfd.readouterr().out


def test_an_operator_passed_as_an_argument_is_checked_like_a_target(small_file: bytes, tmp_path: Path) -> None:
    """A control-flow op calls the operator it is given: aten.from_file there would read any file."""

    def read_a_file(graph: dict) -> None:
        graph["tensor_values"]["stolen"] = {
            "device": {"index": None, "type": "cpu"},
            "dtype": 1,
            "layout": 7,
            "requires_grad": False,
            "sizes": [{"as_int": 8}],
            "storage_offset": {"as_int": 0},
            "strides": [{"as_int": 1}],
        }
        arguments = [{"as_bool": False}, {"as_operator": "torch.ops.aten.from_file.default"}]
        arguments += [{"as_string": "/etc/hostname"}, {"as_bool": False}, {"as_int": 8}]
        node = {"target": "torch.ops.higher_order.wrap_with_set_grad_enabled", "name": "steal", "metadata": {}}
        node |= {"inputs": [_positional(a) for a in arguments], "outputs": [{"as_tensor": {"name": "stolen"}}]}
        graph["nodes"].append(node | {"is_hop_single_tensor_return": True})

    _refused(_with_graph_nodes(small_file, read_a_file), tmp_path / "e.tdp", "aten.from_file.default', which is not")


@pytest.mark.parametrize("size", ["3!", "99999999999!", "s0!"])
def test_a_factorial_in_a_symbolic_size_is_refused(small_file: bytes, tmp_path: Path, size: str) -> None:
    """sympy reads a lone '!' as a factorial: a size could make the loader compute for ever."""

    def factorial(graph: dict) -> None:
        graph["tensor_values"]["x"]["sizes"][0] = {"as_expr": {"expr_str": size, "hint": {"as_int": 2}}}

    _refused(_with_graph_nodes(small_file, factorial), tmp_path / "e.tdp", "unexpected or too long token")
