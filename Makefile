# Two entry points, each self-contained on a machine with only Python 3.11+ and pip:
#   make demo   set up .venv and run the main job
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0: a CPU wheel on the CI machines' disk; elsewhere pip fetches it.
TORCH_SPEC ?= torch==2.13.0
# Triton for its interpreter: the kernels' tests run on CPU tensors (a CUDA torch brings its own Triton).
TRITON_SPEC ?= triton==3.6.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test venv clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install "$(TRITON_SPEC)"
	$(PIP) install -e ".[test,debug,bench]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dynamo-once diagnose --model tiny-llama

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -q tests
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q -m interpret tests

clean:
	rm -rf $(VENV) build *.egg-info
