"""vLLM's packed weight broadcast (the wire of its ``nccl`` weight-transfer backend), both ends.

The byte layout, as vLLM 0.32 sends it (``packed_nccl_broadcast_producer``) and receives it
(``packed_nccl_broadcast_consumer``), and as this module does:

- ``update_info`` lists the tensors (``names``, ``dtype_names``, ``shapes``) in the order
  they are sent; nothing else travels ahead of the bytes.
- Packed: the tensors are cut into chunks in that order. A chunk takes tensors until its
  bytes exceed ``packed_buffer_size_bytes`` (the tensor that crosses the limit is in it);
  the last chunk takes what is left. Each chunk is one broadcast from group rank 0 of a
  uint8 tensor: each tensor's bytes (C-contiguous, the wire dtype, native byte order) back
  to back, with no header, padding or alignment. ``chunk_plan`` is that rule.
- Not packed: one broadcast per tensor, of its own shape and dtype.
- The group: the trainer is rank 0, an engine's workers ``rank_offset + worker rank``.

On GPU the group is vLLM's ``PyNcclCommunicator`` (joined with vLLM's own function). On CPU
it is a gloo group over a TCPStore that rank 0 hosts at ``master_address:master_port``
(``GlooWire``): vLLM's producer needs CUDA streams, so a CPU trainer sends with
``send_packed``, which packs with vLLM's own ``pack_tensors``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta

import torch
from torch.distributed import PrefixStore

from inflight.transport.data_plane import DataPlane
from inflight.transport.store import connect_retrying, host_store

PREFIX = "inflight-packed-wire"
"""Key prefix of the gloo group's rendezvous in rank 0's store."""


def chunk_plan(sizes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """The tensors (indices into ``sizes``, their bytes in send order) of each chunk."""
    if buffer_size_bytes <= 0:
        raise ValueError(f"packed_buffer_size_bytes={buffer_size_bytes} must be > 0")
    chunks: list[range] = []
    first, total = 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_size_bytes:
            chunks.append(range(first, i + 1))
            first, total = i + 1, 0
    if first < len(sizes):
        chunks.append(range(first, len(sizes)))
    return chunks


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize


class GlooWire:
    """A CPU group of the packed wire: rank 0 hosts the store at ``host:port`` and sends;
    every other rank receives. ``broadcast`` is timed out and aborts the group on failure."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, timeout_s: float = 120.0,
                 stop: threading.Event | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"packed wire rank {rank} outside 0..{world_size - 1}")
        self.rank = rank
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            self._store = host_store(host, port, world_size, timeout)
        else:
            self._store = connect_retrying(host, port, world_size, timeout_s, who=f"packed wire rank {rank}",
                                           deadline=time.monotonic() + timeout_s, stop=stop)
        self.plane = DataPlane(PrefixStore(PREFIX, self._store), rank=rank, pg_rank=rank, size=world_size,
                               backend="gloo", timeout=timeout, device=torch.device("cpu"),
                               peers=list(range(1, world_size)), superseded=lambda: False, bind=host, stop=stop)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """vLLM's communicator's call: ``tensor`` from rank ``src`` (0) into every member's."""
        if src != 0:
            raise ValueError(f"the packed wire broadcasts from rank 0, not {src}")
        self.plane.broadcast(tensor, what=f"a packed chunk of {tensor.numel()} B")

    def close(self) -> None:
        self.plane.close()

    destroy = close  # vLLM's name


def send_packed(pairs: Iterable[tuple[str, torch.Tensor]], wire: GlooWire,
                buffer_size_bytes: int) -> list[list[str]]:
    """Rank 0 on CPU: broadcast ``pairs`` packed, chunked by vLLM's own ``pack_tensors`` (the
    rule of ``chunk_plan``). Returns the names of each chunk sent."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    it: Iterator[tuple[str, torch.Tensor]] = iter(pairs)
    sent: list[list[str]] = []
    while (chunk := pack_tensors(it, lambda item: item[1], buffer_size_bytes)) is not None:
        wire.broadcast(chunk.packed_tensor, src=0)
        sent.append(list(chunk.names))
    return sent
