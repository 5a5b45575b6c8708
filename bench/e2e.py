"""The training loop end to end: in-flight vs native pause+update vs batch-boundary, samples/s and reward vs wall clock.

    python -m inflight.bench.e2e [--steps 40] [--rounds 3] [--modes inflight pause batch] [--max-lag 4]
                                 [--workload tiny | smollm2-system] [--placement shared split]
                                 [--set KEY.PATH=VALUE ...] [--out runs/bench]

Every mode trains the same workload with ``inflight.trainer.train`` at the same
``loss.max_lag``, prefix caching on (``engine.prefix_caching``), its own run from the same
seed:

- **inflight**: the engine keeps decoding; each push commits between two steps;
- **pause**: the same async loop, each update through vLLM's native path with the engine
  paused (``rollout.mode = "pause"``, what PipelineRL, prime-rl and TRL's async GRPO do),
  requests salted by version;
- **batch**: sample a step's groups, wait idle for the next version.

The modes run INTERLEAVED, ``--rounds`` times (inflight, pause, batch, inflight, ...), so
a drift in the machine's speed or load hits them alike; each mode's figures are medians
across rounds with their spread (min, max), and the ratios inflight/pause and
inflight/batch are of those medians. Samples/s counts from the first step on (the same
engine start-up for every mode); reward against wall clock comes from each run's
``metrics.jsonl``. ``--placement`` (``inflight.bench.placement``): trainer and engine on
shared cores, or a core each.

Workloads: ``tiny`` (the default: the tiny demo model on one-digit addition, the default
config) and ``smollm2-system`` (SmolLM2-135M-Instruct, ``inflight prepare-model smollm2``;
groups of 8, every prompt at least ``--prompt-tokens`` long, a long shared preamble of
instructions before each problem, so a prefix cache has most of every prompt to reuse) and
``smollm2-leg-counting`` (the packaged ``smollm2_leg_counting_cpu``: a new user's first
config, reasoning-gym's leg_counting with two worked examples, groups of 8, 64 completion
tokens). Each run's row says how much of its steps' time the trainer waited for rollouts
(``wait_share``: near 0, the loop is trainer-bound) and how long the trainer itself took.
Writes ``bench_e2e.json`` (the command line, start time, git revision, load averages, every
run and the summary) and ``bench_e2e.png`` in ``--out``, appends all but the runs to
``bench/results/e2e.jsonl`` (``--results``); prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from inflight.bench.placement import PLACEMENTS, Placement, pinned_processes
from inflight.bench.run_record import add_results_option, append_result, run_record

MODES = ("inflight", "pause", "batch")
WORKLOADS = ("tiny", "smollm2-system", "smollm2-leg-counting")
LEG_COUNTING = "smollm2_leg_counting_cpu"
"""The ``smollm2-leg-counting`` workload: a new user's first SmolLM2 config, as packaged."""
RULES = (
    "Read the whole problem before you answer, and answer the question that is asked.",
    "Work with whole numbers only; there are no fractions, decimals or units in these problems.",
    "Add the numbers from left to right, and keep the running total in mind as you go.",
    "Do not explain your reasoning, do not restate the problem and do not greet the user.",
    "Your reply is a single number written with digits, with no words before or after it.",
    "If the problem looks ambiguous, choose the most literal reading of its arithmetic.",
    "Never refuse: every problem here has exactly one correct whole-number answer.",
    "Check the last digit of your total against the last digits of the numbers you added.",
)
"""The shared preamble's sentences (``system_preamble``), numbered and cycled to length."""


def system_preamble(rules: int) -> str:
    """A long block of instructions every prompt of the ``smollm2-system`` workload opens with."""
    lines = [f"Rule {i + 1}: {RULES[i % len(RULES)]}" for i in range(rules)]
    return "You are a careful arithmetic assistant. Follow every rule below.\n" + "\n".join(lines) + "\n\n"


def smollm2_system(min_tokens: int) -> dict[str, Any]:
    """The ``smollm2-system`` workload's config: the preamble grown until every prompt, as the
    chat template renders it, has at least ``min_tokens`` tokens."""
    import random

    from transformers import AutoTokenizer

    from inflight.trainer.envs.arithmetic import Arithmetic
    from inflight.trainer.models import resolve_model
    from inflight.trainer.tasks.task import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    rules = 8
    while True:
        template = system_preamble(rules) + "What is {expr}? Answer with just the number."
        task, rng = Arithmetic(template=template), random.Random(0)
        shortest = min(len(encode_prompt(tokenizer, task.sample(rng), "auto")) for _ in range(16))
        if shortest >= min_tokens:
            break
        rules += 4
    return {"model": {"path": "smollm2"},
            "task": {"name": "arithmetic", "completion_tokens": 12, "arithmetic": {"template": template}},
            "rollout": {"group_size": 8, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 4,
                        "admit_lag": 8},
            "optim": {"lr": 3e-5}, "transport": {"bucket_mb": 64},
            "engine": {"max_num_seqs": 32, "max_model_len": 2 * min_tokens + 64},
            "meta": {"prompt_tokens_min": shortest, "preamble_rules": rules}}


