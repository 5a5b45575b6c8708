"""The data plane: stream an update's flat bytes bucket by bucket over the group.

Sender (rank 0): ``pack`` casts every tensor once into a flat snapshot buffer and
checksums each bucket, giving the ``UpdateAnnounce``; ``send`` broadcasts, per bucket, a
fixed-size header frame and then the bucket's bytes. The snapshot is the sender's own
copy, so the trainer may keep stepping its optimizer while the bytes are in flight.

Receiver (workers): ``receive`` lands each bucket straight into the caller's flat buffer
(no intermediate copy) after checking its header against the announce, and verifies the
checksum. Ordering invariant: a receiver consumes exactly as many buckets as announced,
each of the size its header declares, even when one is bad (it then lands over the
refused update's own bytes), so the group stays in lockstep and the caller gets one
``UpdateRejected`` at the end.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import torch

from inflight.auth import bucket_mac
from inflight.memory import BucketWindows
from inflight.shard_plan import inside
from inflight.protocol import (
    Abort,
    BucketHeader,
    BucketSpec,
    ChecksumAlgo,
    FrameMessage,
    ProtocolError,
    ShardPlan,
    UpdateAnnounce,
    decode_frame,
    encode,
)
from inflight.transport.errors import TransportError, UpdateRejected
from inflight.transport.group import WeightGroup
from inflight.transport.layout import bucket_specs, checksum, dtype_name, pack_into, plan_tensors

def _mac_context(group: WeightGroup, version: int, index: int, rank: int | None = None) -> str:
    """What a bucket's MAC binds: its version and index, and, when it goes to one worker
    alone, that worker (a bucket sent to one rank cannot be replayed to another)."""
    return group.auth_context(f"bucket/{version}/{index}" if rank is None else f"bucket/{version}/{rank}/{index}")


FRAME_BYTES = 256  # header frame: 4-byte little-endian length + msgpack, zero padded


def _frame(msg: FrameMessage, device: torch.device) -> torch.Tensor:
    body = encode(msg)
    if len(body) > FRAME_BYTES - 4:
        raise ValueError(f"frame of {len(body)} bytes does not fit {FRAME_BYTES} bytes")
    raw = len(body).to_bytes(4, "little") + body
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return frame.to(device)


def _unframe(frame: torch.Tensor) -> FrameMessage:
    raw = frame.cpu().numpy().tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= FRAME_BYTES - 4:
        raise ProtocolError(f"frame declares {n} bytes")
    return decode_frame(raw[4: 4 + n])


@dataclass(frozen=True)
class SendStats:
    version: int
    nbytes: int
    buckets: int
    pack_s: float
    send_s: float


# A fault-injection seam for tests and drills: may replace a bucket's header and bytes.
Tamper = Callable[[BucketHeader, torch.Tensor], tuple[BucketHeader, torch.Tensor]]


class BucketSender:
    """Rank 0: owns the flat snapshot buffer, reused across versions."""

    def __init__(self, group: WeightGroup, *, bucket_bytes: int, checksum_algo: ChecksumAlgo) -> None:
        if group.rank != 0:
            raise ValueError("only rank 0 sends weights")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.checksum_algo = checksum_algo
        self._flats: dict[int | None, torch.Tensor] = {}  # None: the broadcast snapshot; a rank: its own
        self.last_pack_s = 0.0

    def pack(self, version: int, named: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> UpdateAnnounce:
        """Snapshot ``named`` (cast to ``dtype`` if given) and describe it; the caller's tensors are free afterwards."""
        t0 = time.perf_counter()
        wire = {name: dtype_name(dtype or t.dtype) for name, t in named.items()}
        tensors, total = plan_tensors((name, tuple(t.shape), wire[name]) for name, t in named.items())
        announce = self._snapshot(None, version, tensors, total, named)
        self.last_pack_s = time.perf_counter() - t0
        return announce

    def pack_each(self, version: int, named: Mapping[str, torch.Tensor], plans: Mapping[int, ShardPlan],
                  dtype: torch.dtype | None = None) -> dict[int, UpdateAnnounce]:
        """Snapshot, for each worker, the boxes of ``named`` its shard plan asks for (in the
        update's tensor order), and describe them: one announce per worker."""
        t0 = time.perf_counter()
        wire = {name: dtype_name(dtype or t.dtype) for name, t in named.items()}
        out = {}
        for rank, plan in plans.items():
            boxes = {s.name: (s.start, s.length) for s in plan.shards}
            # a tensor the plan has no box for that fits goes whole (start ()): the worker refuses
            # the update naming it, as it would a broadcast one
            fit = {n: b for n, b in boxes.items() if n in named and inside(*b, named[n].shape)}
            tensors, total = plan_tensors(((n, fit[n][1] if n in fit else tuple(t.shape), wire[n]) for n, t in named.items()),
                                          starts={n: fit[n][0] if n in fit else () for n in named})
            out[rank] = msgspec.structs.replace(self._snapshot(rank, version, tensors, total, named), plan_digest=plan.digest)
        self.last_pack_s = time.perf_counter() - t0
        return out

    def _snapshot(self, rank: int | None, version: int, tensors: tuple, total: int,
                  named: Mapping[str, torch.Tensor]) -> UpdateAnnounce:
        flat = self._flats.get(rank)
        if flat is None or flat.numel() < total:
            flat = self._flats[rank] = torch.empty(total, dtype=torch.uint8, device=self.group.device)
        flat[:total].zero_()  # alignment padding is part of the checksummed bytes
        pack_into(flat, tensors, named)
        buckets = bucket_specs(flat, total, self.bucket_bytes, self.checksum_algo)
        if self.group.secret is not None:  # the announce is sealed, so the MACs in it are the trainer's
            buckets = tuple(msgspec.structs.replace(b, mac=bucket_mac(self.group.secret, _mac_context(
                self.group, version, b.index, rank), flat[b.offset: b.offset + b.nbytes])) for b in buckets)
        return UpdateAnnounce(version=version, total_bytes=total, bucket_bytes=self.bucket_bytes,
                              checksum_algo=self.checksum_algo, tensors=tensors, buckets=tuple(buckets))

    def send(self, announce: UpdateAnnounce, *, tamper: Tamper | None = None) -> SendStats:
        """Broadcast every bucket of the last ``pack``; returns when all broadcasts completed.

        Keeps at most two buckets in flight, so the link stays busy while the receivers
        verify the previous bucket.
        """
        return self.send_each({None: announce}, tamper=tamper)

    def send_each(self, announces: Mapping[int | None, UpdateAnnounce], *, tamper: Tamper | None = None) -> SendStats:
        """Send every bucket of the last ``pack`` (``{None: announce}``: broadcast) or
        ``pack_each`` (``{rank: announce}``: each worker its own, in turn, bucket by bucket).
        Keeps at most two buckets in flight per destination, so the link stays busy while
        the receivers verify the previous bucket."""
        t0 = time.perf_counter()
        in_flight: dict[int | None, list[tuple]] = {r: [] for r in announces}
        for i in range(max((len(a.buckets) for a in announces.values()), default=0)):
            for rank, announce in announces.items():
                if i >= len(announce.buckets):
                    continue
                b, v, n = announce.buckets[i], announce.version, len(announce.buckets)
                header = BucketHeader(version=v, index=b.index, offset=b.offset, nbytes=b.nbytes, checksum=b.checksum)
                data = self._flats[rank][b.offset: b.offset + b.nbytes]
                if tamper is not None:
                    header, data = tamper(header, data)
                to = "" if rank is None else f" to rank {rank}"
                in_flight[rank].append(self._post(_frame(header, self.group.device), rank, f"header of bucket {b.index} of v{v}{to}"))
                in_flight[rank].append(self._post(data, rank, f"bucket {b.index}/{n} of v{v}{to} ({data.numel()} B)"))
                while len(in_flight[rank]) > 4:
                    self.group.wait(in_flight[rank].pop(0))
        for pending in in_flight.values():
            for p in pending:
                self.group.wait(p)
        first = next(iter(announces.values()))
        return SendStats(first.version, sum(a.total_bytes for a in announces.values()),
                         sum(len(a.buckets) for a in announces.values()), self.last_pack_s, time.perf_counter() - t0)

    def _post(self, tensor: torch.Tensor, rank: int | None, what: str) -> tuple:
        if rank is None:
            return self.group.start_broadcast(tensor, what=what)
        return self.group.start_send(tensor, rank, what=what)

    def send_abort(self, version: int, reason: str) -> None:
        """The single ``Abort`` frame that replaces the buckets of a refused update: broadcast,
        or sent to each worker in a point-to-point generation."""
        frame = _frame(Abort(version=version, reason=reason[:120]), self.group.device)
        ranks = list(self.group.roster) if self.group.point_to_point else [None]
        for pending in [self._post(frame, r, f"abort frame of v{version}") for r in ranks]:
            self.group.wait(pending)


