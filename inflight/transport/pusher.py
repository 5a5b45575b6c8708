"""Trainer side of a weight update: ``WeightPusher.push(version, named_tensors)``, the whole
model at once or one layer group at a time, whose buckets ``inflight.transport.bucket``
streams; the ``ReadFence`` between a push's reads and the optimizer's writes; and what a push
laid out (``UpdateLayout``) and came to (``PushResult``, ``PushRejected``, ``LayerPushIncomplete``).

Ordering invariants (rank 0 is the only writer, so it alone decides the sequence):
1. ``announce`` before any bucket; buckets only when *every* worker accepted, otherwise a single abort frame,
   so all workers always join the same broadcasts;
2. ``Commit`` only when every worker reported ``Staged``, otherwise ``Abort``: several engines never end up on
   different versions because one of them saw a bad bucket;
3. ``push`` returns after every worker replied ``Committed``: from then on every token the engines sample is
   tagged with the new version;
4. layer-granular (``_push_layers``: one announce per layer group, in ``inflight.layer_groups`` order, and no
   ``Commit``): group k's buckets go out only once every worker accepted group k, which it does only with room
   to stage it (``staged_groups``), so sending is paced by the engines' commits; the first group any worker
   refuses ends the update (an abort frame for its buckets, no later group sent), the groups before it commit,
   the engines serve that hybrid, and ``LayerPushIncomplete`` says how many groups landed;
5. the optimizer may write a parameter only after the push read it (``ReadFence``): ``wait_reads`` opens after
   the last bucket (of the last group) is packed. On CUDA the push packs and checksums on a stream of its own,
   ordered against the trainer's by two events (docs/design.md); a CPU trainer creates no CUDA context.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import torch
from torch.distributed import TCPStore

from inflight.layer_groups import layer_groups
from inflight.protocol import (
    Abort,
    Accepted,
    Commit,
    Committed,
    Left,
    ProtocolError,
    Rejected,
    ReplyMessage,
    ShardPlan,
    Shutdown,
    Staged,
    UpdateAnnounce,
)
from inflight.settings import (
    ChecksumChoice,
    PushDtype,
    PushEncoding,
    SparseCodecChoice,
    check_choices,
)
from inflight.shard_plan import check_digest
from inflight.transport.bucket import (
    BucketSender,
    SendStats,
    aligned_bucket_bytes,
    dtype_name,
    first_use_order,
    wire_dtypes,
)
from inflight.transport.delta import DeltaEncoder, Encoded
from inflight.transport.errors import TransportError, member
from inflight.transport.group import TrainerControl, WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.sources import ShardedSource, SourceError, Weights, weights_of
from inflight.transport.store import wait_key

log = logging.getLogger("inflight.pusher")



@dataclass(frozen=True)
class UpdateLayout:
    """An update laid out: ``{None: announce}`` (broadcast) or ``{rank: announce}`` (each worker
    its own), and what its buckets are read from: the caller's tensors by name, or a sharded
    source that gathers them."""

    announces: dict[int | None, UpdateAnnounce]
    source: Mapping[str, torch.Tensor] | ShardedSource
    groups: tuple[dict[int | None, UpdateAnnounce], ...] = ()
    """A layer-granular update: one layout per layer group (``announces`` is the first)."""
    encoded: Encoded | None = None
    """A sparse update: its encoding against the engine's base (``announces`` carry its delta)."""
    dense: Mapping[str, torch.Tensor] | None = None
    """With ``PushConfig.encoding="sparse"``: the version's wire bytes, what a dense resend reads."""

    @property
    def sharded(self) -> ShardedSource | None:
        return self.source if isinstance(self.source, ShardedSource) else None

    @property
    def version(self) -> int:
        return next(iter(self.announces.values())).version


