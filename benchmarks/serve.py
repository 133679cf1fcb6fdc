"""`torchdelegate llm serve` under load, beside llama.cpp's server on the same checkpoint.

The 200M Llama of ``benchmarks/llm_race.py`` (random weights, fp32 safetensors), as deployers get it:

- ours: ``llm export`` (fp32) and ``llm export --quantize 8da4w``, served by ``llm serve`` with its
  defaults (the unloaded time to first token), then with ``--workers 2`` and ``--workers N``;
- llama.cpp: llama.cpp's own ``convert_hf_to_gguf.py`` (F32, and Q4_0 by ``llama-quantize``, as
  ``llm_race.py`` builds them), served by llama-cpp-python's OpenAI server (``python -m
  llama_cpp.server``, which runs one request at a time) in ``.venv-llamacpp``.

Each server is a fresh process on loopback; clients are threads speaking HTTP. Per server: the time
to first token of a 32-token prompt, unloaded (median of 5); one stream's decode speed and two
concurrent streams' (128 tokens each, greedy); then N clients asking without pause for a bounded
time (requests/s, generated tokens/s, time to first token p50/p99); the total PSS of the server's
processes (``/proc/PID/smaps_rollup``) after the load, over the weights' bytes. Last, a resilience
run of ours: clients for 60 s with a worker killed in the middle: every request must get an answer
(text, or an error body), and the server must answer ``/health`` after.

    python benchmarks/serve.py [--work DIR] [--checkpoint DIR] [--seconds 30] [--clients 4]

Writes ``benchmarks/results/<date>-serve.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from instruments import descendants, processes_bytes  # noqa: E402
from llm_race import LLAMACPP, PEERS, machine, timed, wait_idle  # noqa: E402
from results import written  # noqa: E402

OURS = str(Path(sys.executable).parent / "torchdelegate")
PROMPT = (
    "Once upon a time in a small village by the sea there lived an old fisherman who every morning "
    "walked to the harbour and looked at the boats"
)
STARTUP_SECONDS = 300
FIRST_WORDS = ["Yesterday", "Long ago", "Far away", "Somewhere", "Meanwhile"]
DECODE_TOKENS = 128


# ---------------------------------------------------------------- clients


def stream_completion(port: int, prompt: str, max_tokens: int, model: str, timeout: float = 300) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request: time to the first text, the chunks of text, how it ended."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first, chunks, error, counted = None, 0, None, None
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": response.read().decode(errors="replace")[:300]}
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"].get("message", str(event["error"]))
                continue
            if event.get("usage"):
                counted = event["usage"].get("completion_tokens")
            choices = event.get("choices") or []
            if choices and first is None:  # the first token's chunk (its text may be held back: the finish)
                first = time.perf_counter()
            if any(choice.get("text") for choice in choices):
                chunks += 1
    except (OSError, http.client.HTTPException) as e:
        return {"status": 0, "error": f"{type(e).__name__}: {e}"}
    finally:
        connection.close()
    done = time.perf_counter()
    result: dict[str, Any] = {"status": 200, "tokens": counted if counted is not None else chunks}
    result |= {"wall_s": done - started, "done_at": done}
    if first is not None:
        result |= {"ttft_s": first - started, "decode_s": done - first, "first_at": first}
    if error is not None:
        result["error"] = error
    return result


def unloaded_ttft(port: int, model: str) -> float:
    """The median time to first token of prompts sent one after another, after one to warm up: each
    differs from its first word on, so no cached prefix (both servers reuse one) shortens it."""
    stream_completion(port, PROMPT, 8, model)
    return statistics.median(stream_completion(port, f"{word} {PROMPT}", 1, model)["ttft_s"] for word in FIRST_WORDS)


def get(port: int, path: str) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    except (OSError, http.client.HTTPException, ValueError):
        return 0, None
    finally:
        connection.close()


def concurrently(count: int, work: Any) -> list[Any]:
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        results[index] = work(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def load(port: int, model: str, clients: int, seconds: float, during: Any = None) -> dict[str, Any]:
    """``clients`` threads each asking without pause for ``seconds``; ``during()`` runs halfway."""
    ends = time.perf_counter() + seconds
    outcomes: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        while time.perf_counter() < ends:
            outcome = stream_completion(port, PROMPT, 64, model)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    if during is not None:
        time.sleep(seconds / 2)
        during()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    answered = [o for o in outcomes if o["status"] == 200 and "error" not in o]
    ttfts = sorted(o["ttft_s"] for o in answered if "ttft_s" in o)
    return {
        "clients": clients,
        "wall_s": wall,
        "requests": len(outcomes),
        "succeeded": len(answered),
        "errors": [o.get("error", "")[:160] for o in outcomes if o not in answered],
        "lost": sum(1 for o in outcomes if o["status"] == 0),
        "requests_per_s": len(answered) / wall,
        "tokens_per_s": sum(o["tokens"] for o in answered) / wall,
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p99_s": _quantile(ttfts, 0.99),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ---------------------------------------------------------------- servers


class Server:
    """A server process on a free loopback port, and its process tree's PSS."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            status, _ = get(port, "/v1/models")
            if status == 200:
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{command[:3]} did not start: {''.join(self.output)[-2000:]}")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def tree(self) -> list[int]:
        return sorted(descendants(self.process.pid))

    def pss_bytes(self) -> int:
        return processes_bytes(self.tree(), "smaps_rollup", "Pss:")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.checkpoint = Path(args.checkpoint) if args.checkpoint else self.work / "checkpoint"
        self.env = {**os.environ, "TORCHDELEGATE_CACHE": str(self.work / "cache")}
        self.data: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "builds": {}, "servers": {}}

    def build(self) -> None:
        if not (self.checkpoint / "model.safetensors").is_file():
            command = [sys.executable, str(HERE / "llm_race.py"), "checkpoint", str(self.checkpoint), "base"]
            subprocess.run(command, check=True, timeout=1800)
            subprocess.run(
                [self.args.llamacpp_python, PEERS, "tokenizer", str(self.checkpoint)], check=True, timeout=1800
            )
        ours = {"fp32": [], "8da4w": ["--quantize", "8da4w"]}
        for precision, flags in ours.items():
            path = self.work / f"ours-{precision}.tdp"
            if not path.is_file():
                command = [OURS, "llm", "export", str(self.checkpoint), "-o", str(path), *flags]
                self.data["builds"][f"ours {precision}"] = _figures(timed(command, 3600, env=self.env))
        if self.args.skip_llamacpp:
            return
        found = subprocess.run([self.args.llamacpp_python, PEERS, "llamacpp-converter"], capture_output=True,
                               text=True, check=True, timeout=1800)  # fmt: skip
        converter = json.loads(found.stdout.strip().splitlines()[-1])["path"]
        f32 = self.work / "llamacpp-F32.gguf"
        if not f32.is_file():
            command = [self.args.llamacpp_python, converter, str(self.checkpoint), "--outtype", "f32", "--outfile",
                       str(f32)]  # fmt: skip
            self.data["builds"]["llama.cpp F32"] = _figures(timed(command, 3600, env={"HF_HUB_OFFLINE": "1"}))
        q4 = self.work / "llamacpp-Q4_0.gguf"
        if not q4.is_file():
            command = [self.args.llamacpp_python, PEERS, "llamacpp-quantize", str(f32), str(q4), "Q4_0"]
            self.data["builds"]["llama.cpp Q4_0"] = _figures(timed(command, 3600))

    def sides(self) -> list[tuple[str, Path]]:
        chosen = [("ours fp32", self.work / "ours-fp32.tdp"), ("ours 8da4w", self.work / "ours-8da4w.tdp")]
        if not self.args.skip_llamacpp:
            chosen += [
                ("llama.cpp F32", self.work / "llamacpp-F32.gguf"),
                ("llama.cpp Q4_0", self.work / "llamacpp-Q4_0.gguf"),
            ]
        return chosen

    def start(self, side: str, path: Path, workers: int | None) -> Server:
        """``side``'s server on ``path``; ours with ``workers`` processes (None: its default)."""
        port = free_port()
        if side.startswith("ours"):
            command = [OURS, "llm", "serve", str(path), "--port", str(port)]
            return Server(command + ([] if workers is None else ["--workers", str(workers)]), port, self.env)
        # Not llama-cpp-python's default: by default a new request interrupts the one running, which then ends
        # with no text; off, requests wait their turn (it serves one at a time).
        command = [self.args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
                   "--port", str(port), "--n_ctx", "256", "--n_threads", str(os.cpu_count() or 1),
                   "--interrupt_requests", "False"]  # fmt: skip
        return Server(command, port)

    def measure(self, side: str, path: Path) -> dict[str, Any]:
        model = path.stem if side.startswith("ours") else str(path)
        figures: dict[str, Any] = {"file_bytes": path.stat().st_size, "idle": wait_idle(self.args.idle_wait)}
        server = self.start(side, path, None)
        try:
            figures["ttft_unloaded_s"] = unloaded_ttft(server.port, model)
        finally:
            server.stop()
        server = self.start(side, path, 2)
        try:
            figures["ttft_unloaded_2_workers_s"] = unloaded_ttft(server.port, model)
            one = [stream_completion(server.port, PROMPT, DECODE_TOKENS, model) for _ in range(3)]
            figures["one_stream_tokens_per_s"] = statistics.median(_decode_speed([o]) for o in one)
            two = [concurrently(2, lambda i: stream_completion(server.port, PROMPT, DECODE_TOKENS, model))
                   for _ in range(3)]  # fmt: skip
            figures["two_streams_tokens_per_s"] = statistics.median(_decode_speed(pair) for pair in two)
        finally:
            server.stop()
        workers = self.args.workers
        server = self.start(side, path, workers)
        try:
            figures["workers"] = workers
            figures["pss_idle_bytes"] = server.pss_bytes()
            figures["load"] = load(server.port, model, self.args.clients, self.args.seconds)
            figures["pss_bytes"] = server.pss_bytes()
        finally:
            server.stop()
        return figures

    def resilience(self) -> dict[str, Any]:
        path = self.work / "ours-fp32.tdp"
        server = self.start("ours fp32", path, 2)
        try:
            killed: list[int] = []

            def kill_a_worker() -> None:
                workers = [p for p in server.tree() if p != server.process.pid and b"spawn_main" in
                           Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
                if workers:
                    os.kill(workers[0], signal.SIGKILL)
                    killed.append(workers[0])

            figures = load(server.port, path.stem, self.args.clients, 60.0, during=kill_a_worker)
            time.sleep(2)
            status, health = get(server.port, "/health")
            figures |= {"killed": len(killed), "health_status": status, "health": health}
            return figures
        finally:
            server.stop()

    def __call__(self) -> None:
        self.data["machine"] = machine(self.args)
        self.build()
        for side, path in self.sides():
            print(f"measuring {side}", flush=True)
            self.data["servers"][side] = self.measure(side, path)
            weights = self.weights(side, path)
            self.data["servers"][side]["weights_bytes"] = weights
        print("resilience", flush=True)
        self.data["resilience"] = self.resilience()
        self.data["generate_ttft_s"] = self.generate_ttft()

    def weights(self, side: str, path: Path) -> int:
        """The bytes of weights the file holds (the file, less its tokenizer and settings)."""
        return path.stat().st_size

    def generate_ttft(self) -> dict[str, float]:
        """``llm generate``'s own time to first token on the same prompt, warm: its generator in one
        process, the second generation timed (median of 3 fresh processes)."""
        script = (
            "import sys, torchdelegate as td\n"
            "from torchdelegate.llm.language_model import LanguageModel\n"
            "with td.load(sys.argv[1]) as program:\n"
            "    model = LanguageModel(program)\n"
            "    prompt = model.encode(sys.argv[2])\n"
            "    model.generator().generate(prompt, 2)\n"
            "    print(model.generator().generate(prompt, 1).stats.time_to_first_token)\n"
        )
        found: dict[str, float] = {}
        for precision in ("fp32", "8da4w"):
            times = []
            for _ in range(3):
                prompt = f"{FIRST_WORDS[0]} {PROMPT}"  # as long as the server's unloaded prompts
                command = [sys.executable, "-c", script, str(self.work / f"ours-{precision}.tdp"), prompt]
                done = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=600, check=True)
                times.append(float(done.stdout.strip().splitlines()[-1]))
            found[precision] = statistics.median(times)
        return found


