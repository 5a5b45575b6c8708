"""The frames of the data plane: a fixed-size header before each bucket, or an ``Abort`` in
its place; and what a bucket's MAC binds. Shared by the sender and the receivers."""

from __future__ import annotations

import torch

from inflight.protocol import FrameMessage, ProtocolError, decode_frame, encode
from inflight.transport.group import WeightGroup


def mac_context(group: WeightGroup, version: int, index: int, rank: int | None = None) -> str:
    """What a bucket's MAC binds: its version and index, and, when it goes to one worker
    alone, that worker (a bucket sent to one rank cannot be replayed to another)."""
    return group.auth_context(f"bucket/{version}/{index}" if rank is None else f"bucket/{version}/{rank}/{index}")


FRAME_BYTES = 256  # header frame: 4-byte little-endian length + msgpack, zero padded


def frame(msg: FrameMessage, device: torch.device) -> torch.Tensor:
    """``msg`` as one ``FRAME_BYTES`` tensor on ``device``."""
    body = encode(msg)
    if len(body) > FRAME_BYTES - 4:
        raise ValueError(f"frame of {len(body)} bytes does not fit {FRAME_BYTES} bytes")
    raw = len(body).to_bytes(4, "little") + body
    out = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out.to(device)


def unframe(data: torch.Tensor) -> FrameMessage:
    """The message a received frame holds; ``ProtocolError`` if it holds none."""
    raw = data.cpu().numpy().tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= FRAME_BYTES - 4:
        raise ProtocolError(f"frame declares {n} bytes")
    return decode_frame(raw[4: 4 + n])