class PushRejected(RuntimeError):
    """At least one worker refused the update; the engines keep their last good version."""

    def __init__(self, version: int, phase: str, rejections: dict[int, Rejected]) -> None:
        detail = "; ".join(f"worker rank {r}: [{m.code}] {m.reason}" for r, m in sorted(rejections.items()))
        super().__init__(f"update v{version} refused at {phase}: {detail}")
        self.version = version
        self.phase = phase
        self.rejections = rejections

    @property
    def codes(self) -> set[str]:
        return {m.code for m in self.rejections.values()}


@dataclass(frozen=True)
class PushResult:
    version: int
    send: SendStats
    staged: dict[int, Staged]
    commits: dict[int, Committed]
    stage_wait_s: float
    commit_wait_s: float
    groups: tuple[dict[int, Committed], ...] = ()
    """A layer-granular update: every rank's ``Committed`` for each layer group, in order."""

    @property
    def stall_ms(self) -> float:
        """What the engine spent committing (lowest rank): the commit, or every group's."""
        commits = self.groups or (self.commits,)
        return sum(c[min(c)].commit_ms for c in commits)

    @property
    def step(self) -> int:
        """Engine step after which ``version`` went live (lowest rank's engine)."""
        return self.commits[min(self.commits)].step


def _split(replies: dict[int, ReplyMessage], want: type) -> tuple[dict[int, object], dict[int, Rejected]]:
    good = {r: m for r, m in replies.items() if isinstance(m, want)}
    bad = {r: m for r, m in replies.items() if isinstance(m, Rejected)}
    odd = {r: m for r, m in replies.items() if r not in good and r not in bad}
    if odd:
        raise RuntimeError(f"protocol violation: expected {want.__name__}, got {odd}")
    return good, bad


class LayerPushIncomplete(RuntimeError):
    """A layer-granular update stopped at group ``landed``: groups ``0 .. landed - 1`` are live
    on every engine rank (the engines serve that hybrid), the rest are not."""

    def __init__(self, version: int, landed: int, parts: int, group: int, rejections: dict[int, Rejected]) -> None:
        detail = "; ".join(f"worker rank {r}: [{m.code}] {m.reason}" for r, m in sorted(rejections.items()))
        super().__init__(f"update v{version} stopped at layer group {group} of {parts}; groups 0..{landed - 1} "
                         f"landed: {detail}")
        self.version, self.landed, self.parts, self.group, self.rejections = version, landed, parts, group, rejections

    @property
    def codes(self) -> set[str]:
        return {m.code for m in self.rejections.values()}


