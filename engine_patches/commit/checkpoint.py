"""What an update must contain: the schema of the engine's own checkpoint on disk.

Staged tensors carry Hugging Face checkpoint names (``...q_proj.weight``) and shapes, so
the schema an update is checked against (``inflight.transport.layout.TensorSchema``) is
read from the checkpoint the engine loaded, float tensors in the engine's dtype.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from inflight.transport.layout import TensorSchema, dtype_name

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    """The local directory holding ``model``'s checkpoint (a path, or a cached hub snapshot)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))


def checkpoint_schema(model_dir: Path, engine_dtype: torch.dtype) -> TensorSchema:
    """Every tensor of the safetensors checkpoint, float ones in the engine's dtype."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"inflight: no *.safetensors in {model_dir}; the update schema comes from the checkpoint")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                raw = sl.get_dtype()
                if raw not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"inflight: checkpoint tensor {name} has dtype {raw}, which updates cannot carry")
                wire = _SAFETENSORS_DTYPES[raw]
                if wire in ("float32", "float16", "bfloat16", "float64"):
                    wire = dtype_name(engine_dtype)
                tensors[name] = (tuple(sl.get_shape()), wire)
    return TensorSchema(tensors)
