"""GRPO rollouts under weight updates: in-flight commits with prefix caching vs vLLM's own ways.

In-flight commits keep the prefix cache exact across updates; vLLM users keep it correct by
turning it off, salting requests by version, or resetting it after each update. Like for like:

    python -m inflight.bench.grpo [--model smollm2|DIR | --size S] [--prompt-tokens 256 1024]
                         [--completion-tokens 64 256] [--every 16] [--groups-in-flight 4] [--steps 768] [--rounds 3]
                         [--placement split] [--listener-core trainer|engine]
                         [--workload fresh | system --system-tokens S | multi-turn --turns N --tool-tokens R]

The workload is GRPO's: groups of ``GROUP`` (8) requests sharing one prompt, each turn sampling
exactly ``T`` tokens (``--completion-tokens``, ``ignore_eos``, temperature 1). What the prompt
holds is ``--workload`` (``inflight.bench.grpo_workloads``): a fresh prompt of ``P`` random
tokens per group (``--prompt-tokens``; the prefix cache can help only among a group's 8
siblings: a 1024-token prompt is computed once and shared 7 times, in whole KV blocks of 128
tokens on CPU), one system prompt shared by every group before a fresh P-token question, or
multi-turn episodes whose histories grow. ``--groups-in-flight`` groups run at once, a whole
group admitted as soon as one finishes its last turn. Each chunk opens with an untimed ramp of
one group's life (turns x T steps) that admits its first groups evenly over it, so groups
finish, and the next ones prefill, at staggered steps as in a steady stream; the timed steps
follow. A trainer
process (``inflight.bench.inflight_trainer``; nice 19, one thread; on its own core with
``--placement split``, ``inflight.bench.placement``) holds the weights and sends an update when
cued every ``cadence`` engine steps. Modes, per (P, T, every):

1. ``none``: no updates, prefix caching on (the ceiling);
2. ``inflight``: ``WeightPusher.push`` while the engine keeps stepping, on the in-flight
   engine with prefix caching on: every commit invalidates the cache exactly
   (``inflight.engine.prefix_cache``). A cue due while the previous push stages is skipped;
3. ``native-salt``: vLLM's ``pause_scheduler(keep)`` + ``start_weight_update`` /
   ``update_weights`` (the trainer's gloo broadcast, ``inflight.trainer.native_update``) /
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

Same cadence: per (P, T, every), a calibration chunk of ``inflight`` (after the engine's
first push, which allocates staging) finds the cadence in-flight achieves (a cue due while a
push stages is skipped: ``achieved_cadence``). Each engine's modes run interleaved in
``--rounds`` chunks of ``--steps / --rounds`` timed steps, the order rotated each round,
every update mode at the round's cadence (the calibrated one, then what in-flight achieved
the round before), so each pays for about as many updates over as many steps
(``steps_per_update``). A chunk with a push still staging at its end steps on until it
lands. The second engine starts from the first one's last cadence.

Columns: ``inflight.bench.grpo_figures``. Targets (README), ``fresh``: with 1024-token prompts
and an update every 16 steps, ``inflight``'s tokens/s >= 0.95 x ``none``'s and >= both native
modes'. Goal on ``system`` and ``multi-turn``: in-flight's tokens/s >= 1.1 x native-salt's, by
the rounds' median. ``--listener-core engine`` puts in-flight's listener on the engine's core,
where native's receive runs. Prints a table, the checks and one JSON line, also appended to
``bench/results/grpo.jsonl`` with the command, its start and the git revision.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # a cacheless engine holds 8 x (P + T) per group
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inflight.bench.grpo_figures import GROUP, achieved_cadence, positions, ramp, report, rotate
from inflight.bench.grpo_workloads import KINDS, Workload
from inflight.bench.inflight_trainer import trainer
from inflight.bench.paired import per_round, row
from inflight.bench.placement import ENGINE_CORE, PLACEMENTS, Placement, engine_env, pin_trainer
from inflight.bench.run_record import add_results_option, append_result, run_record
from inflight.trainer.native_update import native_update

ENGINES = {  # engine -> (prefix caching, Bench.run's mode -> row label)
    "cache": (True, {"none": "none", "inflight": "inflight", "native-salt": "native-salt",
                     "native-reset": "native-reset"}),
    "nocache": (False, {"none": "none", "inflight": "inflight-nocache"}),
}



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
        self.forget()

    def reset(self) -> None:
        """Zero the counts (requests admitted before keep their admission)."""
        self.cached = self.prompt = self.recomputed = self.admitted_prompt = self.readmitted = 0

    def forget(self) -> None:
        """Forget every request (a chunk's end: its requests are gone)."""
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


class Stream:
    """One chunk's stream of groups on ``bench``'s engine: admits whole groups (their first
    turn's prompt from ``bench.workload``; in ``native-salt`` every request salted by the version
    live at its admission), admits an episode's next turn when a turn finishes, steps, counts
    generated tokens and times steps. A group stays in flight until its last turn finishes."""

    def __init__(self, bench: GRPOBench, mode: str) -> None:
        self.bench, self.mode, self.params = bench, mode, bench.sampling(bench.shape[1])
        self.active: dict[str, tuple[int, int, int, list[int]]] = {}  # request id -> group, episode, turn, prompt
        self.sampled: dict[str, list[int]] = {}  # request id -> its tokens so far
        self.left: dict[int, int] = {}  # group -> its episodes unfinished
        self.restart_clock()

    def restart_clock(self) -> None:  # the ramp's steps are not timed
        self.times, self.tokens = [time.perf_counter()], 0

    def fill(self, groups: int) -> None:
        """Admit whole groups until ``groups`` are in flight."""
        b = self.bench
        while len(self.left) < groups:
            g, b.next_group = b.next_group, b.next_group + 1
            prompt = b.workload.first_prompt(b.seed, g, b.shape[0], b.vocab)
            for j in range(GROUP):
                self.add(g, j, 0, prompt)
            self.left[g] = GROUP

    def add(self, group: int, episode: int, turn: int, prompt: list[int]) -> None:
        request: dict[str, Any] = {"prompt_token_ids": prompt}
        if self.mode == "native-salt":
            request["cache_salt"] = f"v{self.bench.version}"
        rid = f"{self.mode}-{group}-{episode}-{turn}"
        self.bench.llm.llm_engine.add_request(rid, request, self.params)
        self.active[rid], self.sampled[rid] = (group, episode, turn, prompt), []

    def step(self) -> None:
        b = self.bench
        for out in b.llm.llm_engine.step():
            delta = out.outputs[0].token_ids
            self.tokens += len(delta)
            self.sampled[out.request_id] += delta
            if not out.finished:
                continue
            g, j, turn, prompt = self.active.pop(out.request_id)
            nxt = b.workload.next_prompt(b.seed, g, j, turn, prompt, self.sampled.pop(out.request_id), b.vocab)
            if nxt is not None:
                self.add(g, j, turn + 1, nxt)
                continue
            self.left[g] -= 1
            self.left = {k: n for k, n in self.left.items() if n}
        self.times.append(time.perf_counter())


class GRPOBench:
    """One engine (prefix caching on or off), its trainer process and the modes; ``run``
    gives ``inflight.bench.paired``'s chunks. Set ``shape`` = (P, T) before running."""

    def __init__(self, model_dir: Path, caching: bool, groups: int, max_len: int, seed: int, listener_nice: int,
                 placement: Placement, workload: Workload, listener_core: str = "trainer") -> None:
        from safetensors.torch import load_file
        from vllm import LLM

        from inflight.engine.client import coordinator_of, start_inflight
        from inflight.engine.engine_config import InflightConfig, engine_kwargs
        from inflight.trainer.native_update import register, update_info

        self.groups, self.seed, self.version, self.next_group, self.workload = groups, seed, 0, 0, workload
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        self.native_info = update_info(load_file(str(model_dir / "model.safetensors")))
        register()  # the native baseline's transfer engine, in this process (EngineCore runs here)
        listener_cpus = engine_env(placement)
        if placement == "split" and listener_core == "engine":  # where native's receive runs: the engine's thread
            listener_cpus = (ENGINE_CORE,)
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
            "host": native_group.host, "port": native_group.port, "world_size": 2, "rank": 1,
            "name": native_group.name}})
        assert self.conn.recv() == "ready"
        self.coordinator = coordinator_of(self.llm)
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.counter = PrefillCounter(self.core.scheduler)
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
        native_update(self.core, self.llm, self.conn, self.version, self.native_info)
        t1 = time.perf_counter()
        if reset and not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("reset_prefix_cache(reset_running_requests=True) did not reset the cache")
        t2 = time.perf_counter()
        self.coordinator.set_label(self.version)  # tokens tagged with the version the native path loaded
        self.core.resume_scheduler()
        r = self.conn.recv()
        return {**r, "pause_ms": 1e3 * (time.perf_counter() - t0), "reset_ms": 1e3 * (t2 - t1)}

    def run(self, mode: str, every: int, steps: int) -> dict:
        """``steps`` engine steps of ``mode`` on a fresh stream of groups (``self.shape``),
        after an untimed ramp of one completion's length that admits the first groups."""
        span = self.workload.turns * self.shape[1]  # a group's life in decode steps
        stream, admit_at = Stream(self, mode), ramp(self.groups, span)
        for i in range(span):
            stream.fill(sum(a <= i for a in admit_at))
            stream.step()
        stream.restart_clock()
        self.counter.reset()
        events, pushes = [], []  # events: (interval index, info); pushes: (step sent, step seen landed)
        skipped, pushing, start, i = 0, False, self.coordinator.steps, 0
        while i < steps or pushing:
            due = 0 < i < steps and i % every == 0
            if mode == "inflight" and due and pushing:
                skipped += 1  # the previous push is still staging: this one is not sent
            elif mode == "inflight" and due:
                self.version += 1
                self.conn.send(("push", self.version))
                pushing = True
                pushes.append((i, -1))
            elif mode.startswith("native") and due:
                events.append((len(stream.times), self.native_update(reset=mode == "native-reset")))
            if pushing and self.conn.poll():
                r = self.conn.recv()
                events.append((r["commit_step"] - start + 1, r))
                pushes[-1], pushing = (pushes[-1][0], i), False
            stream.fill(self.groups)
            stream.step()
            i += 1
        return self.finish(mode, every, stream, events, pushes, skipped)

    def finish(self, mode: str, every: int, stream: Stream, events: list, pushes: list, skipped: int) -> dict:
        """End a chunk: drop its requests, and its figures in ``inflight.bench.paired``'s form."""
        extra = {**self.counter.totals(), "pushes": pushes,
                 "reset_ms": [r["reset_ms"] for _, r in events if "reset_ms" in r]}
        engine = self.llm.llm_engine
        engine.abort_request(list(stream.active))
        while engine.has_unfinished_requests():
            engine.step()
        self.counter.forget()
        times = stream.times
        gaps = [b - a for a, b in zip(times, times[1:])]
        at = {i for i, _ in events}
        return {"mode": mode, "every": every, "tokens": stream.tokens, "wall_s": times[-1] - times[0], "gaps": gaps,
                "steps": len(gaps), "skipped": skipped, "infos": [r for _, r in events],
                "quiet": [g for i, g in enumerate(gaps, 1) if i not in at],
                "event_gaps": [gaps[i - 1] for i, _ in events if 0 < i <= len(gaps)], **extra}

    def close(self) -> None:
        self.conn.send(("stop", 0))
        self.proc.join(30)
        self.llm.collective_rpc("inflight_stop")
        self.llm.llm_engine.engine_core.shutdown()  # then drop it and gc.collect(): the next engine starts clean


