"""Trainer side of a weight update: ``WeightPusher.push(version, named_tensors)``.

Ordering invariants (rank 0 is the only writer, so it alone decides the sequence):
1. ``announce`` before any bucket; buckets only when *every* worker accepted, otherwise a
   single abort frame, so all workers always join the same broadcasts;
2. ``Commit`` only when every worker reported ``Staged``, otherwise ``Abort``: several
   engines never end up on different versions because one of them saw a bad bucket;
3. ``push`` returns after every worker replied ``Committed``: from then on every token the
   engines sample is tagged with the new version.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed import TCPStore

from inflight.protocol import (
    Abort,
    Accepted,
    Commit,
    Committed,
    Left,
    ProtocolError,
    Shutdown,
    Staged,
    UpdateAnnounce,
)
from inflight.settings import ChecksumChoice, PushDtype, check_choices
from inflight.shard_plan import check_digest
from inflight.transport.layer_pusher import push_layers, split
from inflight.transport.outcomes import Packed, PushRejected, PushResult, _split
from inflight.transport.sender import BucketSender, SendStats, SourceError, Tamper
from inflight.transport.control import TrainerControl
from inflight.transport.errors import TransportError, member
from inflight.transport.group import GroupConfig, WeightGroup
from inflight.transport.layout import dtype_name
from inflight.transport.packing import aligned_bucket_bytes, first_use_order
from inflight.transport.read_fence import ReadFence
from inflight.transport.sources import ShardedSource, Weights, weights_of
from inflight.transport.store import wait_key


@dataclass(frozen=True, kw_only=True)
class PushConfig:
    """How the trainer packs and sends an update."""

    bucket_mb: float = 256.0
    """Bucket size in MiB; tensors larger than a bucket span several."""
    checksum: ChecksumChoice = "auto"
    """Per-bucket checksum: ``auto`` is xxh3 on gloo (CPU) and wsum64 on NCCL (computed on the GPU)."""
    dtype: PushDtype = "keep"
    """Cast to the engine's dtype once while packing; ``keep`` sends each tensor's own dtype."""
    reply_timeout_s: float = 120.0
    """How long to wait for every worker's reply to each phase (accept, staged, committed)."""

    def __post_init__(self) -> None:
        check_choices(self, "PushConfig")
        if not self.bucket_mb > 0:
            raise ValueError(f"PushConfig.bucket_mb={self.bucket_mb} must be > 0")
        if not self.reply_timeout_s > 0:
            raise ValueError(f"PushConfig.reply_timeout_s={self.reply_timeout_s} must be > 0")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes, rounded down to a multiple of 64 so no element straddles two buckets."""
        return aligned_bucket_bytes(int(self.bucket_mb * (1 << 20)))


def _refuse_fp8_casts(named: Mapping[str, torch.Tensor], wire: Mapping[str, str]) -> None:
    """An engine serving an FP8 checkpoint takes its FP8 tensors as stored: a cast of a wider
    tensor to FP8 would drop the block scales that go with it."""
    for name, d in wire.items():
        if d.startswith("float8") and name in named and dtype_name(named[name].dtype) != d:
            raise ValueError(f"{name}: the engine serves it as {d} (an FP8 checkpoint), this push holds "
                             f"{named[name].dtype}: quantize on the trainer and send the tensors the checkpoint "
                             "stores (the weight in FP8 and its scales); a cast would drop the scales")


def check_update(version: int, named: Mapping[str, torch.Tensor], device: torch.device, *, sharded: bool = False) -> None:
    """Refuse, naming the problem, what the engines could only refuse later or misread:
    called before anything is packed, so a bad call costs the engines nothing. ``sharded``:
    ``named`` is a ``ShardedSource``'s layout (meta tensors), checked for names and dtypes."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r}: versions are integers >= 1 (0 names the weights the engines loaded)")
    if not isinstance(named, Mapping) or not named:
        raise ValueError(f"nothing to push: named tensors is {type(named).__name__} of {len(named) if hasattr(named, '__len__') else '?'} items")
    seen: dict[tuple, str] = {}
    for name, t in named.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} is not a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {type(t).__name__} is not a torch.Tensor")
        if not t.is_floating_point():
            raise ValueError(f"{name}: dtype {t.dtype} is not floating point (weights are; an index or mask tensor?)")
        if sharded:
            continue
        # packing copies into bucket buffers on the group's device: any real device can be read
        # from, except another GPU than the group's, which would be an implicit cross-device copy
        if t.device.type == "meta" or (t.device.type == device.type == "cuda" and t.device.index != device.index):
            raise ValueError(f"{name}: on device {t.device}, but this pusher sends from {device}")
        # a non-contiguous tensor is fine: packing copies its logical values, as .contiguous() would
        if t.numel():
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if view in seen:
                raise ValueError(f"{seen[view]!r} and {name!r} are one tied parameter: send it once, under the name "
                                 "the checkpoint stores (named_weights does)")
            seen[view] = name


