"""The compile cache: partitions answered by content, the same file bytes whatever answered them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import torchdelegate as td
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.cache.compile_cache import ENTRIES
from torchdelegate.partition.capability import CapabilityPartitioner

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402


class Block(torch.nn.Module):
    """Weights of 1 KiB and more, and one of 64 bytes (which ONNX Runtime keeps as named data too:
    it is a parameter)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(256, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.down = torch.nn.Linear(256, 256)
        self.shift = torch.nn.Parameter(torch.randn(16))
        with torch.no_grad():
            self.norm.weight.add_(torch.randn(256))  # a trained model's norms differ from one another

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.norm(self.up(x)))) + self.shift.repeat(16)
        return torch.nextafter(y, y + 1)  # ONNX has no nextafter: a reference partition


INPUT = (torch.randn(3, 256),)


def _lower(seed: int, path: Path, partitioners: list, rows: int = 3, **options: object) -> list[str | None]:
    """Block(seed) lowered on an input of ``rows`` rows (another size is another structure)."""
    program = torch.export.export(Block(seed), (INPUT[0][:1].expand(rows, 256).contiguous(),))
    with td.preprocessing(**options):
        lowered = td.to_edge_transform_and_lower(program, partitioner=partitioners)
    lowered.save(path)
    return [d.meta["compile_cache"] for d in lowered.delegates()["forward"]]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


BACKENDS = [OnnxRuntimePartitioner(), ReferencePartitioner()]


