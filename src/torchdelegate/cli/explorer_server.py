"""``inspect --model-explorer DIR --open``: Google's Model Explorer serving a report's graphs and overlays.

Model Explorer (the ``viz`` extra, ``ai-edge-model-explorer``) is a local web server; it serves on
loopback only, since it reads any file a request names, and runs until Ctrl-C.
"""

from __future__ import annotations

import importlib
import socket
from typing import Any, TextIO

from torchdelegate.cli.command import CommandError, UsageError
from torchdelegate.report.model_explorer import ModelExplorerFiles

LOOPBACK = "127.0.0.1"


def serve_model_explorer(files: ModelExplorerFiles, port: int | None, out: TextIO) -> None:
    """Start Model Explorer on ``port`` (a free one when None) with the graphs and both overlays loaded."""
    try:
        import model_explorer
    except ImportError as error:
        raise CommandError(
            "--open needs Google's Model Explorer: pip install 'torchdelegate[viz]' "
            f"(or open {files.graphs} in a Model Explorer you have)"
        ) from error
    port = _free_port() if port is None else _unused(port)
    _without_update_check()
    config = model_explorer.config().add_model_from_path(str(files.graphs.resolve()))
    for overlay in files.node_data:
        config.add_node_data_from_path(str(overlay.resolve()))
    where = f"http://{LOOPBACK}:{port}/"
    print(f"Model Explorer: {where} with {files.graphs.name} and its overlays (Ctrl-C stops it)", file=out)
    out.flush()
    model_explorer.visualize_from_config(config, host=LOOPBACK, port=port)


def _without_update_check() -> None:
    """Model Explorer asks pypi.org for a newer version of itself, with no timeout, from a thread the
    process waits for at exit: offline, or where the network drops the request, Ctrl-C then never ends
    the command. A loopback server of local files has no reason to reach the internet: the check is off."""
    server: Any = importlib.import_module("model_explorer.server")
    if callable(getattr(server, "_check_new_version", None)):
        server._check_new_version = _no_update_check


def _no_update_check(print_msg: bool = True) -> dict[str, str]:
    del print_msg
    return {"version": "", "runningVersion": "", "releaseUrl": "", "desktopAppUrl": ""}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _unused(port: int) -> int:
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: a port is 1 to 65535")
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError as error:
            raise CommandError(
                f"--port {port}: {error.strerror}; choose another, or leave --port out for a free one"
            ) from error
    return port
