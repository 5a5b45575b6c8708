"""Bucketed weight transfer vs a raw single-tensor broadcast of the same bytes, same run.

    python -m inflight.bench.transport [--sizes-mb 16 64 256] [--bucket-mb 4 64 256] [--reps 5]

A peer process joins the group as worker rank 1. For each model size, the trainer first
broadcasts one flat tensor of the same byte count (the link's ceiling), then pushes a
synthetic transformer-shaped state dict through the full protocol (announce, buckets
with checksums, staged, commit). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time

import torch

from inflight.transport.bucket import aligned_bucket_bytes
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.peer import DictTarget
from inflight.transport.pusher import PushConfig, WeightPusher
from inflight.transport.store import reserve_port


def synthetic_state_dict(total_mb: float, hidden: int = 1024) -> dict[str, torch.Tensor]:
    """Layers of (qkv, o, gate_up, down) linear weights until ``total_mb`` of fp32 is reached."""
    shapes = [(3 * hidden, hidden), (hidden, hidden), (8 * hidden, hidden), (hidden, 4 * hidden)]
    out: dict[str, torch.Tensor] = {}
    budget = int(total_mb * 2**20) // 4
    layer = 0
    while budget > 0:
        for j, shape in enumerate(shapes):
            n = min(shape[0] * shape[1], budget)
            if n <= 0:
                break
            out[f"layers.{layer}.w{j}"] = torch.randn(n // shape[1] or 1, shape[1] if n >= shape[1] else n)
            budget -= out[f"layers.{layer}.w{j}"].numel()
        layer += 1
    return out


def _peer(config: GroupConfig, raw_sizes: list[int], reps: int) -> None:
    group = WeightGroup(config, 1)
    for nbytes in raw_sizes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(reps):
            group.broadcast(buf, what="raw broadcast")
    UpdateListener(group, DictTarget(keep=False), schema=None).run(threading.Event())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64, 256])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[4, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    sds = {mb: synthetic_state_dict(mb) for mb in args.sizes_mb}
    raw_sizes = [sum(t.numel() * 4 for t in sd.values()) for sd in sds.values()]
    config = GroupConfig(port=reserve_port(), world_size=2, timeout_s=120)
    peer = mp.get_context("spawn").Process(target=_peer, args=(config, raw_sizes, args.reps), daemon=True)
    peer.start()
    pusher = WeightPusher(config, PushConfig(bucket_mb=args.bucket_mb[0]))

    raw_mbps: dict[float, float] = {}
    for mb, nbytes in zip(sds, raw_sizes):
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            pusher.group.broadcast(buf, what="raw broadcast")
            times.append(time.perf_counter() - t0)
        raw_mbps[mb] = nbytes / 2**20 / statistics.median(times)

    rows = []
    version = 0
    for mb, sd in sds.items():
        for bucket_mb in args.bucket_mb:
            pusher.sender.bucket_bytes = aligned_bucket_bytes(int(bucket_mb * 2**20))  # no element straddles two
            sends, pushes, packs = [], [], []
            for _ in range(args.reps):
                version += 1
                result = pusher.push(version, sd)
                sends.append(result.send.send_s)
                packs.append(result.send.pack_s)
                pushes.append(result.stage_wait_s + result.commit_wait_s)
            nbytes = result.send.nbytes
            send_mbps = nbytes / 2**20 / statistics.median(sends)
            rows.append({
                "model_mb": mb, "bucket_mb": bucket_mb, "buckets": result.send.buckets,
                "raw_mb_s": round(raw_mbps[mb], 1), "bucketed_mb_s": round(send_mbps, 1),
                "ratio": round(send_mbps / raw_mbps[mb], 3),
                "push_mb_s": round(nbytes / 2**20 / statistics.median(pushes), 1),
                "pack_ms": round(1e3 * statistics.median(packs), 2),
                "ms_per_gb": round(1e3 * statistics.median(sends) / (nbytes / 2**30), 1),
            })
    pusher.close()
    peer.join(60)

    cols = ["model_mb", "bucket_mb", "buckets", "raw_mb_s", "bucketed_mb_s", "ratio", "push_mb_s", "pack_ms",
            "ms_per_gb"]
    print(f"backend={pusher.group.backend}  reps={args.reps}  (medians; bucketed = data plane incl. packing, "
          "headers, checksums; push = announce..commit)")
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>13}" for c in cols))
    print(json.dumps({"bench": "transport", "backend": pusher.group.backend, "reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