class ReadFence:
    """``begin`` (the caller, before a push) -> ``reading`` and ``done`` (the push's thread)
    -> ``wait`` (the caller, before it writes a parameter)."""

    def __init__(self) -> None:
        self._host = threading.Event()
        self._host.set()
        self.stream: torch.cuda.Stream | None = None
        """The push's CUDA stream (made at the first push of a CUDA trainer)."""
        self._begun: torch.cuda.Event | None = None
        self._read: torch.cuda.Event | None = None

    def begin(self) -> None:
        """A push starts: it reads only what the caller's stream queued so far (the last optimizer step)."""
        self._host.clear()
        self._begun = self._read = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            self._begun = torch.cuda.Event()
            self._begun.record()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """The push's thread packs on the push's stream, after ``begin``'s point of the caller's."""
        if self._begun is None or self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._begun)
            yield

    def done(self) -> None:
        """The push read every tensor it sends (or ended); a second call changes nothing."""
        if self._host.is_set():
            return
        if self._begun is not None and self.stream is not None:
            read = torch.cuda.Event()
            read.record(self.stream)
            self._read = read
        self._host.set()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until ``done``, and order the caller's stream after the push's reads; the seconds waited."""
        t0 = time.perf_counter()
        if not self._host.wait(timeout_s):
            raise TimeoutError(f"the push in flight still reads the trainer's tensors after {timeout_s} s")
        if self._read is not None:
            torch.cuda.current_stream().wait_event(self._read)
        return time.perf_counter() - t0


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
    encoding: PushEncoding = "dense"
    """``sparse``: send each tensor as the elements that changed against the version the
    engine serves, where that is smaller (``inflight.transport.delta``). Needs engines that
    keep their live version's bytes (``InflightConfig(keep_base=True)``); the trainer keeps
    the last two versions' wire bytes. Whole-model pushes of plain tensors only: layer
    groups, shard plans and sharded sources travel dense, as does any update to an engine
    that does not hold the base (it refuses, and gets the update dense at once)."""
    sparse_codec: SparseCodecChoice = "auto"
    """How a changed tensor travels (``inflight.transport.delta``): ``xor_zstd`` (its bits xor
    the base's, zstd-compressed on the host), ``index`` (indices and values, on the tensors'
    device), or ``auto``: ``xor_zstd`` on a gloo data plane, ``index`` on NCCL."""

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


def check_update(version: int, named: Mapping[str, torch.Tensor], device: torch.device, *,
                 sharded: bool = False) -> None:
    """Refuse, naming the problem, what the engines could only refuse later or misread:
    called before anything is laid, so a bad call costs the engines nothing. ``sharded``:
    ``named`` is a ``ShardedSource``'s layout (meta tensors), checked for names and dtypes."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r}: versions are integers >= 1 (0 names the weights the engines loaded)")
    if not isinstance(named, Mapping) or not named:
        raise ValueError(f"nothing to push: named tensors is {type(named).__name__} of "
                         f"{len(named) if hasattr(named, '__len__') else '?'} items")
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


