# Two commands for a fresh machine: `make demo` and `make test` (both set up the environment).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gstrain-installed

.PHONY: setup demo test lint clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	rm -rf runs/demo runs/demo_scene
	$(VENV)/bin/gstrain demo-scene runs/demo_scene
	$(VENV)/bin/gstrain fit runs/demo_scene --config configs/demo.yaml --out runs/demo
	$(VENV)/bin/gstrain eval runs/demo

test: setup
	# one torch thread: on 2 busy cores more threads made CPU training many times slower (README),
	# and the bit-identical golden test needs one; subprocesses inherit it. Two workers, one per
	# core, a test file each at a time (its tests never overlap); files holding a slow-marked test
	# start first (conftest.py), so the long ones run side by side
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check gstrain tests bench
