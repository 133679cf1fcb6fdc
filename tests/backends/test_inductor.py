"""The AOTInductor backend (compiles take tens of seconds: two tests compile)."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from backends_for_tests import every_op
from models import ReadThenWrite, TinyDecoder, decoder_methods

import torchdelegate as td
from torchdelegate.backends.blob import pack, unpack
from torchdelegate.backends.inductor import BLOB_VERSION, InductorBackend, InductorPartitioner
from torchdelegate.cache.compile_cache import ENTRIES
from torchdelegate.cache.compiled_entry import decode, encode
from torchdelegate.cache.entry_signature import KEY_VARIABLE
from torchdelegate.delegate.trust import trusting

needs_a_compiler = pytest.mark.skipif(not InductorBackend.is_available(), reason="no C++ compiler for AOTInductor")


@needs_a_compiler
def test_two_methods_compiled_ahead_of_time_share_their_constants_and_match_eager(tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = TinyDecoder(vocab=64, d=32, max_len=16)
    lowered = td.to_edge(decoder_methods(model, prompt_length=4)).to_backend(InductorPartitioner())
    assert {m: [d.backend_id for d in ds] for m, ds in lowered.delegates().items()} == {
        "prefill": ["inductor"],
        "decode": ["inductor"],
    }
    assert lowered.named_data_summary().unique_bytes <= model.weight_bytes() * 1.01  # once for both methods
    lowered.save(tmp_path / "compiled.tdp")
    code = (tmp_path / "compiled.tdp").stat().st_size - model.weight_bytes()
    if shutil.which("strip"):  # without it the libraries keep their debug information
        assert code < 2 * 200 * 1024, f"{code} bytes besides the weights for two compiled methods"  # 1.5 MB each whole

    torch.manual_seed(7)
    eager = TinyDecoder(vocab=64, d=32, max_len=16)
    prompt, positions = torch.tensor([3, 1, 4, 1]), torch.arange(4)
    with pytest.raises(td.UntrustedCodeError, match=r"backend 'inductor' runs native code .* --trust inductor"):
        td.load(tmp_path / "compiled.tdp")  # a compiled library from a file: not without the caller's word
    with td.load(tmp_path / "compiled.tdp", trusted_backends=["inductor"]) as program, torch.no_grad():
        torch.testing.assert_close(program.run("prefill", prompt, positions), eager(prompt, positions))
        for step, token in enumerate((5, 9, 2)):
            args = (torch.tensor([token]), torch.tensor([4 + step]))
            torch.testing.assert_close(program.run("decode", *args), eager(*args))
        prefill, decode = (program._delegates[i]._handle for i in range(2))
        # The same weight, the same memory, for both compiled methods: user-managed constants over the file.
        for name in ("embed.weight", "qkv.weight", "head.weight"):
            assert prefill.constants[name].data_ptr() == decode.constants[name].data_ptr()


@needs_a_compiler
def test_a_plain_sequential_runs_from_the_file_though_its_small_constants_are_built_into_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, "the team's key, shared by every writer")
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    cache = td.CompileCache(tmp_path / "shared")
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), torch.randn(2, 8)
    with td.preprocessing(cache=cache):
        lowered = td.to_edge_transform_and_lower(torch.export.export(model, (x,)), partitioner=[InductorPartitioner()])
    lowered.save(tmp_path / "m.tdp")  # the bias (8 floats) is compiled in: the model asks only for the weight
    (delegate,) = lowered.delegates()["forward"]
    _check_blob_refuses_what_init_should_not_load(delegate)
    # The same partition's entry, unsigned (as anyone who can write the shared cache could put it there).
    (entry,) = cache.store.entries(ENTRIES)
    unsigned = encode(decode(bytes(cache.store.read(ENTRIES, entry.key, "entry") or b"")))
    cache.store.publish(ENTRIES, entry.key, {"entry": unsigned})
    with td.load(tmp_path / "m.tdp", trusted_backends=["inductor"]) as program, torch.no_grad():
        torch.testing.assert_close(program.run("forward", x), model(x))
    with torch.no_grad():
        torch.testing.assert_close(lowered.exported_program().module()(x), model(x))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker of a pool of several sets it: the code is compiled for the machine
    try:  # trusted, yet not from an entry the key did not sign: compiled again
        with (
            td.preprocessing(cache=cache, trusted_backends=["inductor"]),
            pytest.warns(UserWarning, match="not signed"),
        ):
            program = torch.export.export(model, (x,))
            again = td.to_edge_transform_and_lower(program, partitioner=[InductorPartitioner()])
    finally:
        torch.set_num_threads(threads)
    assert [d.meta["compile_cache"] for d in again.delegates()["forward"]] == ["miss"]
    again.save(tmp_path / "again.tdp")  # no compile command, path, random id or thread count of the process
    assert (tmp_path / "again.tdp").read_bytes() == (tmp_path / "m.tdp").read_bytes()


def _check_blob_refuses_what_init_should_not_load(delegate: td.LoweredBackendModule) -> None:
    """check_blob: the backend trusted, and a package of the form we compile: no other file, no path out of
    its folder, its library a shared object of this machine, its contents as compiled."""
    named = td.NamedDataMap(delegate.named_data_store_output)
    header, package = unpack(memoryview(delegate.processed_bytes), BLOB_VERSION, "inductor")
    InductorBackend.check_blob(memoryview(delegate.processed_bytes), [], named)  # trust: this process's own
    with trusting(frozenset()), pytest.raises(td.UntrustedCodeError, match=r"backend 'inductor' runs native code"):
        InductorBackend.check_blob(memoryview(delegate.processed_bytes), [], named)

    def rebuilt(change: Any) -> memoryview:
        original, out = zipfile.ZipFile(io.BytesIO(bytes(package))), io.BytesIO()
        with zipfile.ZipFile(out, "w") as archive:
            for name, data in (pair for i in original.infolist() for pair in change(i.filename, original.read(i))):
                archive.writestr(name, data)
        return memoryview(pack(header, out.getvalue()))

    library = ".so"
    for change, refusal in [
        (lambda n, d: [(n, d), (n + ".py", b"")] if n.endswith(library) else [(n, d)], r"which no compiled package"),
        (lambda n, d: [(n.replace("/data/", "/../data/"), d)], r"reaches outside its folder"),
        (lambda n, d: [(n, b"#!/bin/sh" + d if n.endswith(library) else d)], r"is not an ELF library"),
        (lambda n, d: [(n, d[:-4] + b"evil" if n.endswith(library) else d)], r"serialization id is not the digest"),
    ]:
        with pytest.raises(td.FormatError, match=refusal):
            InductorBackend.check_blob(rebuilt(change), [], named)


def test_a_partition_owning_a_buffer_it_writes_is_refused_before_compiling() -> None:
    edge = td.to_edge(torch.export.export(ReadThenWrite(), (torch.randn(4),)))
    with pytest.raises(
        td.PreprocessError,
        match=r"inductor: partition '\w+' of method 'forward' writes a buffer it owns; leave mutable",
    ):
        edge.to_backend(every_op("inductor", "b_state"))


def test_a_broken_toolchain_is_a_preprocess_error_naming_the_partition() -> None:
    class Sine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) + 1

    edge = td.to_edge(torch.export.export(Sine(), (torch.randn(3),)))
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false")}):
        with pytest.raises(
            td.PreprocessError,
            match=r"inductor: partition '\w+' of method 'forward': AOTInductor failed to compile: InvalidCxxCompiler",
        ):
            edge.to_backend(every_op("inductor"))
