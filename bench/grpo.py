"""GRPO-shaped rollouts under weight updates: in-flight commits with prefix caching vs the ways
vLLM users keep the cache correct (no cache, a per-version salt, a reset), like for like.

    python -m bench.grpo [--model smollm2|DIR | --size S] [--prompt-tokens 256 1024] [--completion-tokens 64 256]
                         [--every 16] [--groups-in-flight 4] [--steps 768] [--rounds 3] [--placement split]

The workload is GRPO's: groups of ``GROUP`` (8) requests sharing one prompt of ``P`` random
tokens (``--prompt-tokens``), each sampling exactly ``T`` tokens (``--completion-tokens``,
``ignore_eos``, temperature 1). ``--groups-in-flight`` groups run at once, refilled as a
whole group finishes; every group has a fresh prompt, so the prefix cache can help only
among a group's 8 siblings (a 1024-token prompt is computed once and shared 7 times, in
whole KV blocks: 128 tokens on CPU). The first groups of a chunk are admitted ``T /
groups`` steps apart, so groups finish, and prefill, at staggered steps as in a steady
stream. A trainer process (``bench.inflight_trainer``; nice 19, one thread; on its own
core with ``--placement split``, ``bench.placement``) holds the weights and sends an update
when cued every ``cadence`` engine steps. Modes, per (P, T, every):

1. ``none``: no updates, prefix caching on (the ceiling);
2. ``inflight``: ``WeightPusher.push`` while the engine keeps stepping, on the in-flight
   engine with prefix caching on: every commit invalidates the cache exactly
   (``engine_patches.prefix_cache``). A cue due while the previous push stages is skipped;
3. ``native-salt``: vLLM's ``pause_scheduler(keep)`` + ``start_weight_update`` /
   ``update_weights`` (the trainer's gloo broadcast, ``bench.native_gloo``) /
   ``finish_weight_update`` + ``resume_scheduler``, every request carrying ``cache_salt=
   "v<version at admission>"`` (prime-rl's and SkyRL's way): blocks of older versions are
   never looked up again, running requests keep their stale KV;
4. ``native-reset``: the same update, then ``LLM.reset_prefix_cache(reset_running_requests=
   True)`` before the resume (verl's, slime's, OpenRLHF's way): vLLM's reset refuses while
   requests hold KV unless it preempts them, so every running request recomputes its prompt
   and every token it sampled;
5. ``inflight-nocache``: in-flight pushes on a second engine started with prefix caching
   off (the flag is fixed at engine start; PipelineRL's and AReaL's way). That engine runs
   its own ``none`` (prefix caching off), interleaved with it: ``vs_none`` and
   ``lost_ms_per_update`` of its rows are against that ``none``; ``vs_none_cache`` and
   ``lost_ms_per_update_cache`` against the first engine's ``none``, not interleaved (the
   engines run one after the other).

Same cadence: for each (P, T, every), a calibration chunk of ``inflight`` at ``every`` finds
the cadence in-flight achieves (the median spacing of its sends; a cue is skipped while a
push stages); every update mode then runs at ``cadence`` = max(every, that), so each pays
for as many updates over as many steps. Each engine's modes run interleaved in ``--rounds``
chunks of ``--steps / --rounds`` engine steps, the order rotated each round
(``bench.inflight_lora.interleaved``); a chunk with a push still staging at its end steps on
until it lands (those steps count).

Columns (per engine, mode and (P, T)):
- ``tok_s``: generated tokens per second of wall time; ``vs_none``: its ratio to ``none``'s;
- ``lost_ms_per_update``: decode time lost per update, (the mode's wall - the wall ``none``
  needs for the same tokens) / updates (``bench.inflight_report.compare``); ``paired_*``:
  the step-paired estimate (``bench.inflight_lora.per_round``: step i against ``none``'s
  step i of the same round); it assumes equal batches at equal steps, which a reset's or a
  commit's restarted prefills break, so the token-based figures are the headline;
- ``updates``, ``steps_per_update`` (achieved: the chunk's steps / its updates), ``cadence``;
- ``hit_rate``: prompt positions served from the prefix cache at admission / prompt
  positions admitted, re-admissions after a preemption included (counted in the
  scheduler's ``schedule``, ``PrefillCounter``);
- ``prompt_computed_per_update``: prompt tokens prefilled (not served from the cache) /
  updates; ``extra_prefill_per_update``: tokens prefilled beyond what the first engine's
  ``none`` prefills for as many prompts (a reset's recomputed prompts and sampled tokens,
  the prompts a commit caught mid-prefill, the sharing a cacheless engine forgoes), /
  updates; ``readmitted_per_update``: requests preempted and re-admitted, / updates;
- ``stall_ms``: the interval holding the update minus the median step; ``pause_ms``
  (native: pause to resume), ``reset_ms`` (the reset alone), ``commit_ms`` (in-flight).

Targets (README): with 1024-token prompts and an update every 16 steps, ``inflight``'s
tokens/s >= 0.95 x ``none``'s and >= both native modes'. Prints a table, the targets' check
and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # a cacheless engine holds 8 x (P + T) per group
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.inflight_lora import interleaved  # noqa: E402
from bench.inflight_report import compare  # noqa: E402
from bench.inflight_trainer import trainer  # noqa: E402
from bench.placement import PLACEMENTS, Placement, engine_env, pin_trainer  # noqa: E402

GROUP = 8
"""Samples per prompt (GRPO's group)."""
ENGINES = {  # engine -> (prefix caching, Bench.run's mode -> row label)
    "cache": (True, {"none": "none", "inflight": "inflight", "native-salt": "native-salt",
                     "native-reset": "native-reset"}),
    "nocache": (False, {"none": "none", "inflight": "inflight-nocache"}),
}
TARGET = {"prompt": 1024, "every": 16, "vs_none": 0.95}
COLS = ["P", "T", "engine", "mode", "cadence", "updates", "steps_per_update", "tok_s", "vs_none", "vs_none_cache",
        "lost_ms_per_update", "lost_ms_per_update_cache", "paired_vs_none", "paired_lost_ms_per_update", "hit_rate",
        "prompt_computed_per_update", "extra_prefill_per_update", "readmitted_per_update", "stall_ms", "pause_ms",
        "reset_ms", "commit_ms"]


# -- the workload and its arithmetic (pure; tests/test_bench_grpo.py) --------------------------
def group_prompt(seed: int, index: int, length: int, vocab: int) -> list[int]:
    """Group ``index``'s prompt: ``length`` random token ids, fresh for every group (and the
    same for a given seed and index), clear of the low ids where tokenizers keep specials."""
    rng = random.Random(f"{seed}/{index}")
    low = min(256, vocab // 4)
    return [rng.randrange(low, vocab) for _ in range(length)]


def ramp(groups: int, completion: int) -> list[int]:
    """The step at which each of a chunk's first ``groups`` groups is admitted: spread over one
    completion's length, so groups finish (and the next ones prefill) at staggered steps."""
    return [g * completion // groups for g in range(groups)]


def positions(start: int, end: int, prompt: int, total: int) -> tuple[int, int]:
    """What one scheduled chunk of a request computes, positions [start, end) of ``total``
    tokens (prompt + sampled so far): (prompt tokens prefilled, sampled tokens recomputed).
    A decode step computes one position, the last sampled token's: no recomputation. After
    a preemption the request re-prefills its prompt and every sampled token; all but the
    last are recomputed (the last is the decode step's own input)."""
    prompt_part = max(0, min(end, prompt) - start)
    outputs = max(0, end - max(start, prompt))
    return prompt_part, max(0, outputs - (end == total))


def achieved_cadence(pushes: list[tuple[int, int]], every: int) -> int:
    """The cadence in-flight achieves at ``every``: from each push's (step sent, step it was
    seen landed), the spacing to the next send (the first cue after it landed: a cue due
    while a push stages is skipped), their median; ``every`` without pushes."""
    spacing = [every * (landed // every + 1) - sent for sent, landed in pushes]
    return max(every, round(statistics.median(spacing))) if spacing else every


def rotate(order: list[str], k: int) -> list[str]:
    return order[k % len(order):] + order[:k % len(order)]


def prefill_figures(rows: list[dict]) -> None:
    """Per row: hit rate and prefill per update; ``extra_prefill_per_update`` against the
    ``cache`` engine's ``none`` of the same (P, T, every): the tokens it prefills per admitted
    prompt token, times this row's admitted prompt tokens, is what this row would prefill
    without updates (a cacheless engine's rows then show the sharing they forgo)."""
    for r in rows:
        nones = [x for x in rows if x["mode"] == "none" and x["group"] == r["group"]]
        ref = next((x for x in nones if x["engine"] == "cache"), next((x for x in nones if x["engine"] == r["engine"]), r))
        per_prompt = ref["prefilled"] / ref["admitted_prompt"] if ref["admitted_prompt"] else 0.0
        seen = r["cached"] + r["prompt_computed"]
        r["hit_rate"] = round(r["cached"] / seen, 3) if seen else None
        u = r["updates"]
        r["prompt_computed_per_update"] = round(r["prompt_computed"] / u) if u else None
        r["extra_prefill_per_update"] = round((r["prefilled"] - per_prompt * r["admitted_prompt"]) / u) if u else None
        r["readmitted_per_update"] = round(r["readmitted"] / u, 1) if u else None


def against_cache(rows: list[dict]) -> None:
    """Rows of the ``nocache`` engine against the ``cache`` engine's ``none`` (same (P, T,
    every); not interleaved: the engines run one after the other)."""
    for r in rows:
        ref = next((x for x in rows if x["engine"] == "cache" and x["mode"] == "none" and x["group"] == r["group"]), None)
        if r["engine"] != "nocache" or ref is None:
            r["vs_none_cache"] = r["lost_ms_per_update_cache"] = None
            continue
        r["vs_none_cache"] = round(r["tok_s"] / ref["tok_s"], 3)
        lost = r["wall_s"] - r["tokens"] / ref["tok_s"]
        r["lost_ms_per_update_cache"] = round(1e3 * lost / r["updates"], 1) if r["updates"] else None


def checks(rows: list[dict]) -> list[dict]:
    """The README's targets, per (P, T, every) with P = 1024 and every = 16: ``inflight``'s
    tokens/s >= 0.95 x ``none``'s, and >= ``native-salt``'s and ``native-reset``'s."""
    out = []
    for r in rows:
        if not (r["engine"] == "cache" and r["mode"] == "inflight" and r["P"] == TARGET["prompt"]
                and r["every"] == TARGET["every"]):
            continue
        same = {x["mode"]: x for x in rows if x["engine"] == "cache" and x["group"] == r["group"]}
        natives = {m: same[m]["tok_s"] for m in ("native-salt", "native-reset") if m in same}
        out.append({"P": r["P"], "T": r["T"], "every": r["every"], "vs_none": r["vs_none"],
                    "vs_none_pass": r["vs_none"] >= TARGET["vs_none"], "tok_s": r["tok_s"], "native_tok_s": natives,
                    "vs_native_pass": all(r["tok_s"] >= v for v in natives.values()) and len(natives) == 2})
    return out


# -- the engine side ------------------------------------------------------------------------
class PrefillCounter:
    """Wraps one scheduler's ``schedule`` (on the instance) and counts, per chunk, what each
    scheduled request computes: prompt positions served from the cache when it is admitted
    (or re-admitted after a preemption), prompt positions prefilled, sampled tokens recomputed."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.count(out)
            return out

        scheduler.schedule = schedule
        self.reset()

    def reset(self) -> None:
        self.cached = self.prompt = self.recomputed = self.admitted_prompt = self.readmitted = 0
        self._seen: dict[str, int] = {}  # request id -> its preemptions when last admitted

    def count(self, out: Any) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens  # already advanced by this schedule (_update_after_schedule)
            start, prompt = end - n, req.num_prompt_tokens
            seen = self._seen.get(rid)
            if seen is None or seen < req.num_preemptions:  # admitted: what it did not schedule came from the cache
                self._seen[rid] = req.num_preemptions
                self.cached += min(start, prompt)
                self.admitted_prompt += prompt if seen is None else 0
                self.readmitted += seen is not None
            p, o = positions(start, end, prompt, req.num_tokens)
            self.prompt += p
            self.recomputed += o

    def totals(self) -> dict:
        return {"cached": self.cached, "prompt_computed": self.prompt, "recomputed": self.recomputed,
                "admitted_prompt": self.admitted_prompt, "readmitted": self.readmitted}


class GRPOBench:
    """One engine (prefix caching on or off), its trainer process and the modes; ``run``
    gives ``bench.inflight_lora``'s chunks. Set ``shape`` = (P, T) before running."""

    def __init__(self, model_dir: Path, caching: bool, groups: int, max_len: int, seed: int, listener_nice: int,
                 placement: Placement) -> None:
        from safetensors.torch import load_file
        from vllm import LLM

        from bench.native_gloo import register, update_info
        from engine_patches.client import coordinator_of, start_inflight
        from engine_patches.config import InflightConfig, engine_kwargs

        self.groups, self.seed, self.version, self.next_group = groups, seed, 0, 0
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        self.native_info = update_info(load_file(str(model_dir / "model.safetensors")))
        register()  # the native baseline's transfer engine, in this process (EngineCore runs here)
        listener_cpus = engine_env(placement)
        self.llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=max_len, seed=seed,
                       max_num_seqs=GROUP * groups, weight_transfer_config={"backend": "inflight_gloo"},
                       **engine_kwargs(enable_prefix_caching=caching))
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=trainer, args=(child, str(model_dir)), daemon=True)
        self.proc.start()
        pin_trainer(self.proc.pid, placement)
        inflight_group, native_group = self.conn.recv()
        start_inflight(self.llm, InflightConfig(group=inflight_group, listener_nice=listener_nice,
                                                listener_cpus=listener_cpus))
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
            "host": native_group.host, "port": native_group.port, "world_size": 2, "rank": 1, "name": native_group.name}})
        assert self.conn.recv() == "ready"
        self.coordinator = coordinator_of(self.llm)
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.counter = PrefillCounter(self.core.scheduler)
        self.log: dict[tuple, list[dict]] = {}  # (P, T, cadence, mode) -> its chunks' extra figures
        self.shape = (0, 0)

    def sampling(self, completion: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=completion, ignore_eos=True, temperature=1.0,
                              output_kind=RequestOutputKind.DELTA)

    def native_update(self, reset: bool) -> dict:
        """vLLM's own update, between two steps: pause(keep), the weight-transfer API, with
        ``reset`` the prefix-cache reset (preempting every running request), resume."""
        self.version += 1
        t0 = time.perf_counter()
        self.core.pause_scheduler(mode="keep", clear_cache=False)
        self.llm.collective_rpc("start_weight_update")
        self.conn.send(("native", self.version))
        self.llm.collective_rpc("update_weights", kwargs={"update_info": self.native_info})
        self.llm.collective_rpc("finish_weight_update")
        t1 = time.perf_counter()
        if reset and not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("reset_prefix_cache(reset_running_requests=True) did not reset the cache")
        t2 = time.perf_counter()
        self.coordinator.set_label(self.version)  # tokens tagged with the version the native path loaded
        self.core.resume_scheduler()
        r = self.conn.recv()
        return {**r, "pause_ms": 1e3 * (time.perf_counter() - t0), "reset_ms": 1e3 * (t2 - t1)}

    def run(self, mode: str, every: int, steps: int) -> dict:
        """``steps`` engine steps of ``mode`` on a fresh stream of groups (``self.shape``)."""
        engine, (prompt, completion) = self.llm.llm_engine, self.shape
        params, admit_at = self.sampling(completion), ramp(self.groups, completion)
        active: dict[str, int] = {}  # request id -> group
        left: dict[int, int] = {}  # group -> requests unfinished
        times, events, pushes = [time.perf_counter()], [], []  # pushes: (step sent, step seen landed)
        st = {"tokens": 0, "skipped": 0}
        pushing, start = False, self.coordinator.steps
        self.counter.reset()

        def admit() -> None:
            g, self.next_group = self.next_group, self.next_group + 1
            request: dict[str, Any] = {"prompt_token_ids": group_prompt(self.seed, g, prompt, self.vocab)}
            if mode == "native-salt":
                request["cache_salt"] = f"v{self.version}"
            for j in range(GROUP):
                engine.add_request(f"{mode}-{g}-{j}", request, params)
                active[f"{mode}-{g}-{j}"] = g
            left[g] = GROUP

        def step() -> None:
            for out in engine.step():
                st["tokens"] += len(out.outputs[0].token_ids)
                if out.finished:
                    g = active.pop(out.request_id)
                    left[g] -= 1
                    if not left[g]:
                        del left[g]
            times.append(time.perf_counter())

        i = 0
        while i < steps or pushing:
            due = 0 < i < steps and i % every == 0
            if mode == "inflight" and due and pushing:
                st["skipped"] += 1  # the previous push is still staging: this one is not sent
            elif mode == "inflight" and due:
                self.version += 1
                self.conn.send(("push", self.version))
                pushing = True
                pushes.append((i, -1))
            elif mode.startswith("native") and due:
                events.append((len(times), self.native_update(reset=mode == "native-reset")))
            if pushing and self.conn.poll():
                r = self.conn.recv()
                events.append((r["commit_step"] - start + 1, r))
                pushes[-1], pushing = (pushes[-1][0], i), False
            while len(left) < sum(a <= i for a in admit_at):
                admit()
            step()
            i += 1
        return self.finish(mode, every, times, events, pushes, st, active)

    def finish(self, mode: str, every: int, times: list[float], events: list, pushes: list, st: dict,
               active: dict[str, int]) -> dict:
        """End a chunk: drop its requests, and its figures in ``bench.inflight_lora``'s form."""
        extra = {**self.counter.totals(), "pushes": pushes,
                 "reset_ms": [r["reset_ms"] for _, r in events if "reset_ms" in r]}
        engine = self.llm.llm_engine
        engine.abort_request(list(active))
        while engine.has_unfinished_requests():
            engine.step()
        self.log.setdefault((*self.shape, every, mode), []).append(extra)
        gaps = [b - a for a, b in zip(times, times[1:])]
        at = {i for i, _ in events}
        return {"mode": mode, "every": every, "tokens": st["tokens"], "wall_s": times[-1] - times[0], "gaps": gaps,
                "steps": len(gaps), "skipped": st["skipped"], "infos": [r for _, r in events],
                "quiet": [g for i, g in enumerate(gaps, 1) if i not in at],
                "event_gaps": [gaps[i - 1] for i, _ in events if 0 < i <= len(gaps)], **extra}

    def close(self) -> None:
        self.conn.send(("stop", 0))
        self.proc.join(30)
        self.llm.collective_rpc("inflight_stop")
        self.llm.llm_engine.engine_core.shutdown()  # then drop it and gc.collect(): the next engine starts clean


