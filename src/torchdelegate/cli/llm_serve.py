"""``torchdelegate llm serve FILE``: the file prepared once, then served over OpenAI's HTTP API by
worker processes that each load it as the command line says."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from torchdelegate.cli.command import EXIT_OK, CommandError, UsageError, backend_options, loaded, refuse_directory
from torchdelegate.cli.generated_text import language_model, read_as_text


def llm_serve_command(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the file until SIGTERM or Ctrl-C; the weights are prepared first (in a process of its
    own) so that every worker maps the same packed copy."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CommandError(
            f"llm serve needs the serve extra ({e.name} is missing): pip install 'torchdelegate[serve]'"
        ) from e
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: give 1 or more")
    if args.queue < 0:
        raise UsageError(f"--queue {args.queue}: give 0 or more")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port}: give 0 to 65535")
    from torchdelegate.llm.serving.http_app import listening_socket, serve
    from torchdelegate.llm.serving.worker_pool import WorkerPool, prepared_in_child
    from torchdelegate.llm.serving.worker_process import FileLoad

    refuse_directory(args.file)  # before the port: the mistake to name is the file, not a busy port
    try:
        listening = listening_socket(args.host, args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    _trusted_by_workers(args.trust)
    with (
        listening,
        loaded(args.file, args.external_data, args.trust, args.backend_options) as program,
        read_as_text(),
    ):
        model = language_model(program)
        options = _per_worker_threads(backend_options(args.backend_options), program, args.workers)
        external = None if args.external_data is None else str(args.external_data)
        file = FileLoad(str(args.file), external, options, tuple(args.imports))
        for line in prepared_in_child(file):
            print(line, file=out, flush=True)
        pool = WorkerPool(file, args.workers, args.queue, lambda line: print(line, file=out, flush=True))
        try:
            serve(model, pool, listening, args.api_key or os.environ.get("TORCHDELEGATE_API_KEY") or None, out)
        except RuntimeError as e:
            raise CommandError(str(e)) from e
    return EXIT_OK


def _trusted_by_workers(trust: list[str]) -> None:
    """--trust given to the workers too: they load the file in processes of their own, which trust
    what ``TORCHDELEGATE_TRUSTED_BACKENDS`` names (this process's environment, which they inherit)."""
    from torchdelegate.delegate.trust import TRUSTED_BACKENDS_VARIABLE

    given = [name.strip() for name in os.environ.get(TRUSTED_BACKENDS_VARIABLE, "").split(",") if name.strip()]
    if trust:
        os.environ[TRUSTED_BACKENDS_VARIABLE] = ",".join(dict.fromkeys([*given, *trust]))


def _per_worker_threads(options: dict[str, dict[str, str]], program: Any, workers: int) -> dict[str, dict[str, str]]:
    """``options`` with ONNX Runtime's threads shared out among the workers (the cores over the
    workers, at least one each) unless given, here or in ``TORCHDELEGATE_BACKEND_OPTIONS``: workers that
    each took every core would fight."""
    from torchdelegate.runtime.backend_options import environment_options

    if not any(d.backend_id == "onnxruntime" for d in program.delegates):
        return options
    onnxruntime = dict(options.get("onnxruntime", {}))
    if "intra_op_num_threads" not in environment_options(["onnxruntime"]).get("onnxruntime", {}):
        onnxruntime.setdefault("intra_op_num_threads", str(max(1, (os.cpu_count() or 1) // workers)))
    return {**options, "onnxruntime": onnxruntime}
