"""What one push costs the trainer: its memory (the buckets in flight, not a copy of the model)
and its optimizer step's time (the step waits only until the push has read the parameters).

    python -m inflight.bench.trainer_push [--model smollm2|DIR] [--bucket-mb 16] [--pushes 3] [--steps 3]
    python -m inflight.bench.trainer_push --nproc 2: the trainer on 2 ranks (``inflight.bench.trainer_ranks``)

The trainer (a transformers model, fp32, in a child process so its memory is its own) pushes
to one receiving worker (``inflight.transport.peer``, another process).

Memory: ``--pushes`` versions. Before each push the trainer's free heap is returned to the
system (``malloc_trim``), so what the push allocates shows as resident growth; a thread
samples the resident set every millisecond during the push. The bound the sender keeps is
two buckets per destination plus the frames and the announce.

Step time: ``--steps`` optimizer steps (forward and backward on one batch, AdamW) alone, then
as many with a push of the previous version in flight, as the training loop runs them:
``push_async`` lays the update out and returns, forward and backward run while the buckets go
out, ``wait_reads`` holds the optimizer until the last bucket is packed. Beside them, the same
run times what a push that snapshots first (one flat copy of the model, checksummed bucket by
bucket, before the call returns) blocks the trainer for. Prints tables and one JSON line,
which it appends to ``bench/results/trainer_push.jsonl`` (``--results``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path

from inflight.bench.run_record import add_results_option, append_result, run_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MiB = float(1 << 20)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler:
    """The peak resident set while it runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss())


def _memory_rows(pusher, model, named, pushes: int) -> list[dict]:
    import torch

    libc = ctypes.CDLL("libc.so.6")
    rows = []
    for version in range(1, pushes + 1):
        with torch.no_grad():
            for t in named.values():  # an optimizer step's worth of writes: the next version
                t.mul_(1.0 + 1e-3)
        libc.malloc_trim(0)
        before = _rss()
        sampler = _Sampler()
        t0 = time.perf_counter()
        result = pusher.push(version, model)
        rows.append({"version": version, "extra_mib": (sampler.stop() - before) / MiB,
                     "push_s": time.perf_counter() - t0, "read_s": result.send.read_s,
                     "sent_mib": result.send.nbytes / MiB})
    return rows


def _snapshot_s(named, bucket_bytes: int) -> float:
    """What a snapshotting push blocks for: one flat copy of the model, checksummed per bucket."""
    import torch

    from inflight.transport.bucket import bucket_windows, checksum, pack_into, plan_tensors

    t0 = time.perf_counter()
    tensors, total = plan_tensors((n, tuple(t.shape), "float32") for n, t in named.items())
    flat = torch.zeros(total, dtype=torch.uint8)
    pack_into(flat, tensors, named)
    for o, n in bucket_windows(total, bucket_bytes):
        checksum(flat[o:o + n], "xxh3")
    return time.perf_counter() - t0


def _step_rows(pusher, model, named, first_version: int, steps: int, batch: tuple[int, int]) -> dict:
    """``steps`` optimizer steps alone, then ``steps`` with a push in flight; per-step seconds."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, batch, generator=torch.Generator().manual_seed(0))

    def step(before_write=lambda: 0.0) -> tuple[float, float]:
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        waited = before_write()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, waited

    step()  # warm-up: the optimizer's state is allocated here, not in a timed step
    alone = [step()[0] for _ in range(steps)]
    with_push, read_waits, returns = [], [], []
    version = first_version
    for _ in range(steps):
        t0 = time.perf_counter()
        pending = pusher.push_async(version, model)  # waits for the previous push first, as training does
        returns.append(time.perf_counter() - t0)
        took, waited = step(pusher.wait_reads)
        with_push.append(took)
        read_waits.append(waited)
        version += 1
    pending.result()
    snapshots = [_snapshot_s(named, pusher.config.bucket_bytes) for _ in range(steps)]
    med = statistics.median
    return {"batch": list(batch), "step_alone_s": med(alone), "step_with_push_s": med(with_push),
            "read_wait_s": med(read_waits), "push_async_return_s": med(returns), "snapshot_s": med(snapshots)}


def _trainer(model_dir: str, bucket_mb: float, pushes: int, steps: int, results) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.transport.group_config import GroupConfig
    from inflight.transport.peer import run_peer
    from inflight.transport.pusher import PushConfig, WeightPusher
    from inflight.transport.sources import named_weights
    from inflight.transport.store import reserve_port

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = named_weights(model)
    model_bytes = sum(t.numel() * t.element_size() for t in named.values())
    group = GroupConfig(port=reserve_port(), world_size=2, timeout_s=300)
    peer = mp.get_context("spawn").Process(target=run_peer, args=(group, 1, None), daemon=True)
    peer.start()
    pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=bucket_mb), join_timeout_s=300)
    rows = _memory_rows(pusher, model, named, pushes)
    timing = _step_rows(pusher, model, named, pushes + 1, steps, (2, 64)) if steps else {}
    pusher.close()
    peer.join(60)
    results.put({"model_mib": model_bytes / MiB, "bucket_mib": pusher.config.bucket_bytes / MiB, "destinations": 1,
                 "pushes": rows, "steps": timing, "peer_exit": peer.exitcode})


def measure(model_dir: Path, bucket_mb: float = 16.0, pushes: int = 3, steps: int = 0) -> dict:
    """Run the trainer in a child process; its report (see the module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_trainer, args=(str(model_dir), bucket_mb, pushes, steps, results))
    child.start()
    try:
        report = results.get(timeout=1800)
    finally:
        child.join(120)
    report["max_extra_mib"] = max(r["extra_mib"] for r in report["pushes"])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, or a model directory")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timing mode (0: memory only)")
    ap.add_argument("--nproc", type=int, default=1, help="N > 1: the trainer on N ranks (inflight.bench.trainer_ranks)")
    add_results_option(ap, "trainer_push")
    args = ap.parse_args()
    if args.nproc > 1:
        from inflight.bench.trainer_ranks import main as on_ranks

        return on_ranks(["--model", args.model, "--nproc", str(args.nproc), "--steps", str(max(args.steps, 1))])
    from inflight.trainer.models import resolve_model

    run = run_record("trainer_push")  # the command, its start and the git revision
    load = os.getloadavg()[0]
    report = measure(resolve_model(args.model), args.bucket_mb, args.pushes, args.steps)
    print(f"model {report['model_mib']:.0f} MiB fp32, buckets of {report['bucket_mib']:.0f} MiB, "
          f"{report['destinations']} destination; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| push | extra resident MiB | push s | reading s |\n| --- | --- | --- | --- |")
    for r in report["pushes"]:
        print(f"| v{r['version']} | {r['extra_mib']:.1f} | {r['push_s']:.2f} | {r['read_s']:.2f} |")
    if s := report["steps"]:
        print(f"\noptimizer step (batch {s['batch'][0]}x{s['batch'][1]}), medians:")
        print("| step alone s | step with a push in flight s | of which waiting for reads s | push_async returns in s "
              "| a snapshot would block s |\n| --- | --- | --- | --- | --- |")
        print(f"| {s['step_alone_s']:.2f} | {s['step_with_push_s']:.2f} | {s['read_wait_s']:.2f} "
              f"| {s['push_async_return_s']:.3f} | {s['snapshot_s']:.2f} |")
    print(json.dumps(report))
    append_result(args.results, {"bench": "trainer_push", **run,
                                 "load_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
                                 "bucket_mb": args.bucket_mb, **report})


if __name__ == "__main__":
    main()
