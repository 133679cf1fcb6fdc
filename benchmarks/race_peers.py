"""The peers' side of benchmarks/llm_race.py: one phase in this fresh process, its figures printed as JSON.

Runs in a peer's own environment (``.venv-llamacpp`` or ``.venv-genai``, never ours): it imports that
peer's package and the standard library, numpy, and for the tokenizer phase sentencepiece and transformers.

    tokenizer DIR                        a SentencePiece BPE tokenizer trained on training/botchan.txt, as
                                         Llama's (tokenizer.model), and the tokenizer.json that transformers'
                                         fast Llama tokenizer converts from it, both written into DIR
    llamacpp-converter [DIR]             llama.cpp's convert_hf_to_gguf.py (with the conversion and gguf-py
                                         packages beside it) of the installed llama-cpp-python, taken from
                                         that release's source distribution into DIR (once; default: this
                                         environment's folder); its path
    llamacpp-quantize IN OUT TYPE        llama_cpp.llama_model_quantize, e.g. TYPE Q4_0
    llamacpp-info GGUF                   the file's tensor bytes, and its token embedding's
    llamacpp-run GGUF --ids JSON         load with Llama(...), evaluate the prompt ids, generate greedily
    genai-info DIR                       the ONNX model's initializer bytes, and its token embedding's
    genai-run DIR --ids JSON             og.Model and og.Generator over the prompt ids, greedily
    versions                             the peer's package versions

The peers' perplexity phases (a trained checkpoint's race) are benchmarks/perplexity.py's ``llamacpp`` and
``genai`` sides, run in these environments too: that module imports only the standard library at its top.

A run's figures: ``load_s`` (constructing the model object), ``time_to_first_token_ms`` (the prompt
evaluated and the first token chosen), ``decode_tokens_per_s`` (the tokens after the first, over the
time from the first token to the last), and the generated ``tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "training" / "botchan.txt"


def train_tokenizer(directory: Path) -> dict[str, Any]:
    """Llama's kind of SentencePiece model (BPE, byte fallback), as large a vocabulary as the novel allows."""
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / "tokenizer"
    errors = []
    for size in (32000, 16000, 8000, 4000):
        try:
            spm.SentencePieceTrainer.train(
                input=str(TEXT), model_prefix=str(prefix), model_type="bpe", vocab_size=size,
                byte_fallback=True, split_digits=True, character_coverage=1.0, add_dummy_prefix=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, minloglevel=2,
            )  # fmt: skip
            break
        except RuntimeError as error:  # "Vocabulary size is too high": the text holds fewer pieces
            errors.append(f"{size}: {str(error).splitlines()[0][:200]}")
    else:
        raise RuntimeError(f"sentencepiece trained no tokenizer: {errors}")
    prefix.with_suffix(".vocab").unlink(missing_ok=True)
    fast = LlamaTokenizerFast.from_pretrained(str(directory), add_bos_token=True, legacy=False)  # converts the .model
    fast.save_pretrained(str(directory))
    return {"vocab_size": len(fast), "refused": errors, "files": sorted(p.name for p in directory.iterdir())}


