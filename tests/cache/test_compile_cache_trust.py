"""The compile cache as a trust boundary: an entry is used only when someone the user trusts wrote it
(signed with the team's key, or unsigned where this user alone writes) and it is the compilation of
the partition looked up (its graph and weights); native code only from trusted backends, nested
delegates included."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import torchdelegate as td
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.cache.compile_cache import ENTRIES
from torchdelegate.cache.compiled_entry import NamedItem, decode, encode, slot_token
from torchdelegate.cache.entry_signature import KEY_FILE_VARIABLE, KEY_VARIABLE, configured_key
from torchdelegate.delegate.named_data import content_key, tensor_bytes

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402

KEY = "the team's key, shared by every writer"
X = torch.arange(8.0).reshape(2, 4)


class Affine(torch.nn.Module):
    def __init__(self, scale: float, shift: float) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class Tuned(torch.nn.Module):
    """One architecture, weights by seed: a model and its fine-tunes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _lower(model: torch.nn.Module, cache: Any, partitioner: Any = None, **options: Any) -> tuple[Any, list[Any]]:
    """The model lowered through ``cache``, and what the cache answered for each delegate."""
    program = torch.export.export(model, (X,))
    with td.preprocessing(cache=cache, **options):
        lowered = td.to_edge_transform_and_lower(program, partitioner=[partitioner or ReferencePartitioner()])
    return lowered, [d.meta["compile_cache"] for d in lowered.delegates()["forward"]]


def _run(lowered: Any) -> torch.Tensor:
    return lowered.exported_program().module()(X)


def _keys(cache: td.CompileCache) -> set[str]:
    return {entry.key for entry in cache.store.entries(ENTRIES)}


def _entry(cache: td.CompileCache, key: str) -> bytes:
    data = cache.store.read(ENTRIES, key, "entry")
    assert data is not None
    return bytes(data)


@pytest.mark.parametrize(
    "partitioner", [ReferencePartitioner, OnnxRuntimePartitioner], ids=["reference", "onnxruntime"]
)
def test_an_entry_moved_under_another_partitions_key_is_refused_though_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partitioner: type
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    cache = td.CompileCache(tmp_path / "shared")
    victim, attacker = Affine(2, 1), Affine(3, -7)
    assert _lower(victim, cache, partitioner())[1] == ["miss"]
    (victim_key,) = _keys(cache)
    assert _lower(attacker, cache, partitioner())[1] == ["miss"]
    (attacker_key,) = _keys(cache) - {victim_key}
    # Signed by a writer the team trusts, but the compilation of x*3-7, put where x*2+1's entry goes.
    cache.store.publish(ENTRIES, victim_key, {"entry": _entry(cache, attacker_key)})
    with pytest.warns(UserWarning, match=r"is not used: it was compiled from another graph \(graph digest"):
        lowered, answers = _lower(victim, cache, partitioner())
    assert answers == ["miss"]
    torch.testing.assert_close(_run(lowered), X * 2 + 1)
    assert _lower(victim, cache, partitioner())[1] == ["hit"]  # its own entry, written again


def _inline_weights(entry: bytes, weights: dict[str, torch.Tensor]) -> Any:
    """The entry with ``weights`` carried inline where it had slots for the unit's own tensors: what
    someone who knows only the architecture can write."""
    decoded = decode(entry)
    blob, items = decoded.blob, []
    for position, item in enumerate(decoded.named_data):
        if item.slot is None:
            items.append(item)
            continue
        tensor = weights[item.slot]
        digest = content_key(tensor)
        blob = blob.replace(slot_token(position), digest.encode())
        items.append(NamedItem(item.key or digest, None, item.alignment, bytes(tensor_bytes(tensor))))
    return replace(decoded, blob=blob, named_data=items)


def test_an_entry_carrying_other_weights_inline_is_refused_signed_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    cache = td.CompileCache(tmp_path / "shared")
    assert _lower(Tuned(0), cache)[1] == ["miss"]
    (key,) = _keys(cache)
    crafted = _inline_weights(_entry(cache, key), dict(Tuned(666).state_dict()))
    cache.store.publish(ENTRIES, key, {"entry": encode(crafted)})  # written without the key
    with pytest.warns(UserWarning, match=r"entries at .* are not used: it is not signed .* Entries are written again"):
        lowered, answers = _lower(Tuned(1), cache)  # a teammate's fine-tune
    assert answers == ["miss"]
    torch.testing.assert_close(_run(lowered), Tuned(1)(X))
    # Even signed (a writer holding the key), weights that do not come from the unit are refused.
    signed = encode(crafted, lambda digest: cache.signer.signature(ENTRIES, digest))
    cache.store.publish(ENTRIES, key, {"entry": signed})
    with pytest.warns(UserWarning, match=r"weight 'linear.\w+' of this partition reaches it neither by its digest"):
        lowered, answers = _lower(Tuned(1), cache)
    assert answers == ["miss"]
    torch.testing.assert_close(_run(lowered), Tuned(1)(X))
    assert _lower(Tuned(2), cache)[1] == ["hit"]  # the honest entry, back, serves every fine-tune


