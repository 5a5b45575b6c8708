"""The trainer's optimizer step on a real workload's batches: padded, packed, and packed with
shared prefixes, side by side.

    python -m inflight.bench.trainer_step [--config smollm2_leg_counting_cpu] [--rounds 3] [--steps 2]
                                          [--modes padded packed prefix_shared] [--set KEY=VALUE ...]

Each step's batch is what ``inflight train --config CONFIG`` trains on: ``rollout.groups_per_step``
groups of ``rollout.group_size`` samples, every group one prompt of the config's task as the engine
sees it (chat template, worked examples), each sample ``task.completion_tokens`` completion
tokens (the longest a sample can be), random behaviour log-probs, versions and rewards (seeded:
every mode trains the same batches). A mode is a fresh process that loads the policy as
``inflight train`` does (``Policy``, one thread, fp32) and takes one untimed step then ``--steps``
timed ones. The modes run interleaved, ``--rounds`` times (padded, packed, shared, padded, ...):

- **padded**: the trainer before packing: rows padded, no activation checkpointing, the batch
  in 4 micro-batches of rows (the padded step in one pass is killed by the OOM killer on a
  24 GiB machine);
- **packed**: samples concatenated unpadded, checkpointed, the default token budget;
- **prefix_shared**: packed with each group's prompt computed once (the default).

Reported per mode: the median step time, tokens/s, and peak resident memory (VmHWM of the
mode's process over its steps) with their spread across rounds; forward, backward and optimizer
milliseconds; tokens run forward as laid out, prompt and completion counted apart; and the
ratios of each mode to ``padded``. One JSON line is appended to ``bench/results/trainer_step.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
from typing import Any

from inflight.bench.run_record import add_results_option, append_result, run_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("padded", "packed", "prefix_shared")
PADDED_PASSES = 4
"""``padded``'s micro-batches: the fewest of the shipped SmolLM2 configs, a step that fits."""


