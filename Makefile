# Two entry points (see README.md). Both set up a virtual environment in $(VENV) on
# first use: the CPU build of torch==2.13.0 when no torch is present, then this project
# with its dev extra, editable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.latentmoe-installed

.PHONY: setup verify test docs clean bench bench-noise

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job: every verification contract this machine can run, then the summary table
# (also written to verify-report.json and verify-report.md).
verify: $(STAMP)
	$(PY) -m pytest verify/ -q

# The tests: unit tests, the verification suite (which includes the CPU compile of every
# fast kernel for sm_90a, sm_100a and sm_103a) over the built-in backends and the example
# external backend (examples/, outside the package, selected as a kernel engineer's own
# would be: docs/verifying-your-kernel.md), the committed benchmark history checked, the
# reference's CPU benchmarks compared with this machine's committed baseline (run once and
# reported as not compared on a processor model that has none), and the
# documentation site built strictly. The unit tests run in TEST_WORKERS pytest-xdist
# processes (most of their time is the kernels' CPU compiles and the planted-bug runs, each
# its own process); the verification suite in one, so its summary report is whole.
EXAMPLE_BACKEND := examples/torchao_mx.py:TorchaoMX
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest tests/ -q -n $(TEST_WORKERS) --dist worksteal
	$(PY) -m pytest verify/ -q --backend default --backend $(EXAMPLE_BACKEND)
	$(PY) -m pytest benchmarks/test_history.py -q
	$(PY) -m benchmarks.run cpu check --without-baseline run
	$(VENV)/bin/mkdocs build --strict -q

# GPU benchmarks on a GPU node (docs/gpu-node.md): `make bench` runs them, saves the run
# under benchmarks/results/<machine>/ and fails on a slowdown beyond that machine's
# measured noise; `make bench-noise` measures the noise from RUNS more runs. PY=python3 uses
# a ready interpreter as it is (a node without a package index); COMMIT=<sha>[-dirty]
# names the measured commit where the tree has no git.
RUNS ?= 3
BENCH_ARGS ?=
BENCH_SETUP = $(if $(filter $(VENV)/bin/python,$(PY)),$(MAKE) --no-print-directory setup,@true)
BENCH_COMMIT = $(if $(COMMIT),--commit $(COMMIT))

bench:
	$(BENCH_SETUP)
	$(PY) -m benchmarks.run gpu record $(BENCH_COMMIT) $(BENCH_ARGS)

bench-noise:
	$(BENCH_SETUP)
	$(PY) -m benchmarks.run gpu noise --runs $(RUNS) $(BENCH_COMMIT) $(BENCH_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis verify-report.json verify-report.md
