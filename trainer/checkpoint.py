"""Trainer checkpoints: everything a resumed run needs to continue as if never stopped.

``<out_dir>/checkpoint/``:
- the model (``save_pretrained``: safetensors + config + tokenizer), which is also what a
  restarted engine loads, so engine and trainer resume on the same weights;
- ``optimizer.pt``: the optimizer's state dict (a local file, not the wire);
- ``state.json``: step, policy version, python/torch RNG states, rollout-buffer counters;
- ``pending.msgpack``: rollout groups admitted but not yet trained on, as wire bytes.

Writes go to a temporary directory renamed into place, so a crash mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from inflight.protocol import RolloutGroup, decode_group, encode


@dataclass
class TrainerState:
    step: int
    version: int
    python_rng: object
    torch_rng: torch.Tensor
    buffer_stats: dict
    pending: list[RolloutGroup]


def save_checkpoint(path: Path, model, tokenizer, optimizer: torch.optim.Optimizer, state: TrainerState) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({
        "step": state.step,
        "version": state.version,
        "python_rng": state.python_rng,
        "torch_rng": base64.b64encode(state.torch_rng.numpy().tobytes()).decode(),
        "buffer_stats": state.buffer_stats,
    }))
    (tmp / "pending.msgpack").write_bytes(msgspec.msgpack.encode([encode(g) for g in state.pending]))
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_state(path: Path) -> TrainerState:
    raw = json.loads((Path(path) / "state.json").read_text())
    pending = [decode_group(b) for b in msgspec.msgpack.decode((Path(path) / "pending.msgpack").read_bytes())]

    def as_tuple(x):
        return tuple(as_tuple(i) for i in x) if isinstance(x, list) else x

    torch_rng = torch.frombuffer(bytearray(base64.b64decode(raw["torch_rng"])), dtype=torch.uint8).clone()
    return TrainerState(raw["step"], raw["version"], as_tuple(raw["python_rng"]), torch_rng, raw["buffer_stats"], pending)


def restore_rng(state: TrainerState) -> None:
    random.setstate(state.python_rng)  # type: ignore[arg-type]
    torch.set_rng_state(state.torch_rng)
