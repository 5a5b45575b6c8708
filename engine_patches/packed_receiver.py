"""vLLM's ``nccl`` wire on an in-flight engine, worker side: ``PackedReceiver``.

One thread per worker (an ``inflight.engine.update_queue.UpdateQueue``), started by
``inflight_start`` when ``InflightConfig.wire`` is set
(the RL API's ``init_weight_transfer_engine`` got the ``nccl`` backend's init info). The RL
API's ``update_weights`` hands it an update (``expect``) and returns at once. The thread
receives the update's chunks (``inflight.transport.packed_wire``) into a staging buffer
while the engine decodes, casting each tensor to the engine's dtype and keeping this rank's
box of it, checks and prepares it. Once the client's ``finish_weight_update`` came
(``finish``), it hands the update to the engine's commit (``EngineTarget.commit``), which
lands it at one step boundary on every rank, or on none.

Invariants: the thread receives exactly the chunks the update's info announced, even for an
update it refuses (a non-finite tensor, a preparation that fails), so the group stays in step
with the trainer; nothing live is touched before the commit; a refused or abandoned update
gives its buffer back and the engine serves its last version; a refusal is kept until the
next ``start_weight_update`` reports it (``take_refusal``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from inflight.engine.commit.base import CommitTarget
from inflight.engine.update_queue import Job, Refused, UpdateQueue
from inflight.protocol import ShardPlan
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.bucket import plan_tensors, tensor_views
from inflight.transport.errors import TransportError
from inflight.transport.listener import ListenerStats, nonfinite
from inflight.transport.packed_wire import chunk_plan, nbytes_of
from inflight.transport.schema import TensorSchema

log = logging.getLogger("inflight.packed_receiver")


@dataclass
class WireUpdate(Job):
    """One update as ``update_weights`` announced it: its tensors in send order."""

    names: list[str]
    shapes: list[list[int]]
    dtypes: list[torch.dtype]


class PackedReceiver(UpdateQueue):
    """Receives, stages and commits the updates of vLLM's packed wire on one worker."""

    what = "packed wire"

    def __init__(self, wire: Any, *, packed: bool, buffer_size_bytes: int, target: CommitTarget, schema: TensorSchema,
                 pool: StagingPool, plan: ShardPlan | None, stats: ListenerStats, check_finite: bool,
                 device: torch.device) -> None:
        super().__init__(target=target, pool=pool, stats=stats)
        self.wire, self.packed, self.buffer_size_bytes = wire, packed, buffer_size_bytes
        self.schema, self.check_finite, self.device = schema, check_finite, device
        self.boxes = {} if plan is None else {s.name: s for s in plan.shards}
        self.broken = ""
        """Why the group is unusable (a transfer failed mid-stream): updates are refused until a new init."""

    def rejoin(self, wire: Any) -> None:
        """A new init (a restarted trainer): drop the open update and receive on ``wire`` from now on."""
        self.abandon()
        old, self.wire, self.broken = self.wire, wire, ""
        close_wire(old)

    def _serve(self, job: Job, stop: Any) -> None:
        wire = self.wire
        try:
            super()._serve(job, stop)
        except TransportError as e:  # the trainer is gone or stalled mid-stream: this group is over
            if wire is self.wire:  # (not a group a new init already replaced)
                self.broken = str(e)
            self.stats.last_error = f"[transport] {e}"
            self._refuse(job, f"the transfer failed: {e}; call init_weight_transfer_engine again")
            log.warning("inflight: v%d's packed transfer failed (%s); still serving v%d", job.version, e,
                        self.target.live_version)

    def _receive(self, job: WireUpdate) -> tuple[torch.Tensor, StagedVersion | None, str | None]:
        """Receive every chunk of ``job`` into a staging buffer: (the buffer, the staged
        version, None) or (the buffer, None, why it is refused)."""
        specs, total = plan_tensors(self._staged_layout(job), self._starts(job))
        flat = self.pool.take(total)
        views = tensor_views(flat, specs)
        first_step = self.target.steps()
        why: str | None = None
        try:
            self._land_all(job, views)
        except Refused as e:  # every byte still came: the group is in step
            why = str(e)
        except BaseException:  # the group failed mid-stream: the buffer goes back, nothing was prepared
            self.pool.give(flat)
            raise
        if why is None and self.check_finite and (bad := nonfinite(views)) is not None:
            why = f"{bad} has NaN or Inf"
        if why is None:
            try:
                self.target.prepare(job.version, views)
            except Exception as e:  # any failure of preparation refuses the update alone
                why = f"preparing it failed: {e!r}"
        return flat, (None if why else StagedVersion(None, flat, first_step, views)), why

    def _staged_layout(self, job: WireUpdate) -> list[tuple[str, list[int], str]]:
        out = []
        for name, shape in zip(job.names, job.shapes):
            box = self.boxes.get(name)
            out.append((name, list(box.length) if box is not None else shape, self.schema.tensors[name][1]))
        return out

    def _starts(self, job: WireUpdate) -> dict[str, tuple[int, ...]] | None:
        if not self.boxes:
            return None
        return {n: tuple(self.boxes[n].start) if n in self.boxes else (0,) * len(s)
                for n, s in zip(job.names, job.shapes)}

    def _land_all(self, job: WireUpdate, views: dict[str, torch.Tensor]) -> None:
        """Each chunk (or, unpacked, each tensor) as it arrives, into ``views``."""
        sizes = [nbytes_of(s, d) for s, d in zip(job.shapes, job.dtypes)]
        groups = (chunk_plan(sizes, self.buffer_size_bytes) if self.packed
                  else [range(i, i + 1) for i in range(len(sizes))])
        refused: list[str] = []
        lengths = [sum(sizes[i] for i in chunk) for chunk in groups]
        landing = torch.empty(max(lengths, default=0), dtype=torch.uint8, device=self.device)  # one per update
        for chunk, length in zip(groups, lengths):
            buf = landing[:length]
            self._broadcast(buf)
            offset = 0
            for i in chunk:
                piece = buf[offset:offset + sizes[i]]
                if offset % job.dtypes[i].itemsize:  # packed bytes carry no alignment: a view needs it
                    piece = piece.clone()
                wire = piece.view(job.dtypes[i]).view(job.shapes[i])
                offset += sizes[i]
                try:
                    self._place(job.names[i], wire, views[job.names[i]])
                except (RuntimeError, TypeError) as e:
                    refused.append(f"{job.names[i]}: {e}")
        if refused:
            raise Refused(f"tensors not taken: {refused[:3]}")

    def _place(self, name: str, wire: torch.Tensor, dest: torch.Tensor) -> None:
        """This rank's box of ``wire`` into ``dest``, cast to the engine's dtype."""
        box = self.boxes.get(name)
        if box is not None:
            wire = wire[tuple(slice(s, s + n) for s, n in zip(box.start, box.length))]
        with torch.no_grad():
            dest.copy_(wire)

    def _broadcast(self, buf: torch.Tensor) -> None:
        if buf.is_cuda:  # vLLM's PyNcclCommunicator: on this thread's stream, which the copies follow
            self.wire.broadcast(buf, src=0, stream=torch.cuda.current_stream())
        else:
            self.wire.broadcast(buf, src=0)


