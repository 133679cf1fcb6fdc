"""The AOTInductor backend: partitions compiled ahead of time to native code.

Each partition is compiled with ``torch._inductor.aoti_compile_and_package`` into a package
(the blob) *without* its weights (``aot_inductor.package_constants_in_so=False``). The
weights are named data keyed by their SHA-256, as for the reference backend; at run time
they are handed to the compiled model as user-managed constants: views of the program
file, not copies, and the same memory for every partition and method that uses them.

Compiling takes tens of seconds per partition, so the partitioner claims every core-ATen
computation, which the capability partitioner groups into as few partitions as it finds.
Mutable buffers stay with the program.
``is_available()`` checks for the C++ compiler AOTInductor needs.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

from torchdelegate.backends.blob import pack, table_keys, unpack, weight_table, weights
from torchdelegate.backends.inductor_package import SERIALIZATION_ID, checked_package, serialization_id
from torchdelegate.backends.reference import reference_support
from torchdelegate.cache.machine_cache import machine_identity
from torchdelegate.delegate.backend_details import BackendDetails, PreprocessResult, shared_named_data, with_named_data
from torchdelegate.delegate.compile_units import current_partition
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
from torchdelegate.delegate.trust import check_trusted, current_trust
from torchdelegate.errors import FormatError, PreprocessError
from torchdelegate.exported.structural_copy import copy_program, with_identifier_state_names
from torchdelegate.partition.capability import CapabilityPartitioner

__all__ = ["BLOB_VERSION", "InductorBackend", "InductorPartitioner"]

BLOB_VERSION = 1
_CONFIG = {"aot_inductor.package_constants_in_so": False}


def _threads() -> int:
    """The threads a compiled partition's parallel loops use: AOTInductor writes the number into
    the code, so it is this machine's core count, not the compiling process's own setting (which
    a worker's pool lowers)."""
    return os.cpu_count() or 1


class InductorBackend(BackendDetails):
    """Runs partitions compiled by AOTInductor; weights are shared named data."""

    backend_id = "inductor"
    runs_native_code = True  # a blob is a compiled shared library, loaded into the process
    compile_cache_version = f"blob {BLOB_VERSION}, sources left out"
    # AOTInductor links small constants into its library (it asks for the others only): the cache key
    # covers every weight's bytes.
    weights_by_reference = False

    @classmethod
    def compile_cache_identity(cls) -> dict[str, str] | None:
        """The blob's version, the C++ compiler, and this machine's CPU and core count, which AOTInductor
        compiles for."""
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            compiler = get_cpp_compiler()
            described = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        except Exception:
            return None  # no compiler to name: nothing is cached
        version = described.splitlines()[0] if described else compiler
        return {
            "compiler": str(cls.compile_cache_version),
            "c++": version,
            **machine_identity(),
            "threads": str(_threads()),
        }

    needs = "AOTInductor needs a C++ compiler (g++ or clang++) on PATH"

    @classmethod
    def partitioner(cls, compile_specs: list[CompileSpec] | None = None) -> InductorPartitioner:
        return InductorPartitioner(compile_specs)

    @classmethod
    def is_available(cls) -> bool:
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            compiler = get_cpp_compiler()
        except Exception:
            return False
        return shutil.which(compiler) is not None

    @classmethod
    def preprocess(cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:  # type: ignore[override]
        """An AOTInductor package of the sub-program; its weights as named data."""
        return with_named_data(lambda store: _package(edge_program, store, current_partition()))

    @classmethod
    def link_results(
        cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]
    ) -> list[PreprocessResult]:
        return shared_named_data(results)

    @classmethod
    def named_data_keys(cls, processed: memoryview, compile_specs: list[CompileSpec]) -> list[str] | None:
        return table_keys(unpack(processed, BLOB_VERSION, "inductor")[0].get("tensors"))

    @classmethod
    def check_blob(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> None:
        """What ``init`` would load, checked without loading it: the backend trusted (its blob is a
        library the process would run), the weight table against the named data, and the package: the
        files a compiled package holds and nothing else, whole, under its own folder, its libraries shared
        objects of this machine, its serialization id the digest of the rest (as compiled)."""
        check_trusted(cls, current_trust(), "inductor blob")
        header, package = unpack(processed, BLOB_VERSION, "inductor")
        weights(header.get("tensors"), named_data, "inductor")
        checked_package(package)

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        header, package = unpack(processed, BLOB_VERSION, "inductor")
        constants = weights(header.get("tensors"), named_data, "inductor")
        runner = torch._inductor.aoti_load_package(io.BytesIO(bytes(package)))
        # AOTInductor builds small constants into its code: it asks only for the others.
        declared = set(runner.get_constant_fqns())
        missing = sorted(declared - set(constants))
        if missing:
            raise FormatError(f"inductor blob: the compiled model reads {missing[0]!r}, which its table does not name")
        constants = {name: tensor for name, tensor in constants.items() if name in declared}
        if constants:
            # User-managed: the compiled model reads these tensors (views of the file) in place.
            runner.load_constants(constants, check_full_update=True, user_managed=True)
        return _Compiled(runner, constants)

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        return handle(inputs)


def _package(program: ExportedProgram, store: NamedDataStore, where: str) -> bytes:
    """The sub-program compiled by AOTInductor, packed with its weight table (the weights go to ``store``)."""
    if any(s.kind == OutputKind.BUFFER_MUTATION for s in program.graph_signature.output_specs):
        raise PreprocessError(
            f"inductor: {where} writes a buffer it owns; leave mutable buffers with the program "
            "(do not tag them) so that the runtime keeps them"
        )
    # A copy (the sub-program stays as it was given), its state named as AOTInductor can read it.
    compilable, _ = with_identifier_state_names(copy_program(program))
    tensors = weight_table(compilable, store, where)
    with tempfile.TemporaryDirectory() as directory:
        package = Path(directory) / "partition.pt2"
        try:
            compilable.example_inputs = (_example_inputs(program), {})
            torch._inductor.aoti_compile_and_package(
                compilable, package_path=str(package), inductor_configs={**_CONFIG, "cpp.threads": _threads()}
            )
        except Exception as e:
            raise PreprocessError(f"inductor: {where}: AOTInductor failed to compile: {e}") from e
        compiled = _compact_package(package, Path(directory))
    return pack({"version": BLOB_VERSION, "tensors": tensors}, compiled)


def _compact_package(package: Path, scratch: Path) -> bytes:
    """The package's bytes with what loading never reads left out, the same for the same code.

    Its C++ sources go (AOTInductor appends each compile's commands and paths to them), its
    libraries lose their debug information and static symbol table, and its serialization id
    (random at every compile) becomes a digest of the rest. The weights are named data, so a
    package holds code, and three quarters of a compiled library is debug information: a small
    graph's package goes from 1.5 MB to about 0.13 MB. Without ``strip`` (binutils) the
    libraries are kept whole.
    """
    strip = shutil.which("strip")
    entries: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(package) as original:
        for entry in original.infolist():
            if entry.filename.endswith(".cpp"):
                continue
            data = original.read(entry)
            if strip is not None and entry.filename.endswith(".so"):
                library = scratch / "library.so"
                library.write_bytes(data)
                stripped = subprocess.run([strip, "--strip-unneeded", str(library)], capture_output=True, timeout=600)
                if stripped.returncode == 0:
                    data = library.read_bytes()
            entries.append((entry, data))
    identity = serialization_id([(entry.filename, data) for entry, data in entries])
    compact = io.BytesIO()
    with zipfile.ZipFile(compact, "w", zipfile.ZIP_DEFLATED) as out:
        for entry, data in entries:
            compact_entry = zipfile.ZipInfo(entry.filename, date_time=entry.date_time)  # as compiled: no clock
            compact_entry.external_attr = entry.external_attr
            if entry.filename.endswith(SERIALIZATION_ID):
                data = identity
            out.writestr(compact_entry, data, compress_type=zipfile.ZIP_DEFLATED)
    return compact.getvalue()


def _size(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 2
    return int(value)


def _example_inputs(program: ExportedProgram) -> tuple[Any, ...]:
    """Inputs of the traced sizes, which AOTInductor asks for (their values do not matter)."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    examples: list[torch.Tensor | int] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        value = placeholders[spec.arg.name].meta.get("val")  # type: ignore[union-attr]
        if isinstance(value, torch.Tensor):
            examples.append(torch.zeros([_size(s) for s in value.shape], dtype=value.dtype))
        else:
            examples.append(_size(value))
    return tuple(examples)


class _Compiled:
    """A loaded AOTInductor model and the constants it reads (kept alive as long as it is)."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor]) -> None:
        self.runner = runner
        self.constants = constants

    def __call__(self, inputs: list[Any]) -> list[torch.Tensor]:
        outputs = self.runner(*inputs)
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


class InductorPartitioner(CapabilityPartitioner):
    """Claims every core-ATen computation (the reference backend's support), for AOTInductor."""

    def __init__(self, compile_specs: list[CompileSpec] | None = None, *, min_partition_size: int = 1) -> None:
        spec = DelegationSpec(InductorBackend.backend_id, list(compile_specs or []))
        super().__init__(self.operator_support, spec, min_partition_size=min_partition_size)

    def operator_support(self, node: Node) -> bool | str:
        """:func:`~torchdelegate.backends.reference.reference_support`; a subclass narrows what it
        claims by overriding this."""
        return reference_support(node)
