"""Every setting's allowed values, declared once, and the one check that enforces them.

Configs across the project (``GroupConfig``, ``PushConfig``, ``InflightConfig``, the
trainer's TOML sections) are frozen keyword-only dataclasses. Each calls
``check_choices(self, where)`` in ``__post_init__``: every field typed with one of the
``Literal`` enums below (or any ``Literal``) is checked against its values at
construction, with an error naming the field, the bad value and the choices. Argument
parsers take their ``choices=`` from ``choices(Enum)``, so a value is spelled in one place.
The wire's own enums (dtypes, checksums) live in ``inflight.protocol``, which imports
nothing, and the settings here are built from them.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from typing import Any, Literal

from inflight.protocol import CastDtype, ChecksumAlgo, SparseCodec

DataPlane = Literal["gloo", "nccl"]
"""The weight group's data plane: NCCL between GPUs, gloo through host memory."""
Backend = Literal["auto", DataPlane]
"""A ``DataPlane``, or ``auto``: NCCL where CUDA is available, else gloo."""
InStorageCommit = Literal["reload", "copy"]
"""The commits that write the staged tensors into the model's own storage
(``inflight.engine.commit.reload``, ``inflight.engine.commit.copy``)."""
CommitStrategyName = Literal["swap", InStorageCommit, "lora"]
"""How staged weights become live (``inflight.engine.commit``); ``lora``: an adapter-only engine's
slot write (``inflight.engine.commit.lora_slot``)."""
CommitChoice = Literal["auto", CommitStrategyName]
"""A ``CommitStrategyName``, or ``auto``: the best one that is right for the engine."""
StagingPlace = Literal["device", "host"]
"""Where a version waits between its buckets' arrival and its commit."""
ChecksumChoice = Literal["auto", ChecksumAlgo]
"""Per-bucket checksum; ``auto`` is xxh3 on gloo and wsum64 (computed on the GPU) on NCCL."""
PushDtype = Literal["keep", CastDtype]
"""What the trainer casts weights to while packing; ``keep`` sends each tensor's own dtype."""
SparseCodecChoice = Literal["auto", SparseCodec]
"""A sparse update's codec: ``auto`` is ``xor_zstd`` on a gloo data plane (host), ``index`` on NCCL (device)."""
PushEncoding = Literal["dense", "sparse"]
"""How an update travels: every tensor whole, or, against a version the engine keeps, only the
elements that changed (``inflight.transport.delta``)."""
RolloutMode = Literal["inflight", "batch", "pause"]
"""In-flight sampling, the synchronous batch-boundary baseline, or async sampling with vLLM's
native pause-and-update path (the baseline of today's async RL frameworks)."""
Packing = Literal["padded", "packed", "prefix_shared"]
"""How the trainer lays a micro-batch out for its forward pass (``inflight.trainer.packed_batch``)."""
TrackerName = Literal["jsonl", "tensorboard", "wandb", "trackio"]
"""Where the trainer's metrics go (``inflight.trainer.trackers``): metrics.jsonl, or an experiment tracker."""


def choices(enum: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` enum, e.g. for ``argparse``'s ``choices=``."""
    return typing.get_args(enum)


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple[Any, ...], bool], ...]:
    """(name, choices, many) of each field typed ``Literal[...]`` or, ``many``, ``tuple[Literal[...], ...]``."""
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))
    out = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is Literal:
            out.append((f.name, typing.get_args(hint), False))
        elif typing.get_origin(hint) is tuple and (args := typing.get_args(hint))[-1:] == (Ellipsis,) \
                and typing.get_origin(args[0]) is Literal:
            out.append((f.name, typing.get_args(args[0]), True))
    return tuple(out)


def _allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    return value in allowed and type(value) is type(allowed[allowed.index(value)])


def check_choices(obj: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``<where>.<field>`` if a ``Literal``-typed field of the
    dataclass ``obj`` holds a value outside its choices; a ``tuple[Literal[...], ...]`` field
    must hold a list of choices, each at most once."""
    for name, allowed, many in _literal_fields(type(obj)):
        value = getattr(obj, name)
        listed = ', '.join(map(repr, allowed))
        if not many:
            if not _allowed(value, allowed):
                raise ValueError(f"{where}.{name}={value!r} is not one of {listed}")
            continue
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{where}.{name}={value!r} must be a list of {listed}")
        for v in value:
            if not _allowed(v, allowed):
                raise ValueError(f"{where}.{name}={tuple(value)!r}: {v!r} is not one of {listed}")
            if value.count(v) > 1:
                raise ValueError(f"{where}.{name}={tuple(value)!r} names {v!r} twice")


PLAIN_CPU_GEMM_ENV = "INFLIGHT_CPU_PLAIN_GEMM"
"""``1``: vLLM's CPU linears keep their weights, unpacked, in every vLLM process (the plugin applies
``inflight.engine.patch.use_plain_cpu_gemm``), which the ``copy`` commit needs on CPU."""
