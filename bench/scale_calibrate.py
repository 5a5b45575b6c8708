"""The CPU replay model's parameters (``scale_replay``), each from a micro-benchmark of its own,
never from the ``inflight.bench.inflight`` runs the model is judged on.

    python -m inflight.bench.scale calibrate [--parts link engine wait] [--out bench/scale_calibration.json]

Parts (each well under 3 minutes; run them one at a time, never beside another heavy job):

- ``link``: each shaped link's achieved bytes/s, one TCP stream (``slow_link.achieved_bytes_per_s``);
  no engine.
- ``engine``: one SmolLM2 engine as ``inflight.bench.inflight --placement split --concurrency
  32`` builds it (``Bench``), no link, over loopback:
  the decode step (two ``none`` chunks of 200 steps, every step's time against the total context
  the replayed request stream holds: ``step_s = a + c x context + p x new requests``); then
  in-flight pushes and vLLM's native pause(keep)+update alternated in chunks as the judged runs
  alternate them (``ROUNDS`` rounds of a 96-step in-flight chunk, then two 96-step native
  chunks, an update due every 16 steps), each path's first update of a chunk (it sets itself up again
  after the other path ran: buffers faulted in afresh) kept apart from the rest: the in-flight
  commit stall, the push's time beyond staging, the loopback staging time, and the decode
  slowdown while the real pusher stages (the figure where the CPU, not the wire, bounds
  staging); native's stall and its transfer; the native broadcast's pack (``pack_into`` of the
  whole state).
- ``wait``: the listener's wait beside decode. The engine decodes ``none`` chunks while a thread
  on the trainer's core receives the pusher's 64 MiB buckets exactly as the listener does (the
  data plane's gloo ``recv`` waited on a helper thread, polled every <= 4 ms, each bucket
  checksummed) from a sender process (on the same core, as the trainer is) behind a shaped
  link, a bucket, then as long idle, again and again through one ``none`` chunk: the median
  step (over the decode step model's figure for that step) while receiving over the median
  while idle, minus one, per rate (the figure where the wire bounds staging). The busier the
  trainer's core, the longer a GIL holder there waits for it.

Writes one JSON file with each part's figures and, in ``runs``, every run that made them (its
command, date and load); a part not run keeps the file's earlier figures, and the wait part's
repeats accumulate (its figure per rate is their median).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

OUT = Path(__file__).resolve().parent / "scale_calibration.json"
RATES = ("10gbit", "1gbit", "100mbit")
BUCKET = 64 << 20  # the benchmark trainer's bucket_mb
WAIT_STEPS = 320  # one chunk per rate
WINDOW_S = 0.8  # wait: a receiving window, then as long idle
ROUNDS = 4  # engine: in-flight and native chunks, alternated as the judged runs alternate them


def link_part(mb: int = 64) -> dict:
    """Achieved bytes/s of one TCP stream over each shaped link."""
    from inflight.bench.slow_link import achieved_bytes_per_s, slow_link

    out = {}
    for i, rate in enumerate(RATES):
        with slow_link(rate, index=i) as link:
            out[rate] = round(achieved_bytes_per_s(link, mb << 20))
    return {"achieved_Bps": out, "mb_sent": mb}


def replayed_context(steps: int, concurrency: int = 32, seed: int = 0) -> tuple[list[int], list[int]]:
    """The total context (prompt + tokens so far, every running request) before each step of a
    chunk of ``inflight.bench.paired.RequestStream``, and the requests admitted at each step."""
    from inflight.bench.scale_replay import chunk_context

    return chunk_context(steps, concurrency, seed)


def fit_step(chunks: list[list[float]]) -> dict:
    """Least squares of each step's seconds on [1, context, new requests] (``replayed_context``)."""
    import numpy as np

    rows, ys = [], []
    for gaps in chunks:
        ctx, new = replayed_context(len(gaps))
        rows += [[1.0, k, n] for k, n in zip(ctx, new)]
        ys += gaps
    (a, c, p), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    resid = np.array(ys) - np.array(rows) @ np.array([a, c, p])
    return {"a_s": float(a), "c_s_per_token": float(c), "p_s_per_request": float(p),
            "resid_ms_mad": round(1e3 * float(np.median(np.abs(resid))), 2), "steps": len(ys)}


