import pytest

from torchdelegate import CompileSpec, DelegationSpec


def test_compile_spec_is_frozen_and_takes_bytes() -> None:
    spec = CompileSpec("threads", b"2")
    assert spec == CompileSpec("threads", b"2")
    with pytest.raises(AttributeError):
        spec.value = b"3"  # type: ignore[misc]


@pytest.mark.parametrize("value", ["2", 2, bytearray(b"2"), None])
def test_compile_spec_rejects_non_bytes(value: object) -> None:
    with pytest.raises(TypeError, match="'threads': value must be bytes"):
        CompileSpec("threads", value)  # type: ignore[arg-type]


def test_delegation_spec_keeps_specs_as_a_tuple() -> None:
    specs = [CompileSpec("a", b"1")]
    spec = DelegationSpec("X", specs)
    specs.append(CompileSpec("b", b"2"))
    assert spec.compile_specs == (CompileSpec("a", b"1"),)
    assert DelegationSpec("X").compile_specs == ()


def test_delegation_spec_rejects_bad_members() -> None:
    with pytest.raises(TypeError, match="must hold CompileSpec"):
        DelegationSpec("X", [("a", b"1")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="non-empty str"):
        DelegationSpec("")
