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

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from inflight.protocol import Abort, Accepted, Commit, Committed, Rejected, ReplyMessage, Shutdown, Staged, UpdateAnnounce
from inflight.transport.buckets import BucketSender, SendStats, Tamper
from inflight.transport.control import TrainerControl
from inflight.transport.group import GroupConfig, WeightGroup


@dataclass(frozen=True, kw_only=True)
class PushConfig:
    """How the trainer packs and sends an update."""

    bucket_mb: float = 256.0
    """Bucket size in MiB; tensors larger than a bucket span several."""
    checksum: Literal["auto", "xxh3", "crc32", "wsum64"] = "auto"
    """Per-bucket checksum: ``auto`` is xxh3 on gloo (CPU) and wsum64 on NCCL (computed on the GPU)."""
    dtype: Literal["keep", "float32", "bfloat16", "float16"] = "keep"
    """Cast to the engine's dtype once while packing; ``keep`` sends each tensor's own dtype."""
    reply_timeout_s: float = 60.0
    """How long to wait for every worker's reply to each phase (accept, staged, committed)."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"PushConfig.bucket_mb={self.bucket_mb} must be > 0")
        if self.checksum not in ("auto", "xxh3", "crc32", "wsum64"):
            raise ValueError(f"PushConfig.checksum={self.checksum!r} is not auto, xxh3, crc32 or wsum64")
        if self.dtype not in ("keep", "float32", "bfloat16", "float16"):
            raise ValueError(f"PushConfig.dtype={self.dtype!r} is not keep, float32, bfloat16 or float16")
        if not self.reply_timeout_s > 0:
            raise ValueError(f"PushConfig.reply_timeout_s={self.reply_timeout_s} must be > 0")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))


class PushRejected(RuntimeError):
    """At least one worker refused the update; the engines keep their last good version."""

    def __init__(self, version: int, phase: str, rejections: dict[int, Rejected]) -> None:
        detail = "; ".join(f"rank {r}: [{m.code}] {m.reason}" for r, m in sorted(rejections.items()))
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

    @property
    def step(self) -> int:
        """Engine step after which ``version`` went live (lowest rank's engine)."""
        return self.commits[min(self.commits)].step


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's tensors by checkpoint name, each shared tensor once: what ``save_pretrained``
    writes, so a tied LM head travels as the input embedding it is."""
    return {name: p.detach() for name, p in model.named_parameters()}


def _split(replies: dict[int, ReplyMessage], want: type) -> tuple[dict[int, object], dict[int, Rejected]]:
    good = {r: m for r, m in replies.items() if isinstance(m, want)}
    bad = {r: m for r, m in replies.items() if isinstance(m, Rejected)}
    odd = {r: m for r, m in replies.items() if r not in good and r not in bad}
    if odd:
        raise RuntimeError(f"protocol violation: expected {want.__name__}, got {odd}")
    return good, bad


class WeightPusher:
    """Rank 0 of the weight group. Not thread-safe: one push at a time."""

    def __init__(self, group: GroupConfig, config: PushConfig = PushConfig(), device: torch.device | None = None, *,
                 join_timeout_s: float | None = None) -> None:
        """Hosts the group and waits up to ``join_timeout_s`` (default: the group's timeout) for every worker."""
        self.config = config
        self.group = WeightGroup(group, rank=0, device=device, join_timeout_s=join_timeout_s)
        algo = config.checksum if config.checksum != "auto" else ("wsum64" if self.group.backend == "nccl" else "xxh3")
        self.sender = BucketSender(self.group, bucket_bytes=config.bucket_bytes, checksum_algo=algo)
        self.control = TrainerControl(self.group)
        self._dtype = None if config.dtype == "keep" else getattr(torch, config.dtype)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-push")
        self._in_flight: Future[PushResult] | None = None

    def send(self, version: int, named: Mapping[str, torch.Tensor], *, tamper: Tamper | None = None) -> tuple[SendStats, dict[int, Staged]]:
        """Phase 1: announce, stream the buckets, and collect ``Staged`` from every worker."""
        return self._send_packed(self.sender.pack(version, named, self._dtype), tamper)

    def _send_packed(self, announce: UpdateAnnounce, tamper: Tamper | None = None) -> tuple[SendStats, dict[int, Staged]]:
        version = announce.version
        seq = self.control.post(announce)
        accepted, refused = _split(self.control.replies(seq, self.config.reply_timeout_s, f"announce of v{version}"), Accepted)
        if refused:
            self.sender.send_abort(version, "refused by " + ",".join(str(r) for r in sorted(refused)))
            raise PushRejected(version, "announce", refused)
        stats = self.sender.send(announce, tamper=tamper)
        staged, bad = _split(self.control.replies(seq, self.config.reply_timeout_s, f"buckets of v{version}", phase="staged"), Staged)
        if bad:
            self.abort(version, "a worker failed to stage")
            raise PushRejected(version, "staging", bad)
        return stats, staged  # type: ignore[return-value]

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

    def push(self, version: int, named: Mapping[str, torch.Tensor], *, tamper: Tamper | None = None) -> PushResult:
        """Send then commit; returns when every engine serves ``version``."""
        return self._push_packed(self.sender.pack(version, named, self._dtype), tamper)

    def _push_packed(self, announce: UpdateAnnounce, tamper: Tamper | None = None) -> PushResult:
        t0 = time.perf_counter()
        stats, staged = self._send_packed(announce, tamper)
        t1 = time.perf_counter()
        commits = self.commit(announce.version)
        return PushResult(announce.version, stats, staged, commits, t1 - t0, time.perf_counter() - t1)

    def push_async(self, version: int, named: Mapping[str, torch.Tensor]) -> Future[PushResult]:
        """Snapshot ``named`` now, then send and commit in the background.

        The caller may change its tensors (take the next optimizer step) as soon as this
        returns. Waits for the previous background push first: one update in flight.
        """
        if self._in_flight is not None:
            self._in_flight.exception()  # wait (the snapshot buffer is in use); its owner reads the outcome
        announce = self.sender.pack(version, named, self._dtype)  # the snapshot
        self._in_flight = self._background.submit(self._push_packed, announce)
        return self._in_flight

    @property
    def engine_versions(self) -> dict[int, int]:
        """Each worker's live version when it joined the current generation of the group."""
        return {r: h.live_version for r, h in self.group.hellos.items()}

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
        self.group.reform(timeout_s, want=want, require=require)
        self.control = TrainerControl(self.group)  # message numbers restart with the generation
        return self.engine_versions

    def knocking(self) -> list[int]:
        """Worker ranks outside the current generation that want to join (see ``WeightGroup``)."""
        return self.group.knocking()

    def close(self, reason: str = "trainer done") -> None:
        """Tell the workers to stop listening, then leave the group."""
        self._background.shutdown(wait=True)
        try:
            self.control.post(Shutdown(reason=reason))
        finally:
            self.group.close()