def llamacpp_converter(directory: Path) -> dict[str, Any]:
    """convert_hf_to_gguf.py of the installed llama-cpp-python's release, from its source distribution."""
    import importlib.metadata
    import subprocess

    version = importlib.metadata.version("llama-cpp-python")
    target = directory / f"llama.cpp-{version}"
    script = target / "convert_hf_to_gguf.py"
    if not script.is_file():
        with tempfile.TemporaryDirectory() as scratch:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*command, "-d", scratch, f"llama-cpp-python=={version}"], check=True, timeout=1800)
            (archive,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(archive) as tar:
                root = tar.getnames()[0].split("/")[0]
                wanted = f"{root}/vendor/llama.cpp/"
                keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
                members = [
                    m for m in tar.getmembers() if m.name.startswith(wanted) and m.name[len(wanted) :].startswith(keep)
                ]
                for member in members:
                    member.name = member.name[len(wanted) :]
                partial = Path(tempfile.mkdtemp(dir=directory, prefix=".partial-"))
                tar.extractall(partial, members=members, filter="data")
            partial.rename(target)
    return {"path": str(script), "version": version}


def _gguf_module(converter: Path) -> Any:
    sys.path.insert(0, str(converter.parent / "gguf-py"))
    import gguf

    return gguf


def llamacpp_info(path: Path, converter: Path) -> dict[str, Any]:
    """The GGUF's tensor bytes, its token embedding's, and each tensor type's count."""
    gguf = _gguf_module(converter)
    reader = gguf.GGUFReader(str(path))
    total = embedding = 0
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        total += int(tensor.n_bytes)
        if tensor.name == "token_embd.weight":
            embedding += int(tensor.n_bytes)
        name = tensor.tensor_type.name
        types[name] = types.get(name, 0) + 1
    return {"tensor_bytes": total, "embedding_bytes": embedding, "tensor_types": types}


def llamacpp_quantize(source: Path, target: Path, kind: str, threads: int) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    started = time.perf_counter()
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if failed:
        raise RuntimeError(f"llama_model_quantize({source}, {kind}) returned {failed}")
    return {"seconds": time.perf_counter() - started, "file_bytes": target.stat().st_size}


def llamacpp_run(path: Path, ids: list[int], new_tokens: int, threads: int, context: int) -> dict[str, Any]:
    """The prompt's ids evaluated in one batch, then ``new_tokens`` chosen greedily (argmax of the logits)."""
    import llama_cpp
    import numpy as np

    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=context, n_batch=context, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    vocab = llm.n_vocab()

    def chosen() -> int:  # the argmax of the last evaluated position's logits (Llama.eval keeps none itself)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    loaded = time.perf_counter()
    llm.eval(ids)
    tokens = [chosen()]
    first = time.perf_counter()
    while len(tokens) < new_tokens:
        llm.eval(tokens[-1:])
        tokens.append(chosen())
    done = time.perf_counter()
    return _figures(started, loaded, first, done, tokens, len(ids))


def genai_info(directory: Path) -> dict[str, Any]:
    """The ONNX model's initializer bytes (inline or external), and the token embedding's."""
    import onnx

    config = json.loads((directory / "genai_config.json").read_text())
    model = onnx.load(str(directory / config["model"]["decoder"]["filename"]), load_external_data=False)
    total = embedding = 0
    kinds: dict[str, int] = {}
    for initializer in model.graph.initializer:
        external = {entry.key: entry.value for entry in initializer.external_data}
        size = int(external["length"]) if "length" in external else len(initializer.raw_data)
        if not size and not external:
            size = onnx.helper.tensor_dtype_to_np_dtype(initializer.data_type).itemsize * _count(initializer.dims)
        total += size
        if "embed_tokens" in initializer.name:
            embedding += size
        kind = onnx.helper.tensor_dtype_to_string(initializer.data_type)
        kinds[kind] = kinds.get(kind, 0) + 1
    operators: dict[str, int] = {}
    for node in model.graph.node:
        operators[node.op_type] = operators.get(node.op_type, 0) + 1
    return {"tensor_bytes": total, "embedding_bytes": embedding, "initializer_types": kinds, "operators": operators}


def _count(dims: Any) -> int:
    count = 1
    for d in dims:
        count *= int(d)
    return count


def genai_run(directory: Path, ids: list[int], new_tokens: int, threads: int, context: int) -> dict[str, Any]:
    """og.Generator over the prompt's ids, greedy, a KV cache of ``context`` positions, no early stop."""
    import onnxruntime_genai as og

    started = time.perf_counter()
    config = og.Config(str(directory))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=context, min_length=context, batch_size=1)
    generator = og.Generator(model, params)
    loaded = time.perf_counter()
    generator.append_tokens(ids)
    generator.generate_next_token()
    tokens = [int(generator.get_next_tokens()[0])]
    first = time.perf_counter()
    while len(tokens) < new_tokens:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    done = time.perf_counter()
    return _figures(started, loaded, first, done, tokens, len(ids))


def _figures(started: float, loaded: float, first: float, done: float, tokens: list[int], prompt: int) -> dict:
    return {
        "load_s": loaded - started,
        "time_to_first_token_ms": (first - loaded) * 1e3,
        "decode_tokens_per_s": (len(tokens) - 1) / (done - first),
        "prompt_tokens": prompt,
        "tokens": tokens,
    }


def versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for name in ("llama-cpp-python", "onnxruntime-genai", "onnxruntime", "torch", "transformers", "sentencepiece"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    phases = parser.add_subparsers(dest="phase", required=True)
    phases.add_parser("tokenizer").add_argument("directory", type=Path)
    phases.add_parser("llamacpp-converter").add_argument("directory", type=Path, nargs="?", default=Path(sys.prefix))
    quantize = phases.add_parser("llamacpp-quantize")
    quantize.add_argument("source", type=Path)
    quantize.add_argument("target", type=Path)
    quantize.add_argument("kind")
    quantize.add_argument("--threads", type=int, default=2)
    info = phases.add_parser("llamacpp-info")
    info.add_argument("path", type=Path)
    info.add_argument("--converter", type=Path, required=True)
    phases.add_parser("genai-info").add_argument("path", type=Path)
    for name in ("llamacpp-run", "genai-run"):
        run = phases.add_parser(name)
        run.add_argument("path", type=Path)
        run.add_argument("--ids", required=True, help="the prompt's token ids, a JSON list")
        run.add_argument("--new-tokens", type=int, default=64)
        run.add_argument("--threads", type=int, default=2)
        run.add_argument("--context", type=int, default=256, help="KV cache positions")
    phases.add_parser("versions")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reads a hub
    if args.phase == "tokenizer":
        result = train_tokenizer(args.directory)
    elif args.phase == "llamacpp-converter":
        result = llamacpp_converter(args.directory)
    elif args.phase == "llamacpp-quantize":
        result = llamacpp_quantize(args.source, args.target, args.kind, args.threads)
    elif args.phase == "llamacpp-info":
        result = llamacpp_info(args.path, args.converter)
    elif args.phase == "genai-info":
        result = genai_info(args.path)
    elif args.phase in ("llamacpp-run", "genai-run"):
        run = llamacpp_run if args.phase == "llamacpp-run" else genai_run
        result = run(args.path, json.loads(args.ids), args.new_tokens, args.threads, args.context)
    else:
        result = versions()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