def test_a_warm_cache_answers_every_partition_and_the_file_is_byte_identical(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _lower(0, tmp_path / "plain.tdp", BACKENDS, cache=False) == [None, None]
    assert _lower(0, tmp_path / "cold.tdp", BACKENDS, cache=cache) == ["miss", "miss"]
    assert _lower(0, tmp_path / "warm.tdp", BACKENDS, cache=cache) == ["hit", "hit"]
    assert _digest(tmp_path / "plain.tdp") == _digest(tmp_path / "cold.tdp") == _digest(tmp_path / "warm.tdp")
    program = td.load(tmp_path / "warm.tdp")
    torch.testing.assert_close(program.run("forward", *INPUT), Block(0)(*INPUT))


def test_a_fine_tuned_variant_takes_the_compiled_partitions_with_its_own_weights(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _lower(0, tmp_path / "base.tdp", BACKENDS, cache=cache)
    assert _lower(1, tmp_path / "tuned.tdp", BACKENDS, cache=cache) == ["hit", "hit"]
    _lower(1, tmp_path / "plain.tdp", BACKENDS, cache=False)
    assert _digest(tmp_path / "tuned.tdp") == _digest(tmp_path / "plain.tdp")
    script = (
        "import sys, torch, torchdelegate as td; p = td.load(sys.argv[1]); "
        "torch.manual_seed(0); x = torch.randn(3, 256); print(float(p.run('forward', x).sum()))"
    )
    # A fresh process: nothing of this one's compile or cache is in memory there.
    answer = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tuned.tdp")], capture_output=True, text=True)
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = float(Block(1)(x).sum())
    assert abs(float(answer.stdout) - expected) < 1e-3, answer.stderr


def test_a_damaged_entry_is_compiled_again_with_a_warning(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _lower(0, tmp_path / "a.tdp", [ReferencePartitioner()], cache=cache)
    (entry,) = (cache / "compile").rglob("entry")
    entry.write_bytes(entry.read_bytes()[:-10])
    with pytest.warns(UserWarning, match=r"compile cache: the entry for partition 'reference_0' of method 'forward'"):
        assert _lower(0, tmp_path / "b.tdp", [ReferencePartitioner()], cache=cache) == ["miss"]
    assert _lower(0, tmp_path / "c.tdp", [ReferencePartitioner()], cache=cache) == ["hit"]
    assert _digest(tmp_path / "a.tdp") == _digest(tmp_path / "b.tdp") == _digest(tmp_path / "c.tdp")


def test_the_least_recently_used_entries_go_first_past_the_size_bound(tmp_path: Path) -> None:
    cache = td.CompileCache(tmp_path / "cache", max_bytes=1 << 30)
    for rows in (1, 2, 3):
        _lower(0, tmp_path / f"{rows}.tdp", [ReferencePartitioner()], rows, cache=cache)
    entries = cache.entries()
    assert len(entries) == 3
    for age, entry in enumerate(entries):
        os.utime(entry["name"], (100 + age, 100 + age))
    _lower(0, tmp_path / "again.tdp", [ReferencePartitioner()], 1, cache=cache)  # a hit: its entry is used now
    used = {e["name"]: e["used"] for e in cache.entries()}
    oldest = min(used, key=used.__getitem__)
    cache.max_bytes = sum(e["size"] for e in entries) - 1
    assert cache.evict() > 0
    assert sorted(e["name"] for e in cache.entries()) == sorted(set(used) - {oldest})
    assert _lower(0, tmp_path / "kept.tdp", [ReferencePartitioner()], 1, cache=cache) == ["hit"]


def test_an_fsspec_url_holds_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHDELEGATE_CACHE_KEY", raising=False)
    url = "memory://torchdelegate-test"
    with pytest.warns(UserWarning, match=r"no TORCHDELEGATE_CACHE_KEY is set, .* for a single writer") as warned:
        assert _lower(0, tmp_path / "a.tdp", [ReferencePartitioner()], cache=url) == ["miss"]
        assert _lower(0, tmp_path / "b.tdp", [ReferencePartitioner()], cache=url) == ["hit"]
    assert len([w for w in warned if "single writer" in str(w.message)]) == 1  # once per process
    assert _digest(tmp_path / "a.tdp") == _digest(tmp_path / "b.tdp")
    monkeypatch.setenv("TORCHDELEGATE_CACHE_KEY", "the team's key, shared by every writer")
    signed = "memory://torchdelegate-test-signed"
    assert _lower(0, tmp_path / "c.tdp", [ReferencePartitioner()], cache=signed) == ["miss"]
    assert _lower(0, tmp_path / "d.tdp", [ReferencePartitioner()], cache=signed) == ["hit"]


def test_TORCHDELEGATE_CACHE_turns_the_cache_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(tmp_path / "cache"))
    program = torch.export.export(Block(0), INPUT)
    first = td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()])
    second = td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()])
    assert [d.meta["compile_cache"] for d in first.delegates()["forward"]] == ["miss"]
    assert [d.meta["compile_cache"] for d in second.delegates()["forward"]] == ["hit"]
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "off")
    third = td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()])
    assert [d.meta["compile_cache"] for d in third.delegates()["forward"]] == [None]