def native_pack_s(model_dir: Path) -> float:
    """Seconds ``native_gloo.broadcast_state`` packs the whole state before its broadcast, on
    the trainer's core at the trainer's niceness (the median of three)."""
    import torch
    from safetensors.torch import load_file

    from inflight.bench.native_gloo import update_info
    from inflight.bench.placement import TRAINER_CORE
    from inflight.transport.layout import pack_into, plan_tensors

    state = load_file(str(model_dir / "model.safetensors"))
    info = update_info(state)
    specs, total = plan_tensors(zip(info["names"], info["shapes"], info["dtype_names"]))
    box: dict[str, list[float]] = {"s": []}

    def run() -> None:
        os.sched_setaffinity(0, {TRAINER_CORE})
        torch.set_num_threads(1)
        for _ in range(3):
            flat = torch.zeros(total, dtype=torch.uint8)
            t0 = time.perf_counter()
            pack_into(flat, specs, state)
            box["s"].append(time.perf_counter() - t0)
            del flat

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return statistics.median(box["s"])


def push_slowdown(chunks: list[dict], step: dict) -> dict:
    """The decode slowdown while the real pusher stages over loopback, from in-flight chunks
    (``Bench.run``): each step's time over the decode step model's, the steps from a push's cue
    until its commit against those between a commit and the next cue (they alternate every few
    steps, so drift and the context's growth hit both alike)."""
    on, off = [], []
    for chunk in chunks:
        ctx, new = replayed_context(len(chunk["gaps"]))
        ratio = [g / (step["a_s"] + step["c_s_per_token"] * ctx[i] + step["p_s_per_request"] * new[i])
                 for i, g in enumerate(chunk["gaps"])]
        cues, commits = chunk["cues"], chunk["event_at"]  # 1-based intervals; staging starts in the cue's
        for k, (cue, commit) in enumerate(zip(cues, commits)):
            nxt = cues[k + 1] if k + 1 < len(cues) else len(ratio) + 1
            on += [ratio[j - 1] for j in range(cue, commit)]  # the commit's interval left out: it holds the stall
            off += [ratio[j - 1] for j in range(commit + 1, nxt)]
    return {"slowdown": round(statistics.median(on) / statistics.median(off) - 1, 4), "steps_on": len(on),
            "steps_off": len(off)}


def first_and_rest(chunks: list[list[float]]) -> tuple[float, float]:
    """The mean of each chunk's first figure and the mean of the others: a path's first update
    after the other path ran sets itself up again (its buffers faulted in afresh)."""
    return statistics.mean(c[0] for c in chunks), statistics.mean(x for c in chunks for x in c[1:])


