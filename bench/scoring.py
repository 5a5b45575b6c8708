"""Decoding while a slow verifier scores: rewards in the engine's scoring processes vs inline.

    python -m inflight.bench.scoring [--model smollm2|DIR | --size S] [--sleep-s 2] [--verifier sleep|cpu] [--workers G]
                            [--groups-in-flight 4] [--completion-tokens 64] [--steps 576] [--rounds 18]
                            [--placement split] [--out runs/scoring] [--png docs/scoring.png]

One in-process engine samples GRPO groups (``n = 8``, a fresh prompt each, exactly
T = ``--completion-tokens`` tokens, temperature 1) with G = ``--groups-in-flight`` groups
decoding, refilled as they finish, as the training loop's engine process does. Each finished
group is scored by a verifier that takes ``--sleep-s`` seconds per group (``SlowVerifier``: the
``repeat_digit`` reward after it), asleep, or with ``--verifier cpu`` computing on the scoring
processes' cores. Modes:

1. ``instant``: the same verifier without the sleep, in the scoring processes
   (``inflight.trainer.rollout.episode_rollout.EpisodeRollout``, ``--workers`` of them), the ceiling;
2. ``pool``: the sleeping verifier in the scoring processes: the loop submits a finished
   group and steps on; a new group starts while fewer than G decode and fewer than G wait
   for their rewards (the training loop's admission, ``EngineLoop._start_inflight``);
3. ``inline``: the sleeping verifier called between two engine steps, as the engine process
   scored before ``inflight.trainer.rollout.episode_rollout``: every sequence waits for it.

Each mode runs in ``--rounds`` chunks of ``--steps / --rounds`` timed engine steps on the same
engine, the order of the modes rotated each round, after an untimed warm-up chunk per mode;
the scoring processes start, and build their task, before anything runs. A chunk starts on an
empty engine with G groups whose completions are T / G, 2 T / G, ..., T tokens long (later
groups': T). Groups of one length started together would finish together for ever, all G at
the verifier at once, a burst that training's varied lengths do not make; staggered, one
group finishes every T / G steps from the start, as in an engine that has run a while. That
first step prefills all G groups (the steady state prefills one per T / G steps; its median
time is reported) and is untimed; the timed steps follow. Then the chunk aborts what is in
flight and drains (untimed).

Placement (``--placement``, ``inflight.bench.placement``). ``split`` (the default) emulates a GPU
node: the engine computes with one thread on ``ENGINE_CORE``; the scoring processes and
their collector thread run on ``TRAINER_CORE``, as a GPU engine's verifiers run on host cores
decode does not use. ``shared``: torch's OpenMP team on both cores, the scoring processes
anywhere; any other work on a core then stalls the whole team at every parallel region, and
on this machine, shared with other jobs, a chunk's tok/s swung tenfold between rounds.

What is counted, exactly: every engine step's sampled tokens, where the engine core hands
them out. ``StepTokens`` wraps the in-process client's ``get_output`` and adds up each
``EngineCoreOutput``'s ``new_token_ids``: the tokens that step sampled for each running
request (each of a group's 8 samples is one), whether or not its group finishes in the
chunk. The requests keep ``RequestOutputKind.FINAL_ONLY``: the loop sees a group whole when
it finishes and hands it to the scorer as the engine process does. A mode's tok/s is its
timed chunks' tokens over their wall time, waits included: ``inline``'s sleeps, and for
``pool`` any time admission waited for rewards with nothing left to decode (time, not a step:
every mode runs the same number of decode steps).

Reports per mode: tok/s and its ratio to ``instant``'s; each round's, its ratio to the same
round's ``instant`` and their median (a round's modes run within a minute of each other: the
ratio other jobs on the machine disturb least); the median step; the groups scored; the most
groups waiting for rewards at once and how long admission waited for them. The verifier
keeps up when its throughput, ``--workers`` / ``--sleep-s`` groups per second (a CPU-bound
one: at most as many workers as the scoring processes have cores), covers the engine's group
rate (``instant``'s tok/s / (8 T)); the output gives their ratio. For a verifier near capacity,
pick ``--sleep-s`` from an earlier run's group rate. The JSON line is also appended to
``bench/results/scoring.jsonl`` with the command, its start and the git revision.
``--workers`` defaults to G, as many as admission lets wait. Writes ``results.json`` under
``--out`` and the figure ``--png`` (tok/s per mode, its ratio to ``instant``; tokens over
each timed chunk's seconds, per round and mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inflight.bench.run_record import add_results_option, append_result, run_record
from inflight.trainer.envs.digits import RepeatDigit
from inflight.trainer.tasks import Completion, encode_prompt

GROUP = 8
MODES = ("instant", "pool", "inline")


class SlowVerifier(RepeatDigit):
    """``repeat_digit``, its ``score`` taking ``sleep_s`` seconds a group: asleep (a sandbox or a
    judge elsewhere), or with ``cpu`` computing for ``sleep_s`` seconds of this process's CPU
    time (a checker on the scoring host's cores, which contends with what else runs there)."""

    def __init__(self, tokenizer: Any, completion_tokens: int, sleep_s: float, cpu: bool = False) -> None:
        super().__init__(tokenizer, completion_tokens)
        self.sleep_s, self.cpu = sleep_s, cpu

    def score(self, prompts, completions):  # (Task's signature)
        if self.cpu:
            burn_cpu(self.sleep_s)
        else:
            time.sleep(self.sleep_s)
        return super().score(prompts, completions)


def burn_cpu(seconds: float) -> int:
    """Compute until this process has used ``seconds`` more CPU time; returns the rounds run."""
    end, x, rounds = time.process_time() + seconds, 1, 0
    while time.process_time() < end:
        for _ in range(2000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        rounds += 1
    return rounds


def make(tokenizer: Any, completion_tokens: int, sleep_s: float, cpu: bool = False) -> SlowVerifier:
    """``task.name = "inflight.bench.scoring:make"``."""
    return SlowVerifier(tokenizer, completion_tokens, sleep_s, cpu)


def verifier_rate(workers: int, sleep_s: float, cpu: bool, scoring_cores: int) -> float:
    """Groups per second the verifier scores at most: each worker one group per ``sleep_s``; a
    CPU-bound one no more workers at once than the cores the scoring processes have."""
    return (min(workers, scoring_cores) if cpu else workers) / sleep_s


class StepTokens:
    """The tokens the engine's last step sampled, counted where EngineCore hands them out:
    the in-process client's ``get_output`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), wrapped,
    sums ``len(o.new_token_ids)`` over the step's ``EngineCoreOutput``s, whatever the
    requests' output kind lets ``LLMEngine.step`` return."""

    def __init__(self, llm: Any) -> None:
        client = llm.llm_engine.engine_core
        self._get_output, self.last = client.get_output, 0
        client.get_output = self._counted

    def _counted(self) -> Any:
        out = self._get_output()
        self.last += sum(len(o.new_token_ids) for o in out.outputs)
        return out

    def step(self, engine: Any) -> tuple[list[Any], int]:
        """``engine.step()``'s outputs and the tokens it sampled."""
        self.last = 0
        outs = engine.step()
        return outs, self.last


class Loop:
    """One mode's sampling loop on the shared engine (``scorer``: None scores inline with ``task``)."""

    def __init__(self, llm: Any, mode: str, params: Any, groups: int, scorer: Any, task: Any,
                 counter: StepTokens) -> None:
        self.llm, self.mode, self.params, self.groups, self.scorer, self.task = llm, mode, params, groups, scorer, task
        self.counter, self.completion = counter, params.max_tokens
        self.rng, self.prompts, self.started, self.scored = random.Random(0), {}, 0, 0
        self.most_waiting, self.waited_s = 0, 0.0
        self.wave = []  # the first G groups of a chunk: completions of T / G, 2 T / G, ..., T tokens
        for g in range(groups):
            self.wave.append(params.clone())
            self.wave[-1].max_tokens = max(1, (g + 1) * self.completion // groups)

    def chunk(self, steps: int) -> dict:
        """From an empty engine: the first wave's step (untimed), ``steps`` timed engine steps,
        the drain (untimed). Returns the timed steps' tokens, wall time and trace (each step's
        end, seconds into the chunk, and its tokens)."""
        self._collect()  # rewards that came back while the other modes ran
        t = time.perf_counter()
        for params in self.wave:
            self._start(params)
        self._step()
        tokens, done, trace, t0 = 0, 0, [], time.perf_counter()
        wave_s = t0 - t
        while done < steps:
            while len(self.prompts) < self.groups and (self.scorer is None or len(self.scorer) < self.groups):
                self._start(self.params)
            if not self.prompts:  # every group waits for its rewards: admission waits, nothing decodes
                t = time.perf_counter()
                time.sleep(0.002)
                self._collect()
                self.waited_s += time.perf_counter() - t
                continue
            n = self._step()
            tokens, done = tokens + n, done + 1
            trace.append((round(time.perf_counter() - t0, 3), n))
        wall = time.perf_counter() - t0
        self._drain()
        return {"tokens": tokens, "wall_s": wall, "steps": done, "trace": trace, "wave_s": wave_s}

    def _step(self) -> int:
        outs, n = self.counter.step(self.llm.llm_engine)
        for out in outs:
            if out.finished:
                prompt = self.prompts.pop(out.request_id)
                if self.scorer is None:
                    self.task.score([prompt] * GROUP, [Completion(c.text, c.token_ids, c.finish_reason or "")
                                                       for c in out.outputs])
                    self.scored += 1
                else:
                    self.scorer.submit(out, prompt)
        self._collect()
        return n

    def _collect(self) -> None:
        if self.scorer is not None:
            self.most_waiting = max(self.most_waiting, len(self.scorer))
            self.scored += len(self.scorer.collect())

    def _start(self, params: Any) -> None:
        prompt = self.task.sample(self.rng)
        rid = f"{self.mode}-{self.started}"
        self.started += 1
        ids = encode_prompt(self.llm.get_tokenizer(), prompt, "auto")
        if self.scorer is None:
            self._add(rid, prompt, ids, params)
        else:  # the rollout driver names the request, and asks for it with this group's params
            self.scorer.add_request = lambda rid, prompt, ids, max_tokens, n: self._add(rid, prompt, ids, params)
            self.scorer.start_group(rid, prompt, ids)

    def _add(self, rid: str, prompt: Any, ids: list[int], params: Any) -> None:
        self.prompts[rid] = prompt
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)

    def _abort(self, rids: list[str]) -> None:
        self.llm.llm_engine.abort_request(rids)
        for rid in rids:
            self.prompts.pop(rid, None)

    def _drain(self) -> None:
        """Abort what this mode has decoding, so the next chunk starts on an empty engine."""
        engine = self.llm.llm_engine
        if self.scorer is not None:
            self.scorer.abort = self._abort
            self.scorer.drop_decoding("the chunk ended")
        self._abort(list(self.prompts))
        while engine.has_unfinished_requests():
            engine.step()


def step_s(trace: list[tuple[float, int]]) -> list[float]:
    """Each timed step's wall time, from a chunk's trace (an inline score is inside its step)."""
    ends = [t for t, _ in trace]
    return [b - a for a, b in zip([0.0] + ends, ends, strict=False)]


def rows_of(totals: dict[str, list[dict]], loops: dict[str, Loop]) -> list[dict]:
    """Per mode: its timed chunks' tok/s and its ratio to ``instant``'s; each round's tok/s, its
    ratio to the same round's ``instant``, their median; the median step over all its chunks
    (what decoding costs a step, apart from the steps a wait or another job stretched)."""
    rate = {m: sum(c["tokens"] for c in cs) / sum(c["wall_s"] for c in cs) for m, cs in totals.items()}
    rows = []
    for m, cs in totals.items():
        rounds = [c["tokens"] / c["wall_s"] for c in cs]
        ratios = [x / (i["tokens"] / i["wall_s"]) for x, i in zip(rounds, totals["instant"], strict=True)]
        rows.append({"mode": m, "tok_s": round(rate[m], 1), "vs_instant": round(rate[m] / rate["instant"], 3),
                     "median_round_vs_instant": round(statistics.median(ratios), 3),
                     "rounds_tok_s": [round(x, 1) for x in rounds], "rounds_vs_instant": [round(x, 3) for x in ratios],
                     "tokens": sum(c["tokens"] for c in cs), "wall_s": round(sum(c["wall_s"] for c in cs), 1),
                     "steps": sum(c["steps"] for c in cs), "groups_scored": loops[m].scored,
                     "most_waiting": loops[m].most_waiting if loops[m].scorer is not None else None,
                     "waited_s": round(loops[m].waited_s, 2),
                     "median_step_ms": round(1e3 * statistics.median(d for c in cs for d in step_s(c["trace"])), 1),
                     "wave_step_s": round(statistics.median(c["wave_s"] for c in cs), 2)})
    return rows


def plot(rows: list[dict], totals: dict[str, list[dict]], title: str, png: Path) -> None:
    """Left: tok/s per mode, its ratio to ``instant`` on the bar; right: tokens sampled over
    each timed chunk's wall time, one line per round and mode (a slope is a tok/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"instant": "C0", "pool": "C2", "inline": "C3"}
    fig, (bars, line) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 2]})
    xs = range(len(rows))
    bars.bar(xs, [r["tok_s"] for r in rows], color=[colors[r["mode"]] for r in rows])
    for x, r in zip(xs, rows, strict=True):
        bars.text(x, r["tok_s"], f"{r['tok_s']:.0f} tok/s\n{r['vs_instant']:.3f}x\n(rounds' median\n"
                  f"{r['median_round_vs_instant']:.3f}x)", ha="center", va="bottom", fontsize=8)
    bars.set_xticks(xs, [r["mode"] for r in rows])
    bars.set_ylim(0, 1.45 * max(r["tok_s"] for r in rows))
    bars.set_ylabel("decode tokens/s (wall time), x instant")
    for m, cs in totals.items():
        for i, c in enumerate(cs):
            ts, ns = [0.0] + [t for t, _ in c["trace"]], [0]
            for _, n in c["trace"]:
                ns.append(ns[-1] + n)
            line.plot(ts, ns, color=colors[m], lw=0.8, alpha=0.45, label=m if i == 0 else None)
    line.set_xlabel("seconds into a timed chunk (one line per round)")
    line.set_ylabel("tokens sampled")
    line.legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def started_on(cpus: tuple[int, ...], start: Any) -> Any:
    """``start()`` called on a thread pinned to ``cpus`` (() : unpinned), so the threads and
    processes it starts (the scoring pools' collectors and workers) run there."""
    result = []

    def run() -> None:
        if cpus:
            os.sched_setaffinity(0, set(cpus))
        result.append(start())
    t = threading.Thread(target=run, name="scoring-start")
    t.start()
    t.join()
    if not result:
        raise RuntimeError("the scoring processes did not start (the error is above)")
    return result[0]


def model_dir_of(args: argparse.Namespace) -> Path:
    """``--size``: a tiny model (``inflight.bench.inflight``'s sizes), for smoke runs; else ``--model``."""
    if args.size:
        from inflight.bench.inflight import SIZES
        from inflight.trainer.tiny_model import build_tiny_model, default_corpus

        config = dataclasses.replace(SIZES[args.size], max_position_embeddings=1024)
        return build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-scoring-")) / args.size, default_corpus(), config)
    from inflight.trainer.models import resolve_model

    return resolve_model(args.model)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a model directory, hub id or 'smollm2' (trainer/models.py)")
    ap.add_argument("--size", default=None, choices=["S", "M", "L"], help="a tiny model instead of --model (smoke)")
    ap.add_argument("--sleep-s", type=float, default=2.0, help="the verifier's time per group")
    ap.add_argument("--verifier", choices=["sleep", "cpu"], default="sleep",
                    help="sleep: the time asleep; cpu: the time computing, on the scoring processes' cores")
    ap.add_argument("--workers", type=int, default=None, help="task.scoring.workers (default: --groups-in-flight)")
    ap.add_argument("--groups-in-flight", type=int, default=4)
    ap.add_argument("--completion-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=576, help="timed engine steps per mode, over all rounds")
    ap.add_argument("--rounds", type=int, default=18)
    ap.add_argument("--placement", choices=["split", "shared"], default="split",
                    help="inflight.bench.placement: the engine on one core, the scoring processes on the other; or "
                         "shared")
    ap.add_argument("--out", default="runs/scoring", help="results.json goes here")
    add_results_option(ap, "scoring")
    ap.add_argument("--png", default="docs/scoring.png", help="the figure ('' for none)")
    args = ap.parse_args()
    args.workers = args.workers or args.groups_in_flight
    return args


def main() -> None:
    args = parse()
    record = run_record("scoring")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from inflight.bench.placement import engine_env
    from inflight.engine.engine_config import engine_kwargs
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.rollout.engine_process import sampling_of
    from inflight.trainer.rollout.episode_rollout import EpisodeRollout

    wall0 = time.perf_counter()
    model_dir = str(model_dir_of(args))
    cpus = engine_env(args.placement)  # this thread, the engine's: ENGINE_CORE and one thread in split
    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
              max_num_seqs=GROUP * args.groups_in_flight, **engine_kwargs())
    # no updates here: the outputs carry version 0, as an in-flight engine's do before its first commit
    llm.llm_engine.engine_core.engine_core._weight_version = "0"
    counter = StepTokens(llm)
    params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    def scorer(sleep_s: float) -> EpisodeRollout:
        cfg = config_from_dict({"rollout": {"group_size": GROUP},
                                "task": {"name": "inflight.bench.scoring:make",
                                         "completion_tokens": args.completion_tokens,
                                         "options": {"completion_tokens": args.completion_tokens, "sleep_s": sleep_s,
                                                     "cpu": args.verifier == "cpu"},
                                         "scoring": {"workers": args.workers, "timeout_s": 10 * args.sleep_s + 30}}})
        s = EpisodeRollout(cfg, model_dir, "e0", sampling_of(params), llm.get_tokenizer(), add_request=None,
                           abort=None, episodic=False)  # type: ignore[arg-type]  # set by each Loop
        s.wait_ready()
        return s
    task = make(llm.get_tokenizer(), args.completion_tokens, args.sleep_s, args.verifier == "cpu")
    scorers = started_on(cpus, lambda: {"instant": scorer(0.0), "pool": scorer(args.sleep_s)})
    loops = {m: Loop(llm, m, params, args.groups_in_flight, scorers.get(m), task, counter) for m in MODES}
    for m in MODES:  # untimed: the engine's first steps and each pool's first calls
        loops[m].chunk(max(1, args.completion_tokens // args.groups_in_flight))  # each scores a group
    for loop in loops.values():  # the warm-up's groups scored, then the counts start
        while loop.scorer is not None and len(loop.scorer):
            time.sleep(0.05)
            loop.scorer.collect()
        loop.scored = loop.most_waiting = 0
        loop.waited_s = 0.0
    load = [round(os.getloadavg()[0], 2)]
    totals: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for m in MODES[r % 3:] + MODES[:r % 3]:
            totals[m].append(loops[m].chunk(args.steps // args.rounds))
        load.append(round(os.getloadavg()[0], 2))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} {c[-1]['tokens'] / c[-1]['wall_s']:.1f}" for m, c in totals.items()) + f" tok/s; load {load[-1]}",
            flush=True)
    for s in scorers.values():
        s.close()
    rows = rows_of(totals, loops)
    model = f"tiny-{args.size}" if args.size else Path(model_dir).name
    group_rate = rows[0]["tok_s"] / (GROUP * args.completion_tokens)
    scoring_cores = len(cpus) if cpus else (os.cpu_count() or 1)  # split: the trainer's core; shared: every core
    capacity = verifier_rate(args.workers, args.sleep_s, args.verifier == "cpu", scoring_cores)
    covered = capacity >= group_rate
    print(f"{model}: verifier {args.sleep_s} s per group ({args.verifier}), {args.workers} scoring workers, "
          f"{args.groups_in_flight} groups of {GROUP} x {args.completion_tokens} tokens, "
          f"{args.steps // args.rounds} timed steps per mode "
          f"in each of {args.rounds} rounds, placement {args.placement}; load average (1 min) at the start, "
          f"after each round: {load}")
    for row in rows:
        waits = (f"; at most {row['most_waiting']} waiting for rewards, admission waited {row['waited_s']} s"
                 if row["most_waiting"] is not None else "")
        print(f"  {row['mode']:8} {row['tok_s']:8} tok/s  {row['vs_instant']:.3f} of instant (median of the rounds' "
              f"ratios {row['median_round_vs_instant']:.3f}), {row['groups_scored']} groups scored{waits}; the "
              f"median step {row['median_step_ms']} ms, the wave's untimed step {row['wave_step_s']} s\n"
              f"           rounds: {row['rounds_tok_s']} tok/s, {row['rounds_vs_instant']} of instant")
    print(f"verifier throughput {capacity:.2f} groups/s ({args.workers} workers / {args.sleep_s} s, {args.verifier}"
          f"{f' on {scoring_cores} cores' if args.verifier == 'cpu' else ''}), {capacity / group_rate:.2f}x "
          + (f"the engine's {group_rate:.2f} groups/s" if covered else
             f"the engine's {group_rate:.2f} groups/s: admission waits for the verifier"))
    result = {"bench": "scoring", **record, **vars(args), "model": model, "group": GROUP, "load_1m": load,
              "group_rate": round(group_rate, 3), "verifier_rate": round(capacity, 3),
              "capacity_over_rate": round(capacity / group_rate, 3), "verifier_covers": covered,
              "wall_s": round(time.perf_counter() - wall0, 1), "rows": rows,
              "traces": {m: [c["trace"] for c in cs] for m, cs in totals.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result) + "\n")
    if args.png:
        plot(rows, totals, f"{model}: verifier {args.sleep_s:g} s per group, {args.workers} workers, "
             f"{args.groups_in_flight} x {GROUP} x {args.completion_tokens} tokens in flight, {args.placement} "
             f"cores; load {min(load)}-{max(load)}", Path(args.png))
    line = {k: v for k, v in result.items() if k != "traces"}
    print(json.dumps(line))
    append_result(args.results, line)


if __name__ == "__main__":
    main()