def whole_boxes(plan: ShardPlan, named: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``plan``'s boxes are the whole of every tensor (one worker per engine)."""
    return all(not any(s.start) and tuple(s.length) == tuple(named[s.name].shape)
               for s in plan.shards if s.name in named)


def following(a: UpdateAnnounce, plan: ShardPlan) -> UpdateAnnounce:
    """A sparse announce for a worker whose shard plan's boxes are whole tensors: its result
    tensors as boxes from the origin, under the plan's digest."""
    assert a.delta is not None
    result = tuple(msgspec.structs.replace(t, start=(0,) * len(t.shape)) for t in a.delta.result)
    return msgspec.structs.replace(a, plan_digest=plan.digest, delta=msgspec.structs.replace(a.delta, result=result))


def split(named: dict, lay_out) -> list[dict[int | None, UpdateAnnounce]]:
    """One layout per layer group: ``lay_out(subset)`` lays a subset of ``named`` out (the
    pusher's broadcast or per-worker layout), and each announce is marked as group k of G."""
    groups = layer_groups(named)
    out = []
    for k, names in enumerate(groups):
        announces = lay_out({n: named[n] for n in names})
        out.append({r: msgspec.structs.replace(a, part=k, parts=len(groups)) for r, a in announces.items()})
    return out


class WeightPusher:
    """Rank 0 of the weight group: it pushes the whole model at once or, to layer-granular
    engines, one layer group at a time (``_push_layers``). Not thread-safe: one push at a time."""

    def __init__(self, group: GroupConfig, config: PushConfig = PushConfig(), device: torch.device | None = None, *,
                 join_timeout_s: float | None = None, store: TCPStore | None = None,
                 stop: threading.Event | None = None, deltas: DeltaEncoder | None = None) -> None:
        """Hosts the group (on ``store``, shared with other groups, if given) and waits up to
        ``join_timeout_s`` (default: the group's timeout) for every worker; ``InterruptedError``
        once ``stop`` is set meanwhile (a worker's process died: it will not come). ``deltas``:
        with ``encoding="sparse"``, the encoder a fleet's pushers share (default: one of its own)."""
        self.config = config
        self.deltas = (deltas or DeltaEncoder()) if config.encoding == "sparse" else None
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

    def _lay_out(self, version: int, weights: Weights) -> UpdateLayout:
        """Lay the update out: one announce for every worker (broadcast), or, in a generation
        whose members all sent shard plans, one per worker with its boxes only
        (``inflight.shard_plan``). Reads no tensor: buckets are packed as they are sent."""
        sharded = weights if isinstance(weights, ShardedSource) else None
        named = sharded.meta if sharded is not None else weights_of(weights)
        check_update(version, named, self.group.device, sharded=sharded is not None)
        source = sharded if sharded is not None else named
        plans = {r: h.plan for r, h in self.group.hellos.items()}  # point to point: None sends the whole model
        # a corrupted plan is the trainer's to refuse; a mismatched update, the worker's
        for rank, plan in plans.items():
            if plan is not None:
                check_digest(plan, f"worker rank {rank}")

        kept = self._kept()
        _refuse_fp8_casts(named, kept)
        if self.deltas is not None and sharded is None and not self.layered:
            laid = self._lay_out_sparse(version, named, kept, plans)
            if laid is not None:
                return laid
            named = source = self.deltas.wire_of(version) or named  # dense, read from the bytes recorded
        if self.layered:
            if sharded is not None:
                raise ValueError("a ShardedSource gathers in one push's order: push it to whole-model engines "
                                 "(commit_unit='model'), or push plain tensors to layer-granular ones")
            groups = tuple(split(named, lambda subset: self._announces(version, subset, kept)))
            return UpdateLayout(groups[0], source, groups)
        return UpdateLayout(self._announces(version, named, kept), source)

    def _kept(self) -> dict[str, str]:
        """The tensors the engines keep in a wire dtype of their own (fp32 of a bf16 engine)."""
        return {n: d for h in self.group.hellos.values() for n, d in h.wire_dtypes.items()}

    def _announces(self, version: int, subset: Mapping[str, torch.Tensor],
                   kept: Mapping[str, str]) -> dict[int | None, UpdateAnnounce]:
        """``{None: announce}`` for a broadcast, or, where the workers are reached point to point
        (shard plans), ``{rank: announce}`` with each worker's boxes only."""
        if not self.group.point_to_point:
            return {None: self.sender.lay_out(version, subset, self._dtype, kept)}
        plans = {r: h.plan for r, h in self.group.hellos.items()}
        return dict(self.sender.lay_out_each(version, subset, plans, self._dtype, kept))

    def _lay_out_sparse(self, version: int, named: Mapping[str, torch.Tensor], kept: Mapping[str, str],
                        plans: Mapping[int, ShardPlan | None]) -> UpdateLayout | None:
        """``encoding="sparse"``: record the version's wire bytes (the last read of the caller's
        tensors), then encode them against the version every member serves, where each keeps
        its bytes and takes whole tensors; None: send the recorded bytes dense."""
        assert self.deltas is not None
        wire = wire_dtypes(named, self._dtype, kept)
        dense = self.deltas.record(version, named, wire)
        live = set(self.engine_versions.values())
        if len(live) != 1 or not all(h.keeps_base for h in self.group.hellos.values()):
            return None
        if not all(plan is None or whole_boxes(plan, named) for plan in plans.values()):
            return None  # tensor parallel boxes: each rank's slice would need its own delta
        codec = self.config.sparse_codec
        if codec == "auto":
            codec = "xor_zstd" if self.group.backend == "gloo" else "index"
        encoded = self.deltas.encode(version, named, wire, live.pop(), self.sender.checksum_algo, codec)
        if encoded is None:
            return None
        announce = msgspec.structs.replace(self.sender.lay_out(version, encoded.wire), delta=encoded.delta)
        if not self.group.point_to_point:
            return UpdateLayout({None: announce}, encoded.wire, encoded=encoded, dense=dense)
        each = {r: announce if plan is None else following(announce, plan) for r, plan in plans.items()}
        return UpdateLayout(each, encoded.wire, encoded=encoded, dense=dense)  # type: ignore[arg-type]

    def send(self, version: int, weights: Weights) -> tuple[SendStats, dict[int, Staged]]:
        """Phase 1: announce, stream the buckets, and collect ``Staged`` from every worker."""
        laid = self._lay_out(version, weights)
        if laid.groups:
            raise ValueError("layer-granular engines (commit_unit='layer') commit each group as it lands: use push()")
        self._reads.begin()
        with self._reads.reading():
            return self._send_laid_out(laid)

    def _send_laid_out(self, laid: UpdateLayout) -> tuple[SendStats, dict[int, Staged]]:
        """Send ``laid``; a sparse update a worker refuses for want of its base goes again dense."""
        try:
            return self._send_once(laid)
        except PushRejected as e:
            if laid.encoded is None or laid.dense is None or e.phase != "announce" or e.codes != {"wrong_base"}:
                raise
            log.info("v%d: %s; sending it dense", laid.version, e)
            dense = laid.dense
            return self._send_once(UpdateLayout(self._announces(laid.version, dense, self._kept()), dense, dense=dense))

    def _send_once(self, laid: UpdateLayout) -> tuple[SendStats, dict[int, Staged]]:
        version = laid.version
        try:
            seq = (self.control.post(laid.announces[None]) if None in laid.announces
                   else self.control.post_each(laid.announces))  # type: ignore[arg-type]
            accepted, refused = _split(self.control.replies(seq, self.config.reply_timeout_s,
                                                            f"announce of v{version}"), Accepted)
            if refused:
                self.sender.send_abort(version, "refused by " + ", ".join(member(r) for r in sorted(refused)))
                raise PushRejected(version, "announce", refused)
            stats = self._stream(laid)
            e = laid.encoded
            stats = dataclasses.replace(stats, dense_bytes=stats.nbytes) if e is None else dataclasses.replace(
                stats, dense_bytes=e.dense_bytes, changed_frac=e.changed / max(e.elements, 1), encode_s=e.encode_s)
        finally:
            if laid.sharded is not None:
                laid.sharded.finish(version)
            self._reads.done()
        staged, bad = _split(self.control.replies(seq, self.config.reply_timeout_s, f"buckets of v{version}",
                                                  phase="staged"), Staged)
        if bad:
            self.abort(version, "a worker failed to stage")
            raise PushRejected(version, "staging", bad)
        return stats, staged  # type: ignore[return-value]

    def _stream(self, laid: UpdateLayout) -> SendStats:
        """The buckets of an accepted update; a source that fails mid-stream drops it everywhere."""
        version, announces = laid.version, laid.announces
        try:
            if laid.sharded is not None:
                laid.sharded.begin(version, first_use_order([a.tensors for a in announces.values()],
                                                            [[(b.offset, b.nbytes) for b in a.buckets]
                                                             for a in announces.values()]))
        except SourceError as e:  # the other trainer ranks are gone before any byte: call the update off
            self.sender.send_abort(version, str(e))
            raise
        try:
            return self.sender.send_each(announces, laid.source, on_read_done=self._reads.done)
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

    def push(self, version: int, weights: Weights) -> PushResult:
        """Send then commit; returns when every engine serves ``version``. ``weights``: a module,
        a mapping or iterator of ``(name, tensor)``, or a ``ShardedSource`` (rank 0 of a sharded
        trainer; the other ranks call its ``follow``)."""
        self._reads.begin()
        return self._push_laid_out(self._lay_out(version, weights))

    @property
    def layered(self) -> bool:
        """Every worker of this generation commits one layer group at a time (``commit_unit="layer"``)."""
        return bool(self.group.hellos) and all(h.commit_unit == "layer" for h in self.group.hellos.values())

    def _push_laid_out(self, laid: UpdateLayout) -> PushResult:
        with self._reads.reading():  # on CUDA, on the push's own stream (``ReadFence``)
            return self._push_reading(laid)

    def _push_reading(self, laid: UpdateLayout) -> PushResult:
        if laid.groups:
            return self._push_layers(laid)
        t0 = time.perf_counter()
        stats, staged = self._send_laid_out(laid)
        t1 = time.perf_counter()
        commits = self.commit(laid.version)
        self._landed = laid.version
        return PushResult(laid.version, stats, staged, commits, t1 - t0, time.perf_counter() - t1)

    def _push_layers(self, laid: UpdateLayout) -> PushResult:
        """Send every group of ``laid`` (a layer-granular update) and collect each engine rank's
        outcome for each."""
        version, parts = laid.version, len(laid.groups)
        t0 = time.perf_counter()
        control, sender, timeout = self.control, self.sender, self.config.reply_timeout_s
        sent: list[tuple[int, int]] = []
        stats = SendStats(version=version, nbytes=0, buckets=0, pack_s=0.0, send_s=0.0)
        refused: dict[int, Rejected] = {}
        try:
            for k, announces in enumerate(laid.groups):
                seq = control.post(announces[None]) if None in announces else control.post_each(announces)  # type: ignore[arg-type]
                _, refused = _split(control.replies(seq, timeout, f"announce of group {k} of v{version}"), Accepted)
                if refused:
                    sender.send_abort(version, f"group {k} refused by " + ", ".join(member(r) for r in sorted(refused)))
                    stop = k
                    break
                stats = stats + sender.send_each(announces, laid.source)
                sent.append((k, seq))
            else:
                stop = parts
        finally:
            self._reads.done()
        t1 = time.perf_counter()
        landed, commits, first_bad = 0, {}, None
        per_group: list[dict] = []
        for k, seq in sent:
            done, bad = _split(control.replies(seq, timeout, f"group {k} of v{version}", phase="staged"), Committed)
            if bad and first_bad is None:
                first_bad = (k, bad)
            if not bad and first_bad is None:
                landed, commits = k + 1, done
                per_group.append(done)
        if first_bad is not None or refused:
            group, why = first_bad if first_bad is not None else (stop, refused)
            raise LayerPushIncomplete(version, landed, parts, group, why)  # type: ignore[arg-type]
        self._landed = version
        # what decoded while the update was on its way: from group 0's first bucket to the last commit
        staged = {r: Staged(rank=r, version=version, receive_ms=1e3 * (t1 - t0),
                            steps_during_transfer=c.steps_since_first_bucket)
                  for r, c in commits.items()}
        return PushResult(version, stats, staged, commits, t1 - t0, time.perf_counter() - t1, tuple(per_group))  # type: ignore[arg-type]

    def push_async(self, version: int, weights: Weights) -> Future[PushResult]:
        """Send and commit in the background; the tensors are read as their buckets go out.

        Reads, not writes: the caller may run the next forward and backward at once, but must
        call ``wait_reads`` before it writes a parameter (``optimizer.step``). Waits for the
        previous background push first: one update in flight.
        """
        return self.push_laid_out(self.lay_out(version, weights))

    def lay_out(self, version: int, weights: Weights) -> UpdateLayout:
        """The first half of ``push_async``: wait for the push in flight (one update at a time:
        its bucket buffers are in use), then check and lay out ``version`` (``_lay_out``). Bad
        input raises here, before anything is sent."""
        if self._in_flight is not None:
            self._in_flight.exception()  # wait; its owner reads the outcome
        return self._lay_out(version, weights)

    def push_laid_out(self, laid: UpdateLayout) -> Future[PushResult]:
        """The second half of ``push_async``: send and commit what the last ``lay_out`` laid out."""
        self._reads.begin()
        self._in_flight = self._background.submit(self._push_laid_out, laid)
        return self._in_flight

    def wait_reads(self, timeout_s: float | None = None) -> float:
        """Block until the push in flight has read every tensor it sends (its last bucket is
        laid, or it ended), and on CUDA order the caller's stream after those reads
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
