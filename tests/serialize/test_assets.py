"""Assets: files a program carries for its users (a tokenizer, a generation config), in its own
file, checksummed, never read or run by the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from crafted import manifest_bytes, with_a_segment_byte_flipped, with_manifest
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate.cli.main import main

TOKENIZER = json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}).encode()
GENERATION = json.dumps({"eos_token_id": 1, "max_new_tokens": 8}).encode()


def _saved(path: Path, **options: object) -> Path:
    manager = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    manager.save(path, assets={"tokenizer.json": TOKENIZER, "generation_config.json": GENERATION}, **options)
    return path


def test_assets_come_back_from_the_file_and_the_program_still_runs(tmp_path: Path) -> None:
    path = _saved(tmp_path / "m.tdp")
    with td.load(path) as program:
        assert program.asset_names == ["generation_config.json", "tokenizer.json"]
        assert program.asset("tokenizer.json") == TOKENIZER
        assert json.loads(program.asset("generation_config.json"))["eos_token_id"] == 1
        program.run("forward", torch.randn(2, 4))
        with pytest.raises(KeyError, match="no asset 'vocab.txt' in .*; its assets are"):
            program.asset("vocab.txt")
    with pytest.raises(td.ProgramClosedError, match="cannot read asset 'tokenizer.json'"):
        program.asset("tokenizer.json")


def test_assets_stay_in_the_program_file_when_the_data_goes_to_another(tmp_path: Path) -> None:
    path = _saved(tmp_path / "m.tdp", external_data_path=tmp_path / "m.data")
    assert TOKENIZER in path.read_bytes() and TOKENIZER not in (tmp_path / "m.data").read_bytes()
    with td.load(path) as program:
        assert program.asset("tokenizer.json") == TOKENIZER


def test_a_file_without_assets_has_none_and_its_manifest_does_not_name_them(tmp_path: Path) -> None:
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).save(tmp_path / "m.tdp")
    assert "assets" not in json.loads(manifest_bytes((tmp_path / "m.tdp").read_bytes()))
    with td.load(tmp_path / "m.tdp") as program:
        assert program.asset_names == []


@pytest.mark.parametrize(
    ("assets", "error", "message"),
    [
        ({"../tokenizer.json": b"x"}, ValueError, "asset name '../tokenizer.json': use a plain file name"),
        ({".hidden": b"x"}, ValueError, "asset name '.hidden': use a plain file name"),
        ({"a/b.json": b"x"}, ValueError, "asset name 'a/b.json': use a plain file name"),
        ({"config.json": {"eos": 1}}, TypeError, "asset 'config.json' is a dict; give its bytes"),
    ],
)
def test_a_bad_asset_is_refused_and_nothing_is_written(
    tmp_path: Path, assets: dict[str, object], error: type, message: str
) -> None:
    manager = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    with pytest.raises(error, match=message.replace("(", r"\(")):
        manager.save(tmp_path / "m.tdp", assets=assets)  # type: ignore[arg-type]
    assert not (tmp_path / "m.tdp").exists()


def _with_assets(original: bytes, assets: list[dict[str, str]]) -> bytes:
    manifest = json.loads(manifest_bytes(original))
    manifest["assets"] = assets
    return with_manifest(original, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def test_a_crafted_asset_table_is_a_format_error_at_load(tmp_path: Path) -> None:
    original = _saved(tmp_path / "m.tdp").read_bytes()
    record = json.loads(manifest_bytes(original))["assets"][0]
    cases = {
        "asset name 'generation_config.json' appears twice": [record, record],
        r"assets\[0\]": [{**record, "name": "../x"}],
        "asset 'generation_config.json'": [{**record, "data": "0" * 64}],
    }
    for message, assets in cases.items():
        (tmp_path / "crafted.tdp").write_bytes(_with_assets(original, assets))
        with pytest.raises(td.FormatError, match=message):
            td.load(tmp_path / "crafted.tdp")


def test_a_damaged_asset_is_a_format_error_when_read(tmp_path: Path) -> None:
    original = _saved(tmp_path / "m.tdp").read_bytes()
    digest = json.loads(manifest_bytes(original))["assets"][1]["data"]
    damaged = with_a_segment_byte_flipped(original, lambda segments: next(s for s in segments if s["sha256"] == digest))
    (tmp_path / "damaged.tdp").write_bytes(damaged)
    with td.load(tmp_path / "damaged.tdp") as program:
        program.run("forward", torch.randn(2, 4))  # nothing else reads it
        with pytest.raises(td.FormatError, match="asset 'tokenizer.json'"):
            program.asset("tokenizer.json")


def test_inspect_lists_the_assets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path / "m.tdp")
    assert main(["inspect", str(path)]) == 0
    assert f"assets: generation_config.json ({len(GENERATION)} B), tokenizer.json ({len(TOKENIZER)} B)" in (
        capsys.readouterr().out
    )
