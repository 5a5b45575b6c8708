"""In-flight commits vs vLLM's native pause(keep)+update vs batch-boundary sync, one run.

    python -m bench.inflight [--sizes S M L] [--every 8 32] [--steps 768] [--rounds 4] [--train-steps 40 [--engines 2]]

Per model size, one in-process vLLM engine (in-flight worker + vLLM's weight-transfer
API with the ``inflight_gloo`` backend) decodes the same workload in four modes: a
stream of requests with 16..512 new tokens, 64 in flight, refilled as they finish. A
trainer process holds the weights and, on the driver's cue every N engine steps:

1. none: no updates (the ceiling);
2. inflight: ``WeightPusher.push`` while the engine keeps stepping; the commit lands in
   the step gate;
3. native: ``pause_scheduler(keep)`` + ``start_weight_update`` / ``update_weights`` (the
   trainer's broadcast) / ``finish_weight_update`` + ``resume_scheduler``;
4. batch: stop admitting, drain every request, update, admit the next batch.

The steps of none / inflight / native run interleaved in ``--rounds`` chunks, so a drift
in machine speed hits all three alike; batch runs once, long enough to drain. Stall per
update = the engine-loop interval that contains the update minus the median interval
(from the loop's own timestamps). With ``--train-steps``, the training loop
(``trainer.train``) also runs in-flight and batch-boundary for end-to-end samples/s.
Prints a table, then one JSON line; writes ``bench_inflight.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus  # noqa: E402

SIZES = {
    "S": TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=384),
    "M": TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "L": TinyModelConfig(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}
MODES = ("none", "inflight", "native", "batch")


def _trainer(conn, inflight_group, native_group, model_dir: str) -> None:
    """The trainer process: owns the weights, pushes or broadcasts them when told.

    It stands in for a trainer on other hardware, so it runs at low priority: on this
    machine it shares the cores with the engine it measures.
    """
    from safetensors.torch import load_file

    os.nice(19)
    torch.set_num_threads(1)
    from engine_patches.native_gloo import broadcast_state
    from inflight.transport.group import WeightGroup
    from inflight.transport.pusher import PushConfig, WeightPusher

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    # Two weight sets, alternated: making new weights is the trainer's job (on its own hardware
    # in a real run), not part of the update path being measured, so it is done once, up front.
    states = [{k: v + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for k, v in base.items()}
              for i in range(2)]
    pusher = WeightPusher(inflight_group, PushConfig(bucket_mb=64))
    native = WeightGroup(native_group, 0)
    conn.send("ready")
    while True:
        cmd, version = conn.recv()
        state = states[version % 2]
        if cmd == "push":
            r = pusher.push(version, state)
            c = r.commits[1]
            conn.send({"version": version, "commit_step": c.step, "commit_ms": c.commit_ms, "send_s": r.send.send_s,
                       "nbytes": r.send.nbytes, "push_s": r.stage_wait_s + r.commit_wait_s,
                       "stage_ms": r.staged[1].receive_ms})
        elif cmd == "native":
            t0 = time.perf_counter()
            nbytes = broadcast_state(native, state)
            conn.send({"version": version, "send_s": time.perf_counter() - t0, "nbytes": nbytes})
        else:
            pusher.close()
            native.close()
            return


class Bench:
    """One model size: the engine, its trainer process, and the four modes."""

    def __init__(self, size: str, work: Path, concurrency: int, seed: int, listener_nice: int) -> None:
        from vllm import LLM

        from engine_patches.config import InflightConfig, engine_kwargs
        from engine_patches.engine import coordinator_of, start_inflight
        from safetensors.torch import load_file

        from engine_patches.native_gloo import update_info
        from inflight.transport.group import GroupConfig, free_port

        self.size, self.concurrency, self.seed = size, concurrency, seed
        model_dir = build_tiny_model(work / size, default_corpus(), SIZES[size])
        state = load_file(str(model_dir / "model.safetensors"))
        self.params = sum(t.numel() for t in state.values())
        self.native_info = update_info(state)
        self.llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=640, seed=seed,
                       max_num_seqs=concurrency, weight_transfer_config={"backend": "inflight_gloo"}, **engine_kwargs())
        inflight_group = GroupConfig(port=free_port(), world_size=2, timeout_s=120)
        native_port = free_port()
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_trainer, args=(child, inflight_group, GroupConfig(port=native_port, world_size=2, backend="gloo",
                                                                      name="native"), str(model_dir)), daemon=True)
        self.proc.start()
        report = start_inflight(self.llm, InflightConfig(group=inflight_group, listener_nice=listener_nice))
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
            "host": "127.0.0.1", "port": native_port, "world_size": 2, "rank": 1, "name": "native"}})
        assert self.conn.recv() == "ready"
        self.gate = coordinator_of(self.llm)
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.version = 0
        self.run("none", every=10**9, steps=48)  # warm-up: kernels, allocator, oneDNN caches

    def run(self, mode: str, every: int, steps: int) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from inflight.versions import tags_from_spans

        engine = self.llm.llm_engine
        rng = random.Random(self.seed)
        prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}
        active: set[str] = set()
        times, tokens, events = [time.perf_counter()], 0, []  # events: (interval index, kind, info)
        lags: list[int] = []
        pushing, draining, n_req = False, False, 0
        gate_start = self.gate.steps
        for step in range(steps):
            due = step > 0 and step % every == 0
            if mode == "inflight":
                if due and not pushing:
                    self.version += 1
                    self.conn.send(("push", self.version))
                    pushing = True
                if pushing and self.conn.poll():
                    r = self.conn.recv()
                    events.append((r["commit_step"] - gate_start + 1, "commit", r))
                    pushing = False
            elif mode == "native" and due:
                self.version += 1
                t0 = time.perf_counter()
                self.core.pause_scheduler(mode="keep", clear_cache=False)
                self.llm.collective_rpc("start_weight_update")
                self.conn.send(("native", self.version))
                self.llm.collective_rpc("update_weights", kwargs={"update_info": self.native_info})
                self.llm.collective_rpc("finish_weight_update")
                self.gate.set_label(self.version)  # tag tokens with the version the native path loaded
                self.core.resume_scheduler()
                r = self.conn.recv()
                r["pause_ms"] = 1e3 * (time.perf_counter() - t0)
                events.append((len(times), "native", r))
            elif mode == "batch":
                draining = draining or due
                if draining and not active:
                    self.version += 1
                    self.conn.send(("push", self.version))  # the engine is idle: the commit is immediate
                    events.append((len(times), "batch", self.conn.recv()))
                    draining = False
            while not draining and len(active) < self.concurrency:
                rid = f"{mode}-{n_req}"
                n_req += 1
                sp = SamplingParams(max_tokens=rng.randint(16, 512), ignore_eos=True, temperature=1.0,
                                    output_kind=RequestOutputKind.DELTA, seed=n_req)
                engine.add_request(rid, prompt, sp)
                active.add(rid)
            for out in engine.step():
                tokens += len(out.outputs[0].token_ids)
                if out.finished:
                    active.discard(out.request_id)
                    spans = out.outputs[0].weight_versions
                    tags = tags_from_spans(spans, spans[-1].end if spans else 0)
                    lags.extend(self.gate.live_version - v for v in tags)
            times.append(time.perf_counter())
        while pushing:  # let the last push land before the next mode
            r = self.conn.recv()
            pushing = False
        for rid in list(active):
            engine.abort_request([rid])
        while engine.has_unfinished_requests():
            engine.step()
        gaps = [b - a for a, b in zip(times, times[1:])]
        at = {i for i, _, _ in events}
        return {"mode": mode, "every": every, "tokens": tokens, "wall_s": times[-1] - times[0], "lags": lags,
                "quiet": [g for i, g in enumerate(gaps, 1) if i not in at],
                "event_gaps": [gaps[i - 1] for i, _, _ in events if 0 < i <= len(gaps)],
                "infos": [r for _, _, r in events], "steps": len(gaps)}

    def report(self, chunks: list[dict]) -> dict:
        """One row from the chunks of one mode (interleaved with the other modes' chunks, so a
        drift in machine speed hits every mode alike)."""
        mode, every = chunks[0]["mode"], chunks[0]["every"]
        tokens = sum(c["tokens"] for c in chunks)
        wall = sum(c["wall_s"] for c in chunks)
        lags = [x for c in chunks for x in c["lags"]]
        base = statistics.median([g for c in chunks for g in c["quiet"]])
        stalls = [1e3 * (g - base) for c in chunks for g in c["event_gaps"]]
        infos = [r for c in chunks for r in c["infos"]]
        nbytes = infos[0]["nbytes"] if infos else 0
        send = [r["send_s"] for r in infos]
        hist: dict[int, int] = {}
        for x in lags:
            hist[x] = hist.get(x, 0) + 1
        return {
            "size": self.size, "params": self.params, "mode": mode, "every": every,
            "steps": sum(c["steps"] for c in chunks), "updates": len(infos), "tokens": tokens, "tok_s": round(tokens / wall, 1),
            "step_ms": round(1e3 * base, 2),
            "stall_ms": round(statistics.median(stalls), 2) if stalls else 0.0,
            "commit_ms": round(statistics.median(r["commit_ms"] for r in infos), 3) if mode == "inflight" and infos else None,
            "stage_ms": round(statistics.median(r["stage_ms"] for r in infos), 1) if mode == "inflight" and infos else None,
            "ms_per_gb": round(1e3 * statistics.median(send) / (nbytes / 2**30), 1) if send else None,
            "lag_hist": dict(sorted(hist.items())),
        }

    def close(self) -> None:
        self.conn.send(("stop", 0))
        self.proc.join(30)
        self.llm.collective_rpc("inflight_stop")


def train_loop(steps: int, work: Path, engines: int = 1) -> list[dict]:
    """End-to-end samples/s of the training loop: in-flight vs batch-boundary with one engine,
    and, with ``engines`` > 1, in-flight with a fleet of that many engines (same trainer, same
    task; on this 2-core machine the engines share the cores with the trainer)."""
    from trainer.config import config_from_dict
    from trainer.train import train

    rows = []
    runs = [("inflight", 1), ("batch", 1)] + ([("inflight", engines)] if engines > 1 else [])
    for mode, count in runs:
        name = f"train_{mode}_x{count}"
        cfg = config_from_dict({"run": {"steps": steps, "out_dir": str(work / name)}, "rollout": {"mode": mode},
                                "engine": {"count": count}})
        t0 = time.perf_counter()
        train(cfg)
        log = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        wall = sum(r["step_ms"] for r in log[1:]) / 1e3  # from the first step on: the same start-up for all
        samples = (len(log) - 1) * cfg.rollout.groups_per_step * cfg.rollout.group_size
        pushes = [r for r in log if "committed_ranks" in r]
        rows.append({"mode": mode, "engines": count, "steps": steps, "samples_s": round(samples / wall, 1),
                     "total_s": round(time.perf_counter() - t0, 1),
                     # every update landed on every engine?
                     "pushes_on_all": sum(len(r["committed_ranks"]) == count for r in pushes) / max(len(pushes), 1),
                     # engine steps decoded between first bucket and commit: how far apart the engines committed
                     "commit_spread_steps": round(sum(r["commit_spread_steps"] for r in pushes) / max(len(pushes), 1), 2)})
    return rows


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in rows}, key=list(SIZES).index)
    everys = sorted({r["every"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for k, every in enumerate(everys):
        for j, mode in enumerate(MODES):
            ys = [next(r["tok_s"] for r in rows if r["size"] == s and r["mode"] == mode and r["every"] == every) /
                  next(r["tok_s"] for r in rows if r["size"] == s and r["mode"] == "none" and r["every"] == every)
                  for s in sizes]
            xs = [i + (k * len(MODES) + j) * 0.9 / (len(MODES) * len(everys)) for i in range(len(sizes))]
            axes[0].bar(xs, ys, width=0.9 / (len(MODES) * len(everys)), label=f"{mode}, every {every}",
                        color=f"C{j}", alpha=1.0 if k == 0 else 0.55)
    axes[0].set_xticks(range(len(sizes)), sizes)
    axes[0].set_ylabel("tokens/s relative to no updates")
    axes[0].axhline(0.95, color="k", lw=0.6, ls="--")
    axes[0].legend(fontsize=6)
    for mode in ("inflight", "native", "batch"):
        pts = [(r["params"], max(r["stall_ms"], 0.0)) for r in rows if r["mode"] == mode and r["every"] == everys[0]]
        axes[1].plot(*zip(*sorted(pts)), marker="o", label=mode, color=f"C{MODES.index(mode)}")
    axes[1].set_xscale("log")
    axes[1].set_yscale("symlog", linthresh=1)
    axes[1].set_ylim(bottom=0)
    axes[1].set_xlabel("parameters")
    axes[1].set_ylabel("stall per update, ms")
    axes[1].legend()
    hist = next(r["lag_hist"] for r in rows if r["mode"] == "inflight" and r["size"] == sizes[-1] and r["every"] == everys[0])
    axes[2].bar(list(hist), list(hist.values()))
    axes[2].set_xlabel(f"token lag at sequence end, versions ({sizes[-1]}, every {everys[0]})")
    axes[2].set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES), help="none: training-loop rows only")
    ap.add_argument("--every", type=int, nargs="+", default=[8, 32], help="update cadence, engine steps")
    ap.add_argument("--steps", type=int, default=768, help="engine steps per mode")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the steps of none/inflight/native are split into")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--listener-nice", type=int, default=19, help="InflightConfig.listener_nice of the engine (its default)")
    ap.add_argument("--train-steps", type=int, default=0, help="also time the training loop (0: skip)")
    ap.add_argument("--engines", type=int, default=1, help="with --train-steps: add a row for a fleet of this many engines")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            bench = Bench(size, Path(tmp), args.concurrency, seed=0, listener_nice=args.listener_nice)
            for every in args.every:
                chunks: dict[str, list[dict]] = {m: [] for m in MODES}
                for _ in range(args.rounds):  # interleaved: none, inflight, native, none, inflight, ...
                    for mode in MODES[:3]:
                        chunks[mode].append(bench.run(mode, every, args.steps // args.rounds))
                # a batch boundary needs every request drained (up to 512 tokens): one long run
                chunks["batch"].append(bench.run("batch", every, args.steps))
                rows += [bench.report(chunks[m]) for m in MODES]
            bench.close()
            del bench
        train_rows = train_loop(args.train_steps, Path(tmp), args.engines) if args.train_steps else []
    for r in rows:
        ceiling = next(x["tok_s"] for x in rows if x["size"] == r["size"] and x["every"] == r["every"] and x["mode"] == "none")
        r["vs_none"] = round(r["tok_s"] / ceiling, 3)
    cols = ["size", "params", "every", "mode", "updates", "tok_s", "vs_none", "step_ms", "stall_ms", "commit_ms", "stage_ms",
            "ms_per_gb"]
    print(" ".join(f"{c:>10}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>10}" for c in cols))
    for r in train_rows:
        print(f"training loop, {r['mode']:>8} x {r['engines']} engine(s): {r['samples_s']} samples/s ({r['steps']} steps; "
              f"updates on every engine {100 * r['pushes_on_all']:.0f}%, commit spread {r['commit_spread_steps']} steps)")
    if rows:
        plot(rows, out / "bench_inflight.png")
    print(json.dumps({"bench": "inflight", "device": "cpu", "rows": rows, "train": train_rows}))


if __name__ == "__main__":
    main()
