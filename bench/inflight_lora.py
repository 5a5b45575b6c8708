"""Adapter-only in-flight updates vs vLLM's own LoRA reload vs whole-model updates, one model.

    python -m inflight.bench.inflight_lora [--model smollm2|DIR] [--every 4] [--steps 192] [--rounds 3] [--rank 16]

``inflight.bench.paired``'s method, as ``inflight.bench.inflight``'s: one in-process vLLM engine at a
time decodes the same request stream (``PROMPT``, 16..512 new tokens, ``--concurrency`` in flight) in each of its modes,
interleaved in ``--rounds`` chunks so a drift in machine speed hits them alike. A trainer
process (nice 19, one thread) holds the weights and, cued every ``--every`` engine steps,
sends an update (made once, up front: making weights is training, not the update path); a
cue due while the last update is on its way is skipped (the *achieved* steps per update can
exceed the requested), and a chunk steps on until its last update landed. Decode time lost
per update is paired step by step with the ``none`` chunk of the same round (``per_round``:
every mode decodes the same batches at the same step), and also given as
``inflight.bench.inflight_report.compare``'s (the mode's wall - the wall ``none`` needs for the same
tokens) / updates. ``--placement`` (``inflight.bench.placement``): ``split`` runs the engine's compute
thread on one core and the trainer process and the engine's listener thread on the other, as
a GPU fleet's trainer runs on its own hardware; ``shared`` lets them share both. Three
engines, one after the other:

1. ``lora-inflight``: an adapter-only in-flight engine (``InflightConfig.adapter``; rank
   ``--rank``, alpha 2 x rank, PEFT's default targets), every request naming the policy
   adapter. ``none`` is the ceiling; ``inflight-lora``: the trainer pushes the adapter's
   tensors while the engine steps; they commit into its one LoRA slot at a step boundary.
2. ``lora-vllm``: a plain vLLM LoRA engine with the same LoRA settings, on vLLM's own path.
   The trainer writes the version as a PEFT directory (``save_pretrained``) while the engine
   decodes, as a trainer would (the write's CPU is in the wall; ``write_ms`` its column); at
   the next step boundary the driver reloads it, ``add_lora(LoRARequest(..., load_inplace=
   True))`` under the id every request names: ``native-lora-inplace`` with the scheduler
   running, ``native-lora-pause`` inside ``pause_scheduler(keep)`` .. ``resume_scheduler``.
   The reload is first checked to take effect (greedy log-probs change at each reload).
3. ``full``: ``inflight.bench.inflight.Bench`` on the whole model: ``inflight-full`` (in-flight push)
   and ``native-full`` (pause(keep) + vLLM's weight-transfer API).

Per row: tokens/s, its ratio to the engine's ``none``, updates, achieved steps per update,
lost decode per update, the stall (the interval holding the update minus the median step),
bytes per update, write / load / pause / commit times, and the step-paired figures with each
round's. Checked, on the step-paired figures: (a) inflight-lora tokens/s >= 0.97 x none's;
(b) its lost decode per update <= 5% of native-full's.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from inflight.bench.inflight import Bench
from inflight.bench.inflight_report import compare
from inflight.bench.inflight_trainer import push_report
from inflight.bench.paired import PROMPT, RequestStream, interleaved
from inflight.bench.placement import PLACEMENTS, Placement, engine_env, pin_trainer

STEP_SCALE = 1e-2  # the trainer's versions: v0's tensors + this x N(0, 1) (v0's B is zero: the step is B)
ENGINES = {"lora-inflight": ("none", "inflight-lora"),
           "lora-vllm": ("none", "native-lora-inplace", "native-lora-pause")}
FULL = {"none": "none", "inflight": "inflight-full", "native": "native-full"}  # Bench.run's modes -> row labels
COLS = ["engine", "mode", "updates", "steps_per_update", "tok_s", "vs_none", "lost_ms_per_update",
        "lost_ms_per_update_capped", "capped_steps", "step_ms", "stall_ms", "bytes_per_update", "write_ms", "load_ms",
        "pause_ms", "commit_ms"]


def lora_trainer(conn: Connection, base_dir: str, adapter_dir: str, out_dir: str, push: bool) -> None:
    """The trainer process: serves ``("push" | "save" | "stop", version)`` from ``conn``.
    ``push``: join a weight group (its ``GroupConfig`` goes to the driver first) and push
    in flight; otherwise only write PEFT directories, two alternating (``v0``, ``v1`` under
    ``out_dir``), so a write never truncates the file of the adapter the engine serves."""
    os.nice(19)
    torch.set_num_threads(1)
    from inflight.adapter import ADAPTER_WEIGHTS
    from inflight.trainer.lora_policy import adapter_weights, load_adapter_weights, load_trainable
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import PushConfig, WeightPusher
    from inflight.transport.store import reserve_port

    model = load_trainable(Path(base_dir), Path(adapter_dir))
    v0 = adapter_weights(model)
    states = [{k: v + STEP_SCALE * torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
               for k, v in v0.items()} for i in range(2)]
    pusher = None
    if push:
        group = GroupConfig(port=reserve_port(), world_size=2, timeout_s=120)
        conn.send(group)
        pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=64))
    conn.send("ready")
    while True:
        cmd, version = conn.recv()
        state = states[version % 2]
        if cmd == "push" and pusher is not None:
            cpu0 = time.process_time()
            conn.send(push_report(pusher.push(version, state), version, time.process_time() - cpu0))
        elif cmd == "save":
            load_adapter_weights(model, state)  # the optimizer's step, not the write: untimed
            out = Path(out_dir) / f"v{version % 2}"
            t0 = time.perf_counter()
            model.save_pretrained(str(out))
            conn.send({"version": version, "path": str(out), "write_ms": 1e3 * (time.perf_counter() - t0),
                       "nbytes": (out / ADAPTER_WEIGHTS).stat().st_size})
        else:
            if pusher is not None:
                pusher.close()
            return


class LoRABench:
    """One LoRA engine of ``ENGINES`` (``lora-inflight``: adapter-only in-flight; ``lora-vllm``:
    plain vLLM LoRA), its trainer process and modes; ``run`` gives ``Bench.run``'s chunks."""

    def __init__(self, kind: str, base: Path, v0: Path, work: Path, concurrency: int, listener_nice: int,
                 placement: Placement) -> None:
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        from inflight.adapter import AdapterSpec
        from inflight.engine.client import coordinator_of, policy_lora, start_inflight
        from inflight.engine.engine_config import InflightConfig, engine_kwargs

        self.concurrency, self.seed, self.version = concurrency, 0, 0
        spec = AdapterSpec(path=str(v0))
        if kind == "lora-inflight":
            kwargs = engine_kwargs(adapter=spec)
        else:  # the LoRA settings engine_kwargs(adapter=spec) picks, without the in-flight worker
            shape = spec.shape()
            kwargs = dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=shape.max_lora_rank,
                          lora_target_modules=list(shape.target_modules), enable_prefix_caching=True,
                          generation_config="vllm")
        listener_cpus = engine_env(placement)
        self.llm = LLM(str(base), enforce_eager=True, dtype="float32", max_model_len=640, seed=self.seed,
                       max_num_seqs=concurrency, **kwargs)
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=lora_trainer, args=(child, str(base), str(v0), str(work / kind), kind == "lora-inflight"),
            daemon=True)
        self.proc.start()
        pin_trainer(self.proc.pid, placement)
        self.coordinator = None
        if kind == "lora-inflight":
            config = InflightConfig(group=self.conn.recv(), adapter=spec, listener_nice=listener_nice,
                                    listener_cpus=listener_cpus)
            start_inflight(self.llm, config)
            self.lora = policy_lora(config)
            self.coordinator = coordinator_of(self.llm)
        else:
            self.lora = LoRARequest(spec.name, spec.int_id, spec.path)
        assert self.conn.recv() == "ready"
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.reload_change = self.check_reload() if kind == "lora-vllm" else None
        self.run("none", every=10**9, steps=48)  # warm-up: kernels, allocator, oneDNN caches

    def load(self, mode: str, r: dict) -> dict:
        """vLLM's reload, between engine steps, of the version the trainer wrote to ``r["path"]``."""
        from vllm.lora.request import LoRARequest

        pause, t0 = mode == "native-lora-pause", time.perf_counter()
        if pause:
            self.core.pause_scheduler(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        # vLLM 0.32's LRU worker manager, load_inplace: reads the directory, drops the cached
        # adapter of this id, registers and activates the new one: the next step decodes with it
        if not self.llm.llm_engine.add_lora(LoRARequest(self.lora.lora_name, self.lora.lora_int_id, r["path"],
                                                         load_inplace=True)):
            raise RuntimeError(f"add_lora(load_inplace=True) did not load {r['path']}")
        t2 = time.perf_counter()
        if pause:
            self.core.resume_scheduler()
        return {**r, "load_ms": 1e3 * (t2 - t1), "pause_ms": 1e3 * (time.perf_counter() - t0)}

    def check_reload(self) -> float:
        """That vLLM's in-place reload serves the new version to requests naming the same id: the
        greedy log-probs of ``PROMPT`` change at each of two reloads (returned: the smaller change)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)

        def logprobs() -> list[float]:
            out = self.llm.generate([PROMPT], sp, lora_request=self.lora, use_tqdm=False)[0].outputs[0]
            return [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)]

        seen = [logprobs()]
        for _ in range(2):
            self.version += 1
            self.conn.send(("save", self.version))
            self.load("native-lora-inplace", self.conn.recv())
            seen.append(logprobs())
        change = min(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(seen, seen[1:]))
        if change < 1e-4:
            raise RuntimeError(f"add_lora(load_inplace=True) left the outputs unchanged (max |dlogprob| {change:.2e})")
        return change

    def run(self, mode: str, every: int, steps: int) -> dict:
        """``steps`` engine steps of ``mode``: ``none``, ``inflight-lora`` (a push) or
        ``native-lora-inplace`` / ``native-lora-pause`` (a write, then vLLM's reload)."""
        stream = RequestStream(self.llm.llm_engine, mode, self.seed, self.concurrency, lora_request=self.lora)
        skipped, pending = 0, False
        start = self.coordinator.steps if self.coordinator is not None else 0

        def land(r: dict) -> None:
            if mode == "inflight-lora":  # committed inside the engine step that held it
                stream.event(r, r["commit_step"] - start + 1)
            else:  # loaded now, between steps: the next interval holds it
                stream.event(self.load(mode, r))

        i = 0
        while i < steps or pending:  # past the chunk while its last update is on its way: those steps count
            if mode != "none" and 0 < i < steps and i % every == 0:
                if pending:
                    skipped += 1  # the previous update is still on its way: this one is not sent
                else:
                    self.version += 1
                    self.conn.send(("push" if mode == "inflight-lora" else "save", self.version))
                    pending = True
            if pending and self.conn.poll():
                land(self.conn.recv())
                pending = False
            stream.refill()
            stream.step()
            i += 1
        if self.coordinator is not None and self.coordinator.live_version != self.version:
            raise RuntimeError(f"the engine serves version {self.coordinator.live_version}, pushed {self.version}")
        return stream.end(every, skipped)

    def close(self) -> None:
        self.conn.send(("stop", 0))
        self.proc.join(30)
        if self.coordinator is not None:
            self.llm.collective_rpc("inflight_stop")
        self.llm.llm_engine.engine_core.shutdown()  # then drop it and gc.collect(): the next engine starts clean


def checks(rows: list[dict]) -> dict:
    """The targets, on the step-paired figures (``per_round``): (a) inflight-lora tokens/s >=
    0.97 x its engine's none's; (b) its lost decode per update <= 5% of native-full's."""
    get = {(r["engine"], r["mode"]): r for r in rows}
    lora, full = get["lora-inflight", "inflight-lora"], get["full", "native-full"]
    frac = lora["paired_lost_ms_per_update"] / full["paired_lost_ms_per_update"]
    return {"a_vs_none": lora["paired_vs_none"], "a_pass": lora["paired_vs_none"] >= 0.97,
            "b_lost_ms": lora["paired_lost_ms_per_update"], "b_native_full_lost_ms": full["paired_lost_ms_per_update"],
            "b_frac": round(frac, 4), "b_pass": frac <= 0.05}


def main() -> None:
    from inflight.trainer.lora_policy import LoRAOptions, write_first_adapter
    from inflight.trainer.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a model directory, hub id or 'smollm2' (trainer/models.py)")
    ap.add_argument("--every", type=int, default=4, help="requested update cadence, engine steps (every mode)")
    ap.add_argument("--steps", type=int, default=192, help="engine steps per mode")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds the steps of each engine's modes are split into")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16, help="the adapter's rank (alpha = 2 x rank)")
    ap.add_argument("--listener-nice", type=int, default=19,
                    help="InflightConfig.listener_nice, as inflight.bench.inflight's")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split",
                    help="inflight.bench.placement: where the threads run")
    args = ap.parse_args()
    load, t0 = [round(os.getloadavg()[0], 2)], time.perf_counter()
    base = resolve_model(args.model)
    model, run = base.name, dict(every=args.every, steps=args.steps, rounds=args.rounds)
    rows: list[dict] = []
    reload_change = None
    with tempfile.TemporaryDirectory() as tmp:
        v0 = write_first_adapter(base, LoRAOptions(rank=args.rank, alpha=2.0 * args.rank), Path(tmp) / "v0", seed=0)
        for kind, modes in ENGINES.items():
            bench = LoRABench(kind, base, v0, Path(tmp), args.concurrency, args.listener_nice, args.placement)
            reload_change = bench.reload_change or reload_change
            rows += interleaved(bench, {m: m for m in modes}, model, kind, **run)
            bench.close()
            del bench
            gc.collect()
        full = Bench(str(base), Path(tmp), args.concurrency, seed=0, listener_nice=args.listener_nice,
                         placement=args.placement)
        rows += interleaved(full, FULL, model, "full", **run)
        full.close()
        full.llm.llm_engine.engine_core.shutdown()
        del full
        gc.collect()
    load.append(round(os.getloadavg()[0], 2))
    compare(rows)
    c = checks(rows)
    print(f"{model}, adapter rank {args.rank}, every {args.every} steps, {args.steps} steps per mode in {args.rounds} "
          f"rounds; vLLM's in-place reload moved greedy log-probs by >= {reload_change:.3g} at each reload")
    print(f"load average (1 min) at start / end: {load[0]} / {load[1]} ({os.cpu_count()} cores, placement "
          f"{args.placement})")
    print(" | ".join(COLS))
    for r in rows:
        print(" | ".join(str(r[k]) for k in COLS))
    for r in rows:
        if r["mode"] != "none":
            print(f"{r['engine']} {r['mode']}, step-paired: vs none {r['paired_vs_none']}, lost "
                  f"{r['paired_lost_ms_per_update']} ms/update; per round: {r['round_vs_none']}, "
                  f"{r['round_lost_ms']} ms")
    print(f"(a) inflight-lora tokens/s vs none's on its engine: {c['a_vs_none']} (target >= 0.97): "
          f"{['FAIL', 'PASS'][c['a_pass']]}")
    print(f"(b) inflight-lora decode lost per update {c['b_lost_ms']} ms vs native-full's "
          f"{c['b_native_full_lost_ms']} ms: {100 * c['b_frac']:.2f}% (target <= 5%): {['FAIL', 'PASS'][c['b_pass']]}")
    print(json.dumps({"bench": "inflight-lora", "device": "cpu", "model": model, "rank": args.rank, **run,
                      "placement": args.placement,
                      "concurrency": args.concurrency, "load_1m": load, "wall_s": round(time.perf_counter() - t0, 1),
                      "reload_change": reload_change, "checks": c, "rows": rows}))


if __name__ == "__main__":
    main()
