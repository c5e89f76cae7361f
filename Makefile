# Two entry points, each setting up .venv on a fresh machine first:
#   make train   # trains the tiny GLM-5.1 on real text (CPU here, the GPU when present)
#   make test    # runs the test suite (slow tests too when SLOW=1)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# jax 0.11.2 needs Python 3.12: pyenv's 3.12.x if present, else a working python3.12 on PATH.
PYTHON312 ?= $(shell for p in $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.12.*/bin/python 2>/dev/null | sort -V -r) $$(command -v python3.12); do \
  "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
CONFIG ?= configs/glm5_1.py:tiny
WORKDIR ?= runs/glm5_1_tiny
TRAIN_ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): 2 fits the 2-core, 24 GB CI machine (16 min there against 23.5 in one).
PYTEST_WORKERS ?= 2
MARKERS := $(if $(filter 1 true,$(SLOW)),,-m "not slow")
# With an NVIDIA GPU present, install the CUDA jaxlib plugin too, so `make train` uses the GPU.
EXTRAS ?= $(if $(shell nvidia-smi -L 2>/dev/null),test$(comma)gpu,test)
comma := ,

.PHONY: setup train test clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

train: setup
	$(PY) train.py --config=$(CONFIG) --workdir=$(WORKDIR) $(TRAIN_ARGS)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup $(MARKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