def test_the_command_reports_what_the_cache_answered_and_writes_the_same_file(tmp_path: Path) -> None:
    torch.export.save(torch.export.export(Block(0), INPUT), tmp_path / "block.pt2")
    command = [sys.executable, "-m", "torchdelegate", "lower", f"forward={tmp_path / 'block.pt2'}", "-b", "reference"]
    outputs = []
    for name in ("cold", "warm"):
        out = tmp_path / f"{name}.tdp"
        done = subprocess.run(
            [*command, "-o", str(out), "--cache", str(tmp_path / "cache")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    header = next(line for line in outputs[0].splitlines() if line.strip().startswith("partition "))
    assert header.split()[-2:] == ["cache", "ops"]
    assert "  miss  " in outputs[0] and "  hit  " in outputs[1]
    plain = subprocess.run([*command, "-o", str(tmp_path / "plain.tdp"), "--cache", "off"], capture_output=True)
    assert plain.returncode == 0
    assert _digest(tmp_path / "cold.tdp") == _digest(tmp_path / "warm.tdp") == _digest(tmp_path / "plain.tdp")


def test_a_cache_that_cannot_be_a_directory_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"cannot be a directory: .*/file is a file"):
        td.CompileCache(tmp_path / "file" / "cache")
    with pytest.raises(ValueError, match=r"needs a directory or an fsspec URL, got an empty name"):
        td.CompileCache("")


def test_damaged_bindings_are_warned_about_and_unfinished_writes_are_cleared(tmp_path: Path) -> None:
    cache = td.CompileCache(tmp_path / "cache")
    _lower(0, tmp_path / "a.tdp", [ReferencePartitioner()], cache=cache)
    (bindings,) = (tmp_path / "cache" / "compile-bindings").rglob("bindings.json")
    bindings.write_text("{not json")
    with pytest.warns(UserWarning, match=r"is damaged \(.*\); its entries are compiled again"):
        assert _lower(0, tmp_path / "b.tdp", [ReferencePartitioner()], cache=cache) == ["miss"]
    (entry,) = [e["name"] for e in cache.entries()]
    left = Path(entry).parent / f".{Path(entry).name}.0123456789abcdef.partial"  # a write a crash stopped
    left.mkdir()
    (left / "entry").write_bytes(b"x" * 10)
    assert [e["name"] for e in cache.entries()] == [entry]  # maybe still being written
    os.utime(left / "entry", (1, 1))
    assert cache.evict() == 10 and not left.exists()
    assert [e["name"] for e in cache.entries()] == [entry]


class NativeReference(ReferenceBackend):
    """The reference backend declaring ``runs_native_code``: AOTInductor's trust, in seconds."""

    backend_id = "test_cache_native_reference"
    runs_native_code = True


class NativePartitioner(CapabilityPartitioner):
    def __init__(self) -> None:
        super().__init__(ReferencePartitioner().operator_support, td.DelegationSpec(NativeReference.backend_id))


def test_a_planted_native_code_entry_is_compiled_here_unless_its_backend_is_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHDELEGATE_TRUSTED_BACKENDS", raising=False)
    cache = td.CompileCache(tmp_path / "cache")
    assert _lower(0, tmp_path / "honest.tdp", [NativePartitioner()], cache=cache) == ["miss"]
    (entry,) = cache.store.entries(ENTRIES)
    planted = cache.store.read(ENTRIES, entry.key, "entry")  # as any writer of a shared cache could put it there
    assert planted is not None
    cache.store.publish(ENTRIES, entry.key, {"entry": planted})
    with pytest.warns(UserWarning, match=r"native code of backend 'test_cache_native_reference', which whoever"):
        assert _lower(0, tmp_path / "untrusted.tdp", [NativePartitioner()], cache=cache) == ["miss"]
    assert _digest(tmp_path / "untrusted.tdp") == _digest(tmp_path / "honest.tdp")
    trusted = _lower(
        0, tmp_path / "trusted.tdp", [NativePartitioner()], cache=cache, trusted_backends=[NativeReference.backend_id]
    )
    assert trusted == ["hit"]
    monkeypatch.setenv("TORCHDELEGATE_TRUSTED_BACKENDS", NativeReference.backend_id)
    assert _lower(0, tmp_path / "by-environment.tdp", [NativePartitioner()], cache=cache) == ["hit"]


def test_two_processes_lowering_one_model_at_once_compile_it_once(tmp_path: Path) -> None:
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from test_compile_cache import Block, INPUT
program = torch.export.export(Block(0), INPUT)
with td.preprocessing(cache={str(tmp_path / "cache")!r}):
    lowered = td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()])
