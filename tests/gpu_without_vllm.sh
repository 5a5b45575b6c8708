#!/bin/bash
# The gpu-marked tests that need no vLLM, on a CUDA machine without a package registry
# (bash tests/gpu_without_vllm.sh tests/unit/test_kernels.py ...; results go to $OUT when it is set):
# msgspec travels as a wheel in .whl (carried), the rest is the machine's image.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python3 -c "import torch, triton, transformers, peft, msgspec; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'msgspec', msgspec.__version__, torch.cuda.get_device_name())"
set -o pipefail
python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 240 "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