# -- the driver -----------------------------------------------------------------------------
def calibrate(bench: GRPOBench, every: int, steps: int) -> tuple[int, str]:
    """The cadence in-flight achieves at ``every`` on this engine and shape (one chunk), and
    what it is made of (steps and pushes)."""
    chunk = bench.run("inflight", every, max(steps, 4 * every))
    push_ms = [1e3 * r["push_s"] for r in chunk["infos"]]
    step_ms = 1e3 * statistics.median(chunk["quiet"])
    how = f"a push takes {statistics.median(push_ms):.0f} ms (median of {len(push_ms)}), a step {step_ms:.1f} ms"
    return achieved_cadence(chunk["pushes"], every), how


def bench_engine(bench: GRPOBench, engine: str, model: str, shapes: list[tuple[int, int, int]],
                 cadences: dict[tuple[int, int, int], int], steps: int, rounds: int) -> list[dict]:
    """Every (P, T, every) of ``shapes`` on one engine, its modes interleaved; ``cadences``
    (filled by the first engine, reused by the next) holds each shape's common cadence."""
    rows = []
    modes = ENGINES[engine][1]
    chunk = steps // rounds
    for k, (prompt, completion, every) in enumerate(shapes):
        bench.shape = (prompt, completion)
        bench.run("none", 10**9, min(48, chunk))  # warm-up: this shape's kernels and allocations
        if k == 0:  # the engine's first push allocates staging: not measured
            bench.run("inflight", every, max(chunk, 2 * every))
        key = (prompt, completion, every)
        if key not in cadences:
            cadences[key], how = calibrate(bench, every, chunk)
            print(f"{engine} engine, P={prompt} T={completion}: in-flight achieves an update per {cadences[key]} steps "
                  f"at every {every} ({how}); every update mode runs at that cadence", flush=True)
        if chunk < 2 * cadences[key]:
            print(f"warning: chunks of {chunk} steps hold fewer than 2 updates at {cadences[key]} steps each: "
                  "raise --steps", flush=True)
        bench.log.clear()
        for r in interleaved(bench, modes, model, engine, cadences[key], steps, rounds):
            run_mode = next(m for m, label in modes.items() if label == r["mode"])
            extra = bench.log[(prompt, completion, cadences[key], run_mode)]
            totals = {k: sum(c[k] for c in extra) for k in ("cached", "prompt_computed", "recomputed",
                                                              "admitted_prompt", "readmitted")}
            resets = [x for c in extra for x in c["reset_ms"]]
            rows.append({**r, **totals, "P": prompt, "T": completion, "every": every,
                         "cadence": cadences[key] if r["mode"] != "none" else None,
                         "group": f"P{prompt}/T{completion}/every{every}",
                         "prefilled": totals["prompt_computed"] + totals["recomputed"],
                         "reset_ms": round(statistics.median(resets), 2) if resets else None})
    return rows