def join_wire(config: Any, parallel_config: Any, device: torch.device, timeout_s: float, stop: threading.Event) -> Any:
    """This worker's member of the trainer's packed-wire group (``InflightConfig.wire``):
    vLLM's own ``PyNcclCommunicator`` on a GPU, a ``GlooWire`` on CPU; its rank is vLLM's
    (``rank_offset`` + the worker's rank across data-parallel groups). Blocks until the
    trainer and every worker joined, as vLLM's ``init_weight_transfer_engine`` does."""
    rank = config.rank_offset + parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
    if device.type == "cuda":
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

        info = NCCLWeightTransferInitInfo(
            master_address=config.master_address, master_port=config.master_port, rank_offset=config.rank_offset,
            world_size=config.world_size, nccl_unique_id_b64=config.nccl_unique_id_b64, packed=config.packed,
            packed_buffer_size_bytes=config.packed_buffer_size_bytes, packed_num_buffers=config.packed_num_buffers)
        return worker_init_process_group(info, parallel_config)
    if config.nccl_unique_id_b64 is not None:
        raise ValueError("inflight: nccl_unique_id_b64 names an NCCL group; this engine runs on CPU (gloo): give "
                         "master_address and master_port")
    from inflight.transport.packed_wire import GlooWire

    return GlooWire(config.master_address, config.master_port, rank, config.world_size, timeout_s=timeout_s, stop=stop)


def close_wire(wire: Any) -> None:
    """Let go of a packed-wire group (vLLM's communicator or a ``GlooWire``)."""
    try:
        wire.destroy()
    except Exception:  # a broken group may refuse a clean goodbye; nothing to save
        pass
