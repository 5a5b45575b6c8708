"""The engine's own checkpoint on disk: what an update must contain, and the weights the
engine loaded, as the rollback copy of a first commit.

Staged tensors carry Hugging Face checkpoint names (``...q_proj.weight``) and shapes, so
the schema an update is checked against (``inflight.transport.bucket.TensorSchema``) is
read from the checkpoint the engine loaded, float tensors in the engine's dtype. The same
files are read once more at start into the rollback buffer (``read_checkpoint_into``; with
a shard plan only this rank's boxes), so that no rollback reads the disk inside the engine's
stall.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inflight.protocol import ShardPlan
from inflight.transport.bucket import dtype_name, plan_tensors, tensor_views, torch_dtype
from inflight.transport.schema import TensorSchema

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                       "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_WIDE_FLOATS = ("float32", "float16", "bfloat16", "float64")  # travel in the engine's dtype unless kept


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    """The local directory holding ``model``'s checkpoint (a path, or a cached hub snapshot)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, local_files_only=True,
                                  allow_patterns=["*.safetensors", "*.json"]))


def kept_dtypes(model: torch.nn.Module, engine_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The float parameters the engine keeps in a dtype of their own, by name: vLLM holds e.g.
    an MoE router's ``e_score_correction_bias`` (and GLM-4.5's router weight) in float32 in a
    bfloat16 engine. An update carries each in that dtype, never rounded to the engine's."""
    return {n: p.dtype for n, p in model.named_parameters() if p.dtype.is_floating_point and p.dtype != engine_dtype}


def engine_schema(model_runner: Any) -> TensorSchema:
    """What an update of this loaded engine must hold: its checkpoint's tensors, float ones in
    the engine's dtype or the one its parameter of that name keeps (``kept_dtypes``)."""
    mc = model_runner.model_config
    return checkpoint_schema(checkpoint_dir(mc.model, mc.revision), mc.dtype,
                             kept_dtypes(model_runner.get_model(), mc.dtype))


def checkpoint_schema(model_dir: Path, engine_dtype: torch.dtype,
                      kept: Mapping[str, torch.dtype] | None = None) -> TensorSchema:
    """Every tensor of the safetensors checkpoint, float ones in the engine's dtype, or in
    ``kept``'s dtype for the names it holds. An FP8 checkpoint's FP8 tensors travel as they
    are stored, and its float32 tensors (their scales) stay float32: the trainer sends them
    quantized, as the checkpoint holds them (``WeightPusher`` refuses to cast to FP8)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"inflight: no *.safetensors in {model_dir}; the update schema comes from the "
                                "checkpoint")
    stored: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                raw = sl.get_dtype()
                if raw not in SAFETENSORS_DTYPES:
                    raise ValueError(f"inflight: checkpoint tensor {name} has dtype {raw}, which updates cannot carry")
                stored[name] = (tuple(sl.get_shape()), SAFETENSORS_DTYPES[raw])
    fp8 = any(d.startswith("float8") for _, d in stored.values())
    tensors = {}
    for name, (shape, wire) in stored.items():
        if name in (kept or {}):
            wire = dtype_name(kept[name])  # type: ignore[index]
        elif wire in _WIDE_FLOATS and not (fp8 and wire == "float32"):
            wire = dtype_name(engine_dtype)
        tensors[name] = (shape, wire)
    return TensorSchema(tensors)


@torch.no_grad()
def read_checkpoint_into(model_dir: Path, schema: TensorSchema, flat: torch.Tensor,
                         plan: ShardPlan | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, in ``schema``'s wire dtypes, laid out in ``flat`` as an update
    of them would be (with this worker's shard ``plan``: only each tensor's box, as a
    point-to-point update following the plan lands); returns the views, keyed by name, each
    of its box's shape. Read at start, so that rolling back a first commit never reads the
    disk inside the engine's stall; a box is read alone (``get_slice``), never the whole
    tensor. ``flat`` must be exactly the bytes staging reserved for one update
    (``inflight.memory.update_bytes(schema, plan)``): a mismatch means the accounting and
    this layout disagree, and is refused."""
    from safetensors import safe_open

    boxes = {} if plan is None else {s.name: (tuple(s.start), tuple(s.length)) for s in plan.shards}
    specs, total = plan_tensors((name, boxes[name][1] if name in boxes else shape, dtype)
                                for name, (shape, dtype) in schema.tensors.items())
    if flat.numel() != total:
        what = "this rank's boxes of the checkpoint" if plan is not None else "the checkpoint"
        raise ValueError(f"inflight: the rollback copy's buffer is {flat.numel()} B, and {what} lays out in {total} B")
    views = tensor_views(flat, specs)
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                view = views[name]
                if name in boxes and tuple(view.shape) != schema.tensors[name][0]:
                    start, length = boxes[name]
                    t = st.get_slice(name)[tuple(slice(b, b + n) for b, n in zip(start, length))]
                else:
                    t = st.get_tensor(name)
                view.copy_(t.to(torch_dtype(schema.tensors[name][1])))
    return views
