"""Staleness study: what per-token version tags buy, on the CPU demo task.

    inflight bench staleness [--steps 100] [--seed 0] [--only NAME ...] [--lr 3e-3]

Runs real training (``inflight.trainer.train.train``, the packaged ``demo`` config with overrides) for:
batch-boundary (synchronous) RL; in-flight with max lag 1, 2, 4 and 8 (``loss.max_lag`` and
``rollout.admit_lag`` equal) under token TIS; and at max lag 8: no correction, Seq-MIS and
M2PO, each alone (objective ``none`` plus the mask), so each correction is compared with
nothing else changed. Measured per run: training reward against wall-clock time (the sum of
the step times, so the engine's start-up is left out) and against samples trained on, and
an eval at the end: the mean reward of greedy completions of the ten prompts ``repeat: D``
(D = 0..9, the whole prompt space of the task) and of 8 sampled completions each at
temperature 1, both from the final checkpoint with Hugging Face ``generate``.

Prints a table (time and samples until the 10-step moving mean of the reward reaches 0.45,
among others), then one JSON line, which it appends to ``bench/results/staleness.jsonl``
(``--results``); writes docs/staleness.png and runs/staleness/results.json.
``--replot`` rebuilds the table and the PNG from results.json without training.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

from inflight.bench.run_record import add_results_option, append_result, run_record

ROOT = Path(__file__).resolve().parents[1]
TIS = {"name": "reinforce", "truncation": 2.0}
NONE = {"name": "none"}


def _inflight(lag: int, objective: dict, **loss: Any) -> dict:
    return {"rollout": {"mode": "inflight", "admit_lag": lag}, "loss": {"max_lag": lag, "objective": objective, **loss}}


RUNS: dict[str, dict] = {
    "batch TIS": {"rollout": {"mode": "batch"}, "loss": {"objective": TIS}},
    "lag1 TIS": _inflight(1, TIS),
    "lag2 TIS": _inflight(2, TIS),
    "lag4 TIS": _inflight(4, TIS),
    "lag8 TIS": _inflight(8, TIS),
    "lag8 none": _inflight(8, NONE),
    "lag8 Seq-MIS": _inflight(8, NONE, seq_mask="product", seq_mask_low=0.5, seq_mask_high=2.0),
    "lag8 M2PO": _inflight(8, NONE, m2_threshold=0.04),
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) and k != "objective" else v
    return out


def evaluate(model_dir: Path, completion_tokens: int, digit_credit: float, samples: int = 8) -> dict[str, float]:
    """Greedy and sampled (T=1) reward on the ten prompts of the task."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight.trainer.envs.digits import RepeatDigit

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    task = RepeatDigit(tok, completion_tokens, digit_credit)
    torch.manual_seed(0)
    greedy, sampled = [], []
    with torch.no_grad():
        for prompt in task.eval_prompts(10):
            ids = tok(prompt.text, return_tensors="pt").input_ids
            for do_sample, n, acc in ((False, 1, greedy), (True, samples, sampled)):
                sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {}
                out = model.generate(ids.repeat(n, 1), attention_mask=torch.ones_like(ids).repeat(n, 1),
                                     max_new_tokens=completion_tokens, do_sample=do_sample, **sampling,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                acc += [task.reward(prompt, row[ids.shape[1]:].tolist()) for row in out]
    return {"eval_greedy": sum(greedy) / len(greedy), "eval_sampled": sum(sampled) / len(sampled)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run_config(name: str, base: dict, steps: int, seed: int, out: Path) -> Any:
    """The ``TrainConfig`` of run ``name``: ``base`` (a config file's tables) with the run's settings."""
    from inflight.trainer.config_files import config_from_dict

    return config_from_dict(_merge(base, {**RUNS[name], "run": {"steps": steps, "seed": seed, "out_dir": str(out),
                                                                 "name": f"staleness {name}"}}))


def run_one(name: str, base: dict, steps: int, seed: int, out_root: Path) -> dict[str, Any]:
    from inflight.trainer.train import train

    out = out_root / name.replace(" ", "_")
    cfg = run_config(name, base, steps, seed, out)
    t0 = time.perf_counter()
    summary = train(cfg)
    total_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = cfg.rollout.groups_per_step * cfg.rollout.group_size
    wall, t = [], 0.0
    for r in rows:
        t += r["step_ms"] / 1e3
        wall.append(t)
    k = max(1, len(rows) // 5)
    ev = evaluate(out / "checkpoint", cfg.task.completion_tokens, cfg.task.digit_credit)
    return {
        "run": name, "mode": cfg.rollout.mode, "max_lag": cfg.loss.max_lag, "objective": cfg.loss.objective.name,
        "steps": len(rows), "loop_s": round(wall[-1], 1), "total_s": round(total_s, 1),
        "samples": per_step * len(rows),
        "reward_first20": round(_mean([r["reward_mean"] for r in rows[:k]]), 3),
        "reward_last20": round(_mean([r["reward_mean"] for r in rows[-k:]]), 3),
        "eval_greedy": round(ev["eval_greedy"], 3), "eval_sampled": round(ev["eval_sampled"], 3),
        "lag_mean": round(summary["lag_mean"], 2),
        "ess_mean": round(_mean([r["ess"] for r in rows]), 3),
        "frac_masked": round(_mean([r["frac_masked"] for r in rows]), 3),
        "dropped_stale": int(rows[-1].get("dropped_stale", 0)),
        "curve": {"wall_s": [round(w, 2) for w in wall], "samples": [per_step * r["step"] for r in rows],
                  "reward": [round(r["reward_mean"], 4) for r in rows]},
    }


def plot(results: list[dict], png: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for res in results:
        c = res["curve"]
        w = max(1, len(c["reward"]) // 10)
        smooth = [_mean(c["reward"][max(0, i - w + 1): i + 1]) for i in range(len(c["reward"]))]
        style = "--" if res["run"].startswith("batch") else "-"
        for ax, x in zip(axes, (c["wall_s"], c["samples"])):
            ax.plot(x, smooth, style, label=f"{res['run']} (eval {res['eval_greedy']:.2f})")
    axes[0].set_xlabel("training wall-clock (s, engine start-up excluded)")
    axes[1].set_xlabel("samples trained on")
    for ax in axes:
        ax.axhline(TARGET, color="grey", lw=0.6, ls=":")
    # a run that stalled (a push held up by a loaded machine) would squash every other curve
    ends = sorted(res["curve"]["wall_s"][-1] for res in results)
    cap = 3 * ends[len(ends) // 2]
    if ends[-1] > cap:
        axes[0].set_xlim(0, cap)
        cut = ", ".join(res["run"] for res in results if res["curve"]["wall_s"][-1] > cap)
        axes[0].text(0.98, 0.02, f"off the axis: {cut}", transform=axes[0].transAxes, ha="right", fontsize=8)
    axes[0].set_ylabel("batch reward, moving mean")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Staleness study, CPU demo (repeat_digit, tiny Qwen2), one seed{title}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


TARGET = 0.45  # a reward every run reaches in 100 steps of the demo; where the curves separate
COLS = ["run", "loop_s", "step_ms_median", "reward_first20", "reward_last20", "s_to_target", "samples_to_target",
        "eval_greedy", "eval_sampled", "lag_mean", "ess_mean", "frac_masked", "dropped_stale"]


def time_to_target(res: dict, target: float = TARGET) -> dict:
    """Wall-clock and samples until the moving mean (10 steps) of the batch reward first reaches ``target``."""
    c = res["curve"]
    for i in range(len(c["reward"])):
        if _mean(c["reward"][max(0, i - 9): i + 1]) >= target:
            return {"s_to_target": round(c["wall_s"][i], 1), "samples_to_target": c["samples"][i]}
    return {"s_to_target": None, "samples_to_target": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="demo", help="a packaged config by name, or a TOML file")
    ap.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--out", default=str(ROOT / "runs" / "staleness"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "staleness.png"))
    ap.add_argument("--lr", type=float, default=None, help="override optim.lr for every run (a harsher setting)")
    ap.add_argument("--replot", action="store_true", help="no training: table and PNG from OUT/results.json")
    add_results_option(ap, "staleness")
    args = ap.parse_args()
    run = run_record("staleness")  # the command, its start and the git revision
    from inflight.trainer.config_files import find_config

    with open(find_config(args.config), "rb") as f:
        base = tomllib.load(f)
    if args.lr is not None:
        base = _merge(base, {"optim": {"lr": args.lr}})
    out_root = Path(args.out)
    results = json.loads((out_root / "results.json").read_text()) if args.replot else []
    for name in [] if args.replot else args.only:
        results.append(run_one(name, base, args.steps, args.seed, out_root))
        (out_root / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: results[-1].get(k) for k in COLS}), flush=True)
    for r in results:
        r.update(time_to_target(r))
        steps_s = sorted(b - a for a, b in zip([0.0] + r["curve"]["wall_s"], r["curve"]["wall_s"]))
        r["step_ms_median"] = round(1e3 * steps_s[len(steps_s) // 2])
    plot(results, Path(args.png), f", lr {args.lr}" if args.lr is not None else "")
    print("| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in COLS) + " |")
    line = {"bench": "staleness", **run, "config": args.config, "lr": args.lr,
            "steps": results[0]["steps"] if results else 0, "seed": args.seed, "target": TARGET,
            "rows": [{k: r[k] for k in COLS + ["total_s", "mode", "max_lag", "objective"]} for r in results]}
    print(json.dumps(line))
    append_result("" if args.replot else args.results, line)


if __name__ == "__main__":
    main()
