"""Build the torchdelegate-runtime distribution: the repository's ``src/torchdelegate`` with this
folder's ``pyproject.toml`` (no torch among its dependencies), staged in a directory of its own, since
setuptools builds only what lies under the project's root.

    python packaging/runtime/build_runtime.py --outdir DIR     # the sdist and, built from it, the wheel
    python packaging/runtime/build_runtime.py --stage DIR      # only the staged project, to read or build

Building needs the ``build`` package (``pip install build``); it fetches setuptools as any build does.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STAGED = {HERE / "pyproject.toml": "pyproject.toml", HERE / "README.md": "README.md", ROOT / "LICENSE": "LICENSE"}


def stage(destination: Path) -> Path:
    """``destination`` made a project setuptools builds: this folder's metadata, the license and a copy
    of ``src/torchdelegate`` (caches and compiled files left out). It must not exist yet."""
    destination.mkdir(parents=True)
    for source, name in STAGED.items():
        shutil.copyfile(source, destination / name)
    shutil.copytree(
        ROOT / "src" / "torchdelegate",
        destination / "src" / "torchdelegate",
        ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"),
    )
    return destination


def build(outdir: Path) -> list[Path]:
    """The sdist and the wheel built from it, written to ``outdir``: the paths of both."""
    outdir.mkdir(parents=True, exist_ok=True)
    before = set(outdir.iterdir())
    with tempfile.TemporaryDirectory() as work:
        project = stage(Path(work) / "torchdelegate-runtime")
        done = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(outdir.resolve()), str(project)],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        sys.exit(f"building torchdelegate-runtime failed:\n{done.stdout}{done.stderr}")
    return sorted(set(outdir.iterdir()) - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--outdir", type=Path, help="build the sdist and the wheel into this directory")
    where.add_argument("--stage", type=Path, help="only stage the project into this new directory")
    arguments = parser.parse_args()
    if arguments.stage is not None:
        if arguments.stage.exists():
            parser.error(f"--stage {arguments.stage}: it exists; give a new directory")
        print(stage(arguments.stage))
        return
    for path in build(arguments.outdir):
        print(path)


if __name__ == "__main__":
    main()