print(lowered.delegates()["forward"][0].meta["compile_cache"])
"""
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    answers = sorted(run.communicate(timeout=300)[0].strip() for run in runs)
    assert answers == ["hit", "miss"]


def _crafted_reference(entry: bytes) -> bytes:
    """A reference entry whose graph reads a file (aten.from_file), as a writer of a shared cache could craft it."""
    from dataclasses import replace

    from torchdelegate.backends.blob import pack, unpack
    from torchdelegate.backends.reference import BLOB_VERSION
    from torchdelegate.cache.compiled_entry import decode, encode
    from torchdelegate.serialize.container import canonical_json

    decoded = decode(entry)
    header, payload = unpack(memoryview(decoded.blob), BLOB_VERSION, "reference")
    program = json.loads(zlib.decompress(payload))
    node = program["graph"]["graph_module"]["graph"]["nodes"][0]
    node["target"] = "torch.ops.aten.from_file.default"
    return encode(replace(decoded, blob=pack(header, zlib.compress(canonical_json(program)))))


def _crafted_onnx(entry: bytes) -> bytes:
    """An onnxruntime entry whose model imports a custom operator domain (served by a custom-op library)."""
    from dataclasses import replace

    import onnx

    from torchdelegate.backends.onnxruntime.blob_header import model_blob, unpacked
    from torchdelegate.cache.compiled_entry import decode, encode

    decoded = decode(entry)
    header, payload = unpacked(memoryview(decoded.blob))
    model = onnx.ModelProto.FromString(bytes(payload))
    model.opset_import.add(domain="com.example.custom", version=1)
    return encode(replace(decoded, blob=model_blob(header, model.SerializeToString())))


@pytest.mark.parametrize(
    ("partitioner", "craft", "refusal"),
    [
        (ReferencePartitioner, _crafted_reference, "from_file"),
        (OnnxRuntimePartitioner, _crafted_onnx, "operator domain 'com.example.custom'"),
    ],
    ids=["reference", "onnxruntime"],
)
def test_a_crafted_entry_in_a_shared_cache_fails_its_backends_load_checks_and_is_compiled_here(
    tmp_path: Path, partitioner: type, craft: Any, refusal: str
) -> None:
    cache = td.CompileCache(tmp_path / "shared")
    assert _lower(0, tmp_path / "honest.tdp", [partitioner()], cache=cache)[0] == "miss"
    for entry in cache.store.entries(ENTRIES):
        honest = cache.store.read(ENTRIES, entry.key, "entry")
        assert honest is not None
        cache.store.publish(ENTRIES, entry.key, {"entry": craft(honest)})  # whole, checksummed: as any writer could
    with pytest.warns(UserWarning, match=rf"fails the load-time checks of backend '\w+' \(FormatError: .*{refusal}"):
        assert _lower(0, tmp_path / "crafted.tdp", [partitioner()], cache=cache)[0] == "miss"
    assert _digest(tmp_path / "crafted.tdp") == _digest(tmp_path / "honest.tdp")
    assert _lower(0, tmp_path / "again.tdp", [partitioner()], cache=cache)[0] == "hit"  # the honest entry is back


def test_equal_partitions_of_two_methods_are_answered_by_one_look_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LLM's decode exported as its prefill: a warm cache is asked once for both (each look-up maps
    and checks the entry's weights), and the file is the one a cold cache writes."""
    from torchdelegate.cache.compile_cache import CompileCache
    from torchdelegate.exported.structural_copy import copy_program

    program = torch.export.export(Block(0), INPUT)
    cache = tmp_path / "cache"

    def lowered(path: Path) -> list[str | None]:
        with td.preprocessing(cache=cache):
            manager = td.to_edge_transform_and_lower(
                {"prefill": program, "decode": copy_program(program)}, partitioner=[OnnxRuntimePartitioner()]
            )
        manager.save(path)
        return [d.meta["compile_cache"] for ds in manager.delegates().values() for d in ds]

    assert lowered(tmp_path / "cold.tdp") == ["miss", "miss"]
    asked: list[str] = []
    original = CompileCache.get

    def counted(self: CompileCache, key: str, where: str, *args: Any) -> Any:
        asked.append(where)
        return original(self, key, where, *args)

    monkeypatch.setattr(CompileCache, "get", counted)
    assert lowered(tmp_path / "warm.tdp") == ["hit", "hit"]
    assert asked == ["partition 'onnxruntime_0' of method 'prefill'"]
    assert _digest(tmp_path / "cold.tdp") == _digest(tmp_path / "warm.tdp")
