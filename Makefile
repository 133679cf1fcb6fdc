# make test: create .venv if missing, install the package with its test extras under the
# pinned torch, run the tests. make demo: the same set-up, then `torchdelegate demo`: a small
# language model lowered to ONNX Runtime, saved, loaded and generating tokens checked against eager.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/torchdelegate demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src

bench: $(STAMP)
	$(PY) benchmarks/lowering.py
	$(PY) benchmarks/runtime.py
	$(PY) benchmarks/backends.py

clean:
	rm -rf $(VENV) .pytest_cache