# -- the driver -----------------------------------------------------------------------------
def calibrate(bench: GRPOBench, every: int, steps: int) -> int:
    """The cadence in-flight achieves at ``every`` on this engine and shape (one chunk)."""
    chunk = bench.run("inflight", every, max(steps, 4 * every))
    push_ms = statistics.median(1e3 * r["push_s"] for r in chunk["infos"]) if chunk["infos"] else float("nan")
    cadence = achieved_cadence(chunk["pushes"], every)
    print(f"P={bench.shape[0]} T={bench.shape[1]}: in-flight achieves an update per {cadence} steps at every {every} "
          f"(a push {push_ms:.0f} ms, a step {1e3 * statistics.median(chunk['quiet']):.1f} ms)", flush=True)
    return cadence


def rounds_of(bench: GRPOBench, modes: list[str], every: int, cadence: int, steps: int,
              rounds: int) -> tuple[dict[str, list[dict]], list[int]]:
    """``modes`` interleaved in ``rounds`` chunks of ``steps // rounds``, the order rotated
    each round. Every update mode of a round runs at that round's cadence: the calibrated one
    first, then what in-flight achieved in the round before (it follows the machine)."""
    chunks: dict[str, list[dict]] = {m: [] for m in modes}
    cadences = []
    for k in range(rounds):
        cadences.append(cadence)
        for mode in rotate(modes, k):
            chunks[mode].append(bench.run(mode, cadence, steps // rounds))
        if "inflight" in chunks:
            cadence = achieved_cadence(chunks["inflight"][-1]["pushes"], every)
    if steps // rounds < 2 * max(cadences):
        print(f"warning: chunks of {steps // rounds} steps hold fewer than 2 updates at {max(cadences)} steps each: "
              "raise --steps", flush=True)
    return chunks, cadences


def bench_engine(bench: GRPOBench, engine: str, model: str, shapes: list[tuple[int, int, int]],
                 cadences: dict[tuple[int, int, int], int], steps: int, rounds: int) -> list[dict]:
    """Every (P, T, every) of ``shapes`` on one engine, its modes interleaved; ``cadences``
    holds each shape's cadence to start from (calibrated on the first engine, where missing)."""
    rows, modes, chunk = [], ENGINES[engine][1], steps // rounds
    for k, (prompt, completion, every) in enumerate(shapes):
        bench.shape, key = (prompt, completion), (prompt, completion, every)
        bench.run("none", 10**9, min(48, chunk))  # warm-up: this shape's kernels and allocations
        if k == 0:  # the engine's first push allocates staging: not measured
            bench.run("inflight", every, max(chunk, 2 * every))
        if key not in cadences:
            cadences[key] = calibrate(bench, every, chunk)
        chunks, used = rounds_of(bench, list(modes), every, cadences[key], steps, rounds)
        cadences[key] = used[-1]
        for mode, label in modes.items():
            cs = chunks[mode]
            totals = {k: sum(c[k] for c in cs) for k in ("cached", "prompt_computed", "recomputed", "admitted_prompt",
                                                           "readmitted")}
            resets = [x for c in cs for x in c["reset_ms"]]
            rows.append({**row(model, engine, label, cs), **per_round(chunks, mode), **totals, "P": prompt,
                         "T": completion, "every": every, "cadence": used if mode != "none" else None,
                         "group": f"P{prompt}/T{completion}/every{every}",
                         "prefilled": totals["prompt_computed"] + totals["recomputed"],
                         "round_tok_s": [round(c["tokens"] / c["wall_s"], 1) for c in cs],
                         "reset_ms": round(statistics.median(resets), 2) if resets else None})
    return rows


def model_dir_of(args: argparse.Namespace, work: Path, max_len: int) -> tuple[Path, str]:
    """The model: ``--model`` (a directory, hub id or 'smollm2') or a tiny ``--size``."""
    if args.model:
        from inflight.trainer.models import resolve_model

        path = resolve_model(args.model)
        return path, path.name
    from inflight.bench.inflight import SIZES
    from inflight.trainer.tiny_model import build_tiny_model, default_corpus

    config = dataclasses.replace(SIZES[args.size], max_position_embeddings=max(max_len, 1024))
    return build_tiny_model(work / args.size, default_corpus(), config), f"tiny-{args.size}"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory, hub id or 'smollm2' (trainer/models.py)")
    ap.add_argument("--size", default="S", choices=["S", "M", "L"],
                    help="without --model: a tiny model (inflight.bench.inflight's sizes)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024], help="P: each group's prompt length")
    ap.add_argument("--completion-tokens", type=int, nargs="+", default=[64, 256], help="T: every sample's length")
    ap.add_argument("--every", type=int, nargs="+", default=[16], help="requested update cadence, engine steps")
    ap.add_argument("--groups-in-flight", type=int, default=4, help="groups of 8 decoding at once")
    ap.add_argument("--steps", type=int, default=768, help="engine steps per mode and (P, T, every)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds the steps of each engine's modes are split into")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES),
                    help="cache: none, inflight, native-salt, native-reset; nocache: none, inflight-nocache")
    ap.add_argument("--listener-nice", type=int, default=19,
                    help="InflightConfig.listener_nice, as inflight.bench.inflight's")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split",
                    help="inflight.bench.placement: where the threads run")
    ap.add_argument("--listener-core", choices=["trainer", "engine"], default="trainer",
                    help="--placement split: the in-flight listener on the trainer's core, or on the engine's, "
                         "where native's receive runs")
    ap.add_argument("--workload", choices=KINDS, default="fresh",
                    help="inflight.bench.grpo_workloads: what the groups hold")
    ap.add_argument("--system-tokens", type=int, default=0, help="--workload system: the shared system prompt's tokens")
    ap.add_argument("--turns", type=int, default=1, help="--workload multi-turn: turns per episode")
    ap.add_argument("--tool-tokens", type=int, default=0, help="--workload multi-turn: each tool answer's tokens")
    ap.add_argument("--seed", type=int, default=0)
    add_results_option(ap, "grpo")
    args = ap.parse_args(argv)
    if args.listener_core == "engine" and args.placement != "split":
        ap.error("--listener-core engine: only with --placement split (shared places no thread)")
    try:
        args.workload_spec = Workload(kind=args.workload, system_tokens=args.system_tokens, turns=args.turns,
                                      tool_tokens=args.tool_tokens)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    record = run_record("grpo", argv)
    load, t0 = [round(os.getloadavg()[0], 2)], time.perf_counter()
    shapes = [(p, t, e) for p in args.prompt_tokens for t in args.completion_tokens for e in args.every]
    max_len = args.workload_spec.max_len(max(args.prompt_tokens), max(args.completion_tokens)) + 8
    rows: list[dict] = []
    cadences: dict[tuple[int, int, int], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model = model_dir_of(args, Path(tmp), max_len)
        for engine in args.engines:  # the prefix-caching flag is fixed when an engine starts: an engine each
            bench = GRPOBench(model_dir, ENGINES[engine][0], args.groups_in_flight, max_len, args.seed,
                              args.listener_nice, args.placement, args.workload_spec, args.listener_core)
            rows += bench_engine(bench, engine, model, shapes, cadences, args.steps, args.rounds)
            bench.close()
            del bench
            gc.collect()
    load.append(round(os.getloadavg()[0], 2))
    line = report(rows, args, model, load, time.perf_counter() - t0, record)
    append_result(args.results, line)


if __name__ == "__main__":
    main()