def mode_settings(mode: str, cfg: Any) -> dict[str, dict[str, Any]]:
    """The ``optim`` settings of ``mode`` on ``cfg``'s batches."""
    if mode != "padded":
        return {"optim": {"packing": mode, "activation_checkpointing": True}}
    width = cfg.engine.max_model_len  # rows x the longest row bounds a padded micro-batch
    rows = -(-cfg.rollout.group_size * cfg.rollout.groups_per_step // PADDED_PASSES)
    return {"optim": {"packing": "padded", "activation_checkpointing": False, "micro_batch_tokens": rows * width}}


def batches(cfg: Any, steps: int, seed: int) -> list[list[Any]]:
    """``steps`` batches of the config's workload (see the module docstring)."""
    from transformers import AutoTokenizer

    from inflight.protocol import RolloutGroup, RolloutSample
    from inflight.trainer.envs import build_task
    from inflight.trainer.models import resolve_model
    from inflight.trainer.tasks.task import encode_prompt
    from inflight.trainer.tasks.tool_calls import use_chat_template

    tokenizer = use_chat_template(AutoTokenizer.from_pretrained(str(resolve_model(cfg.model.path))),
                                  cfg.task.chat_template)
    task, rng = build_task(cfg, tokenizer), random.Random(seed)
    t, out = cfg.task.completion_tokens, []
    for step in range(steps):
        groups = []
        for g in range(cfg.rollout.groups_per_step):
            prompt = encode_prompt(tokenizer, task.sample(rng), cfg.task.chat)
            samples = tuple(RolloutSample(
                sample_id=f"s{step}-{g}-{i}", group_id=f"s{step}-{g}", prompt_ids=prompt,
                token_ids=[rng.randrange(100, tokenizer.vocab_size) for _ in range(t)],
                logprobs=[-rng.random() * 3 for _ in range(t)], versions=[step] * t, reward=float(rng.random() < 0.5))
                for i in range(cfg.rollout.group_size))
            groups.append(RolloutGroup(group_id=f"s{step}-{g}", samples=samples))
        out.append(groups)
    return out


def _mode(config: str, overrides: list[str], mode: str, steps: int, seed: int, out) -> None:
    """One mode's process: its policy, one untimed step, ``steps`` timed ones; what each took."""
    import time
    from pathlib import Path

    from inflight.trainer.config_files import config_from_dict, config_to_dict, load_config
    from inflight.trainer.host_memory import peak_bytes
    from inflight.trainer.models import resolve_model
    from inflight.trainer.policy import Policy

    base = load_config(config, overrides)
    data = config_to_dict(base)
    for section, values in mode_settings(mode, base).items():
        data[section] = {**data[section], **values}
    cfg = config_from_dict(data)
    work = batches(cfg, steps + 1, seed)
    policy = Policy(cfg, Path(resolve_model(cfg.model.path)), None)
    rows = []
    for step, groups in enumerate(work):
        t0 = time.perf_counter()
        result = policy.step(groups, version=step + 1, step=step)
        m = result.metrics
        rows.append({"step_s": time.perf_counter() - t0, **{k: m[k] for k in (
            "forward_ms", "backward_ms", "optimizer_ms", "trainer_tokens", "trainer_prompt_tokens",
            "trainer_completion_tokens", "micro_batches", "peak_rss_gb")}, "loss": result.loss,
            "prompt_tokens_in_batch": sum(len(s.prompt_ids) for g in groups for s in g.samples)})
    out.put({"mode": mode, "packing": policy.packing, "steps": rows[1:], "warmup": rows[0],
             "process_peak_gb": peak_bytes() / 1e9})


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Per mode: medians with their spread over every timed step of every round, and the
    ratios against ``padded``."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        steps = [s for r in runs if r["mode"] == mode for s in r["steps"]]
        out[mode] = {
            "step_s": _spread([s["step_s"] for s in steps]),
            "tokens_per_s": _spread([s["trainer_tokens"] / s["step_s"] for s in steps]),
            "samples_tokens_per_s": _spread([(s["prompt_tokens_in_batch"] + s["trainer_completion_tokens"])
                                            / s["step_s"] for s in steps]),
            "peak_rss_gb": _spread([r["process_peak_gb"] for r in runs if r["mode"] == mode]),
            **{k: statistics.median(s[k] for s in steps) for k in (
                "forward_ms", "backward_ms", "optimizer_ms", "trainer_tokens", "trainer_prompt_tokens",
                "trainer_completion_tokens", "micro_batches", "prompt_tokens_in_batch")},
            "prompt_passes": statistics.median(s["trainer_prompt_tokens"] / s["prompt_tokens_in_batch"]
                                               for s in steps),
        }
    if "padded" in out:
        base = out["padded"]
        for row in out.values():
            row["vs_padded"] = {"step_time": row["step_s"]["median"] / base["step_s"]["median"],
                                "peak_rss": row["peak_rss_gb"]["median"] / base["peak_rss_gb"]["median"],
                                "prompt_tokens": row["trainer_prompt_tokens"] / base["trainer_prompt_tokens"]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2_leg_counting_cpu")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode and round (after one untimed)")
    ap.add_argument("--seed", type=int, default=0)
    add_results_option(ap, "trainer_step")
    args = ap.parse_args(argv)
    record, load = run_record("trainer_step", argv), os.getloadavg()
    ctx, runs = mp.get_context("spawn"), []
    for r in range(args.rounds):
        for mode in args.modes:
            queue = ctx.Queue()
            proc = ctx.Process(target=_mode, args=(args.config, args.overrides, mode, args.steps, args.seed + r, queue))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                runs.append({"mode": mode, "round": r, "exitcode": proc.exitcode, "steps": []})
                print(f"round {r} {mode}: exit code {proc.exitcode}", flush=True)
                continue
            runs.append({**queue.get(), "round": r})
            last = runs[-1]["steps"][-1]
            print(f"round {r} {mode}: {last['step_s']:.1f} s/step, {last['trainer_tokens']} tokens, "
                  f"peak {runs[-1]['process_peak_gb']:.2f} GB", flush=True)
    summary = summarize([r for r in runs if r["steps"]])
    line = {**record, "config": args.config, "overrides": args.overrides, "rounds": args.rounds, "steps": args.steps,
            "load": [round(x, 2) for x in load] + [round(os.getloadavg()[0], 2)], "summary": summary, "runs": runs}
    append_result(args.results, line)
    print(json.dumps({"summary": summary}, indent=1))


if __name__ == "__main__":
    main()
