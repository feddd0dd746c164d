# The two commands a new user runs. Both set up a local virtual environment first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
NPROC   ?= 2

.PHONY: install demo test test-quick plain-install bench clean deepspeed-venv ecosystem-venv ecosystem-compare

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/deepshard --num_gpus $(NPROC) examples/train_gpt.py --deepspeed_config examples/ds_config.json

# the three venvs install at once (each a torch wheel and a few packages: mostly waiting on disk and unzip),
# then the suite runs on TEST_WORKERS processes (pytest-xdist; --dist loadfile: one worker runs a whole test
# file, so its module fixtures start once and its tests keep their order and fixed names, such as the docs
# pages' launches on port 29500), taking the files longest first (tests/file_order.py, by the table
# tests/file_seconds.json), so the many short unit files fill in at the end while the last long file runs.
# TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2

test:
	$(MAKE) --no-print-directory -j3 --output-sync=target install plain-install deepspeed-venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# Real DeepSpeed 0.19.8 for the checkpoint tests (tests/deepspeed_compat run it as a subprocess): its own
# venv, built once (~1 min), no C++ ops compiled. Where it cannot be installed (no package index) the
# reason goes to $(DS_VENV)/.failed and those tests are skipped saying so.
DS_VENV ?= .venv-deepspeed

$(DS_VENV)/.installed:
	rm -f $(DS_VENV)/.failed
	$(PY) -m venv $(DS_VENV)
	( $(DS_VENV)/bin/pip install -q $(TORCH) && DS_BUILD_OPS=0 $(DS_VENV)/bin/pip install -q deepspeed==0.19.8 \
	  && touch $@ ) || echo "pip install $(TORCH) deepspeed==0.19.8 failed" > $(DS_VENV)/.failed

deepspeed-venv: $(DS_VENV)/.installed

# the inner loop (docs/testing.md): every unit test, the comm API on 2 processes (the multi-process
# harness) and one end-to-end run of a DeepSpeed script on 2 processes through the launcher
test-quick: install
	$(BIN)/python -m pytest -q -x tests/unit tests/multiproc/test_comm_api.py tests/e2e/test_deepspeed_script.py

# deepshard installed from this checkout with no extras (`pip install .`) in its own venv, then a real script end to end (~30 s after the first run)
plain-install:
	tests/e2e/plain_install/check.sh $(PY) .venv-plain $(TORCH)

# deepshard against torch DDP, FSDP2 and DeepSpeed, every engine 3 times interleaved (~60 min on 2 cores), then the MoE,
# sequence-parallel and ZeRO++ parts (BENCH_ARGS="--only moe" runs one part); make bench BENCH_ARGS=--quick for ~9 min plus the parts.
# Its own venv: with a real DeepSpeed installed, `import deepspeed` is DeepSpeed's, which the test suite's
# one-import checks (deepshard standing in for deepspeed) rightly refuse to shadow unasked.
BENCH_VENV ?= .venv-bench

$(BENCH_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q $(TORCH)
	$(BENCH_VENV)/bin/pip install -q -e ".[dev,bench]"
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/bench.py $(BENCH_ARGS)

# TRL and PEFT on deepshard against the same scripts on DeepSpeed 0.19.8 (docs/ecosystem.md): their own venv
# with the libraries' newest releases that install together, built once (~3 min); not part of `make test`
# (each comparison run takes minutes: the libraries' imports and DeepSpeed's CPU op build).
ECO_VENV ?= .venv-ecosystem
ECO_PACKAGES ?= deepspeed==0.19.8 trl==1.16.0 peft==0.21.2 transformers==5.24.0 accelerate==1.15.0 datasets

$(ECO_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(ECO_VENV)
	$(ECO_VENV)/bin/pip install -q $(TORCH)
	DS_BUILD_OPS=0 $(ECO_VENV)/bin/pip install -q $(ECO_PACKAGES)
	$(ECO_VENV)/bin/pip install -q -e .
	touch $@

ecosystem-venv: $(ECO_VENV)/.installed

# every case (about an hour on 2 busy cores); ECO_ARGS="--cases sft_zero3 grpo_zero3" for some
ecosystem-compare: $(ECO_VENV)/.installed
	$(ECO_VENV)/bin/python -m benchmarks.ecosystem.run_compare $(ECO_ARGS)

clean:
	rm -rf $(VENV) .venv-plain $(BENCH_VENV) $(DS_VENV) $(ECO_VENV) build *.egg-info src/*.egg-info