def model_dir_of(args: argparse.Namespace, work: Path, max_len: int) -> tuple[Path, str]:
    """The model: ``--model`` (a directory, hub id or 'smollm2') or a tiny ``--size``."""
    if args.model:
        from trainer.models import resolve_model

        path = resolve_model(args.model)
        return path, path.name
    from bench.inflight import SIZES
    from trainer.tiny_model import build_tiny_model, default_corpus

    config = dataclasses.replace(SIZES[args.size], max_position_embeddings=max(max_len, 1024))
    return build_tiny_model(work / args.size, default_corpus(), config), f"tiny-{args.size}"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory, hub id or 'smollm2' (trainer/models.py)")
    ap.add_argument("--size", default="S", choices=["S", "M", "L"], help="without --model: a tiny model (bench.inflight)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024], help="P: each group's prompt length")
    ap.add_argument("--completion-tokens", type=int, nargs="+", default=[64, 256], help="T: every sample's length")
    ap.add_argument("--every", type=int, nargs="+", default=[16], help="requested update cadence, engine steps")
    ap.add_argument("--groups-in-flight", type=int, default=4, help="groups of 8 decoding at once")
    ap.add_argument("--steps", type=int, default=768, help="engine steps per mode and (P, T, every)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds the steps of each engine's modes are split into")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES),
                    help="cache: none, inflight, native-salt, native-reset; nocache: none, inflight-nocache")
    ap.add_argument("--listener-nice", type=int, default=19, help="InflightConfig.listener_nice, as bench.inflight's")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split", help="bench.placement: where the threads run")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def report(rows: list[dict], args: argparse.Namespace, model: str, load: list[float], wall_s: float) -> None:
    compare(rows)
    against_cache(rows)
    prefill_figures(rows)
    targets = checks(rows)
    print(f"{model}, groups of {GROUP}, {args.groups_in_flight} groups in flight, {args.steps} steps per mode in "
          f"{args.rounds} rounds, placement {args.placement}; load average (1 min) at start / end: {load[0]} / {load[1]}")
    print(" | ".join(COLS))
    for r in rows:
        print(" | ".join(str(r[c]) for c in COLS))
    for c in targets:
        print(f"target P={c['P']} T={c['T']} every {c['every']}: inflight vs none {c['vs_none']} (>= {TARGET['vs_none']}: "
              f"{['FAIL', 'PASS'][c['vs_none_pass']]}); {c['tok_s']} tok/s vs native {c['native_tok_s']}: "
              f"{['FAIL', 'PASS'][c['vs_native_pass']]}")
    if not targets:
        print(f"(the README's targets are at P={TARGET['prompt']}, every {TARGET['every']}: not in this run)")
    print(json.dumps({"bench": "grpo", "device": "cpu", **vars(args), "model": model, "group": GROUP, "load_1m": load,
                      "wall_s": round(wall_s, 1), "checks": targets, "rows": rows}))


def main() -> None:
    args = parse()
    load, t0 = [round(os.getloadavg()[0], 2)], time.perf_counter()
    shapes = [(p, t, e) for p in args.prompt_tokens for t in args.completion_tokens for e in args.every]
    max_len = max(args.prompt_tokens) + max(args.completion_tokens) + 8
    rows: list[dict] = []
    cadences: dict[tuple[int, int, int], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model = model_dir_of(args, Path(tmp), max_len)
        for engine in args.engines:  # the prefix-caching flag is fixed when an engine starts: an engine each
            bench = GRPOBench(model_dir, ENGINES[engine][0], args.groups_in_flight, max_len, args.seed,
                              args.listener_nice, args.placement)
            rows += bench_engine(bench, engine, model, shapes, cadences, args.steps, args.rounds)
            bench.close()
            del bench
            gc.collect()
    load.append(round(os.getloadavg()[0], 2))
    report(rows, args, model, load, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