class BucketReceiver:
    """A worker: receives announced buckets into caller-provided flat storage."""

    def __init__(self, group: WeightGroup, windows: BucketWindows | None = None) -> None:
        self.group = group
        # two header frames: the next bucket's header is posted while this bucket's bytes arrive
        self._frames = [torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=group.device) for _ in range(2)]
        # reserved at the worker's start (``inflight.memory``), or allocated on need (tests, peers)
        self.windows = windows
        # host staging on a device data plane: buckets land here (NCCL writes device memory
        # only), are verified, then copied to the host destination; two, like the frames
        self._landing: list[torch.Tensor] = [] if windows is None else windows.landing

    def fits(self, announce: UpdateAnnounce) -> str | None:
        """Why this receiver cannot land ``announce``'s buckets in what it reserved, or None."""
        w = self.windows
        if w is None or announce.bucket_bytes <= w.bucket_bytes:
            return None
        return (f"v{announce.version} comes in buckets of {announce.bucket_bytes} B, larger than the {w.bucket_bytes} B "
                "this worker reserved (InflightConfig.max_bucket_mb; the trainer's bucket_mb must not exceed it)")

    def _landing_for(self, index: int, nbytes: int, bucket_bytes: int) -> torch.Tensor:
        if not self._landing or self._landing[0].numel() < bucket_bytes:  # sized once per bucket size
            self._landing = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]
        return self._landing[index % 2][:nbytes]

    def _refused_window(self, dest: torch.Tensor, nbytes: int, announce: UpdateAnnounce) -> torch.Tensor:
        """Where a bucket of a refused update lands so the group stays in step: the update's
        own staging buffer (nothing reads it again: feeding stopped at the first error), so
        no scratch memory is ever needed. A bucket larger than the whole buffer means the
        sender is not speaking this protocol."""
        if nbytes > dest.numel():
            raise TransportError(f"rank {self.group.rank}: a bucket of v{announce.version} declares {nbytes} B, more "
                                 f"than the whole update ({announce.total_bytes} B); the data plane is out of step")
        return dest[:nbytes]

    def receive(
        self,
        announce: UpdateAnnounce,
        dest: torch.Tensor,
        *,
        on_bucket: Callable[[int], None] | None = None,
        on_verified: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Fill ``dest[:total_bytes]`` with the update; raise ``UpdateRejected`` if any bucket is bad.

        ``on_bucket(i)`` runs when bucket i has landed; ``on_verified(i)`` once buckets 0..i
        all passed their checksums (in order, never after a bad one), while bucket i + 1 is
        already on the wire: work done there overlaps the transfer. Neither may raise.

        ``dest`` lives on the data plane's device, or in host memory while the data plane is
        on CUDA (host staging): each bucket then lands on the device and is copied to the
        host once its checksum matched. Transport failures (timeouts, a dead peer) raise ``TransportError`` instead: the
        group is then out of step and must be rebuilt.
        """
        if dest.dtype != torch.uint8 or dest.dim() != 1 or dest.numel() < announce.total_bytes:
            raise ValueError(f"dest must be a 1-D uint8 tensor of >= {announce.total_bytes} bytes")
        to_host = dest.device.type == "cpu" and self.group.device.type == "cuda"
        if dest.device != self.group.device and not to_host:
            raise ValueError(f"dest on {dest.device}, group data plane on {self.group.device}")
        v = announce.version
        first_error: UpdateRejected | None = None
        landed: tuple[BucketSpec, torch.Tensor] | None = None  # received, not yet verified
        n = len(announce.buckets)
        next_header = self.group.start_frame(self._frames[0], what=f"header of bucket 0 of v{v}")
        for spec in announce.buckets:
            self.group.wait(next_header, timeout_s)
            header: BucketHeader | None = None
            try:
                frame = _unframe(self._frames[spec.index % 2])
            except ProtocolError as e:
                error: UpdateRejected | None = UpdateRejected("bad_message", f"bucket {spec.index}: {e}")
            else:
                if isinstance(frame, Abort):
                    if spec.index == 0:  # the trainer called the update off before any bytes
                        raise UpdateRejected("aborted", f"v{v} aborted by the trainer: {frame.reason}")
                    raise TransportError(f"rank {self.group.rank}: abort frame after bucket {spec.index - 1} of v{v}")
                header = frame
                error = self._check_header(header, spec, v)
            # A declared size above bucket_bytes means the sender is not speaking this
            # protocol: there is no safe place to land it, so the group must be rebuilt.
            nbytes = spec.nbytes if header is None else header.nbytes
            if nbytes > announce.bucket_bytes:
                raise TransportError(
                    f"rank {self.group.rank}: bucket {spec.index} of v{v} declares {nbytes} B > bucket_bytes "
                    f"{announce.bucket_bytes}; the data plane is out of step"
                )
            first_error = first_error or error
            good = first_error is None
            if to_host:
                window = self._landing_for(spec.index, nbytes, announce.bucket_bytes)
            elif good:
                window = dest[spec.offset: spec.offset + nbytes]
            else:  # the update is refused: its bytes are garbage from here on, and land over its own
                window = self._refused_window(dest, nbytes, announce)
            pending = self.group.start_frame(window, what=f"bucket {spec.index}/{n} of v{v}")
            if spec.index + 1 < n:
                next_header = self.group.start_frame(
                    self._frames[(spec.index + 1) % 2], what=f"header of bucket {spec.index + 1} of v{v}"
                )
            if landed is not None:  # verify the previous bucket while this one is on the wire
                first_error = first_error or self._settle(*landed, announce, dest if to_host else None)
                if first_error is None and on_verified is not None:
                    on_verified(landed[0].index)
            self.group.wait(pending, timeout_s)
            landed = (spec, window) if good else None
            if on_bucket is not None:
                on_bucket(spec.index)
        if landed is not None:
            first_error = first_error or self._settle(*landed, announce, dest if to_host else None)
            if first_error is None and on_verified is not None:
                on_verified(landed[0].index)
        if first_error is not None:
            raise first_error

    def _settle(self, spec: BucketSpec, window: torch.Tensor, announce: UpdateAnnounce,
                host: torch.Tensor | None) -> UpdateRejected | None:
        """Verify a landed bucket; with host staging, copy it to the host once it verified
        (synchronously: its landing slot is reused two buckets later)."""
        error = self._verify(spec, window, announce) or self._authenticate(spec, window, announce.version)
        if error is None and host is not None:
            host[spec.offset: spec.offset + spec.nbytes].copy_(window)
        return error

    @staticmethod
    def _verify(spec: BucketSpec, window: torch.Tensor, announce: UpdateAnnounce) -> UpdateRejected | None:
        if checksum(window, announce.checksum_algo) == spec.checksum:
            return None
        return UpdateRejected("checksum", f"bucket {spec.index} of v{announce.version}: {announce.checksum_algo} mismatch")

    def _authenticate(self, spec: BucketSpec, window: torch.Tensor, version: int) -> UpdateRejected | None:
        """With a secret, the bucket's bytes must carry the trainer's MAC (a valid checksum is not
        proof: anyone who reaches the data plane can match a linear one)."""
        secret = self.group.secret
        if secret is None:
            return None
        if window.device.type != "cpu" and self.windows is not None and self.windows.mac_host is not None:
            window = self.windows.mac_host[:window.numel()].copy_(window)  # the reserved host copy, not a new one
        rank = self.group.rank if self.group.point_to_point else None
        if hmac.compare_digest(spec.mac, bucket_mac(secret, _mac_context(self.group, version, spec.index, rank), window)):
            return None
        return UpdateRejected("unauthenticated", f"bucket {spec.index} of v{version}: its bytes do not carry the "
                                                 "trainer's MAC (forged or altered in transit; INFLIGHT_SECRET)")

    def receive_abort(self, version: int, timeout_s: float | None = None) -> None:
        """Join the single abort frame that follows an announce this worker refused."""
        self.group.wait(self.group.start_frame(self._frames[0], what=f"abort frame of v{version}"), timeout_s)
        try:
            frame = _unframe(self._frames[0])
        except ProtocolError as e:
            raise TransportError(f"rank {self.group.rank}: expected the abort frame of v{version}: {e}") from None
        if not isinstance(frame, Abort):
            raise TransportError(f"rank {self.group.rank}: refused v{version} but the trainer sent buckets anyway")

    @staticmethod
    def _check_header(header: BucketHeader, spec: BucketSpec, version: int) -> UpdateRejected | None:
        if header.version != version:
            return UpdateRejected("bucket_order", f"bucket header says v{header.version}, update is v{version}")
        if header.index != spec.index:
            return UpdateRejected(
                "bucket_order", f"expected bucket {spec.index} of v{version}, got bucket {header.index} (duplicate or out of order)"
            )
        if header.nbytes < spec.nbytes:
            return UpdateRejected("short_bucket", f"bucket {spec.index} of v{version}: {header.nbytes} B, announced {spec.nbytes} B")
        if header.offset != spec.offset or header.nbytes != spec.nbytes or header.checksum != spec.checksum:
            return UpdateRejected("bad_layout", f"bucket {spec.index} of v{version}: header does not match the announce")
        return None
