"""The trainer's side of a layer-granular update (engines with ``commit_unit="layer"``).

An update of version v goes out as one announce per layer group, in the commit order both
sides derive from the tensor names (``inflight.layer_groups``); each engine commits each
group at its next step boundary once every one of its ranks staged and verified it, with
no ``Commit`` from the trainer (``inflight.transport.layer_listener``).

Ordering invariants:
- group k's buckets go out only once every worker accepted group k, and a worker accepts
  it only with room to stage it: sending is paced by the engines' commits (back-pressure),
  and a worker never stages more than its ``staged_groups``;
- the first group any worker refuses ends the update: its buckets are replaced by an abort
  frame, no later group is sent, and the groups before it commit (each was verified). The
  engines serve that hybrid, and ``LayerPushIncomplete`` says how many groups landed;
- the caller's tensors are read group by group as the buckets go out; the read fence
  (``WeightPusher.wait_reads``) opens after the last group's buckets are packed.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from inflight.layer_groups import layer_groups
from inflight.protocol import Accepted, Committed, Rejected, Staged, UpdateAnnounce
from inflight.transport.errors import member
from inflight.transport.outcomes import Packed, PushResult, _split
from inflight.transport.sender import SendStats, Tamper


def split(named: dict, lay_out) -> list[dict[int | None, UpdateAnnounce]]:
    """One layout per layer group: ``lay_out(subset)`` lays a subset of ``named`` out (the
    pusher's broadcast or per-worker packing), and each announce is marked as group k of G."""
    groups = layer_groups(named)
    out = []
    for k, names in enumerate(groups):
        announces = lay_out({n: named[n] for n in names})
        out.append({r: msgspec.structs.replace(a, part=k, parts=len(groups)) for r, a in announces.items()})
    return out


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


def push_layers(pusher: Any, packed: Packed, tamper: Tamper | None = None) -> PushResult:
    """Send every group of ``packed`` and collect each engine rank's outcome for each
    (``pusher``: the ``WeightPusher``, for its control channel, sender and read fence)."""
    version, parts = packed.version, len(packed.groups)
    t0 = time.perf_counter()
    control, sender, timeout = pusher.control, pusher.sender, pusher.config.reply_timeout_s
    sent: list[tuple[int, int]] = []
    stats = SendStats(version=version, nbytes=0, buckets=0, pack_s=0.0, send_s=0.0)
    refused: dict[int, Rejected] = {}
    try:
        for k, announces in enumerate(packed.groups):
            seq = control.post(announces[None]) if None in announces else control.post_each(announces)  # type: ignore[arg-type]
            _, refused = _split(control.replies(seq, timeout, f"announce of group {k} of v{version}"), Accepted)
            if refused:
                sender.send_abort(version, f"group {k} refused by " + ", ".join(member(r) for r in sorted(refused)))
                stop = k
                break
            stats = _add(stats, sender.send_each(announces, packed.source, tamper=tamper))
            sent.append((k, seq))
        else:
            stop = parts
    finally:
        pusher._reads.done()
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
    pusher._landed = version
    # what decoded while the update was on its way: from group 0's first bucket to the last commit
    staged = {r: Staged(rank=r, version=version, receive_ms=1e3 * (t1 - t0), steps_during_transfer=c.steps_since_first_bucket)
              for r, c in commits.items()}
    return PushResult(version, stats, staged, commits, t1 - t0, time.perf_counter() - t1, tuple(per_group))  # type: ignore[arg-type]


def _add(a: SendStats, b: SendStats) -> SendStats:
    return SendStats(version=a.version, nbytes=a.nbytes + b.nbytes, buckets=a.buckets + b.buckets,
                     pack_s=a.pack_s + b.pack_s, send_s=a.send_s + b.send_s, read_s=a.read_s + b.read_s,
                     delivered_bytes=a.delivered_bytes + b.delivered_bytes)
