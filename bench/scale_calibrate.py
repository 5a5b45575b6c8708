"""The CPU replay model's parameters (``scale_replay``), each from a micro-benchmark of its own,
never from the ``inflight.bench.inflight`` runs the model is judged on.

    python -m inflight.bench.scale calibrate [--parts link engine push] [--out bench/scale_calibration.json]

Parts (each under 6 minutes; run them one at a time, never beside another heavy job):

- ``link``: each shaped link's achieved bytes/s, one TCP stream (``slow_link.achieved_bytes_per_s``);
  no engine.
- ``engine``: one SmolLM2 engine as ``inflight.bench.inflight --placement split --concurrency
  32`` builds it (``Bench``), no link, over loopback:
  the decode step (two ``none`` chunks of 200 steps, every step's time against the total context
  the replayed request stream holds: ``step_s = a + c x context + p x new requests``); then
  in-flight pushes and vLLM's native pause(keep)+update alternated in chunks as the judged runs
  alternate them (the loopback run's ``SETTINGS``: 4 rounds of a 96-step in-flight chunk, then
  two 96-step native chunks, an update due every 16 steps), each path's first update of a chunk (it sets itself
  up again after the other path ran: buffers faulted in afresh) kept apart from the rest: the
  in-flight commit stall, the push's time beyond staging, the loopback staging time, and the
  decode slowdown while the real pusher stages over loopback; native's stall and its
  transfer; the native broadcast's pack (``pack_into`` of the whole state).
- ``push``: the decode slowdown while the real pusher stages over each shaped link (the
  listener's whole work: the polled receive, checksums, finite checks, the CPU prepare): a
  fresh engine per rate, its trainer behind the link, pushes far enough apart that each lands
  well before the next is due; each step's time over the decode step model's, the steps from a
  push's cue until its commit against those between a commit and the next cue.

Writes one JSON file with each part's figures and, in ``runs``, every run that made them (its
command, date and load); a part not run keeps the file's earlier figures, and an earlier run
whose figures of a part were replaced names that part in its ``superseded``.
"""

from __future__ import annotations

import argparse
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
PUSHES = {"10gbit": (24, 6), "1gbit": (64, 5), "100mbit": (400, 3)}
"""push: per rate, the steps between two pushes (each stages for about 11 / 31 / 300 steps) and
the pushes."""


