import pytest
import torch

from torchdelegate import NamedDataMap, NamedDataStore


def test_identical_bytes_are_stored_once() -> None:
    store = NamedDataStore()
    store.add_named_data("a", b"weights")
    store.add_named_data("b", b"weights", alignment=16)
    store.add_named_data("a", b"weights", alignment=64)
    out = store.get_named_data_store_output()
    assert len(out.buffers) == 1
    assert out.entries["a"].alignment == 64 and out.entries["b"].alignment == 16
    assert out.entries["a"].buffer_index == out.entries["b"].buffer_index


def test_same_key_with_other_bytes_is_an_error() -> None:
    store = NamedDataStore()
    store.add_named_data("w", b"one")
    with pytest.raises(ValueError, match="'w' is stored twice with different bytes"):
        store.add_named_data("w", b"two")


@pytest.mark.parametrize("alignment", [0, 3, -8, 1.5])
def test_alignment_must_be_a_power_of_two(alignment: object) -> None:
    with pytest.raises(ValueError, match="power of two"):
        NamedDataStore().add_named_data("w", b"x", alignment=alignment)  # type: ignore[arg-type]


def test_tensors_are_stored_without_a_copy_and_read_back_zero_copy() -> None:
    weight = torch.randn(4, 4)
    store = NamedDataStore()
    store.add_named_data("w", weight)
    store.add_named_data("bf16", torch.ones(3, dtype=torch.bfloat16))
    data = NamedDataMap(store.get_named_data_store_output())
    view = data.get_data("w")
    assert view.readonly and len(view) == 64
    assert torch.frombuffer(bytearray(view), dtype=torch.float32).view(4, 4).equal(weight)
    # The stored view aliases the tensor: no copy was made.
    weight[0, 0] = 123.0
    assert torch.frombuffer(bytearray(data.get_data("w")), dtype=torch.float32)[0] == 123.0
    assert sorted(data.keys()) == ["bf16", "w"] and "w" in data and "x" not in data
    with pytest.raises(KeyError, match="no named data 'x'"):
        data.get_data("x")


def test_merge_dedups_across_stores_and_reports_conflicts() -> None:
    first, second = NamedDataStore(), NamedDataStore()
    first.add_named_data("shared", b"abc")
    second.add_named_data("shared", b"abc")
    second.add_named_data("other", b"abc")
    merged = NamedDataStore()
    merged.merge(first.get_named_data_store_output())
    merged.merge(second.get_named_data_store_output())
    out = merged.get_named_data_store_output()
    assert len(out.buffers) == 1 and list(out.entries) == ["other", "shared"]
    conflicting = NamedDataStore()
    conflicting.add_named_data("shared", b"xyz")
    with pytest.raises(ValueError, match="'shared'"):
        merged.merge(conflicting.get_named_data_store_output())


def test_bad_keys_and_data_are_type_errors() -> None:
    with pytest.raises(TypeError, match="key"):
        NamedDataStore().add_named_data("", b"x")
    with pytest.raises(TypeError, match="bytes or a torch.Tensor"):
        NamedDataStore().add_named_data("k", [1, 2])  # type: ignore[arg-type]