def engine_part(bench) -> dict:
    """Decode step, native update and in-flight push of the SmolLM2 engine, over loopback. The
    updates run as the judged runs run them (``SETTINGS``' 16-step cadence, 96-step chunks):
    ``ROUNDS`` rounds of an in-flight chunk then two native chunks (a run's native and
    native@inflight), each path's first update of a chunk kept apart from the rest
    (``first_and_rest``)."""
    from inflight.trainer.models import resolve_model

    step = fit_step([bench.run("none", 10**9, 200)["gaps"] for _ in range(2)])
    pushes, natives = [], []
    for _ in range(ROUNDS):
        pushes.append(bench.run("inflight", 16, 96))
        natives += [bench.run("native", 16, 96) for _ in range(2)]  # as native, then native@inflight
    stalls = []
    for c in natives:
        base = statistics.median(c["quiet"])
        stalls.append([g - base for g in c["event_gaps"]])
    stage = first_and_rest([[r["stage_ms"] / 1e3 for r in c["infos"]] for c in pushes])
    send = first_and_rest([[r["send_s"] for r in c["infos"]] for c in natives])
    infos = [r for c in pushes for r in c["infos"]]
    nbytes = infos[0]["nbytes"]
    return {"model": bench.model, "nbytes": nbytes, "step": step, "rounds": ROUNDS,
            "native": {"first_stall_s": first_and_rest(stalls)[0], "stall_s": first_and_rest(stalls)[1],
                       "first_send_s": send[0], "send_s": send[1], "updates": sum(map(len, stalls)),
                       "pack_s": native_pack_s(Path(resolve_model("smollm2")))},
            "inflight": {"first_stage_s": stage[0], "stage_s": stage[1], "updates": len(infos),
                         "push_over_stage_s": statistics.median(r["push_s"] - r["stage_ms"] / 1e3 for r in infos),
                         "stall_s": statistics.median(r["stall_ms"] for r in infos) / 1e3,
                         **push_slowdown(pushes, step), "buckets": -(-nbytes // BUCKET)}}


def _sender(link, conn, buckets: int, nbytes: int) -> None:
    """In the namespace: host the store, join the gloo pair as rank 0 and send ``buckets`` buckets
    of ``nbytes``, each with its checksum computed first, as the pusher does."""
    from datetime import timedelta

    import torch

    from inflight.bench.placement import TRAINER_CORE
    from inflight.bench.slow_link import enter
    from inflight.transport.data_plane import DataPlane
    from inflight.transport.layout import checksum
    from inflight.transport.store import host_store, reserve_port

    if link is not None:
        enter(link)
    os.sched_setaffinity(0, {TRAINER_CORE})
    os.nice(19)
    host = link.inner if link is not None else "127.0.0.1"
    port = reserve_port(host)
    store = host_store(host, port, 2, timedelta(seconds=120))
    conn.send(port)
    plane = DataPlane(store, rank=0, pg_rank=0, size=2, backend="gloo", timeout=timedelta(seconds=600),
                      device=torch.device("cpu"), peers=[1], superseded=lambda: False, bind=host)
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    for _ in range(buckets):
        checksum(data, "xxh3")
        plane.wait(plane.start_send(data, 1, what="bucket"))
    store.wait(["done"])
    plane.close()


def _receive(link, port: int, buckets: int, nbytes: int, windows: list[tuple[float, float]],
             stop: threading.Event) -> None:
    """The listener's work, on the trainer's core: join the gloo pair (its I/O threads start here,
    on this core, as the listener's do), then receive each bucket into one window
    (``DataPlane.wait``: gloo's wait on a helper thread, polled) and checksum it, back to back
    for about ``WINDOW_S``, then idle as long (the sender blocks meanwhile), and again.
    ``windows``: (0, 0) once the first bucket (the connection's set-up) landed, then each
    receiving window's (start, end)."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from inflight.bench.placement import TRAINER_CORE
    from inflight.transport.data_plane import DataPlane
    from inflight.transport.layout import checksum

    os.sched_setaffinity(0, {TRAINER_CORE})
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # InflightConfig.listener_nice, as benchmarked
    inner, outer = (link.inner, link.outer) if link is not None else ("127.0.0.1", "127.0.0.1")
    store = TCPStore(inner, port, 2, is_master=False, timeout=timedelta(seconds=120))
    plane = DataPlane(store, rank=1, pg_rank=1, size=2, backend="gloo", timeout=timedelta(seconds=600),
                      device=torch.device("cpu"), peers=[], superseded=lambda: False, bind=outer)
    window = torch.empty(nbytes, dtype=torch.uint8)
    plane.wait(plane.start_recv(window, what="bucket"))
    windows.append((0.0, 0.0))
    left = buckets - 1
    while left:
        t0 = time.perf_counter()
        while left and (time.perf_counter() - t0 < WINDOW_S or stop.is_set()):  # back to back for about WINDOW_S
            plane.wait(plane.start_recv(window, what="bucket"))
            checksum(window, "xxh3")
            left -= 1
        t1 = time.perf_counter()
        windows.append((t0, t1))
        stop.wait(t1 - t0)  # idle as long; once the chunk is over, the rest back to back
    store.set("done", "1")
    plane.close()


def _slowdown(gaps: list[float], t0: float, windows: list[tuple[float, float]], step: dict) -> dict:
    """Each step's time over the decode step model's (``engine.step``: context and admissions),
    the steps inside a receiving window against those inside an idle one (they alternate about
    every second, so the machine's drift and the context's growth hit both alike)."""
    ctx, new = replayed_context(len(gaps))
    busy = windows[1:]
    last = busy[-1][1] + (busy[-1][1] - busy[-1][0]) if busy else 0.0  # the last idle window's end
    on, off, t = [], [], t0
    for i, g in enumerate(gaps):
        a, b, t = t, t + g, t + g
        ratio = g / (step["a_s"] + step["c_s_per_token"] * ctx[i] + step["p_s_per_request"] * new[i])
        if any(s <= a and b <= e for s, e in busy):
            on.append(ratio)
        elif busy and busy[0][0] <= a and b <= last and not any(s < b and a < e for s, e in busy):
            off.append(ratio)
    return {"slowdown": round(statistics.median(on) / statistics.median(off) - 1, 4) if on and off else None,
            "steps_on": len(on), "steps_off": len(off)}


def wait_part(bench, step: dict, rates: tuple[str, ...] = ("loopback",) + RATES) -> dict:
    """The decode slowdown per rate while buckets arrive as the listener receives them: one
    ``none`` chunk of ``WAIT_STEPS`` per rate, the receiver alternating between about
    ``WINDOW_S`` of buckets and as long idle."""
    import multiprocessing as mp

    from inflight.bench.placement import TRAINER_CORE
    from inflight.bench.slow_link import slow_link

    out = {}
    for i, rate in enumerate(rates):
        with (slow_link(rate, index=i) if rate != "loopback" else contextlib.nullcontext()) as link:
            bps = {"loopback": 3.5e8, "10gbit": 3.5e8, "1gbit": 1.2e8, "100mbit": 1.2e7}[rate]  # about
            nbytes = BUCKET  # the pusher's buckets: what the listener waits on and checksums, one at a time
            buckets = 1 + max(2, round(WAIT_STEPS * 0.16 / 2 * bps / nbytes))  # receiving for about half the chunk
            here, there = mp.get_context("spawn").Pipe()
            proc = mp.get_context("spawn").Process(target=_sender, args=(link, there, buckets, nbytes), daemon=True)
            proc.start()
            os.sched_setaffinity(proc.pid, {TRAINER_CORE})  # from its start, as pin_trainer does
            windows: list[tuple[float, float]] = []
            stop = threading.Event()
            t = threading.Thread(target=_receive, args=(link, here.recv(), buckets, nbytes, windows, stop), daemon=True)
            t.start()
            while not windows:  # the chunk starts once the first bucket landed
                time.sleep(0.001)
            t0 = time.perf_counter()
            gaps = bench.run("none", 10**9, WAIT_STEPS)["gaps"]
            stop.set()
            t.join()
            proc.join(60)
            out[rate] = _slowdown(gaps, t0, windows, step) | {"bucket_bytes": nbytes, "buckets": buckets - 1}
        print(f"wait {rate}: {out[rate]}", flush=True)
    return {"steps": WAIT_STEPS, "by_rate": out}


def merge_waits(old: dict, new: list[dict]) -> dict:
    """Every repeat of the wait part, this run's added to the file's; each rate's figure is the
    median of its repeats (one chunk is noisy: its steps vary by several percent). Repeats made
    with another bucket size are dropped: they measured another wait."""
    by_rate = {rate: dict(v, repeats=v.get("repeats", [v["slowdown"]])) for rate, v in old.get("by_rate", {}).items()}
    for run in new:
        for rate, v in run["by_rate"].items():
            same = by_rate.get(rate, {}).get("bucket_bytes") == v["bucket_bytes"]
            kept = (by_rate[rate]["repeats"] if same else []) + [v["slowdown"]]
            by_rate[rate] = v | {"repeats": kept, "slowdown": round(statistics.median(kept), 4)}
    return {"steps": WAIT_STEPS, "by_rate": by_rate}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="inflight bench scale calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["link", "engine", "wait"], choices=["link", "engine", "wait"])
    ap.add_argument("--wait-rates", nargs="+", default=["loopback", *RATES], choices=["loopback", *RATES],
                    help="wait: the links to measure (the others keep the file's figures)")
    ap.add_argument("--wait-repeats", type=int, default=1, help="wait: chunks per rate (each kept; the figure is their median)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    load = [round(os.getloadavg()[0], 1)]
    if "link" in args.parts:
        data["link"] = link_part()
    if "wait" in args.parts and "engine" not in args.parts and "engine" not in data:
        raise SystemExit("calibrate: the wait part needs the engine part's decode step model first (--parts engine)")
    if "engine" in args.parts or "wait" in args.parts:
        from inflight.bench.inflight import Bench

        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench("smollm2", Path(tmp), 32, seed=0, listener_nice=19, placement="split")
            try:
                if "engine" in args.parts:
                    data["engine"] = engine_part(bench)
                if "wait" in args.parts:
                    data["wait"] = merge_waits(data.get("wait", {}), [wait_part(bench, data["engine"]["step"],
                                                                               tuple(args.wait_rates))
                                                                     for _ in range(args.wait_repeats)])
            finally:
                bench.close()
    load.append(round(os.getloadavg()[0], 1))
    stamp = {"command": "python -m inflight.bench.scale calibrate " + " ".join(sys.argv[1:] if argv is None else argv),
             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_1m": load}
    data.setdefault("runs", []).append(stamp | {"parts": args.parts})  # every run whose figures the file holds
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data))