def _decode_speed(streams: list[dict[str, Any]]) -> float:
    """Tokens generated after each stream's first, per second from the earliest first token to the last
    stream's end: for a server that runs one request at a time, the second waits inside that span."""
    tokens = sum(max(o.get("tokens", 0) - 1, 0) for o in streams)
    starts = [o["first_at"] for o in streams if "first_at" in o]
    window = max(o["done_at"] for o in streams) - min(starts) if starts else 0.0
    return tokens / window if window > 0 else 0.0


def _figures(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: figures.get(k) for k in ("wall_s", "peak_rss_bytes", "others_busy")}


def page(data: dict[str, Any]) -> list[str]:
    m = data["machine"]
    peers = ", ".join(f"{k} {json.dumps(v, sort_keys=True)}" for k, v in m.items() if isinstance(v, dict))
    lines = [
        f"# `llm serve` beside llama.cpp's server — {data['date']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; Python {m['python']}, torch {m['torch']}, "
        f"onnxruntime {m['onnxruntime']}, torchdelegate {m['torchdelegate commit']}; peers: {peers}",
        "",
        "| server | file MB | TTFT unloaded ms | TTFT unloaded, 2 workers | 1 stream tok/s | 2 streams tok/s | "
        "ratio | workers | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | PSS ÷ weights | PSS GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side, f in data["servers"].items():
        load_ = f["load"]
        ratio = f["two_streams_tokens_per_s"] / f["one_stream_tokens_per_s"] if f["one_stream_tokens_per_s"] else 0
        lines.append(
            f"| {side} | {f['file_bytes'] / 1e6:.0f} | {f['ttft_unloaded_s'] * 1e3:.1f} | "
            f"{f['ttft_unloaded_2_workers_s'] * 1e3:.1f} | "
            f"{f['one_stream_tokens_per_s']:.1f} | {f['two_streams_tokens_per_s']:.1f} | {ratio:.2f} | "
            f"{f['workers']} | {load_['requests_per_s']:.2f} | {load_['tokens_per_s']:.1f} | "
            f"{_ms(load_['ttft_p50_s'])} | {_ms(load_['ttft_p99_s'])} | {f['pss_bytes'] / f['weights_bytes']:.2f} | "
            f"{f['pss_bytes'] / 1e9:.2f} |"
        )
    r = data["resilience"]
    lines += [
        "",
        "llama.cpp: llama-cpp-python's server with `--interrupt_requests False` (its default lets a new request "
        "interrupt the one running, which then ends with no text); it runs one request at a time. Ours: `llm serve` "
        "with its defaults (one worker, every core) for the first unloaded figure, then `--workers 2` (the second "
        "unloaded figure and the streams) and `--workers 4` (the load); ONNX Runtime's threads are shared out among "
        "the workers, 1 each at 2 and 4 here. Time to first token unloaded: 5 prompts that differ from their first "
        "word, so no server reads them from a cached prefix. Two streams: tokens after each first one, over the span "
        "from the earlier first token to the later end.",
        "`llm generate`'s time to first token on the same prompt (its generator warm, 2 threads): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in data["generate_ttft_s"].items()),
        "",
        f"Resilience (ours fp32, 2 workers, {r['clients']} clients for 60 s, {r['killed']} worker killed at 30 s): "
        f"{r['requests']} requests, {r['succeeded']} answered with text, {len(r['errors'])} with an error body, "
        f"{r['lost']} lost; /health after: {r['health_status']} {json.dumps(r['health'])}.",
        "",
        "Errors seen: " + ("; ".join(sorted(set(r["errors"]))) or "none"),
        "",
    ]
    return lines


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "torchdelegate-serve-bench"))
    parser.add_argument("--checkpoint", help="the 200M checkpoint llm_race.py wrote (default: write one in --work)")
    parser.add_argument("--seconds", type=float, default=30.0, help="the load phase's length")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4, help="our workers in the load phase")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--llamacpp-python", default=str(HERE.parent / ".venv-llamacpp" / "bin" / "python"))
    parser.add_argument("--genai-python", default=str(HERE.parent / ".venv-genai" / "bin" / "python"))
    parser.add_argument("--executorch-python", default=str(HERE.parent / ".venv-executorch" / "bin" / "python"))
    parser.add_argument("--idle-wait", type=float, default=60.0)
    args = parser.parse_args()
    args.tools = [] if args.skip_llamacpp else [LLAMACPP]  # the peers whose versions the page records
    run = Run(args)
    run()
    path = written(HERE / "results", f"{run.data['date']}-serve", run.data, page(run.data))
    print(path.read_text())


if __name__ == "__main__":
    main()
