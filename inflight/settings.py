"""Every setting's allowed values, declared once, and the one check that enforces them.

Configs across the project (``GroupConfig``, ``PushConfig``, ``InflightConfig``, the
trainer's TOML sections) are frozen keyword-only dataclasses. Each calls
``check_choices(self, where)`` in ``__post_init__``: every field typed with one of the
``Literal`` enums below (or any ``Literal``) is checked against its values at
construction, with an error naming the field, the bad value and the choices. Argument
parsers take their ``choices=`` from ``choices(Enum)``, so a value is spelled in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from typing import Any, Literal

DataPlane = Literal["gloo", "nccl"]
"""The weight group's data plane: NCCL between GPUs, gloo through host memory."""
Backend = Literal["auto", DataPlane]
"""A ``DataPlane``, or ``auto``: NCCL where CUDA is available, else gloo."""
CommitStrategyName = Literal["swap", "reload", "copy", "lora"]
"""How staged weights become live (``engine_patches.commit``); ``lora``: an adapter-only engine's
slot write (``engine_patches.commit.lora_slot``)."""
CommitChoice = Literal["auto", CommitStrategyName]
"""A ``CommitStrategyName``, or ``auto``: the best one that is right for the engine."""
StagingPlace = Literal["device", "host"]
"""Where a version waits between its buckets' arrival and its commit."""
ChecksumChoice = Literal["auto", "xxh3", "crc32", "wsum64"]
"""Per-bucket checksum; ``auto`` is xxh3 on gloo and wsum64 (computed on the GPU) on NCCL."""
PushDtype = Literal["keep", "float32", "bfloat16", "float16"]
"""What the trainer casts weights to while packing; ``keep`` sends each tensor's own dtype."""
ModelDtype = Literal["float32", "bfloat16"]
"""The engine's (and the pushed weights') dtype."""
RolloutMode = Literal["inflight", "batch"]
"""In-flight sampling, or the synchronous batch-boundary baseline."""


def choices(enum: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` enum, e.g. for ``argparse``'s ``choices=``."""
    return typing.get_args(enum)


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))
    out = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is Literal:
            out.append((f.name, typing.get_args(hint)))
    return tuple(out)


def check_choices(obj: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``<where>.<field>`` if a ``Literal``-typed field of the
    dataclass ``obj`` holds a value outside its choices."""
    for name, allowed in _literal_fields(type(obj)):
        value = getattr(obj, name)
        if value not in allowed or type(value) is not type(allowed[allowed.index(value)]):
            raise ValueError(f"{where}.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
