"""Loading and closing a program hundreds of times keeps resident memory flat.

In a fresh process: 700 cycles of load, run, close of a small two-method program, the cyclic
garbage each cycle leaves (torch.fx's graphs are cycles of nodes) collected every 50 cycles, so
that what is measured is what stays alive rather than when Python's collector happens to run
(left to itself, it let resident memory climb by about 4 MiB to a plateau, reached by cycle 250
or by cycle 700 depending on how many objects the imports made). The growth from cycle 300 to
cycle 700 must be noise. And torch.fx's cache of generated source must not keep a graph's
source per load: it did, about 27 KiB a cycle, 11 MiB over these 400 cycles.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from models import TinyDecoder, decoder_methods

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner

TESTS = Path(__file__).parent.parent

CYCLES = textwrap.dedent(
    """
    import gc, json, linecache, sys
    import torch, torchdelegate as td

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    tokens, positions = torch.zeros(1, dtype=torch.long), torch.tensor([4])
    marks = {}
    for cycle in range(1, 701):
        with td.load(sys.argv[1]) as program:
            program.run("decode", tokens, positions)
        if cycle % 50 == 0:
            gc.collect()
        if cycle in (300, 700):
            marks[cycle] = {"rss": rss(), "linecache": len(linecache.cache)}
    print(json.dumps(marks))
    """
)


def test_hundreds_of_loads_and_closes_do_not_grow_memory(tmp_path: Path) -> None:
    methods = decoder_methods(TinyDecoder(vocab=16, d=8, max_len=8), prompt_length=4)
    td.to_edge(methods).to_backend(ReferencePartitioner()).save(tmp_path / "d.tdp")
    done = subprocess.run(
        [sys.executable, "-c", CYCLES, str(tmp_path / "d.tdp")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    growth = marks["700"]["rss"] - marks["300"]["rss"]
    assert marks["700"]["linecache"] == marks["300"]["linecache"]
    assert growth < 4 * 2**20, f"resident memory grew {growth / 2**20:.1f} MiB over 400 load/close cycles"