class WeightPusher:
    """Rank 0 of the weight group. Not thread-safe: one push at a time."""

    def __init__(self, group: GroupConfig, config: PushConfig = PushConfig(), device: torch.device | None = None, *,
                 join_timeout_s: float | None = None, store: TCPStore | None = None,
                 stop: threading.Event | None = None) -> None:
        """Hosts the group (on ``store``, shared with other groups, if given) and waits up to
        ``join_timeout_s`` (default: the group's timeout) for every worker; ``InterruptedError``
        once ``stop`` is set meanwhile (a worker's process died: it will not come)."""
        self.config = config
        self.group = WeightGroup(group, rank=0, device=device, join_timeout_s=join_timeout_s, store=store, stop=stop)
        algo = config.checksum if config.checksum != "auto" else ("wsum64" if self.group.backend == "nccl" else "xxh3")
        self.sender = BucketSender(self.group, bucket_bytes=config.bucket_bytes, checksum_algo=algo)
        self.control = TrainerControl(self.group)
        self._dtype = None if config.dtype == "keep" else getattr(torch, config.dtype)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-push")
        self._in_flight: Future[PushResult] | None = None
        self._reads = ReadFence()  # between a push's reads of the caller's tensors and the caller's writes
        self._closed = False
        self._landed = -1  # the version the last push that landed in this generation committed
        # a script that ends without close() still says goodbye, so no engine reads a dead store
        ref = weakref.ref(self)
        self._atexit = lambda: (p := ref()) is not None and p.close("trainer process exiting")
        atexit.register(self._atexit)

    def _pack(self, version: int, weights: Weights) -> Packed:
        """Lay the update out: one announce for every worker (broadcast), or, in a generation
        whose members all sent shard plans, one per worker with its boxes only
        (``inflight.shard_plan``). Reads no tensor: buckets are packed as they are sent."""
        sharded = weights if isinstance(weights, ShardedSource) else None
        named = sharded.meta if sharded is not None else weights_of(weights)
        check_update(version, named, self.group.device, sharded=sharded is not None)
        source = sharded if sharded is not None else named
        plans = {r: h.plan for r, h in self.group.hellos.items()}  # point to point: None sends the whole model
        for rank, plan in plans.items():  # a corrupted plan is the trainer's to refuse; a mismatched update, the worker's
            if plan is not None:
                check_digest(plan, f"worker rank {rank}")

        kept = {n: d for h in self.group.hellos.values() for n, d in h.wire_dtypes.items()}  # fp32 of a bf16 engine
        _refuse_fp8_casts(named, kept)

        def lay_out(subset: Mapping[str, torch.Tensor]) -> dict[int | None, UpdateAnnounce]:
            if not self.group.point_to_point:
                return {None: self.sender.pack(version, subset, self._dtype, kept)}
            return dict(self.sender.pack_each(version, subset, plans, self._dtype, kept))
        if self.layered:
            if sharded is not None:
                raise ValueError("a ShardedSource gathers in one push's order: push it to whole-model engines "
                                 "(commit_unit='model'), or push plain tensors to layer-granular ones")
            groups = tuple(split(named, lay_out))
            return Packed(groups[0], source, groups)
        return Packed(lay_out(named), source)

    def send(self, version: int, weights: Weights, *, tamper: Tamper | None = None) -> tuple[SendStats, dict[int, Staged]]:
        """Phase 1: announce, stream the buckets, and collect ``Staged`` from every worker."""
        packed = self._pack(version, weights)
        if packed.groups:
            raise ValueError("layer-granular engines (commit_unit='layer') commit each group as it lands: use push()")
        self._reads.begin()
        with self._reads.reading():
            return self._send_packed(packed, tamper)

    def _send_packed(self, packed: Packed, tamper: Tamper | None = None) -> tuple[SendStats, dict[int, Staged]]:
        version = packed.version
        try:
            seq = self.control.post(packed.announces[None]) if None in packed.announces else self.control.post_each(packed.announces)  # type: ignore[arg-type]
            accepted, refused = _split(self.control.replies(seq, self.config.reply_timeout_s, f"announce of v{version}"), Accepted)
            if refused:
                self.sender.send_abort(version, "refused by " + ", ".join(member(r) for r in sorted(refused)))
                raise PushRejected(version, "announce", refused)
            stats = self._stream(packed, tamper)
        finally:
            if packed.sharded is not None:
                packed.sharded.finish(version)
            self._reads.done()
        staged, bad = _split(self.control.replies(seq, self.config.reply_timeout_s, f"buckets of v{version}", phase="staged"), Staged)
        if bad:
            self.abort(version, "a worker failed to stage")
            raise PushRejected(version, "staging", bad)
        return stats, staged  # type: ignore[return-value]

    def _stream(self, packed: Packed, tamper: Tamper | None) -> SendStats:
        """The buckets of an accepted update; a source that fails mid-stream drops it everywhere."""
        version, announces = packed.version, packed.announces
        try:
            if packed.sharded is not None:
                packed.sharded.begin(version, first_use_order([a.tensors for a in announces.values()],
                                                              [[(b.offset, b.nbytes) for b in a.buckets] for a in announces.values()]))
        except SourceError as e:  # the other trainer ranks are gone before any byte: call the update off
            self.sender.send_abort(version, str(e))
            raise
        try:
            return self.sender.send_each(announces, packed.source, tamper=tamper, on_read_done=self._reads.done)
        except SourceError as e:  # the stream ended in step: the workers that finished drop what they staged
            self.abort(version, str(e)[:200])
            raise

    def commit(self, version: int) -> dict[int, Committed]:
        """Phase 2: every worker swaps ``version`` in at its next step boundary."""
        seq = self.control.post(Commit(version=version))
        done, bad = _split(self.control.replies(seq, self.config.reply_timeout_s, f"commit of v{version}"), Committed)
        if bad:
            raise PushRejected(version, "commit", bad)
        return done  # type: ignore[return-value]

    def abort(self, version: int, reason: str = "") -> None:
        """Drop a staged ``version`` on every worker."""
        self.control.post(Abort(version=version, reason=reason))

    def push(self, version: int, weights: Weights, *, tamper: Tamper | None = None) -> PushResult:
        """Send then commit; returns when every engine serves ``version``. ``weights``: a module,
        a mapping or iterator of ``(name, tensor)``, or a ``ShardedSource`` (rank 0 of a sharded
        trainer; the other ranks call its ``follow``)."""
        self._reads.begin()
        return self._push_packed(self._pack(version, weights), tamper)

    @property
    def layered(self) -> bool:
        """Every worker of this generation commits one layer group at a time (``commit_unit="layer"``)."""
        return bool(self.group.hellos) and all(h.commit_unit == "layer" for h in self.group.hellos.values())

    def _push_packed(self, packed: Packed, tamper: Tamper | None = None) -> PushResult:
        with self._reads.reading():  # on CUDA, on the push's own stream (``ReadFence``)
            return self._push_reading(packed, tamper)

    def _push_reading(self, packed: Packed, tamper: Tamper | None) -> PushResult:
        if packed.groups:
            return push_layers(self, packed, tamper)
        t0 = time.perf_counter()
        stats, staged = self._send_packed(packed, tamper)
        t1 = time.perf_counter()
        commits = self.commit(packed.version)
        self._landed = packed.version
        return PushResult(packed.version, stats, staged, commits, t1 - t0, time.perf_counter() - t1)

    def push_async(self, version: int, weights: Weights, *, tamper: Tamper | None = None) -> Future[PushResult]:
        """Send and commit in the background; the tensors are read as their buckets go out.

        Reads, not writes: the caller may run the next forward and backward at once, but must
        call ``wait_reads`` before it writes a parameter (``optimizer.step``). Waits for the
        previous background push first: one update in flight.
        """
        return self.push_laid_out(self.lay_out(version, weights), tamper=tamper)

    def lay_out(self, version: int, weights: Weights) -> Packed:
        """The first half of ``push_async``: wait for the push in flight (one update at a time:
        its bucket buffers are in use), then check and lay out ``version`` (``_pack``). Bad
        input raises here, before anything is sent."""
        if self._in_flight is not None:
            self._in_flight.exception()  # wait; its owner reads the outcome
        return self._pack(version, weights)

    def push_laid_out(self, packed: Packed, *, tamper: Tamper | None = None) -> Future[PushResult]:
        """The second half of ``push_async``: send and commit what the last ``lay_out`` laid out."""
        self._reads.begin()
        self._in_flight = self._background.submit(self._push_packed, packed, tamper)
        return self._in_flight

    def wait_reads(self, timeout_s: float | None = None) -> float:
        """Block until the push in flight has read every tensor it sends (its last bucket is
        packed, or it ended), and on CUDA order the caller's stream after those reads
        (``ReadFence``); returns the seconds waited. Call it before writing parameters."""
        return self._reads.wait(timeout_s)

    @property
    def engine_versions(self) -> dict[int, int]:
        """Each member's live version: the last push that landed in the current generation of
        the group, or, before one, what the member reported when it joined."""
        return {r: max(h.live_version, self._landed) for r, h in self.group.hellos.items()}

    def rejoin(self, timeout_s: float | None = None, *, want: set[int] | None = None,
               require: set[int] | None = None) -> dict[int, int]:
        """After a failed push (an engine died or timed out), or to let knocking engines in:
        form the group's next generation, waiting up to ``timeout_s`` (a restarted engine
        needs its start-up time) for the ranks in ``want`` (default: all); returns the
        members' live versions. Raises ``TransportTimeout`` naming the ranks of ``require``
        (default: ``want``) that did not come back; it may be called again."""
        if self._in_flight is not None:
            self._in_flight.exception()  # let the failed push finish failing
            self._in_flight = None
        self._landed = -1
        self.group.reform(timeout_s, want=want, require=require)
        self.control = TrainerControl(self.group)  # message numbers restart with the generation
        return self.engine_versions

    def knocking(self) -> list[int]:
        """Worker ranks outside the current generation that want to join (see ``WeightGroup``)."""
        return self.group.knocking()

    def close(self, reason: str = "trainer done", *, goodbye_timeout_s: float = 5.0) -> None:
        """Tell the workers to stop listening, wait (up to ``goodbye_timeout_s``) until each let
        go of this store (``Left``), then leave the group. Idempotent.

        The wait is what lets an engine outlive its trainer quietly: a store client whose
        store's host exits prints a C++ stack trace on its next read."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._background.shutdown(wait=True)
        try:
            seq = self.control.post(Shutdown(reason=reason))
            self._await_goodbyes(seq, goodbye_timeout_s)
        except (TransportError, ProtocolError, RuntimeError):  # the group already broke: nobody to wait for
            pass
        finally:
            self.group.close()

    def _await_goodbyes(self, seq: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for rank in self.group.peers:
            key = f"rep/{seq}/ack/{rank}"
            gone = lambda r=rank: self.group.store.check([f"left/{r}"])  # noqa: E731  its engine stopped first
            try:
                raw = wait_key(self.group.store, key, timeout_s=max(deadline - time.monotonic(), 0.001), stop=None,
                               what=f"{member(rank)}'s goodbye", who=member(0), give_up=gone)
            except TransportError:
                continue
            if not isinstance(self.control.read_reply(key, raw, f"worker rank {rank}'s goodbye"), Left):
                raise ProtocolError(f"worker rank {rank} answered Shutdown with something other than Left")
