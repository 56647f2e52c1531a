# threed: `make demo` and `make test` set everything up themselves (a venv in .venv, once).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed JIT-compiles a CPU comm op on first use; keep its build cache out of the repo.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/threed/torch_extensions
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test test-slow test-gpu test-slurm bench convert export docs clean gpu-bundle

venv: $(STAMP)
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: it takes the CPU wheel on disk instead of pulling a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	# the eval extra too (lm-eval, for threed eval-harness and its tests)
	$(VENV)/bin/pip install -q --no-build-isolation -e '.[test,eval]' || $(VENV)/bin/pip install -q -e '.[test,eval]'
	touch $(STAMP)

demo: $(STAMP)
	bash tools/demo.sh

# DURATIONS_DIR=dir (`.ci/run` sets it): each test target's pytest also writes every test's time there, as JUnit XML
# named after the target; tools/test_durations.py turns them into docs/performance.md's "Test suite times". Unset (by
# hand), nothing is written.
junit = $(if $(DURATIONS_DIR),--junitxml=$(DURATIONS_DIR)/$(1).xml)

# pytest-xdist workers of `make test` and `make test-slow`: a test module to a worker, every tests/ranks module that asks
# for the rank pool to one (one pool: tests/xdist_scheduling.py), the other tests on the other core meanwhile. 2: the CI machine's
# cores. The tests marked `alone` time the machine (a pipeline's idle fraction against the wall clock) and a test on
# the other core would stall their ranks (seen: 0.063 off, against 0.05, 2026-11-29): they run after the others, in
# a pytest of their own with nothing beside them.
TEST_WORKERS ?= 2
xdist = -n $(TEST_WORKERS) --dist loadscope -p xdist_scheduling

# The house first (pyproject.toml's import-linter layers and ruff's format and lint rules: seconds), then the suite.
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -x -q $(xdist) -m "not slow and not gpu and not alone" --durations=15 $(call junit,test) tests
	$(PY) -m pytest -x -q -m "not slow and not gpu and alone" $(call junit,test-alone) tests

# The slow tests that are not Slurm jobs (those are test-slurm's).
test-slow: $(STAMP)
	$(PY) -m pytest -q $(xdist) -m "slow and not slurm and not alone" $(call junit,test-slow) tests
	$(PY) -m pytest -q -m "slow and not slurm and alone" $(call junit,test-slow-alone) tests

# CUDA/NCCL: parity, training parity + resume, SDPA attention vs the math kernel, context parallelism's attention per
# rank (test_cp_gpu.py). Skips, with its reason, without GPUs.
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu: no CUDA GPU visible (torch ' + str(torch.__version__) + ', CUDA build: ' + str(torch.version.cuda) + '); run it on a GPU node with the CUDA build of torch')"
	THREED_DEVICE=cuda $(PY) -m pytest -q -s -m gpu tests/gpu/test_gpu.py tests/gpu/test_cp_gpu.py

# The wheels the lent GPU machine lacks (deepspeed from its sdist, megatron-core, pydantic, hjson; CPython 3.12
# manylinux), into gpu-bundle/ with its MANIFEST.json: carried there with the tree, installed by tools/gpu_check.sh
# (docs/gpu.md). Needs PyPI and any python3 with pip, not the venv.
gpu-bundle:
	$(PYTHON) tools/gpu_bundle.py --out gpu-bundle

test-slurm: $(STAMP)
	$(PY) -m pytest -q -s --durations=0 -m "slurm and slow" $(call junit,test-slurm) tests

bench: $(STAMP)
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_init.py
	$(PY) benchmarks/bench_preprocess.py
	$(PY) benchmarks/bench_data.py
	$(PY) benchmarks/bench_pipeline.py
	$(PY) benchmarks/bench_schedule.py
	$(PY) benchmarks/bench_packing.py
	$(PY) benchmarks/bench_sp.py
	$(PY) benchmarks/bench_cp.py
	$(PY) benchmarks/bench_guard.py
	$(PY) benchmarks/bench_generate.py

# make convert / make export without one of their variables: one line naming it and the usage, exit 2, before
# anything runs (not argparse's "expected one argument").
CONVERT_USAGE := make convert HF=path/to/Meta-Llama-3-8B TP=2 PP=2 OUT=ckpt/llama3-8b-tp2pp2 [ARGS="--workers 2"]
EXPORT_USAGE := make export CKPT=runs/llama3-8b/ckpt OUT=runs/llama3-8b-hf [ARGS=...]
missing = $(strip $(foreach v,$(1),$(if $(strip $($(v))),,$(v))))
need = $(if $(call missing,$(2)),$(error make $(1): $(call missing,$(2)) not set; usage: $(3)))
ifneq ($(filter convert,$(MAKECMDGOALS)),)
$(call need,convert,HF TP PP OUT,$(CONVERT_USAGE))
endif
ifneq ($(filter export,$(MAKECMDGOALS)),)
$(call need,export,CKPT OUT,$(EXPORT_USAGE))
endif

# $(CONVERT_USAGE)
convert: $(STAMP)
	$(PY) -m threed.cli convert --hf $(HF) --tp $(TP) --pp $(PP) --out $(OUT) $(ARGS)

# $(EXPORT_USAGE)
export: $(STAMP)
	$(PY) -m threed.cli export --ckpt $(CKPT) --out $(OUT) $(ARGS)

# docs/flags.md from the config fields' metadata, the same the parser is built from (tools/gen_flags.py;
# tests/unit/test_docs.py fails when the file is stale), and the pipeline timelines of docs/schedules-and-memory.md
# from the schedule model (tools/gen_timelines.py; tests/unit/test_schedule_vpp.py). PYTHONPATH: this checkout's
# source, whatever the venv holds.
docs: $(STAMP)
	PYTHONPATH=src $(PY) tools/gen_flags.py
	PYTHONPATH=src $(PY) tools/gen_timelines.py

clean:
	rm -rf runs .pytest_cache
