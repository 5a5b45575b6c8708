"""In-flight commits vs vLLM's native pause(keep)+update vs batch-boundary sync, like for like.

    python -m inflight.bench.inflight [--sizes S M L MoE | --model DIR|smollm2] [--every 8 32] [--steps 768]
                             [--rounds 4] [--commit-unit model layer] [--routing] [--placement shared|split]
                             [--link 1gbit] [--train-steps 40 [--engines 2]]

The adapter-only rows are ``inflight.bench.inflight_lora``'s.

Per model, one in-process vLLM engine (in-flight worker + vLLM's weight-transfer API with
the ``inflight_gloo`` backend) decodes the same workload in every mode (``inflight.bench.paired``):
a stream of requests with 16..512 new tokens, ``--concurrency`` in flight, refilled as they
finish. ``--placement`` (``inflight.bench.placement``) puts the engine and the trainer on shared
cores or a core each, for the engine rows and the training loop's alike; ``--link RATE`` puts
the trainer process behind a shaped link (``inflight.bench.slow_link``), so both update paths,
in-flight and native, cross it. A
trainer process holds the weights and, on the driver's cue every N engine steps:

1. none: no updates (the ceiling); and, whenever in-flight ran past its chunk while its last
   push landed, **none@inflight**: none over in-flight's very steps, run right after it (the
   least drift between the two), the ceiling of the rows run at in-flight's length (a longer
   chunk holds longer contexts, so its steps are slower with no update at all);
2. inflight: ``WeightPusher.push`` while the engine keeps stepping; the commit lands at
   a step boundary. A push that comes due while the previous one is still staging is
   skipped, so in-flight's *achieved* cadence can be lower than the requested one;
3. native: ``pause_scheduler(keep)`` + ``start_weight_update`` / ``update_weights`` (the
   trainer's broadcast) / ``finish_weight_update`` + ``resume_scheduler``, at the
   requested cadence; and, whenever in-flight fell behind (a due push skipped, or steps
   run past the chunk while its last push landed), **native@inflight**: native over the
   same number of steps with as many updates, evenly spaced, so the two are compared at
   the same cadence;
4. batch: stop admitting, drain every request, update, admit the next batch.

``--commit-unit model layer`` runs all of that once per commit unit, each on its own engine
(the unit is fixed when the engine starts) with its own trainer process: the layer engine
commits one layer group per step boundary (``InflightConfig(commit_unit="layer")``), and its
in-flight row is ``inflight-layer``; every row names its engine, and each engine's rows are
measured against its own ``none``. A layer update commits its groups at as many step
boundaries: ``stall_ms`` holds only its last group's interval, ``push_stall_ms`` every group's
commit summed (``PushResult.stall_ms``; the whole model's commit on the model engine) and
``groups`` the groups per update. ``staging_peak_bytes``: measured on the engine worker for
the rows that push, computed (the flat receive buffer) for native's (``Bench.staging_of``).

The steps of none / inflight / native run interleaved in ``--rounds`` chunks, so a drift
in machine speed hits all of them alike; a chunk with a push still staging at its end keeps
stepping until it landed (those steps count: an update's whole cost is in its chunk). The
headline is **decode time lost per update** = (wall time of the mode - wall time ``none``
(``none@inflight`` for inflight and native@inflight where it ran) needs for the same tokens) /
updates: it counts the stall and every slower step while an update stages. The commit
interval (the engine-loop interval holding the commit minus the median interval) is its own
column. ``--routing`` adds rows for ``record_routing`` on a
tiny MoE (``none`` with the recorder off and on, interleaved). ``--train-steps`` runs the
training loop end to end (``inflight.bench.e2e``). Prints a table, one JSON line; writes a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inflight.bench.inflight_report import COLS, compare, plot
from inflight.bench.inflight_trainer import trainer
from inflight.bench.paired import RequestStream
from inflight.bench.placement import PLACEMENTS, Placement, engine_env, pin_trainer
from inflight.bench.run_record import run_record
from inflight.bench.slow_link import slow_link
from inflight.trainer.native_update import native_update
from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

if TYPE_CHECKING:
    from collections.abc import Callable

    from inflight.bench.slow_link import SlowLink
    from inflight.protocol import CommitUnit

SIZES = {  # tiny random-init models; MoE: a Qwen3-MoE (4 experts, top-2) for the record_routing rows
    "S": TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=384),
    "M": TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "L": TinyModelConfig(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    "MoE": TinyModelConfig(arch="qwen3_moe", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256,
                           num_experts=4, experts_per_token=2, moe_intermediate_size=128),
}


class Bench:
    """One model and commit unit: the engine, its trainer process, and the modes."""

    def __init__(self, size: str, work: Path, concurrency: int, seed: int, listener_nice: int,
                 record_routing: bool = False, commit_unit: CommitUnit = "model", placement: Placement = "shared",
                 link: SlowLink | None = None, rl_api: bool = False, engine_args: dict | None = None,
                 make_stream: Callable[..., RequestStream] = RequestStream) -> None:
        from safetensors.torch import load_file
        from vllm import LLM

        from inflight.engine.client import coordinator_of, start_inflight
        from inflight.engine.engine_config import InflightConfig, engine_kwargs
        from inflight.trainer.native_update import register, update_info

        self.size, self.concurrency, self.seed, self.unit = size, concurrency, seed, commit_unit
        self.make_stream = make_stream  # (engine, mode, seed, concurrency) -> a chunk's requests: paired's by default
        if size in SIZES:
            model_dir = build_tiny_model(work / size, default_corpus(), SIZES[size])
        else:  # --model: a directory, hub id or "smollm2"
            from inflight.trainer.models import resolve_model

            model_dir = resolve_model(size)
        self.model = size if size in SIZES else Path(model_dir).name
        state = load_file(str(model_dir / "model.safetensors"))
        self.params, self.native_info = sum(t.numel() for t in state.values()), update_info(state)
        del state
        register()  # the native baseline's transfer engine, in this process (EngineCore runs here)
        listener_cpus = engine_env(placement)
        # --rl-api: the inflight backend of vLLM's RL API (inflight-native-api rows); else inflight_gloo (native rows)
        self.rl_api = rl_api
        transfer = {} if rl_api else {"weight_transfer_config": {"backend": "inflight_gloo"}}
        # engine_args: more engine arguments, or others in place of these (inflight.bench.spec's speculation)
        args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 640, "seed": seed,
                "max_num_seqs": concurrency, **transfer, **engine_kwargs(rl_api=rl_api), **(engine_args or {})}
        self.llm = LLM(str(model_dir), **args)
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=trainer, args=(child, str(model_dir), link, not rl_api),
                                                      daemon=True)
        self.proc.start()
        pin_trainer(self.proc.pid, placement)
        inflight_group, native_group = self.conn.recv()  # the trainer's stores, on the ports it holds
        # layer: staged_groups=2, the default
        self.config = InflightConfig(group=inflight_group, listener_nice=listener_nice, listener_cpus=listener_cpus,
                                     record_routing=record_routing, commit_unit=commit_unit)
        start_inflight(self.llm, self.config)
        if not rl_api:
            self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
                "host": native_group.host, "port": native_group.port, "world_size": 2, "rank": 1,
                "name": native_group.name, "timeout_s": native_group.timeout_s, "insecure": native_group.insecure}})
        assert self.conn.recv() == "ready"
        self.coordinator = coordinator_of(self.llm)
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.version = 0
        self.routing = record_routing
        self.run("none", every=10**9, steps=48)  # warm-up: kernels, allocator, oneDNN caches

    def set_routing(self, on: bool) -> None:
        """Bench only: switch ``record_routing`` of the running engine (the worker's recorder
        and the coordinator's flag), so its cost is measured in interleaved chunks of one engine."""
        import dataclasses

        from inflight.engine.routing import RoutingRecorder

        worker = self.core.model_executor.driver_worker.worker
        if on and worker._inflight_routing is None:
            worker._inflight_routing = RoutingRecorder(worker.model_runner)
        elif not on and worker._inflight_routing is not None:
            worker._inflight_routing.close()
            worker._inflight_routing = None
        self.coordinator.config = dataclasses.replace(self.coordinator.config, record_routing=on)
        self.routing = on

    def staging_peak(self) -> int:
        """The engine worker's staging high-water mark since it started, bytes."""
        from inflight.engine.client import inflight_status

        return inflight_status(self.llm).staging_peak_bytes

    def run(self, mode: str, every: int, steps: int) -> dict:
        """``steps`` engine steps of ``mode`` (none, inflight, native, batch), an update due every
        ``every``; the chunk's figures (``RequestStream.end``), the tags' lags, the step intervals
        each push was sent before (``cues``; each lands in its ``infos`` entry's event interval)
        and the staging peak."""
        from inflight.versions import tags_from_spans

        stream = self.make_stream(self.llm.llm_engine, mode, self.seed, self.concurrency)
        lags: list[int] = []
        cues: list[int] = []  # the step intervals (1-based) a push was sent before
        st = {"routed": 0, "finished": 0, "skipped": 0}
        api_s: list[float] = []  # inflight-native-api: the engine thread's time in the API's calls, per update
        pushing, draining = False, False
        coordinator_start = self.coordinator.steps
        peak_before = self.staging_peak()

        def step() -> None:
            if not draining:
                stream.refill()
            for out in stream.step():
                st["finished"] += 1
                st["routed"] += out.outputs[0].routed_experts is not None
                spans = out.outputs[0].weight_versions
                tags = tags_from_spans(spans, spans[-1].end if spans else 0)
                lags.extend(self.coordinator.live_version - v for v in tags)

        api = mode == "inflight-native-api"

        def landed() -> None:
            r = self.conn.recv()
            stream.event(r, r["commit_step"] - coordinator_start + 1)
            if api:  # as InflightTrainerWeightTransferEngine.send_weights: finish, naming the version, once it landed
                t0 = time.perf_counter()
                self.llm.finish_weight_update(str(self.version))
                api_s[-1] += time.perf_counter() - t0

        for i in range(steps):
            due = i > 0 and i % every == 0
            if mode in ("inflight", "inflight-native-api"):
                if due and pushing:
                    st["skipped"] += 1  # the previous update is still staging: this one is not sent
                elif due:
                    self.version += 1
                    if api:  # vLLM's RL API, each call between two steps: start, then update_weights(info)
                        t0 = time.perf_counter()
                        self.llm.start_weight_update()
                        self.llm.update_weights({"update_info": {"version": self.version, **self.native_info}})
                        api_s.append(time.perf_counter() - t0)
                    self.conn.send(("push", self.version))
                    cues.append(i + 1)
                    pushing = True
                if pushing and self.conn.poll():
                    landed()
                    pushing = False
            elif mode == "native" and due:
                self.version += 1
                t0 = time.perf_counter()
                native_update(self.core, self.llm, self.conn, self.version, self.native_info)
                self.coordinator.set_label(self.version)  # tag tokens with the version the native path loaded
                self.core.resume_scheduler()
                r = self.conn.recv()
                r["pause_ms"] = 1e3 * (time.perf_counter() - t0)
                stream.event(r)
            elif mode == "batch":
                draining = draining or due
                if draining and not stream.active:
                    self.version += 1
                    self.conn.send(("push", self.version))  # the engine is idle: the commit is immediate
                    stream.event(self.conn.recv())
                    draining = False
            step()
        while pushing:  # the last push is staging: keep decoding (and counting) until it lands
            step()
            if self.conn.poll():
                landed()
                pushing = False
        return {**stream.end(every, st["skipped"]), "lags": lags, "cues": cues, "routing": self.routing, "api_s": api_s,
                "routed": st["routed"], "finished": st["finished"], "peak": (peak_before, self.staging_peak())}

    def report(self, chunks: list[dict], label: str | None = None) -> dict:
        """One row from the chunks of one mode (interleaved with the other modes' chunks, so a
        drift in machine speed hits every mode alike)."""
        mode, every = chunks[0]["mode"], chunks[0]["every"]
        tokens = sum(c["tokens"] for c in chunks)
        wall = sum(c["wall_s"] for c in chunks)
        steps = sum(c["steps"] for c in chunks)
        lags = [x for c in chunks for x in c["lags"]]
        base = statistics.median([g for c in chunks for g in c["quiet"]])
        stalls = [1e3 * (g - base) for c in chunks for g in c["event_gaps"]]
        infos = [r for c in chunks for r in c["infos"]]
        nbytes = infos[0]["nbytes"] if infos else 0
        send = [r["send_s"] for r in infos]
        hist: dict[int, int] = {}
        for x in lags:
            hist[x] = hist.get(x, 0) + 1
        pushed = mode in ("inflight", "inflight-native-api", "batch") and infos
        label = label or mode
        return {
            "model": self.model, "engine": self.unit, "size": self.size, "params": self.params, "every": every,
            "mode": "inflight-layer" if label == "inflight" and self.unit == "layer" else label,
            "routing": chunks[0]["routing"], "routed_frac": round(sum(c["routed"] for c in chunks) /
                                                                  max(1, sum(c["finished"] for c in chunks)), 3),
            "steps": steps, "updates": len(infos), "skipped": sum(c["skipped"] for c in chunks),
            "steps_per_update": round(steps / len(infos), 1) if infos else None,
            "tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1),
            "step_ms": round(1e3 * base, 2),
            "stall_ms": round(statistics.median(stalls), 2) if stalls else 0.0,
            "commit_ms": round(statistics.median(r["commit_ms"] for r in infos), 3) if pushed else None,
            "push_stall_ms": round(statistics.median(r["stall_ms"] for r in infos), 3) if pushed else None,
            "groups": statistics.median(r["groups"] for r in infos) if pushed else None,
            "stage_ms": round(statistics.median(r["stage_ms"] for r in infos), 1) if pushed else None,
            "ms_per_gb": round(1e3 * statistics.median(send) / (nbytes / 2**30), 1) if send else None,
            "lag_hist": dict(sorted(hist.items())), **self.staging_of(mode, chunks, infos),
            # inflight-native-api: the RL API's calls per update (start, update_weights, finish), on the engine thread
            "api_ms": (round(1e3 * statistics.median(a), 3)
                       if (a := [x for c in chunks for x in c.get("api_s", ())]) else None),
            "_quiet": [g for c in chunks for g in c["quiet"]], "_events": [g for c in chunks for g in c["event_gaps"]],
        }

    @staticmethod
    def staging_of(mode: str, chunks: list[dict], infos: list[dict]) -> dict:
        """A row's peak staging bytes, and how they are known (``peak_how``).

        Rows that push (inflight, batch): the worker's high-water mark since the engine started,
        read when the row's last chunk ended. Only those chunks touch the staging pool (native
        loads through vLLM's own path, ``none`` stages nothing) and the warm-up pushes nothing,
        so each engine's first in-flight row is the first to stage and raises the mark itself:
        "row", the figure is that row's own. A later row that does not raise it reads "earlier":
        it staged at most that (the same update, so in practice as much). Native rows: the flat buffer
        ``receive_weights`` allocates, the size of the broadcast (both sides plan it from the
        same ``update_info``): "computed", not measured."""
        if mode == "native" and infos:
            return {"staging_peak_bytes": infos[0]["nbytes"], "peak_how": "computed"}
        if mode in ("inflight", "inflight-native-api", "batch") and infos:
            before, after = chunks[0]["peak"][0], chunks[-1]["peak"][1]
            return {"staging_peak_bytes": after, "peak_how": "row" if after > before else "earlier"}
        return {"staging_peak_bytes": None, "peak_how": None}

    def close(self) -> None:
        self.conn.send(("stop", 0))
        self.proc.join(30)
        self.llm.collective_rpc("inflight_stop")


def bench_model(bench: Bench, everys: list[int], steps: int, rounds: int) -> list[dict]:
    if bench.rl_api:
        return bench_rl_api(bench, everys, steps, rounds)
    rows = []
    chunk = steps // rounds
    for every in everys:
        chunks: dict[str, list[dict]] = {m: [] for m in ("none", "inflight", "native", "native@inflight",
                                                         "none@inflight")}
        for _ in range(rounds):  # interleaved: none, inflight, none@inflight, native, native@inflight, none, ...
            for mode in ("none", "inflight"):
                chunks[mode].append(bench.run(mode, every, chunk))
            got = chunks["inflight"][-1]
            # none over in-flight's very steps, right after it (the least drift between the two): a
            # longer chunk holds longer contexts (slower steps) whatever the updates do, so the rows
            # that ran past the chunk are measured against it.
            same = got["steps"] == chunk
            chunks["none@inflight"].append(chunks["none"][-1] if same else bench.run("none", every, got["steps"]))
            chunks["native"].append(bench.run("native", every, chunk))
            # In-flight fell behind (a due push skipped, or steps run past the chunk while its last
            # push landed): native over as many steps with as many updates, evenly spaced.
            achieved = (got["steps"] - 1) // len(got["infos"]) if got["infos"] else every
            if achieved > every:
                chunks["native@inflight"].append(bench.run("native", achieved, got["steps"]))
        # a batch boundary needs every request drained (up to 512 tokens): one long run
        batch = bench.run("batch", every, steps)
        if all(c["steps"] == chunk for c in chunks["inflight"]):
            chunks["none@inflight"] = []  # in-flight kept to the chunk: none is its ceiling already
        group = [bench.report(chunks[m], label=m) for m in chunks if chunks[m]] + [bench.report([batch])]
        for r in group:
            r["group"], r["every"] = every, every  # requested cadence; steps_per_update is the achieved one
            if chunks["none@inflight"] and r["mode"] in ("inflight", "native@inflight"):
                r["ceiling"] = "none@inflight"  # inflight_report.compare measures these rows against it
        rows += group
    return rows


def bench_rl_api(bench: Bench, everys: list[int], steps: int, rounds: int) -> list[dict]:
    """An engine on the RL API's inflight backend: none, inflight (``WeightPusher`` alone) and
    inflight-native-api (the same pushes inside vLLM's start / update_weights / finish calls),
    interleaved, alternating which of the two pushing modes runs first in a round. Each row that
    ran past its chunk is measured against none over as many steps, run right after it."""
    rows = []
    chunk = steps // rounds
    for every in everys:
        modes = ("inflight", "inflight-native-api")
        chunks: dict[str, list[dict]] = {m: [] for m in ("none", *modes, "none@inflight", "none@inflight-native-api")}
        for k in range(rounds):
            chunks["none"].append(bench.run("none", every, chunk))
            for mode in modes[::-1] if k % 2 else modes:
                got = bench.run(mode, every, chunk)
                chunks[mode].append(got)
                extra = got["steps"] != chunk
                chunks[f"none@{mode}"].append(bench.run("none", every, got["steps"]) if extra else chunks["none"][-1])
        group = [bench.report(chunks[m], label=m) for m in chunks if chunks[m]]
        for r in group:
            r["group"], r["every"] = every, every
            if r["mode"] in modes:
                r["ceiling"] = f"none@{r['mode']}"
        rows += group
    return rows


def bench_routing(bench: Bench, every: int, steps: int, rounds: int) -> list[dict]:
    """``record_routing`` off and on in interleaved chunks of one MoE engine: none, and inflight."""
    chunks: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(rounds):
        for on in (False, True):
            bench.set_routing(on)
            for mode in ("none", "inflight"):
                chunks.setdefault((mode, on), []).append(bench.run(mode, every, steps // rounds))
    bench.set_routing(False)
    rows = []
    for (mode, on), cs in chunks.items():
        r = bench.report(cs, label=mode + ("+routing" if on else ""))
        r["group"] = f"routing/{every}"
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", default=["S", "M", "L"], choices=list(SIZES),
                    help="none: only --model / training rows")
    ap.add_argument("--model", nargs="*", default=[],
                    help="model directories, hub ids or 'smollm2' (trainer/models.py)")
    ap.add_argument("--every", type=int, nargs="+", default=[8, 32], help="requested update cadence, engine steps")
    ap.add_argument("--steps", type=int, default=768, help="engine steps per mode")
    ap.add_argument("--rounds", type=int, default=4,
                    help="interleaved rounds the steps of none/inflight/native are split into")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--commit-unit", nargs="+", default=["model"], choices=["model", "layer"],
                    help="one engine per unit, each running every mode (InflightConfig.commit_unit)")
    ap.add_argument("--listener-nice", type=int, default=19,
                    help="InflightConfig.listener_nice of the engine (19, as docs/performance.md's table was measured; "
                         "the engine's own default is 0)")
    ap.add_argument("--routing", action="store_true", help="add record_routing rows on the tiny MoE")
    ap.add_argument("--link", default=None, metavar="RATE",
                    help="the engine rows' trainer behind a shaped link (inflight.bench.slow_link; e.g. 1gbit, "
                         "100mbit; needs root); the training loop's rows run without it")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also time the training loop (0: skip); see inflight.bench.e2e")
    ap.add_argument("--placement", choices=PLACEMENTS, default="shared",
                    help="inflight.bench.placement: where the engine and the trainer run (engine rows and training "
                         "loop)")
    ap.add_argument("--engines", type=int, default=1,
                    help="with --train-steps: add a row for a fleet of this many engines")
    ap.add_argument("--rl-api", action="store_true",
                    help="engines on vLLM's RL API's inflight backend: rows none, inflight and inflight-native-api "
                         "(the same pushes inside start / update_weights / finish); no native rows")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    run = run_record("inflight")  # the command, its start and the git revision, in the JSON
    load = [round(os.getloadavg()[0], 1)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        link = stack.enter_context(slow_link(args.link)) if args.link else None
        if args.routing:  # first: vLLM builds its expert-parallel group only if the process's first engine is MoE
            bench = Bench("MoE", Path(tmp), args.concurrency, seed=0, listener_nice=args.listener_nice,
                          placement=args.placement, link=link)
            rows += bench_routing(bench, args.every[0], args.steps, args.rounds)
            bench.close()
            del bench
        for size in args.model + args.sizes:
            for unit in args.commit_unit:  # fixed when an engine starts: an engine each
                bench = Bench(size, Path(tmp), args.concurrency, seed=0, listener_nice=args.listener_nice,
                              commit_unit=unit, placement=args.placement, link=link, rl_api=args.rl_api)
                rows += bench_model(bench, args.every, args.steps, args.rounds)
                bench.close()
                del bench
        load.append(round(os.getloadavg()[0], 1))
        train_rows = []
        if args.train_steps:
            from inflight.bench.e2e import plot_e2e, train_loop

            train_rows = train_loop(args.train_steps, Path(tmp), args.engines, placement=args.placement)
            plot_e2e(train_rows, out / "bench_e2e.png")
    compare(rows)
    print(f"load average (1 min) at start / after the engine rows: {load[0]} / {load[1]}")
    print(" | ".join(COLS))
    for r in rows:
        print(" | ".join(str(r[c]) for c in COLS))
    for r in train_rows:
        print(f"training loop ({r['cores']}), {r['mode']:>8} x {r['engines']} engine(s): {r['samples_s']} samples/s, "
              f"reward last 20% {r['reward_last']} ({r['steps']} steps, {r['wall_s']} s)")
    if rows:
        plot(rows, out / "bench_inflight.png")
    print(json.dumps({"bench": "inflight", **run, "device": "cpu", "link": args.link, "placement": args.placement,
                      "concurrency": args.concurrency, "steps": args.steps,
                      "rounds": args.rounds, "commit_units": args.commit_unit, "load_1m": load, "rows": rows,
                      "train": train_rows}))


if __name__ == "__main__":
    main()
