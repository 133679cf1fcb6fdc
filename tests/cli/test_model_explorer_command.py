"""``torchdelegate inspect FILE --model-explorer DIR --open``: Model Explorer started on loopback with
the report's graphs and overlays, shown by its own web app, and stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from chromium import Chromium, chromium_path
from loopback import free_port
from models import layered_program

from torchdelegate.cli import main


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


@pytest.mark.timeout(300)
def test_open_serves_the_files_on_loopback_and_model_explorers_app_shows_them(tmp_path: Path) -> None:
    program = layered_program(tmp_path / "layered.tdp")
    port = free_port()
    command = [sys.executable, "-m", "torchdelegate.cli", "inspect", str(program)]
    command += ["--model-explorer", str(tmp_path / "me"), "--open", "--port", str(port)]
    env = {**os.environ, "BROWSER": "true", "PYTHONUNBUFFERED": "1"}  # open nothing; lines as printed
    # Ctrl-C reaches the command as at a terminal, whatever this worker process inherited: a child
    # started where SIGINT is ignored ignores it too, and Python then installs no KeyboardInterrupt.
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    printed = ""
    try:
        assert server.stdout is not None
        while "Press Ctrl+C to stop" not in printed:
            line = server.stdout.readline()
            assert line, printed
            printed += line
        assert f"Model Explorer: http://127.0.0.1:{port}/ with layered.json" in printed
        assert _get(f"http://127.0.0.1:{port}/check_health") == "model_explorer_ok"
        url = re.search(rf"http://127\.0\.0\.1:{port}/\?data=\S+", printed)
        assert url is not None
        data = json.loads(urllib.parse.unquote(url.group(0).split("data=", 1)[1]))
        files = [data["models"][0]["url"], *data["nodeData"]]
        assert [Path(f).name for f in files] == ["layered.json", "layered.backends.json", "layered.partitions.json"]
        for file in files:
            query = urllib.parse.urlencode({"path": file})
            served = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/read_text_file?{query}"))
            assert served == {"content": Path(file).read_text()}
        if chromium_path() is not None:
            _model_explorer_app_shows(url.group(0), tmp_path)
        with pytest.raises(OSError):
            socket.create_connection((_other_address(), port), timeout=2).close()  # loopback only
    finally:
        server.send_signal(signal.SIGINT)
        try:
            rest, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert server.returncode == 0, printed + rest
    assert "Stopping server" in rest


def _other_address() -> str:
    """An address of this machine that is not loopback (the one a route to the outside would use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            address = probe.getsockname()[0]
        except OSError:
            pytest.skip("this machine has no address but loopback")
    if address.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    return str(address)


def _model_explorer_app_shows(url: str, tmp_path: Path) -> None:
    """Model Explorer's own web app loads the graph and both overlays: its node data table lists our
    nodes with their backend and partition."""
    with Chromium(webgl=True) as browser:
        browser.open(url, ready="document.body.innerText.includes('reference_0')")
        text = browser.evaluate("document.body.innerText")
        assert "forward" in text and "18 nodes" in text
        assert "backend" in text and "partition" in text and "not delegated" in text
        browser.screenshot(tmp_path / "model-explorer.png")
        errors = [e for e in browser.errors if "ERR_NAME_NOT_RESOLVED" not in e]  # its check for a newer version
        assert errors == []


def test_a_port_in_use_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = layered_program(tmp_path / "layered.tdp")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["inspect", str(program), "--model-explorer", str(tmp_path / "me"), "--open", "--port", str(port)]
        assert main(args) == 1
    assert f"--port {port}: Address already in use; choose another" in capsys.readouterr().err
    assert main([*args[:-1], "70000"]) == 2
    assert "a port is 1 to 65535" in capsys.readouterr().err
    assert main(["inspect", str(program), "--port", "8080"]) == 2
    assert "--open and --port go with --model-explorer DIR" in capsys.readouterr().err
    assert main(["inspect", str(program), "--model-explorer", str(tmp_path / "me"), "--port", "8080"]) == 2
    assert "--port is Model Explorer's port: it goes with --open" in capsys.readouterr().err


def test_open_without_model_explorer_installed_says_how_to_install_it(tmp_path: Path) -> None:
    """A process where ``import model_explorer`` fails, as where the viz extra is not installed."""
    program = layered_program(tmp_path / "layered.tdp")
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "model_explorer.py").write_text("raise ImportError('not installed here')\n")
    command = [sys.executable, "-m", "torchdelegate.cli", "inspect", str(program)]
    command += ["--model-explorer", str(tmp_path / "me"), "--open"]
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "--open needs Google's Model Explorer: pip install 'torchdelegate[viz]'" in result.stderr
    assert (tmp_path / "me" / "layered.json").exists()  # the files are written all the same