def test_unsigned_and_wrongly_signed_entries_are_compiled_again_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    place = tmp_path / "cache"
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    models = [Tuned(0), Affine(2, 1)]
    for model in models:
        assert _lower(model, place)[1] == ["miss"]  # unsigned: this user's own directory
    assert _lower(models[0], place)[1] == ["hit"]
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    cache = td.CompileCache(place)
    with pytest.warns(UserWarning, match=r"not signed") as warned:
        assert [_lower(model, cache)[1] for model in models] == [["miss"], ["miss"]]
    assert len([w for w in warned if "are not used" in str(w.message)]) == 1  # one warning, not one per entry
    assert _lower(models[0], place)[1] == ["hit"]  # written again, signed
    monkeypatch.setenv(KEY_VARIABLE, "another team's key, not ours")
    with pytest.warns(UserWarning, match=r"its signature is not made with this key"):
        assert _lower(models[0], place)[1] == ["miss"]


def test_without_a_key_a_directory_others_can_write_serves_no_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    place = tmp_path / "team"
    place.mkdir(mode=0o700)
    assert _lower(Tuned(0), place)[1] == ["miss"]
    os.chmod(place, 0o770)  # the group may write: anyone in it could have planted an entry
    with pytest.warns(UserWarning, match=r"can be written by its group or by others \(mode drwxrwx---\), and no TORCH"):
        assert _lower(Tuned(0), place)[1] == ["miss"]
    monkeypatch.setenv(KEY_VARIABLE, KEY)  # a key tells the writers apart
    with pytest.warns(UserWarning, match=r"it is not signed"):  # the entry written before the key
        assert _lower(Tuned(0), place)[1] == ["miss"]
    assert _lower(Tuned(0), place)[1] == ["hit"]


class NativeNested(ReferenceBackend):
    """The reference backend declaring ``runs_native_code``: AOTInductor's trust, without its compile."""

    backend_id = "test_cache_trust_native"
    runs_native_code = True


def _nesting_native_code() -> td.LoweredBackendModule:
    """A reference delegate whose blob nests a native-code delegate, taking and giving what Affine does."""
    inner_program = td.to_edge(torch.export.export(Affine(3, -7), (X,))).exported_program()
    inner = td.to_backend(NativeNested.backend_id, inner_program, [])

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 0

    outer = td.to_edge(torch.export.export(Outer(), (X,))).to_backend(td.DelegationSpec("reference"))
    (delegate,) = outer.delegates()["forward"]
    return delegate


def test_a_delegate_nested_in_an_entry_needs_the_trust_its_native_code_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    cache = td.CompileCache(tmp_path / "cache")  # this user's own: unsigned entries are used
    assert _lower(Affine(2, 1), cache)[1] == ["miss"]
    (key,) = _keys(cache)
    nesting = _nesting_native_code()
    output = nesting.named_data_store_output
    named = [NamedItem(k, None, e.alignment, output.buffers[e.buffer_index]) for k, e in output.entries.items()]
    crafted = replace(decode(_entry(cache, key)), blob=nesting.processed_bytes, named_data=named)
    cache.store.publish(ENTRIES, key, {"entry": encode(crafted)})
    with pytest.warns(
        UserWarning, match=r"holds native code of a backend not trusted here, .*'test_cache_trust_native'"
    ):
        lowered, answers = _lower(Affine(2, 1), cache)
    assert answers == ["miss"]
    torch.testing.assert_close(_run(lowered), X * 2 + 1)
    cache.store.publish(ENTRIES, key, {"entry": encode(crafted)})
    trusted = _lower(Affine(2, 1), cache, trusted_backends=[NativeNested.backend_id])
    assert trusted[1] == ["hit"]  # the caller's word, as for a file


def test_the_key_comes_from_the_environment_or_a_file_and_is_long_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    monkeypatch.delenv(KEY_FILE_VARIABLE, raising=False)
    assert configured_key() is None
    (tmp_path / "key").write_text(f"  {KEY}\n")
    monkeypatch.setenv(KEY_FILE_VARIABLE, str(tmp_path / "key"))
    assert configured_key() == KEY.encode()
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    with pytest.raises(ValueError, match="set TORCHDELEGATE_CACHE_KEY or TORCHDELEGATE_CACHE_KEY_FILE, not both"):
        configured_key()
    monkeypatch.delenv(KEY_FILE_VARIABLE)
    monkeypatch.setenv(KEY_VARIABLE, "short")
    with pytest.raises(ValueError, match=r"the cache key has 5 bytes; give at least 16 \(a random one: python -c"):
        td.CompileCache(tmp_path / "cache")
    monkeypatch.delenv(KEY_VARIABLE)
    monkeypatch.setenv(KEY_FILE_VARIABLE, str(tmp_path))
    with pytest.raises(ValueError, match=r"TORCHDELEGATE_CACHE_KEY_FILE: .* is not a regular file|cannot be read"):
        configured_key()


def test_a_planted_bindings_list_nested_too_deep_is_damaged_not_a_recursion_error(tmp_path: Path) -> None:
    """The unsigned list of bindings steers look-ups only: read by the bounded reader, at most 8 kept."""
    from torchdelegate.cache.compile_cache import BINDINGS

    cache = td.CompileCache(tmp_path / "cache")
    cache.store.publish(BINDINGS, "a" * 64, {"bindings.json": b"[" * 100_000 + b"]" * 100_000})
    with pytest.warns(UserWarning, match="is damaged .*nesting deeper than 128 levels"):
        assert cache.bindings("a" * 64) == []
    cache.store.publish(BINDINGS, "b" * 64, {"bindings.json": repr([["w"]] * 20).replace("'", '"').encode()})
    assert cache.bindings("b" * 64) == [["w"]] * 8
