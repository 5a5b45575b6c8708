"""Trainer checkpoints: everything a resumed run needs to continue as if never stopped.

``<out_dir>/checkpoint/``:
- the model (``save_pretrained``: safetensors + config + tokenizer; in a LoRA run, the adapter: PEFT's
  ``adapter_config.json`` and ``adapter_model.safetensors``), which is also what a
  restarted engine loads, so engine and trainer resume on the same weights;
- ``optimizer/``: the optimizer's state as a ``torch.distributed.checkpoint``, each trainer rank
  writing its shard, readable by any number of ranks (``save_optimizer``, ``load_optimizer``);
- ``state.json``: step, policy version, python/torch/CUDA RNG states, rollout-buffer counters;
- ``pending.msgpack``: rollout groups admitted but not yet trained on, as wire bytes.

Writes go to a temporary directory swapped into place in one atomic step (Linux
``renameat2(RENAME_EXCHANGE)``), so a crash at any point leaves a complete checkpoint at the
path: the previous one or the new one. Where the exchange is not available the swap is two
renames, and a crash between them leaves the previous checkpoint as ``<path>.old``, which
``recover`` (called by ``load_state`` and ``save_checkpoint``) moves back.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
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
    cuda_rng: list[torch.Tensor] = field(default_factory=lambda: _cuda_rng_now())
    """One state per visible GPU, taken when the state is built (none without CUDA)."""
    ledger: dict = field(default_factory=dict)
    """The trainer's side of the rollout ledger (``inflight.trainer.metrics.RolloutLedger.state``)."""


def _cuda_rng_now() -> list[torch.Tensor]:
    return [t.cpu() for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux >= 3.15); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def recover(path: Path) -> bool:
    """Move ``<path>.old`` back where a crash between the two renames of a fallback swap left
    only it; True if it did. A complete checkpoint at ``path`` is left as it is."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and (old / "state.json").exists():
        old.rename(path)
        return True
    return False


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The optimizer's state in ``path``, a ``torch.distributed.checkpoint``: called by every
    trainer rank at once (each writes its shard), or by the one process of a run without ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """The optimizer state of ``checkpoint`` (``save_optimizer``'s, written by any number of
    ranks) into ``optimizer``, resharded to this run's ranks; an older checkpoint's
    ``optimizer.pt`` is read as it was written, by one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    checkpoint = Path(checkpoint)
    if not (checkpoint / "optimizer").is_dir() and (checkpoint / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
        return
    state = get_optimizer_state_dict(model, optimizer)
    dcp.load({"optimizer": state}, checkpoint_id=str(checkpoint / "optimizer"))
    set_optimizer_state_dict(model, optimizer, state)


def save_checkpoint(path: Path, model, tokenizer, write_optimizer: Callable[[Path], None], state: TrainerState,
                    extra: Callable[[Path], None] | None = None) -> None:
    """``model`` (a Hugging Face model, or a PEFT adapter) and ``tokenizer`` saved, the optimizer
    written by ``write_optimizer(directory)`` (``save_optimizer``, on every rank), what ``extra``
    writes into the checkpoint's directory (a draft model: ``draft/``), then ``state``: the whole
    swapped into ``path`` at once."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    write_optimizer(tmp / "optimizer")
    if extra is not None:
        extra(tmp)
    (tmp / "state.json").write_text(json.dumps({
        "step": state.step,
        "version": state.version,
        "python_rng": state.python_rng,
        "torch_rng": _b64(state.torch_rng),
        "cuda_rng": [_b64(t) for t in state.cuda_rng],
        "buffer_stats": state.buffer_stats,
        "ledger": state.ledger,
    }))
    (tmp / "pending.msgpack").write_bytes(msgspec.msgpack.encode([encode(g) for g in state.pending]))
    recover(path)
    if path.exists() and _exchange(tmp, path):  # one atomic step: path is the new checkpoint, tmp the old
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_state(path: Path) -> TrainerState:
    recover(path)
    raw = json.loads((Path(path) / "state.json").read_text())
    pending = [decode_group(b) for b in msgspec.msgpack.decode((Path(path) / "pending.msgpack").read_bytes())]

    def as_tuple(x):
        return tuple(as_tuple(i) for i in x) if isinstance(x, list) else x

    return TrainerState(raw["step"], raw["version"], as_tuple(raw["python_rng"]), _unb64(raw["torch_rng"]),
                        raw["buffer_stats"], pending, [_unb64(s) for s in raw.get("cuda_rng", [])],
                        raw.get("ledger", {}))


def restore_rng(state: TrainerState) -> None:
    random.setstate(state.python_rng)  # type: ignore[arg-type]
    torch.set_rng_state(state.torch_rng)
    if state.cuda_rng and torch.cuda.is_available():
        if len(state.cuda_rng) != torch.cuda.device_count():  # a different machine: say so rather than half-restore
            raise ValueError(f"checkpoint has CUDA RNG states of {len(state.cuda_rng)} GPUs, this process sees "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all(state.cuda_rng)
