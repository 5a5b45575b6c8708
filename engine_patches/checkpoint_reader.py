"""Checkpoint directories as in-flight updates, worker side: ``CheckpointReader``.

A directory of safetensors (prime-rl's ``step_N``, any checkpoint-writing trainer) is checked
at once, on the RPC that names it, from its headers alone (``check_directory``): every tensor
of this engine there once, at its shape, every file whole. Then the reader's thread (an
``UpdateQueue``) reads it into staging while the engine decodes and commits it at a step
boundary. The version: the payload's, else N of a directory named ``step_N`` (``version_of``).
Invariants: a refused directory leaves the engine serving its last version; versions only grow.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.engine.commit.engine_checkpoint import SAFETENSORS_DTYPES, read_checkpoint_into
from inflight.engine.rpc import OUT_OF_ORDER
from inflight.engine.transfer_engine import RLApiError
from inflight.engine.update_queue import Job, UpdateQueue
from inflight.memory import update_bytes
from inflight.protocol import ShardPlan
from inflight.staging import StagedVersion
from inflight.transport.bucket import torch_dtype
from inflight.transport.listener import nonfinite
from inflight.transport.schema import TensorSchema

STEP_DIR = re.compile(r"^step_(\d+)$")
"""prime-rl's checkpoint directory name (``get_step_path``): its trainer step is the version."""


@dataclass
class DirUpdate(Job):
    """One checkpoint directory, checked, waiting for (or under) its read."""

    weight_dir: Path


def version_of(weight_dir: Path, version: Any = None) -> int:
    """The version a directory commits as: ``version`` if given, else N of ``step_N``."""
    if version is None:
        found = STEP_DIR.match(weight_dir.name)
        if found is None:
            raise RLApiError(f"inflight: {weight_dir}: no version: name the directory step_<N> (prime-rl's layout) "
                             "or give the version with it (update_info.version)")
        return int(found[1])
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise RLApiError(f"inflight: version={version!r} for {weight_dir} must be an integer >= 0")
    return version


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors file's tensors, (shape, dtype name), by name; refuses a file that is
    not whole (its header or its data cut short), naming it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise RLApiError(f"inflight: {path} is truncated: {size} bytes, its safetensors header cut short")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise RLApiError(f"inflight: {path} has no readable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + length + end > size:
        raise RLApiError(f"inflight: {path} is truncated: its header describes {8 + length + end} bytes, the file "
                         f"holds {size}")
    out = {}
    for name, t in header.items():
        if t["dtype"] not in SAFETENSORS_DTYPES:
            raise RLApiError(f"inflight: {path}: {name} has dtype {t['dtype']}, which updates cannot carry")
        out[name] = (tuple(t["shape"]), SAFETENSORS_DTYPES[t["dtype"]])
    return out


def check_directory(weight_dir: Path, schema: TensorSchema) -> None:
    """Refuse ``weight_dir`` unless its safetensors hold every tensor of ``schema`` once, at
    its shape, in a dtype this engine takes (a float converts to any float), every file whole."""
    if not weight_dir.is_dir():
        raise RLApiError(f"inflight: weight_dir {weight_dir} is not a directory")
    files = sorted(weight_dir.glob("*.safetensors"))
    if not files:
        raise RLApiError(f"inflight: {weight_dir} holds no *.safetensors")
    seen: dict[str, Path] = {}
    for path in files:
        for name, (shape, dtype) in read_header(path).items():
            if name not in schema.tensors:
                raise RLApiError(f"inflight: {path}: {name} is not a tensor of this engine")
            if name in seen:
                raise RLApiError(f"inflight: {name} is in both {seen[name]} and {path}")
            seen[name] = path
            own_shape, own = schema.tensors[name]
            if shape != tuple(own_shape):
                raise RLApiError(f"inflight: {path}: {name} has shape {shape}, this engine's is {tuple(own_shape)}")
            if dtype != own and not (torch_dtype(dtype).is_floating_point and torch_dtype(own).is_floating_point):
                raise RLApiError(f"inflight: {path}: {name} is {dtype}, which this engine cannot take into its {own}")
    missing = sorted(set(schema.tensors) - set(seen))
    if missing:
        raise RLApiError(f"inflight: {weight_dir} is missing tensor {missing[0]} ({len(missing)} missing in all: "
                         f"{missing[:5]}); an update carries every tensor")


class CheckpointReader(UpdateQueue):
    """Reads, stages and commits checkpoint directories on one worker."""

    what = "checkpoint"

    def __init__(self, *, target: Any, schema: TensorSchema, pool: Any, plan: ShardPlan | None, stats: Any,
                 check_finite: bool) -> None:
        super().__init__(target=target, pool=pool, stats=stats)
        self.schema, self.plan, self.check_finite = schema, plan, check_finite
        self._newest = target.live_version  # the newest version queued here
        self._last: tuple[Path, int] | None = None  # the last directory queued, and its version

    def check(self, weight_dir: Any, version: Any = None, newer_than: int = -1) -> DirUpdate:
        """``weight_dir`` as a job, its headers checked (on the calling thread: it answers the
        client); refused if its version is not newer than every one this engine served or queued."""
        if not isinstance(weight_dir, (str, Path)) or not str(weight_dir):
            raise RLApiError(f"inflight: weight_dir={weight_dir!r} must name a directory")
        path = Path(weight_dir)
        v = version_of(path, version)
        newest = max(self._newest, self.target.live_version, newer_than)
        if v <= newest:
            raise RLApiError(f"inflight: {path} is v{v}, not newer than v{newest} (this engine serves "
                             f"v{self.target.live_version}): versions only move forward", OUT_OF_ORDER)
        check_directory(path, self.schema)
        return DirUpdate(v, weight_dir=path)

    def taken(self, weight_dir: Any, version: Any = None) -> int | None:
        """The version of ``weight_dir`` if it is the directory queued last (at ``version``, if
        given): a client's retry of a call whose answer it lost, answered as the first was."""
        if self._last is None or not isinstance(weight_dir, (str, Path)) or not str(weight_dir):
            return None
        same = Path(weight_dir).resolve() == self._last[0] and version in (None, self._last[1])
        return self._last[1] if same else None

    def expect(self, job: Job) -> None:
        assert isinstance(job, DirUpdate)
        self._newest = max(self._newest, job.version)
        self._last = (job.weight_dir.resolve(), job.version)
        super().expect(job)

    def _refuse(self, job: Job, why: str) -> None:
        if self._last is not None and self._last[1] == job.version:
            self._last = None  # a retry of a refused directory is checked (and refused) again
        super()._refuse(job, why)

    def abandon(self) -> None:
        super().abandon()
        self._newest = self.target.live_version  # the dropped version's number may be named again

    def _receive(self, job: Job) -> tuple[torch.Tensor, StagedVersion | None, str | None]:
        assert isinstance(job, DirUpdate)
        nbytes = update_bytes(self.schema, self.plan)
        flat = self.pool.take(nbytes)
        first_step = self.target.steps()
        try:  # the headers were checked; the files may still change under the read
            views = read_checkpoint_into(job.weight_dir, self.schema, flat[:nbytes], self.plan)
        except Exception as e:
            return flat, None, f"reading {job.weight_dir} failed: {e!r}"
        if self.check_finite and (bad := nonfinite(views)) is not None:
            return flat, None, f"{bad} has NaN or Inf ({job.weight_dir})"
        try:
            self.target.prepare(job.version, views)
        except Exception as e:  # any failure of preparation refuses the update alone
            return flat, None, f"preparing it failed: {e!r}"
        return flat, StagedVersion(None, flat, first_step, views), None

