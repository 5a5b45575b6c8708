"""Where one in-flight update's staging time goes, phase by phase.

    python -m inflight.bench.profile_staging [--model smollm2] [--updates 4] [--steps 96] [--concurrency 32]
                                             [--no-load-plan]

One in-process engine on the model and a trainer process (``inflight.bench.inflight.Bench``). The
listener's phases are wrapped with timers that read, for the calling thread, the wall
time, the CPU time and the time spent runnable but waiting for a core
(``/proc/thread-self/schedstat``); what is left of the wall time is time blocked: on the
GIL, or on the peer (the bytes not there yet). Two conditions:

- idle: the engine does not decode while the update stages (the cost of the work itself);
- decoding: the engine decodes ``--concurrency`` requests while the update stages (what a
  deployment sees: the listener shares the GIL and the cores with decode).

Prints one table per condition and one JSON line, which it appends to
``bench/results/profile_staging.jsonl`` (``--results``). Nothing here changes what is measured:
the wrappers call the real methods.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from inflight.bench.inflight import Bench
from inflight.bench.run_record import add_results_option, append_result, run_record

PHASES = [  # (owner, attribute, phase name); missing attributes are skipped (older or newer code)
    ("inflight.transport.listener:UpdateListener", "_on_announce", "staging total (announce to Staged)"),
    ("inflight.transport.listener:BucketReceiver", "receive", "receive (with the per-bucket work below)"),
    ("inflight.transport.listener:BucketReceiver", "_verify", "  checksums"),
    ("inflight.transport.listener", "nonfinite", "  finite check"),
    ("inflight.transport.listener:StreamPreparer", "verified", "  prepare during receive (per bucket)"),
    ("inflight.engine.commit.swap:SwapStrategy", "prepare", "prepare after the last bucket"),
    ("inflight.engine.commit.swap:SwapStrategy", "_shadows", "  shadow parameters (fresh)"),
    ("inflight.engine.commit.swap:ShadowSets", "take", "  shadow parameters (reused)"),
    ("inflight.engine.commit.swap:SwapStrategy", "_load", "  weight loaders"),
    ("inflight.engine.commit.swap:SwapStrategy", "_copy", "  load plan copies (all)"),
    ("inflight.engine.commit.swap:SwapStrategy", "_repack_one", "  re-pack, oneDNN handles (all)"),
    ("inflight.transport.listener:UpdateListener", "_on_commit", "commit round trip (listener)"),
    ("inflight.engine.commit.swap:SwapStrategy", "apply", "commit swap (engine thread)"),
]


def _schedstat() -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a core) of the calling thread."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, wait, _ = f.read().split()
        return int(cpu) / 1e9, int(wait) / 1e9
    except OSError:
        return time.thread_time(), 0.0


class Recorder:
    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        self._lock = threading.Lock()

    def wrap(self, owner: type, attr: str, phase: str) -> None:
        raw = owner.__dict__[attr]
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            w0, (c0, q0) = time.perf_counter(), _schedstat()
            try:
                return fn(*args, **kwargs)
            finally:
                c1, q1 = _schedstat()
                with self._lock:
                    self.samples[phase].append((time.perf_counter() - w0, c1 - c0, q1 - q0))

        setattr(owner, attr, staticmethod(timed) if static else timed)

    def take(self) -> dict[str, list[tuple[float, float, float]]]:
        with self._lock:
            out, self.samples = dict(self.samples), defaultdict(list)
        return out


def install(rec: Recorder) -> list[str]:
    import importlib

    names = []
    for target, attr, phase in PHASES:
        mod, _, cls = target.partition(":")  # "module:Class", or "module" for a module-level function
        owner = importlib.import_module(mod)
        owner = getattr(owner, cls) if cls else owner
        if attr in owner.__dict__:
            rec.wrap(owner, attr, phase)
            names.append(phase)
    return names


def per_update(samples: dict[str, list[tuple[float, float, float]]], updates: int) -> dict[str, dict[str, float]]:
    """Median over updates of each phase's (wall, cpu, core wait, blocked) ms; calls made several
    times per update (one checksum per bucket) are summed per update first."""
    out = {}
    for phase, xs in samples.items():
        k = max(1, len(xs) // max(updates, 1))
        groups = [xs[i:i + k] for i in range(0, len(xs) - len(xs) % k or len(xs), k)]
        sums = [tuple(sum(g[j] for g in grp) for j in range(3)) for grp in groups]
        wall, cpu, wait = (1e3 * statistics.median(s[j] for s in sums) for j in range(3))
        out[phase] = {"wall_ms": round(wall, 1), "cpu_ms": round(cpu, 1), "core_wait_ms": round(wait, 1),
                      "blocked_ms": round(max(wall - cpu - wait, 0.0), 1), "calls_per_update": k}
    return out


def show(title: str, table: dict[str, dict[str, float]], order: list[str]) -> None:
    print(f"\n{title}")
    print(f"{'phase':<40}{'wall ms':>10}{'cpu ms':>10}{'core wait':>11}{'blocked':>10}")
    for phase in order:
        if phase in table:
            r = table[phase]
            print(f"{phase:<40}{r['wall_ms']:>10}{r['cpu_ms']:>10}{r['core_wait_ms']:>11}{r['blocked_ms']:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a model directory, hub id, 'smollm2', or a bench size S/M/L")
    ap.add_argument("--updates", type=int, default=4, help="updates per condition")
    ap.add_argument("--steps", type=int, default=96, help="decode steps between updates (decoding condition)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--no-load-plan", action="store_true",
                    help="without the load plan: vLLM's loaders into fresh shadows")
    add_results_option(ap, "profile_staging")
    args = ap.parse_args()
    run = run_record("profile_staging")  # the command, its start and the git revision
    if args.no_load_plan:
        from inflight.engine.commit.swap import SwapStrategy

        SwapStrategy.__init__.__kwdefaults__["load_plan"] = False
    rec = Recorder()
    order = install(rec)
    load = os.getloadavg()[0]
    result: dict = {"bench": "profile_staging", **run, "updates": args.updates, "model": args.model,
                    "load_plan": not args.no_load_plan, "load_1m": round(load, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args.model, Path(tmp), args.concurrency, seed=0, listener_nice=19)
        result["params"] = bench.params
        for _ in range(2):  # warm-up: first-touch of staging and shadow memory, oneDNN caches
            bench.version += 1
            bench.conn.send(("push", bench.version))
            bench.conn.recv()
        rec.take()
        trainer = []
        engine_cpu, faults = [], []
        for _ in range(args.updates):  # idle: nothing decodes, so the listener has the process to itself
            bench.version += 1
            cpu0 = time.process_time()  # every thread of the engine process (OpenMP helpers, gloo) while it stages
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # first touches of fresh pages, kernel-zeroed
            bench.conn.send(("push", bench.version))
            trainer.append(bench.conn.recv())
            engine_cpu.append(time.process_time() - cpu0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0)
        result["idle"] = per_update(rec.take(), args.updates)
        # The CPU both processes spend on one update while it stages, over the cores there are:
        # a lower bound on staging's wall time however the work overlaps (the trainer packs
        # each bucket as it sends it, so its pack is part of it).
        both = statistics.median(e + r["cpu_s"] for e, r in zip(engine_cpu, trainer))
        result["idle_trainer"] = {"send_ms": round(1e3 * statistics.median(r["send_s"] for r in trainer), 1),
                                  "push_ms": round(1e3 * statistics.median(r["push_s"] for r in trainer), 1),
                                  "engine_process_cpu_ms": round(1e3 * statistics.median(engine_cpu), 1),
                                  "engine_minor_faults": int(statistics.median(faults)),
                                  "trainer_send_cpu_ms": round(1e3 * statistics.median(r["cpu_s"] for r in trainer), 1),
                                  "floor_ms": round(1e3 * both / (os.cpu_count() or 1), 1)}
        run = bench.run("inflight", every=args.steps, steps=args.steps * args.updates + 1)
        result["decoding"] = per_update(rec.take(), len(run["infos"]))
        result["decoding_updates"] = len(run["infos"])
        result["decoding_step_ms"] = round(1e3 * statistics.median(run["quiet"]), 2)
        bench.close()
    result["load_1m_end"] = round(os.getloadavg()[0], 2)
    path = "load plan, reused buffers" if result["load_plan"] else "vLLM loaders, fresh shadows (before)"
    show(f"{path}; idle engine, {args.model} ({result['params'] / 1e6:.1f} M params), load {load:.1f}", result["idle"],
         order)
    trainer = result["idle_trainer"]
    print(f"  trainer: send {trainer['send_ms']} ms, push (announce to committed) {trainer['push_ms']} ms")
    print(f"  CPU per update, all threads: engine process {trainer['engine_process_cpu_ms']} ms, trainer's send "
          f"{trainer['trainer_send_cpu_ms']} ms; on {os.cpu_count()} cores staging cannot take less than "
          f"{trainer['floor_ms']} ms")
    print(f"  page faults per update in the engine process: {trainer['engine_minor_faults']} "
          f"({trainer['engine_minor_faults'] * resource.getpagesize() / 2**20:.0f} MiB first touched)")
    show(f"engine decoding {args.concurrency} requests ({result['decoding_updates']} updates)", result["decoding"],
         order)
    print(json.dumps(result))
    append_result(args.results, result)


if __name__ == "__main__":
    main()
