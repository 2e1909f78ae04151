# Two entry points (see README.md). Both set up a virtual environment in $(VENV) on
# first use: the CPU build of torch==2.13.0 when no torch is present, then this project
# with its dev extra, editable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.latentmoe-installed

.PHONY: setup verify test docs clean

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
# fast kernel for sm_90a, sm_100a and sm_103a), and the documentation site built strictly.
test: $(STAMP)
	$(PY) -m pytest tests/ verify/ -q
	$(VENV)/bin/mkdocs build --strict -q

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis verify-report.json verify-report.md