def link_part(seconds: float = 1.0) -> dict:
    """Achieved bytes/s of one TCP stream over each shaped link, a second's worth of bytes at
    each rate (``slow_link.bytes_to_measure``)."""
    from inflight.bench.slow_link import achieved_bytes_per_s, bytes_to_measure, slow_link

    out, sent = {}, {}
    for i, rate in enumerate(RATES):
        with slow_link(rate, index=i) as link:
            sent[rate] = bytes_to_measure(link, seconds) >> 20
            out[rate] = round(achieved_bytes_per_s(link, sent[rate] << 20))
    return {"achieved_Bps": out, "mb_sent": sent}


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
    """Seconds ``native_update.broadcast_state`` packs the whole state before its broadcast, on
    the trainer's core at the trainer's niceness (the median of three)."""
    import torch
    from safetensors.torch import load_file

    from inflight.bench.placement import TRAINER_CORE
    from inflight.trainer.native_update import update_info
    from inflight.transport.bucket import pack_into, plan_tensors

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
    """The decode slowdown while the real pusher stages, from in-flight chunks (``Bench.run``):
    each step's time over the decode step model's, the steps from a push's cue until its commit
    against those between a commit and the next cue (they alternate every few steps, so drift
    and the context's growth hit both alike)."""
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
    updates run as the judged loopback run makes them (``scale_replay.SETTINGS``: its rounds,
    chunk length and cadence): each round an in-flight chunk then two native chunks (a run's
    native and native@inflight), each path's first update of a chunk kept apart from the rest
    (``first_and_rest``)."""
    from inflight.bench.scale_replay import SETTINGS
    from inflight.trainer.models import resolve_model

    run = SETTINGS["loopback"]
    every, chunk = run["every"], run["steps"] // run["rounds"]
    step = fit_step([bench.run("none", 10**9, 200)["gaps"] for _ in range(2)])
    pushes, natives = [], []
    for _ in range(run["rounds"]):
        pushes.append(bench.run("inflight", every, chunk))
        natives += [bench.run("native", every, chunk) for _ in range(2)]  # as native, then native@inflight
    stalls = []
    for c in natives:
        base = statistics.median(c["quiet"])
        stalls.append([g - base for g in c["event_gaps"]])
    stage = first_and_rest([[r["stage_ms"] / 1e3 for r in c["infos"]] for c in pushes])
    stall = first_and_rest(stalls)
    send = first_and_rest([[r["send_s"] for r in c["infos"]] for c in natives])
    infos = [r for c in pushes for r in c["infos"]]
    nbytes = infos[0]["nbytes"]
    return {"model": bench.model, "nbytes": nbytes, "step": step, "rounds": run["rounds"],
            "native": {"first_stall_s": stall[0], "stall_s": stall[1],
                       "first_send_s": send[0], "send_s": send[1], "updates": sum(map(len, stalls)),
                       "pack_s": native_pack_s(Path(resolve_model("smollm2")))},
            "inflight": {"first_stage_s": stage[0], "stage_s": stage[1], "updates": len(infos),
                         "push_over_stage_s": statistics.median(r["push_s"] - r["stage_ms"] / 1e3 for r in infos),
                         "stall_s": statistics.median(r["stall_ms"] for r in infos) / 1e3,
                         **push_slowdown(pushes, step), "buckets": -(-nbytes // BUCKET)}}


def push_part(step: dict, rates: tuple[str, ...] = RATES) -> dict:
    """The decode slowdown while the real pusher stages over each shaped link: per rate, a fresh
    engine (``Bench``, its trainer behind the link, as ``inflight.bench.inflight --link`` builds
    it) decodes one in-flight chunk with a push due every ``PUSHES[rate][0]`` steps (far enough
    apart that each push lands well before the next is due), ``PUSHES[rate][1]`` pushes, and
    ``push_slowdown`` compares its staging steps with the steps between pushes."""
    from inflight.bench.inflight import Bench
    from inflight.bench.slow_link import slow_link

    out = {}
    for i, rate in enumerate(rates):
        every, pushes = PUSHES[rate]
        with tempfile.TemporaryDirectory() as tmp, slow_link(rate, index=i) as link:
            bench = Bench("smollm2", Path(tmp), 32, seed=0, listener_nice=19, placement="split", link=link)
            try:
                chunk = bench.run("inflight", every, every * pushes + 1)
            finally:
                bench.close()
                del bench
        out[rate] = push_slowdown([chunk], step) | {
            "every": every, "pushes": len(chunk["infos"]), "skipped": chunk["skipped"],
            "stage_s": round(statistics.median(r["stage_ms"] for r in chunk["infos"]) / 1e3, 3)}
        print(f"push {rate}: {out[rate]}", flush=True)
    return {"by_rate": out}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inflight bench scale calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["link", "engine", "push"], choices=["link", "engine", "push"])
    ap.add_argument("--push-rates", nargs="+", default=list(RATES), choices=RATES,
                    help="push: the links to measure (the others keep the file's figures)")
    ap.add_argument("--out", type=Path, default=OUT)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    load = [round(os.getloadavg()[0], 1)]
    if "link" in args.parts:
        data["link"] = link_part()
    if "engine" in args.parts:
        from inflight.bench.inflight import Bench

        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench("smollm2", Path(tmp), 32, seed=0, listener_nice=19, placement="split")
            try:
                data["engine"] = engine_part(bench)
            finally:
                bench.close()
                del bench
    if "push" in args.parts:
        if "engine" not in data:
            raise SystemExit("calibrate: the push part needs the engine part's decode step model first "
                             "(--parts engine)")
        old = data.get("push", {}).get("by_rate", {})
        data["push"] = {"by_rate": old | push_part(data["engine"]["step"], tuple(args.push_rates))["by_rate"]}
    load.append(round(os.getloadavg()[0], 1))
    stamp = {"command": "python -m inflight.bench.scale calibrate " + " ".join(sys.argv[1:] if argv is None else argv),
             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_1m": load}
    for run in data.setdefault("runs", []):  # each earlier run whose figures of a part this one replaced says so
        replaced = [p for p in args.parts if p in run["parts"] and p not in run.get("superseded", [])]
        if replaced:
            run["superseded"] = run.get("superseded", []) + replaced
    data["runs"].append(stamp | {"parts": args.parts})  # every run whose figures the file holds (or held)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data))
