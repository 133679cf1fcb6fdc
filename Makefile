# make test: create .venv if missing, install the package with its test extras under the
# pinned torch, run the tests. make docs: the documentation site into docs/_build/html. make demo: the same set-up, then `torchdelegate demo`: a small
# language model lowered to ONNX Runtime, saved, loaded and generating tokens checked against eager.
# make bench: torchdelegate against ExecuTorch on this machine (benchmarks/compare.py); ExecuTorch
# lives in its own .venv-executorch, never a dependency of the package; then benchmarks/llm.py, a 200M-parameter
# Llama on both sides (--size large for 1.1B); then benchmarks/llm_race.py, the same Llama generating with
# torchdelegate, llama.cpp (.venv-llamacpp) and ONNX Runtime GenAI (.venv-genai), peers in their own
# environments too. About an hour and a half. make bench BIG=1 adds benchmarks/bigger_than_ram.py: an 8B-shaped
# checkpoint (it writes ~16 GB, and ~5 GB of program) exported and run on this machine, and the 1.1B beside
# ExecuTorch's llama flow (about an hour more).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXECUTORCH_VENV := .venv-executorch
EXECUTORCH_STAMP := $(EXECUTORCH_VENV)/.installed
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
GENAI_VENV := .venv-genai
GENAI_STAMP := $(GENAI_VENV)/.installed

.PHONY: test demo docs lint bench soak fuzz zoo clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

demo: $(STAMP)
	$(VENV)/bin/torchdelegate demo

# make docs: the site, warnings as errors and every cross-reference checked, into docs/_build/html
docs: $(STAMP)
	$(PY) -m sphinx -b html -W --keep-going -n docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src

$(EXECUTORCH_STAMP): benchmarks/executorch-constraints.txt
	test -x $(EXECUTORCH_VENV)/bin/python || $(PYTHON) -m venv $(EXECUTORCH_VENV)
	$(EXECUTORCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EXECUTORCH_VENV)/bin/python -m pip install --quiet -r benchmarks/executorch-constraints.txt
	touch $(EXECUTORCH_STAMP)

# llama-cpp-python compiles llama.cpp for this CPU (several minutes); its release's convert_hf_to_gguf.py
# comes from the same release's source distribution, into the environment's folder.
$(LLAMACPP_STAMP): benchmarks/llamacpp-constraints.txt
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install --quiet -r benchmarks/llamacpp-constraints.txt
	$(LLAMACPP_VENV)/bin/python benchmarks/race_peers.py llamacpp-converter
	touch $(LLAMACPP_STAMP)

$(GENAI_STAMP): benchmarks/genai-constraints.txt
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GENAI_VENV)/bin/python -m pip install --quiet -r benchmarks/genai-constraints.txt
	touch $(GENAI_STAMP)

bench: $(STAMP) $(EXECUTORCH_STAMP) $(LLAMACPP_STAMP) $(GENAI_STAMP)
	$(PY) benchmarks/compare.py
	$(PY) benchmarks/llm.py --size base
	$(PY) benchmarks/llm.py --size base --quantize 8da4w
	$(PY) benchmarks/llm_race.py --size base
	if [ -n "$(BIG)" ]; then $(PY) benchmarks/bigger_than_ram.py --executorch-python $(EXECUTORCH_VENV)/bin/python; fi

# make soak: the differential property test over many more random programs (about 0.85 s each here).
SOAK_EXAMPLES ?= 5000
soak: $(STAMP)
	TORCHDELEGATE_EXAMPLES=$(SOAK_EXAMPLES) $(PY) -m pytest -q tests/test_differential.py

# make fuzz: atheris over load + run, from real files, for FUZZ_SECONDS; then over crafted graphs of the
# operators a saved graph may call, with hostile arguments (fuzz/residual_ops.py: no crash, no output that depends
# on memory outside the inputs), for FUZZ_SECONDS more; crashes land in fuzz/crashes/
# (make each one a file under tests/serialize/fuzz_regressions/, or a case of tests/serialize/test_operator_contracts.py).
FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,fuzz]'
	$(PY) fuzz/seeds.py fuzz/corpus
	mkdir -p fuzz/crashes
	$(PY) fuzz/load_and_run.py fuzz/corpus -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/crashes/ -rss_limit_mb=4096
	$(PY) fuzz/residual_ops.py --seed-corpus fuzz/corpus_residual --runs 500
	$(PY) -W ignore fuzz/residual_ops.py fuzz/corpus_residual -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/crashes/ -rss_limit_mb=0 -timeout=60 -max_len=256 -len_control=0 -print_final_stats=1

# make zoo: every model of tests/zoo/models.py exported, lowered with reference and with onnxruntime then
# reference, saved, loaded and run in a fresh process, compared with eager; writes docs/zoo.json and docs/ZOO.md.
# ZOO_MODELS picks some (names from the catalogue); ZOO_WORKERS runs models in parallel (at most 2).
ZOO_MODELS ?=
ZOO_WORKERS ?= 2
zoo: $(STAMP)
	$(PY) tests/zoo/run.py --workers $(ZOO_WORKERS) --json docs/zoo.json --markdown docs/ZOO.md $(ZOO_MODELS)

clean:
	rm -rf $(VENV) $(EXECUTORCH_VENV) $(LLAMACPP_VENV) $(GENAI_VENV) .pytest_cache
