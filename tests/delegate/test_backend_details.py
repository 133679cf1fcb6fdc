import sys
import textwrap
from pathlib import Path

import pytest

import torchdelegate
from torchdelegate import (
    BackendDetails,
    BackendNotFoundError,
    BackendRegistrationError,
    PreprocessResult,
    get_backend,
    registered_backend_ids,
)


class RegistryBackendA(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return PreprocessResult(b"a")


class RegistryBackendB(RegistryBackendA):
    pass


class RegistryBackendNamed(BackendDetails):
    backend_id = "registry-named"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return PreprocessResult(b"n")


def test_id_is_the_class_name_unless_set() -> None:
    assert RegistryBackendA.backend_id == "RegistryBackendA"
    assert get_backend("RegistryBackendA") is RegistryBackendA
    assert get_backend("registry-named") is RegistryBackendNamed


def test_a_subclass_is_a_new_backend_with_its_own_id() -> None:
    assert RegistryBackendB.backend_id == "RegistryBackendB"
    assert get_backend("RegistryBackendB") is RegistryBackendB
    assert get_backend("RegistryBackendA") is RegistryBackendA


def test_abstract_classes_are_not_registered() -> None:
    class NoPreprocess(BackendDetails):
        pass

    assert "NoPreprocess" not in registered_backend_ids()


def test_two_classes_claiming_one_id_is_an_error_naming_both() -> None:
    with pytest.raises(BackendRegistrationError) as info:

        class Impostor(BackendDetails):
            backend_id = "registry-named"

            @staticmethod
            def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
                return PreprocessResult()

    message = str(info.value)
    assert "RegistryBackendNamed" in message and "Impostor" in message
    assert get_backend("registry-named") is RegistryBackendNamed


def test_unknown_id_names_the_id_and_the_known_ids() -> None:
    with pytest.raises(BackendNotFoundError) as info:
        get_backend("NoSuchBackend")
    assert isinstance(info.value, NotImplementedError)
    assert "'NoSuchBackend'" in str(info.value) and "'RegistryBackendA'" in str(info.value)


def test_the_default_runtime_says_the_backend_has_none() -> None:
    with pytest.raises(torchdelegate.DelegateExecutionError, match="'RegistryBackendA' has no Python runtime"):
        RegistryBackendA.init(memoryview(b""), [], torchdelegate.NamedDataMap())


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, entry_point: str) -> None:
    """A distribution on sys.path: module ``ep_backend_pkg`` and one entry point in our group."""
    (tmp_path / "ep_backend_pkg.py").write_text(textwrap.dedent(module))
    dist = tmp_path / "ep_backend_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-backend-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[torchdelegate.backends]\n{entry_point}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Whatever the test imports and registers is forgotten after it: each test reaches the entry point.
    monkeypatch.setitem(sys.modules, "ep_backend_pkg", None)
    monkeypatch.delitem(sys.modules, "ep_backend_pkg")
    monkeypatch.setattr(
        torchdelegate.delegate.backend_details, "_REGISTRY", dict(torchdelegate.delegate.backend_details._REGISTRY)
    )


_ENTRY_POINT_MODULE = """
    from torchdelegate import BackendDetails, PreprocessResult

    class EntryPointBackend(BackendDetails):
        backend_id = "entry-point-backend"

        @staticmethod
        def preprocess(edge_program, compile_specs):
            return PreprocessResult(b"e")

    def not_a_backend():
        pass
    """


def test_backends_load_through_their_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, monkeypatch, _ENTRY_POINT_MODULE, "entry-point-backend = ep_backend_pkg:EntryPointBackend")
    assert "entry-point-backend" in registered_backend_ids()
    backend = get_backend("entry-point-backend")
    assert backend.__name__ == "EntryPointBackend" and backend.__module__ == "ep_backend_pkg"


@pytest.mark.parametrize(
    ("entry_point", "message"),
    [
        (
            "misnamed-backend = ep_backend_pkg:EntryPointBackend",
            r"entry point 'misnamed-backend' loads ep_backend_pkg\.EntryPointBackend, whose backend_id is "
            r"'entry-point-backend'; make the entry point's name equal the backend_id",
        ),
        (
            "function-backend = ep_backend_pkg:not_a_backend",
            r"entry point 'function-backend' in group 'torchdelegate.backends' points to "
            r"ep_backend_pkg:not_a_backend, which is not a BackendDetails subclass",
        ),
    ],
)
def test_an_entry_point_must_load_the_backend_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry_point: str, message: str
) -> None:
    _install(tmp_path, monkeypatch, _ENTRY_POINT_MODULE, entry_point)
    with pytest.raises(BackendNotFoundError, match=message):
        get_backend(entry_point.split(" ")[0])
