"""The machine cache as a trust boundary: a prepared model is used only when its signed record says
it was made for this file's content (the blob and its weights' digests) and its files are those the
record lists; otherwise the load packs the weights itself, with a warning, and ``prepare`` mends it."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from crafted import with_a_segment_byte_flipped

import torchdelegate as td
from torchdelegate.cache.entry_signature import KEY_VARIABLE

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402

KEY = "the team's key, shared by every writer"
X = torch.randn(4, 512)


def _saved(path: Path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()
    td.to_edge(torch.export.export(model, (X,))).to_backend(OnnxRuntimePartitioner()).save(path)
    return model


def _prepared(path: Path) -> Path:
    with td.load(path) as program:
        (line,) = program.prepare()
    return Path(line.rpartition(" in ")[2])


def _run(path: Path) -> torch.Tensor:
    with td.load(path) as program:
        return program.run("forward", X)


def _negated(place: Path) -> None:
    """The prepared model made to negate its output, its manifest rewritten to match: what a writer of
    the cache without the key can do."""
    model = onnx.load(str(place / "model.onnx"), load_external_data=False)
    output = model.graph.output[0].name
    producer = next(node for node in model.graph.node if output in node.output)
    producer.output[list(producer.output).index(output)] = "before_negation"
    model.graph.node.append(onnx.helper.make_node("Neg", ["before_negation"], [output]))
    (place / "model.onnx").write_bytes(model.SerializeToString())
    manifest = json.loads((place / "manifest.json").read_text())
    data = (place / "model.onnx").read_bytes()
    manifest["files"]["model.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (place / "manifest.json").write_text(json.dumps(manifest))


def test_a_prepared_model_swapped_with_its_manifest_is_refused_and_prepared_again(
    tmp_path: Path, cache_directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    model = _saved(tmp_path / "m.tdp", 0)
    place = _prepared(tmp_path / "m.tdp")
    torch.testing.assert_close(_run(tmp_path / "m.tdp"), model(X), atol=1e-4, rtol=1e-4)
    _negated(place)
    with pytest.warns(UserWarning, match=r"is not used: its files are not those its signed record lists: 'model.onnx"):
        outputs = _run(tmp_path / "m.tdp")
    torch.testing.assert_close(outputs, model(X), atol=1e-4, rtol=1e-4)
    assert _prepared(tmp_path / "m.tdp") == place  # written again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(_run(tmp_path / "m.tdp"), model(X), atol=1e-4, rtol=1e-4)


def test_an_entry_made_for_another_file_is_refused_though_signed(
    tmp_path: Path, cache_directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    victim, other = _saved(tmp_path / "victim.tdp", 0), _saved(tmp_path / "other.tdp", 1)
    victims, others = _prepared(tmp_path / "victim.tdp"), _prepared(tmp_path / "other.tdp")
    shutil.rmtree(victims)
    shutil.copytree(others, victims)  # signed by a writer the team trusts, for the other file's weights
    with pytest.warns(UserWarning, match=r"is not used: it was made for something else \(its record names the key"):
        outputs = _run(tmp_path / "victim.tdp")
    torch.testing.assert_close(outputs, victim(X), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(other(X), victim(X))


def test_unsigned_entries_are_refused_with_one_warning_where_a_key_is_set_or_others_can_write(
    tmp_path: Path, cache_directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    models = [_saved(tmp_path / f"{seed}.tdp", seed) for seed in (0, 1)]
    for seed in (0, 1):
        _prepared(tmp_path / f"{seed}.tdp")  # unsigned: this user's own directory
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    with pytest.warns(UserWarning, match=r"machine cache: entries at .* are not used: it is not signed") as warned:
        for seed, model in enumerate(models):
            torch.testing.assert_close(_run(tmp_path / f"{seed}.tdp"), model(X), atol=1e-4, rtol=1e-4)
    assert len([w for w in warned if "not signed" in str(w.message)]) == 1  # once, not per entry
    for seed in (0, 1):
        _prepared(tmp_path / f"{seed}.tdp")  # signed now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(tmp_path / "0.tdp")
    monkeypatch.delenv(KEY_VARIABLE)
    cache_directory.chmod(0o777)
    with pytest.warns(UserWarning, match=r"can be written by its group or by others \(mode drwxrwxrwx\)"):
        torch.testing.assert_close(_run(tmp_path / "1.tdp"), models[1](X), atol=1e-4, rtol=1e-4)


def test_a_record_that_prepare_checked_a_file_moved_to_a_damaged_file_is_refused(
    tmp_path: Path, cache_directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare`` records that it checked the very file it prepared, so that loads of it skip the check.
    A writer of the cache without the key who damages the file and moves that signed record to the
    damaged file's identity gains nothing: the record names the file it was made for, and the damaged
    file is checked and refused."""
    from torchdelegate.cache.machine_cache import CHECKED_FILE, _checked_file_key, entry_path
    from torchdelegate.serialize.reader import ProgramFile

    def record_of(path: Path) -> Path:
        file = ProgramFile(path)
        try:
            return entry_path(CHECKED_FILE, _checked_file_key(file.identity()))
        finally:
            file.close()

    monkeypatch.setenv(KEY_VARIABLE, KEY)
    _saved(tmp_path / "m.tdp", 0)
    _prepared(tmp_path / "m.tdp")
    checked = record_of(tmp_path / "m.tdp")
    assert checked.is_dir()
    damaged = with_a_segment_byte_flipped(
        (tmp_path / "m.tdp").read_bytes(), lambda segments: max(segments, key=lambda s: s["length"]), at=3
    )
    with open(tmp_path / "m.tdp", "r+b") as file:  # in place: the same inode, changed
        file.write(damaged)
    shutil.copytree(checked, record_of(tmp_path / "m.tdp"))
    with td.load(tmp_path / "m.tdp") as program, pytest.raises(td.FormatError, match="checksum mismatch"):
        program.run("forward", X)


def test_a_file_changed_within_its_file_systems_tick_of_the_check_is_not_recorded_as_checked(
    tmp_path: Path, cache_directory: Path
) -> None:
    """Where change times keep whole seconds, a write in the same second as the check would leave the
    identity as it was: such a file is not recorded, so its loads keep checking it."""
    from torchdelegate.cache.machine_cache import file_checked, remember_checked

    seconds = 1_700_000_000 * 1_000_000_000
    coarse = [[1, 2, 3, seconds, seconds, "header"]]
    remember_checked(coarse, seconds + 1_500_000_000)  # within two seconds of its change
    assert not file_checked(coarse)
    remember_checked(coarse, seconds + 2_500_000_000)
    assert file_checked(coarse)
    fine = [[1, 2, 3, seconds + 7, seconds + 7, "header"]]  # nanoseconds kept: any later write moves it
    remember_checked(fine, seconds + 7)
    assert not file_checked(fine)
    remember_checked(fine, seconds + 8)
    assert file_checked(fine)
