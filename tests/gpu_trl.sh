#!/bin/bash
# TRL 1.16's AsyncGRPOTrainer, unchanged, against `vllm serve --weight-transfer-config '{"backend": "inflight"}'`
# (the gpu test of tests/engine/test_rl_api_trl.py), on a CUDA machine with 2 GPUs or more (NCCL refuses two ranks
# of one communicator on one device: the trainer takes cuda:0, the server the last GPU) and a package registry:
#   bash tests/gpu_trl.sh [pytest args]      # results in $OUT/gpu_trl.log when OUT is set, else /tmp
# Uses $PYTHON (default python3) where it already has a CUDA vLLM 0.32.0, trl 1.16.0, the hub's kernels package and
# this project; else makes .venv-gpu-trl and installs the project with its gpu, test and trl extras (a few minutes).
# TRL's tree attention loads the FA3 kernel from the hub (kernels-community/flash-attn3): fetched here, read offline.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
LOG="${OUT:-/tmp}/gpu_trl.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1

ready() {  # $1 a python: CUDA vLLM 0.32.0, trl 1.16.0, the hub's kernels, pytest-timeout, this project installed
    (cd /tmp && "$1" - <<'EOF' 2>/dev/null)
import importlib.metadata as m
import importlib.util
import sys
want = {"vllm": "0.32.0", "trl": "1.16.0"}
ok = all(m.version(name) == v for name, v in want.items())
ok = ok and all(importlib.util.find_spec(p) for p in ("kernels", "pytest_timeout", "inflight"))
from vllm.platforms import current_platform
sys.exit(0 if ok and current_platform.is_cuda() else 1)
EOF
}

nvidia-smi -L || { echo "gpu_trl: no GPU (nvidia-smi failed)"; exit 1; }
GPUS=$(nvidia-smi -L | grep -c '^GPU')
[ "$GPUS" -ge 2 ] || echo "gpu_trl: $GPUS GPU(s): the trainer test needs 2 and will skip, saying why"
if ! ready "$PY"; then
    echo "gpu_trl: $PY lacks CUDA vLLM 0.32.0 / trl 1.16.0 / kernels / this project: installing into .venv-gpu-trl"
    [ -x .venv-gpu-trl/bin/python ] || python3 -m venv .venv-gpu-trl || exit 1
    PY="$PWD/.venv-gpu-trl/bin/python"
    "$PY" -m pip install -q --upgrade pip || exit 1
    "$PY" -m pip install -q -e '.[gpu,test,trl]' 'kernels>=0.17,<0.18' || exit 1
    ready "$PY" || { echo "gpu_trl: the install did not give a CUDA vLLM 0.32.0 with trl 1.16.0"; exit 1; }
fi
"$PY" -c "import torch, vllm, trl, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
(cd /tmp && HF_HUB_OFFLINE=0 "$PY" -c "from kernels import get_kernel; get_kernel('kernels-community/flash-attn3', version=1); print('FA3 kernel cached')") \
    || echo "gpu_trl: the FA3 kernel could not be fetched: the trainer test will skip, saying why"
START=$(date +%s)
HF_HUB_OFFLINE=1 "$PY" -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 480 tests/engine/test_rl_api_trl.py "$@" 2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}
echo "== gpu_trl summary ($(( $(date +%s) - START )) s, pytest rc $RC; log $LOG)"
grep -E '^(PASSED|FAILED|SKIPPED|ERROR)' "$LOG" || tail -5 "$LOG"
exit "$RC"
