"""Workers' side of the data plane: ``BucketReceiver.receive`` lands an announced update's
buckets in the caller's flat buffer.

Ordering invariant: a receiver consumes exactly as many buckets as announced, each of the
size its header declares, even when one is bad (it then lands over the refused update's own
bytes), so the group stays in lockstep and the caller gets one ``UpdateRejected`` at the
end; or it stops at an ``Abort`` frame, which the sender sends in place of a header and
follows with nothing (the update was refused elsewhere, or its source failed mid-stream).
Each bucket's checksum and MAC come in its header, checked against the bytes that landed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import torch

from inflight.auth import bucket_mac
from inflight.memory import BucketWindows
from inflight.protocol import Abort, BucketHeader, BucketSpec, ProtocolError, UpdateAnnounce
from inflight.transport.errors import TransportError, UpdateRejected, member
from inflight.transport.frames import FRAME_BYTES, mac_context, unframe
from inflight.transport.group import WeightGroup
from inflight.transport.layout import checksum


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
            raise TransportError(f"{member(self.group.rank)}: a bucket of v{announce.version} declares {nbytes} B, more "
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
        landed: tuple[BucketSpec, BucketHeader, torch.Tensor] | None = None  # received, not yet verified
        n = len(announce.buckets)
        next_header = self.group.start_frame(self._frames[0], what=f"header of bucket 0 of v{v}")
        for spec in announce.buckets:
            self.group.wait(next_header, timeout_s)
            header, error = self._header(spec, announce)
            nbytes = spec.nbytes if header is None else header.nbytes
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
                first_error = first_error or self._settle(landed, announce, dest if to_host else None, on_verified)
            self.group.wait(pending, timeout_s)
            landed = (spec, header, window) if good and header is not None else None
            if on_bucket is not None:
                on_bucket(spec.index)
        if landed is not None:
            first_error = first_error or self._settle(landed, announce, dest if to_host else None, on_verified)
        if first_error is not None:
            raise first_error

    def _header(self, spec: BucketSpec, announce: UpdateAnnounce) -> tuple[BucketHeader | None, UpdateRejected | None]:
        """Bucket ``spec``'s header as it landed, None where unreadable, and the refusal it earns.
        An ``Abort`` in its place raises ``UpdateRejected``; a declared size above
        ``bucket_bytes`` raises ``TransportError``: the sender is not speaking this protocol,
        there is no safe place to land the bucket, and the group must be rebuilt."""
        v = announce.version
        header: BucketHeader | None = None
        try:
            frame = unframe(self._frames[spec.index % 2])
        except ProtocolError as e:
            error: UpdateRejected | None = UpdateRejected("bad_message", f"bucket {spec.index}: {e}")
        else:
            if isinstance(frame, Abort):  # called off: refused elsewhere, or its source failed mid-stream
                raise UpdateRejected("aborted", f"v{v} aborted by the trainer before bucket {spec.index}: {frame.reason}")
            header = frame
            error = self._check_header(header, spec, v)
        nbytes = spec.nbytes if header is None else header.nbytes
        if nbytes > announce.bucket_bytes:
            raise TransportError(f"{member(self.group.rank)}: bucket {spec.index} of v{v} declares {nbytes} B > "
                                 f"bucket_bytes {announce.bucket_bytes}; the data plane is out of step")
        return header, error

    def _settle(self, landed: tuple[BucketSpec, BucketHeader, torch.Tensor], announce: UpdateAnnounce,
                host: torch.Tensor | None, on_verified: Callable[[int], None] | None) -> UpdateRejected | None:
        """Verify the bucket that landed last; with host staging, copy it to the host once it
        verified (synchronously: its landing slot is reused two buckets later); then
        ``on_verified``. Returns its refusal, or None."""
        spec, header, window = landed
        error = self._verify(header, window, announce) or self._authenticate(header, window, announce.version)
        if error is None and host is not None:
            host[spec.offset: spec.offset + spec.nbytes].copy_(window)
        if error is None and on_verified is not None:
            on_verified(spec.index)
        return error

    @staticmethod
    def _verify(header: BucketHeader, window: torch.Tensor, announce: UpdateAnnounce) -> UpdateRejected | None:
        if checksum(window, announce.checksum_algo) == header.checksum:
            return None
        return UpdateRejected("checksum", f"bucket {header.index} of v{announce.version}: {announce.checksum_algo} mismatch")

    def _authenticate(self, header: BucketHeader, window: torch.Tensor, version: int) -> UpdateRejected | None:
        """With a secret, the bucket's bytes must carry the trainer's MAC (a valid checksum is not
        proof: anyone who reaches the data plane can match a linear one)."""
        secret = self.group.secret
        if secret is None:
            return None
        if window.device.type != "cpu" and self.windows is not None and self.windows.mac_host is not None:
            window = self.windows.mac_host[:window.numel()].copy_(window)  # the reserved host copy, not a new one
        rank = self.group.rank if self.group.point_to_point else None
        if hmac.compare_digest(header.mac, bucket_mac(secret, mac_context(self.group, version, header.index, rank), window)):
            return None
        return UpdateRejected("unauthenticated", f"bucket {header.index} of v{version}: its bytes do not carry the "
                                                 "trainer's MAC (forged or altered in transit; INFLIGHT_SECRET)")

    def receive_abort(self, version: int, timeout_s: float | None = None) -> None:
        """Join the single abort frame that follows an announce this worker refused."""
        self.group.wait(self.group.start_frame(self._frames[0], what=f"abort frame of v{version}"), timeout_s)
        try:
            frame = unframe(self._frames[0])
        except ProtocolError as e:
            raise TransportError(f"{member(self.group.rank)}: expected the abort frame of v{version}: {e}") from None
        if not isinstance(frame, Abort):
            raise TransportError(f"{member(self.group.rank)}: refused v{version} but the trainer sent buckets anyway")

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
        if header.offset != spec.offset or header.nbytes != spec.nbytes:
            return UpdateRejected("bad_layout", f"bucket {spec.index} of v{version}: header does not match the announce")
        return None
