# Two entry points do all the set-up on a fresh machine:
#   make demo   -- create .venv, install, run the main job (DLRM on generated Criteo data, tuned)
#   make test   -- create .venv if missing, install with dev extras, run the test suite
# make test-fast runs every test not marked slow (the edit loop); make lint runs ruff and mypy.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast venv install bench simulate pretrain lint format clean peers-tf-env ft-env

venv: $(STAMP)

# torch is installed first, and only when the interpreter has no torch of its own, so a user's
# CUDA build is kept (the venv then sees it through --system-site-packages). Without an NVIDIA
# driver it comes from PyTorch's CPU index where that index answers: PyPI's Linux wheels are
# CUDA builds, several GB with their nvidia-* packages. A machine that reaches only its own
# package index (a mirror that holds the CPU build) installs from it. README.md's "Install"
# gives the same paths; TORCH_INDEX= picks one.
TORCH_VERSION ?= 2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,$(shell $(PYTHON) -c "import urllib.request; urllib.request.urlopen('$(CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo $(CPU_INDEX)))

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "using the interpreter's own torch"; \
	  test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	  $(PY) -c "import torch" 2>/dev/null || \
	    $(PIP) install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	# .[dev] includes Ray (2.x, about 80 MB), so tests/test_remote.py runs a two-node cluster.
	$(PIP) install -q -e ".[dev]"
	# TorchRec for the DLRM example. On CPU its normal dependencies pull a CUDA fbgemm, so the
	# CPU fbgemm is installed first and torchrec itself without dependencies.
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.version.cuda else 1)"; then \
	  $(PIP) install -q fbgemm-gpu==1.8.0 pyre-extensions iopath && $(PIP) install -q --no-deps torchrec==1.8.0; \
	else \
	  $(PIP) install -q fbgemm-gpu-cpu==1.8.0 pyre-extensions iopath && $(PIP) install -q --no-deps torchrec==1.8.0; \
	fi
	touch $(STAMP)

install: $(STAMP)

# The whole suite, with the 25 slowest tests' durations (CI's output shows them too).
test: $(STAMP)
	$(PY) -m pytest -q --durations=25

# The fast tier for the edit loop: every test not marked slow (pyproject.toml's markers).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(PY) -m torchtune_pipe.tools.cli demo

bench: $(STAMP)
	$(PY) -m benchmarks.executor

simulate: $(STAMP)
	$(PY) -m torchtune_pipe.tools.cli simulate --out out/simulate

pretrain: $(STAMP)
	$(PY) -m torchtune_pipe.tools.cli pretrain

# TensorFlow for the tf.data contenders of benchmarks/peers.py, in its own environment (never
# in .venv). torch, psutil and cloudpickle let its tfdata-pyfunc variant import examples/dlrm.
TF_VENV ?= /tmp/tf-venv
TF_BASE_PYTHON ?= python3.11

peers-tf-env: $(TF_VENV)/.installed

$(TF_VENV)/.installed:
	test -x $(TF_VENV)/bin/python || $(TF_BASE_PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q tensorflow-cpu==2.21.0 torch==2.13.0 psutil cloudpickle
	touch $@

# A free-threaded CPython 3.13 (python3.13t) and a venv with what benchmarks/zoo.py needs, for
# the zoo under no GIL; benchmarks/ft_env.sh says where CPython's sources come from.
FT_PREFIX ?= /tmp/ft-python
FT_VENV ?= /tmp/ft-venv
CPYTHON_SRC ?=

ft-env:
	FT_PREFIX=$(FT_PREFIX) FT_VENV=$(FT_VENV) CPYTHON_SRC=$(CPYTHON_SRC) bash benchmarks/ft_env.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build dist *.egg-info out
