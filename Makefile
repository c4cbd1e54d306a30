# swiftslurm: the two commands.
#   make demo  -- install everything, then train the quickstart job on this machine (local executor, CPU)
#   make test  -- install everything, start the local Slurm cluster, run the whole test suite, stop the cluster
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first (DeepSpeed builds against it); 2.13.0 is a CPU build on our dev/CI machines
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
PYTEST_ARGS ?=
# test workers: a file to a worker, so the Slurm tests' waiting overlaps the CPU-bound ones (tests/conftest.py)
TEST_WORKERS ?= 4

.PHONY: demo test setup system-deps ds-ops cluster-up cluster-down clean bench

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation -c constraints.txt "$(DEEPSPEED_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[train,dev,tracking,fp8]"
	touch $@

setup: $(VENV)/.installed system-deps

system-deps:
	@bash scripts/system-deps.sh

demo: setup
	$(VENV)/bin/swiftslurm submit examples/quickstart.toml --executor local --wait

cluster-up:
	bash tests/cluster/up.sh

cluster-down:
	bash tests/cluster/down.sh

# DeepSpeed's CPU comm op is JIT-built on first use: build it once, before tests that kill ranks run,
# into the venv's own cache (tests/conftest.py points TORCH_EXTENSIONS_DIR there too)
ds-ops: $(VENV)/.installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" TORCH_EXTENSIONS_DIR="$(CURDIR)/$(VENV)/torch_extensions" DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()" >/dev/null

# the package's and the tests' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (CI's machines), every one
# of the suite's ~2,700 Python processes compiled them again (0.6 s of CPU per rank start, 0.1 s per CLI call)
test: setup ds-ops
	$(PY) -m compileall -q swiftslurm tests >/dev/null
	bash tests/cluster/up.sh
	$(PY) -m pytest -ra --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests; rc=$$?; bash tests/cluster/down.sh; exit $$rc

bench: setup
	$(PY) benchmarks/verify.py
	$(PY) benchmarks/train_overhead.py
	$(PY) benchmarks/submit_array.py
	$(PY) benchmarks/supervisor_scale.py
	$(PY) benchmarks/rank_start.py

clean:
	rm -rf $(VENV) output build *.egg-info
