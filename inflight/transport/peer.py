"""A stand-alone receiving worker without an engine: for transport tests, benchmarks and drills.

``run_peer`` joins the group as a worker rank and serves updates into a ``DictTarget``,
which keeps (and optionally saves) the committed tensors. It runs the same
``UpdateListener`` as the vLLM worker, so what it proves about the transport holds there.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from inflight.protocol import CommitInfo
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.schema import TensorSchema


class DictTarget:
    """Commits by copying the staged tensors into a dict (``keep``); optionally saves each version."""

    def __init__(self, out_dir: str | Path | None = None, *, keep: bool = True) -> None:
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.keep = keep
        self.live: dict[str, torch.Tensor] = {}
        self._version = 0
        self._steps = 0

    @property
    def live_version(self) -> int:
        return self._version

    def steps(self) -> int:
        return self._steps

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Nothing to get ready: the commit is a copy."""

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Nothing to get ready per bucket either."""

    def discard(self) -> None:
        """Nothing was prepared."""

    def leave(self) -> None:
        """Nothing else holds the trainer's store."""

    def commit(self, version: int, staged: StagedVersion, pool: StagingPool) -> CommitInfo:
        t0 = time.perf_counter()
        if self.keep:
            self.live = {k: v.clone() for k, v in staged.views.items()}
        pool.went_live(staged)  # copied (or not kept): the staging buffer is free again, unless kept as the base
        self._version = version
        if self.out_dir is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in self.live.items()}, str(self.out_dir / f"v{version}.safetensors"))
        return CommitInfo(step=self._steps, commit_ms=1e3 * (time.perf_counter() - t0))


def run_peer(group: GroupConfig, rank: int, out_dir: str | None,
             schema: dict[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Process entry point: serve updates until the trainer sends ``Shutdown``."""
    import threading

    if group.resolved_backend() == "nccl":  # one GPU per rank: NCCL cannot connect two ranks on one device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    target = DictTarget(out_dir)
    listener = UpdateListener(WeightGroup(group, rank), target, TensorSchema(schema) if schema is not None else None)
    listener.run(threading.Event())