def packaged(name: str) -> dict[str, Any]:
    """A packaged config's tables as its file sets them (``run`` aside: each mode sets its own)."""
    import tomllib

    from inflight.trainer.config_files import find_config

    data = tomllib.loads(find_config(name).read_text())
    data.pop("run", None)
    return data


def workload(name: str, steps: int, max_lag: int, min_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config tables every mode shares, what to record about the workload)."""
    base: dict[str, Any] = ({} if name == "tiny" else smollm2_system(min_tokens) if name == "smollm2-system"
                            else packaged(LEG_COUNTING))
    meta = base.pop("meta", {})
    base["run"] = {"steps": steps}
    base["loss"] = {"max_lag": max_lag}
    base.setdefault("engine", {})["prefix_caching"] = True
    return base, {"workload": name, **meta}


def run_mode(base: dict[str, Any], mode: str, rnd: int, work: Path, placement: Placement,
             overrides: list[str]) -> dict[str, Any]:
    """One training run of ``mode``; its figures from the first step on."""
    from inflight.trainer.config_files import apply_overrides, config_from_dict
    from inflight.trainer.train import train

    name = f"{mode}_r{rnd}_{placement}_{len(os.listdir(work))}"  # unique in ``work``
    data = apply_overrides(json.loads(json.dumps(base)), overrides)
    data.setdefault("run", {})["out_dir"] = str(work / name)
    data.setdefault("rollout", {})["mode"] = mode
    cfg = config_from_dict(data)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with pinned_processes(placement):
        train(cfg)
    total = time.perf_counter() - t0
    log = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return figures(log, cfg, mode=mode, rnd=rnd, placement=placement, load=load, total=total)


def figures(log: list[dict], cfg: Any, **about: Any) -> dict[str, Any]:
    """A run's row: samples/s and per-step times from the first step on, reward vs wall clock."""
    steps = [r for r in log if "reward_mean" in r]
    timed = steps[1:]  # from the first step on: the same start-up for every mode
    wall = sum(r["step_ms"] for r in timed) / 1e3
    samples = len(timed) * cfg.rollout.groups_per_step * cfg.rollout.group_size
    k = max(1, len(steps) // 5)
    clock, curve = 0.0, []
    for r in timed:
        clock += r["step_ms"] / 1e3
        curve.append((round(clock, 2), r["reward_mean"]))
    stalls = [r["stall_ms"] for r in steps if r.get("stall_ms") is not None]
    return {"mode": about["mode"], "round": about["rnd"], "cores": f"{about['placement']} cores",
            "steps": len(steps), "samples_s": round(samples / max(wall, 1e-9), 2), "wall_s": round(wall, 1),
            "total_s": round(about["total"], 1), "load_1m": round(about["load"], 2),
            "step_ms": round(1e3 * wall / max(1, len(timed)), 1),
            # trainer time waiting for rollouts: what the overlap can hide; its share of the steps'
            # time (near 0: the loop is trainer-bound) and where the rest went
            "wait_ms": round(statistics.fmean(r.get("wait_ms", 0.0) for r in timed), 1) if timed else None,
            "wait_share": round(sum(r.get("wait_ms", 0.0) for r in timed) / max(1e3 * wall, 1e-9), 3),
            "trainer_ms": round(statistics.median(sum(r.get(k, 0.0) for k in ("forward_ms", "backward_ms",
                                                                                "reference_ms", "optimizer_ms"))
                                                  for r in timed), 1) if timed else None,
            "peak_rss_gb": max((r.get("peak_rss_gb", 0.0) for r in timed), default=None),
            "stall_ms": round(statistics.median(stalls), 2) if stalls else None,
            "reward_first": round(statistics.fmean(r["reward_mean"] for r in steps[:k]), 3),
            "reward_last": round(statistics.fmean(r["reward_mean"] for r in steps[-k:]), 3),
            "reward_vs_wall": curve}


def interleaved(base: dict[str, Any], modes: list[str], rounds: int, placement: Placement, overrides: list[str],
                work: Path) -> list[dict[str, Any]]:
    """Every mode once per round, in order, round after round."""
    rows = []
    for rnd in range(rounds):
        for mode in modes:
            rows.append(run_mode(base, mode, rnd, work, placement, overrides))
            print(f"round {rnd} {mode:>8}: {rows[-1]['samples_s']} samples/s, reward {rows[-1]['reward_first']} -> "
                  f"{rows[-1]['reward_last']}, stall {rows[-1]['stall_ms']} ms", flush=True)
    return rows


def train_loop(steps: int, work: Path, engines: int = 1, *, placement: Placement = "shared") -> list[dict]:
    """``inflight.bench.inflight --train-steps``: one round of every mode on the tiny workload
    (and, with ``engines`` > 1 on shared cores, in-flight with a fleet of that many engines)."""
    from inflight.trainer.loss_config import LossConfig

    base, _ = workload("tiny", steps, LossConfig.max_lag, 0)
    rows = interleaved(base, list(MODES), 1, placement, [], work)
    if engines > 1 and placement == "shared":
        rows.append({**run_mode(base, "inflight", 0, work, placement, [f"engine.count={engines}"]), "engines": engines})
    return [{"engines": 1, **r} for r in rows]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per placement and mode: medians across rounds with their spread; the ratios of the medians."""
    out: dict[str, Any] = {}
    for cores in sorted({r["cores"] for r in rows}):
        per: dict[str, Any] = {}
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["cores"] == cores and r["mode"] == mode and r.get("engines", 1) == 1]
            if not mine:
                continue
            rates = [r["samples_s"] for r in mine]
            stalls = [r["stall_ms"] for r in mine if r["stall_ms"] is not None]
            per[mode] = {"rounds": len(mine), "samples_s": statistics.median(rates), "samples_s_min": min(rates),
                         "samples_s_max": max(rates), "samples_s_rounds": rates,
                         "stall_ms": statistics.median(stalls) if stalls else None,
                         "wait_ms": statistics.median(r["wait_ms"] for r in mine if r["wait_ms"] is not None),
                         "wait_share": statistics.median(r.get("wait_share", 0.0) for r in mine),
                         "trainer_ms": statistics.median(r.get("trainer_ms") or 0.0 for r in mine),
                         "reward_first": statistics.median(r["reward_first"] for r in mine),
                         "reward_last": statistics.median(r["reward_last"] for r in mine)}
        ratios = {f"inflight/{m}": round(per["inflight"]["samples_s"] / per[m]["samples_s"], 3)
                  for m in ("pause", "batch") if "inflight" in per and m in per and per[m]["samples_s"]}
        out[cores] = {"modes": per, "ratios": ratios}
    return out


def plot_e2e(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"inflight": "C1", "pause": "C0", "batch": "C3"}
    for r in rows:
        if r.get("engines", 1) != 1:
            continue
        xs, ys = zip(*r["reward_vs_wall"]) if r["reward_vs_wall"] else ((), ())
        smooth = [statistics.fmean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
        first = r["round"] == 0
        ax.plot(xs, smooth, color=colors.get(r["mode"], "C7"), ls="-" if r["cores"] == "split cores" else ":",
                alpha=0.9 if first else 0.4, label=f"{r['mode']}, {r['cores']}" if first else None)
    ax.set_xlabel("training wall clock from the first step, s")
    ax.set_ylabel("reward (batch mean, 5-step average)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report(summary: dict[str, Any]) -> None:
    for cores, s in summary.items():
        for mode, m in s["modes"].items():
            print(f"{cores:>12} {mode:>8}: {m['samples_s']} samples/s (median of {m['rounds']}, "
                  f"{m['samples_s_min']}..{m['samples_s_max']}), reward {m['reward_first']} -> {m['reward_last']}, "
                  f"stall {m['stall_ms']} ms, trainer waits {m['wait_ms']} ms/step")
        for name, ratio in s["ratios"].items():
            print(f"{cores}: {name} = {ratio:.2f}x")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--max-lag", type=int, default=4, help="loss.max_lag of every mode")
    ap.add_argument("--workload", choices=WORKLOADS, default="tiny")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="smollm2-system: the shortest prompt, tokens")
    ap.add_argument("--placement", nargs="+", choices=PLACEMENTS, default=["shared"],
                    help="inflight.bench.placement: each runs every mode (split: trainer and engine on a core each)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                    help="a config override for every run (as inflight train --set)")
    ap.add_argument("--out", default="runs/bench")
    add_results_option(ap, "e2e")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    run = run_record("e2e", argv)  # the command, its start and the git revision
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, about = workload(args.workload, args.steps, args.max_lag, args.prompt_tokens)
    load = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for p in args.placement
                for r in interleaved(base, args.modes, args.rounds, p, args.overrides, Path(tmp))]
    load.append(round(os.getloadavg()[0], 2))
    summary = summarize(rows)
    report(summary)
    print(f"load average (1 min): {load[0]} at the start, {load[1]} at the end")
    record = {"bench": "e2e", **run, "cpus": os.cpu_count(), "load_1m": load, **about,
              "steps": args.steps, "rounds": args.rounds, "max_lag": args.max_lag, "overrides": args.overrides,
              "summary": summary, "rows": rows}
    (out / "bench_e2e.json").write_text(json.dumps(record, indent=1))
    append_result(args.results, {k: v for k, v in record.items() if k != "rows"})  # the summary; rows stay in --out
    plot_e2e(rows, out / "bench_e2e.png")
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}))


if __name__ == "__main__":
    main()
