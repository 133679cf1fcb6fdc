"""The command line: every command, its arguments and their help."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from torchdelegate.cli.command import EXIT_USAGE
from torchdelegate.version import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchdelegate",
        description="Lower torch.export programs to backends, inspect and run the files, or try the demo.",
    )
    parser.add_argument("--version", action="version", version=f"torchdelegate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    lower = commands.add_parser(
        "lower",
        help="lower torch.export files (one per method) and save one program file",
        description="Lower torch.export.save files, one per method, to backends in priority order; save one file.",
    )
    lower.add_argument("methods", nargs="+", metavar="METHOD=FILE.pt2", help="a method name and its exported program")
    lower.add_argument(
        "--backend",
        "-b",
        action="append",
        required=True,
        dest="backends",
        metavar="ID",
        help="a backend, highest priority first (repeat): onnxruntime, inductor, reference, or any installed "
        "backend that proposes a partitioner",
    )
    lower.add_argument("-o", "--output", required=True, type=Path, help="the program file to write")
    lower.add_argument(
        "--compile-spec",
        action="append",
        default=[],
        metavar="ID:KEY=VALUE",
        help="a compile spec for one backend, e.g. onnxruntime:intra_op_num_threads=2 (repeat)",
    )
    lower.add_argument("--min-partition-size", type=int, default=1, metavar="N", help="smallest partition (default 1)")
    lower.add_argument("--html", type=Path, metavar="FILE.html", help="also write the partition report as HTML")
    lower.add_argument("--external-data", type=Path, metavar="FILE", help="put weights in this separate data file")
    _lowering_options(lower)

    inspect = commands.add_parser(
        "inspect", help="describe a program file", description="Describe a program file written by torchdelegate."
    )
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--html", type=Path, metavar="FILE.html", help="write the saved partition report as HTML")
    inspect.add_argument("--report", action="store_true", help="print the saved partition report in full")
    inspect.add_argument(
        "--model-explorer",
        type=Path,
        metavar="DIR",
        help="write the saved report for Google's Model Explorer: the graphs (FILE.json) and node-data "
        "overlays by backend and by partition",
    )
    inspect.add_argument(
        "--open",
        action="store_true",
        help="with --model-explorer: start Model Explorer on loopback with them loaded, until Ctrl-C "
        "(needs torchdelegate[viz])",
    )
    inspect.add_argument(
        "--port", type=int, metavar="N", help="with --open: Model Explorer's port (default: a free one)"
    )

    run = commands.add_parser(
        "run",
        help="run one method of a program file",
        description="Run one method of a program file on inputs from .npy files (or numbers), in call order.",
    )
    run.add_argument("file", type=Path)
    run.add_argument("--method", "-m", default=None, help="the method (default: the only one, or 'forward')")
    run.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        dest="inputs",
        metavar="[NAME=]X.npy|NUMBER",
        help="one input, in call order (repeat); NAME= passes it by keyword",
    )
    run.add_argument("--save", type=Path, metavar="OUT.npz", help="save the outputs as output_0, output_1, ...")

    prepare = commands.add_parser(
        "prepare",
        help="do a program's machine-specific loading work once, so that loads on this machine start faster",
        description="Do once the work a program's backends would repeat at every load because it depends on this "
        "machine (ONNX Runtime optimizes the model and packs the weights for this CPU), and keep it in the machine "
        "cache (TORCHDELEGATE_CACHE, by default ~/.cache/torchdelegate), where later loads on this machine find "
        "it. The file is not changed.",
    )
    prepare.add_argument("file", type=Path)
    cache = commands.add_parser(
        "cache",
        help="show or empty the cache (compiled partitions and prepared programs)",
        description="The one cache both kinds of entries live in: compiled partitions (lower, llm export) and "
        "what prepare keeps for this machine. It is TORCHDELEGATE_CACHE (a directory or an fsspec URL; 'off': "
        "none), by default ~/.cache/torchdelegate, bounded by TORCHDELEGATE_CACHE_MAX_BYTES (16 GiB), least "
        "recently used first.",
    )
    cache.add_argument("action", choices=["info", "clear"], help="info: where it is and what it holds; clear: empty it")
    cache.add_argument("--kind", choices=["compile", "machine"], help="only this kind of entry")
    trust = (
        "run this backend's native code from the file (AOTInductor's compiled libraries: --trust inductor); "
        "without it such delegates are refused. Repeatable; or set TORCHDELEGATE_TRUSTED_BACKENDS to "
        "comma-separated ids"
    )
    for sub in (inspect, run, prepare):
        sub.add_argument("--external-data", type=Path, metavar="FILE", help="where the data file is, if moved")
        sub.add_argument(
            "--trust",
            action="append",
            default=[],
            metavar="BACKEND",
            help="accepted for symmetry with run: inspect never runs a delegate, so needs no trust"
            if sub is inspect
            else trust,
        )

    llm = commands.add_parser(
        "llm",
        help="a transformers checkpoint to one program file, and text generated from it",
        description="Deploy a decoder-only language model: export a local transformers checkpoint (nothing is "
        "downloaded) as prefill + decode over a static KV cache, lower it and save one file that carries its "
        "tokenizer; then generate text from that file.",
    )
    llm_commands = llm.add_subparsers(dest="llm_command", required=True, metavar="COMMAND", parser_class=_Parser)
    export = llm_commands.add_parser(
        "export",
        help="a checkpoint directory to one program file",
        description="Load the checkpoint in DIR (config.json, safetensors weights, tokenizer.json), export prefill "
        "(the prompt) and decode (one token) over a static KV cache, lower them to the backends in "
        "priority order, and save one file with the tokenizer and generation settings.",
    )
    export.add_argument("directory", type=Path, metavar="DIR", help="the checkpoint directory save_pretrained wrote")
    export.add_argument("-o", "--output", required=True, type=Path, help="the program file to write")
    export.add_argument(
        "--backend",
        "-b",
        action="append",
        dest="backends",
        metavar="ID",
        help="a backend, highest priority first (repeat; default: onnxruntime, then reference)",
    )
    export.add_argument(
        "--max-cache",
        type=int,
        metavar="N",
        help="KV cache positions: prompt and generated tokens (default 256, or fewer if the model has fewer positions)",
    )
    export.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="export prefill for exactly N tokens, read a prompt N at a time (for backends that need static "
        "shapes); default: prefill takes a prompt of any length up to the cache",
    )
    _lowering_options(export)
    generate = llm_commands.add_parser(
        "generate",
        help="generate text from a program llm export wrote",
        description="Generate text after a prompt, printing it as it comes, then the time to first token and the "
        "speeds.",
    )
    generate.add_argument("file", type=Path)
    generate.add_argument("--prompt", "-p", required=True, help="the text to continue")
    generate.add_argument(
        "--chat", action="store_true", help="the prompt is a user's message: apply the checkpoint's chat template"
    )
    chat = llm_commands.add_parser(
        "chat",
        help="talk with a program llm export wrote",
        description="An interactive conversation: each line read is a user's message, answered through the "
        "checkpoint's chat template. The conversation stays in the KV cache; earlier turns are dropped when it "
        "outgrows it. /reset starts over; /exit or the end of input ends.",
    )
    chat.add_argument("file", type=Path)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    for sub, tokens in ((generate, 64), (chat, 256)):
        sub.add_argument(
            "--max-new-tokens", type=int, default=tokens, metavar="N", help=f"at most N tokens (default {tokens})"
        )
        sub.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
        sub.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
        sub.add_argument("--top-p", type=float, metavar="P", help="sample among the most likely tokens up to P")
        sub.add_argument("--seed", type=int, metavar="S", help="the seed of the sampling")
        sub.add_argument("--ids", action="store_true", help="also print the generated token ids")
    for sub in (export, generate, chat):
        sub.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    for sub in (run, prepare, generate, chat):
        sub.add_argument(
            "--backend-option",
            action="append",
            default=[],
            dest="backend_options",
            metavar="ID.KEY=VALUE",
            help="a load-time option of a backend, for this machine (repeat), e.g. onnxruntime.intra_op_num_threads=4",
        )

    demo = commands.add_parser(
        "demo",
        help="lower, save, load and run a small language model, checked against eager",
        description="A small decoder-only language model (built in, trained on a public-domain novel) as prefill + "
        "decode with a KV cache: lowered to ONNX Runtime with reference as fallback, saved, loaded, generating "
        "tokens checked against eager torch.",
    )
    demo.add_argument("--tokens", type=int, default=80, metavar="N", help="tokens to generate (default 80)")
    demo.add_argument("--output-dir", type=Path, metavar="DIR", help="keep the program file and report here")
    demo.add_argument("--rounds", type=int, default=3, metavar="R", help="timing rounds, median taken (default 3)")
    demo.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="instead, write the demo model as a transformers checkpoint (GPT-2, byte-level tokenizer) in DIR, "
        "for torchdelegate llm export",
    )

    for sub in (lower, inspect, run, prepare):
        sub.add_argument(
            "--import",
            action="append",
            default=[],
            dest="imports",
            metavar="MODULE",
            help="import this module before reading the files (repeat; the current directory is searched last): "
            "the one that registers the programs' output types or custom operators, e.g. "
            "transformers.modeling_outputs",
        )
    for sub in (lower, inspect, run, prepare, demo):
        sub.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    return parser


def _lowering_options(parser: argparse.ArgumentParser) -> None:
    """--cache, --quantize (--group-size, --keep-float), --jobs and --cluster: for lower and llm export."""
    parser.add_argument(
        "--cache",
        metavar="DIR",
        help="keep compiled partitions in this compile cache (a directory or fsspec URL; 'off': none); "
        "default: TORCHDELEGATE_CACHE, else ~/.cache/torchdelegate",
    )
    parser.add_argument(
        "--quantize",
        choices=["8da4w", "int4", "int8"],
        help="quantize linear layers with torchao first: 8da4w (int8 dynamic activations, int4 weights in groups), "
        "int4 or int8 (weights only); needs torchao",
    )
    parser.add_argument(
        "--group-size", type=int, metavar="N", help="--quantize: inputs per scale (default 32; int8: one per row)"
    )
    parser.add_argument(
        "--keep-float",
        action="append",
        default=[],
        metavar="PATTERN",
        help="--quantize: leave in float the layers whose weight or module path matches (fnmatch), e.g. lm_head",
    )
    parser.add_argument("--jobs", "-j", type=int, metavar="N", help="compile partitions on N worker processes")
    parser.add_argument(
        "--cluster", metavar="tcp://HOST:PORT", help="compile partitions on the Dask cluster with this scheduler"
    )
