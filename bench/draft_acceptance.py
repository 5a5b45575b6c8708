"""A draft distilled online keeps its acceptance while the policy moves; a frozen one does not.

    python -m inflight.bench.draft_acceptance [--config demo] [--steps 200] [--layers 1] [--temperature 0.3]
                                              [--samples 512] [--distill-steps 300]

First a draft trained on the first policy (version 0): cut from it (``truncated_draft``: its
embeddings, first ``--layers`` layers, norm and head), then distilled on ``--samples``
completions it samples (transformers, the run's temperature; 3:1 split, the held-out quarter
picks the best of ``--distill-steps`` full-batch steps). Then two training runs of one config
and seed (``inflight.trainer.train``), each engine speculating with that draft (``draft.path``):
``online`` distills it on every batch and pushes it with the policy (``draft.train``);
``frozen`` pushes it unchanged, the draft of version 0 throughout. Then:

1. **Engine acceptance per version** (``spec_by_version`` of each run's last metrics row): the
   rejection sampler's accepted / drafted tokens under each version the engine committed. The
   first and the last ``--window`` versions' medians, per run.
2. **Acceptance against the final policy**, offline: ``--samples`` completions sampled from the
   online run's final policy, split 3:1. A ``reference`` draft starts from the version-0 draft
   and is distilled on the first three quarters as that one was: a draft trained on the
   current target.
   On the held-out quarter, each draft's expected acceptance of its greedy proposal (vLLM's
   draft proposer proposes its most likely token; the target accepts it with its probability
   there): alpha = mean over positions of p_target(argmax draft), for the online run's final
   draft, the frozen draft and the reference.

Checks: ``alpha(online) >= 0.9 * alpha(reference)`` (the issue: within 10% of a draft trained on
the current target), and the frozen run's last versions accept less than its first. The run's
temperature is low (0.3) so that the policy is sharp enough for a draft to be accepted at all
(a tiny random-init policy at temperature 1 gives its most likely token ~1% on average). The two runs'
policies diverge after the first step (their random streams differ), so each run is read against
itself, and the offline alphas against one final policy. Prints a table and one JSON line, also
appended to ``bench/results/draft_acceptance.jsonl`` with the command, its start and the git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM

from inflight.bench.run_record import add_results_option, append_result, run_record
from inflight.protocol import RolloutGroup, RolloutSample
from inflight.trainer.config import TrainConfig
from inflight.trainer.config_files import config_from_dict, config_to_dict, load_config


def run(config: TrainConfig, mode: str, out: Path) -> dict:
    """One training run with the draft ``mode`` (online / frozen): its metrics rows."""
    from inflight.trainer.train import train

    data = config_to_dict(config)
    data["run"] = {**data["run"], "out_dir": str(out / mode), "checkpoint_every": 0, "resume": False}
    data["draft"] = {**data["draft"], "train": mode == "online"}
    t0 = time.perf_counter()
    train(config_from_dict(data))
    rows = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall_s": time.perf_counter() - t0}


def by_version(rows: list[dict], window: int) -> dict:
    """Engine acceptance per version, and the medians of the first and the last ``window``
    versions. A row holds the engines' newest 64 versions (``spec_decode.KEPT_VERSIONS``): each
    version's tally is the last row's that holds it."""
    tally = {int(v): a for row in rows for v, (a, _) in row.get("spec_by_version", {}).items()}
    versions = sorted(tally)
    first, last = [tally[v] for v in versions[:window]], [tally[v] for v in versions[-window:]]
    return {"acceptance": {str(v): tally[v] for v in versions}, "first": statistics.median(first),
            "last": statistics.median(last), "first_spread": [min(first), max(first)],
            "last_spread": [min(last), max(last)], "draft_loss_first": rows[0].get("draft_loss"),
            "draft_loss_last": rows[-1].get("draft_loss")}


def final_samples(config: TrainConfig, policy_dir: Path, n: int, seed: int) -> list[RolloutSample]:
    """``n`` completions of the task's prompts sampled from the policy at ``policy_dir``."""
    from transformers import AutoTokenizer

    from inflight.trainer.envs import build_task
    from inflight.trainer.tasks.task import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    task, rng = build_task(config, tokenizer), random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    torch.manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = encode_prompt(tokenizer, task.sample(rng), config.task.chat)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=config.rollout.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=config.task.completion_tokens,
                                 pad_token_id=tokenizer.eos_token_id or 0)
        tokens = out[0, len(prompt):].tolist()
        samples.append(RolloutSample(sample_id=f"r{i}", group_id="r", prompt_ids=prompt, token_ids=tokens,
                                     logprobs=[0.0] * len(tokens), versions=[0] * len(tokens), reward=0.0))
    return samples


def alpha(target: torch.nn.Module, draft: torch.nn.Module, samples: list[RolloutSample], temperature: float) -> float:
    """Mean over the samples' completion positions of the target's probability (at
    ``temperature``) of the draft's most likely token there."""
    total, count = 0.0, 0
    for s in samples:
        seq = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad():
            p = torch.softmax(target(input_ids=seq).logits[0].double() / temperature, -1)
            guess = draft(input_ids=seq).logits[0].argmax(-1)
        rows = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) + len(s.token_ids) - 1)
        total += float(p[rows, guess[rows]].sum())
        count += len(rows)
    return total / count


def distill(config: TrainConfig, start: Path, samples: list[RolloutSample], steps: int) -> tuple:
    """A ``DraftTrainer`` from the draft at ``start``, distilled on three quarters of ``samples``
    in full-batch steps; its weights the best of ``steps`` by the held-out quarter's loss.
    Returns it, the held-out samples and the losses (first, best)."""
    from inflight.trainer.draft import DraftTrainer

    cut = 3 * len(samples) // 4
    train_part = [RolloutGroup(group_id="r", samples=tuple(samples[:cut]))]
    held = [RolloutGroup(group_id="r", samples=tuple(samples[cut:]))]
    drafter = DraftTrainer(config, start)
    first = best = _held_loss(drafter, held)
    kept = {n: t.clone() for n, t in drafter.model.state_dict().items()}
    for k in range(steps):
        drafter.step(train_part)
        if k % 10 == 9 and (loss := _held_loss(drafter, held)) < best:
            best, kept = loss, {n: t.clone() for n, t in drafter.model.state_dict().items()}
    drafter.model.load_state_dict(kept)
    return drafter, samples[cut:], (first, best)


def _held_loss(drafter, held: list[RolloutGroup]) -> float:
    from inflight.trainer.draft import completion_batch

    return drafter.evaluate(*completion_batch(held))[0]


def first_draft(config: TrainConfig, out: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """The version-0 draft: cut from the first policy, distilled on its samples; saved to
    ``<out>/draft_v0`` with the policy it was trained on (``<out>/policy_v0``)."""
    from inflight.trainer.draft import truncated_draft
    from inflight.trainer.tiny_model import build_tiny_model, default_corpus

    policy = build_tiny_model(out / "policy_v0", default_corpus(), config.model.tiny)
    truncated_draft(policy, args.layers).save_pretrained(str(out / "cut"))
    samples = final_samples(config, policy, args.samples, seed=config.run.seed + 2)
    drafter, held, (first, best) = distill(config, out / "cut", samples, args.distill_steps)
    drafter.model.save_pretrained(str(out / "draft_v0"))
    target = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    return out / "draft_v0", {"held_loss_cut": first, "held_loss_distilled": best,
                              "alpha_v0": alpha(target, drafter.model.eval(), held, config.rollout.temperature)}


def offline(config: TrainConfig, out: Path, start: Path, args: argparse.Namespace) -> dict:
    """Each draft's alpha against the online run's final policy, on held-out samples of it;
    the reference draft distilled on the rest, from the version-0 draft."""
    policy_dir = out / "online" / "checkpoint"
    samples = final_samples(config, policy_dir, args.samples, seed=config.run.seed + 1)
    reference, held, (first, best) = distill(config, start, samples, args.distill_steps)
    load = lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()  # noqa: E731
    target, t = load(policy_dir), config.rollout.temperature
    drafts = {"online": load(policy_dir / "draft"), "frozen": load(start), "reference": reference.model.eval()}
    alphas = {name: alpha(target, d, held, t) for name, d in drafts.items()}
    return {"alpha": alphas, "alpha_online_vs_reference": alphas["online"] / alphas["reference"],
            "alpha_frozen_vs_reference": alphas["frozen"] / alphas["reference"],
            "reference_held_loss_first": first, "reference_held_loss_best": best,
            "held_out_positions": sum(len(s.token_ids) for s in held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="demo", help="the training config (a packaged name or a TOML file)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    ap.add_argument("--layers", type=int, default=1, help="draft.layers: the draft's decoder layers")
    ap.add_argument("--temperature", type=float, default=0.3, help="rollout.temperature of both runs")
    ap.add_argument("--draft-lr", type=float, default=3e-3, help="draft.learning_rate")
    ap.add_argument("--window", type=int, default=10, help="versions in the first and last medians")
    ap.add_argument("--samples", type=int, default=512, help="completions each offline distillation samples")
    ap.add_argument("--distill-steps", type=int, default=300, help="full-batch steps of each offline distillation")
    add_results_option(ap, "draft_acceptance")
    args = ap.parse_args()
    record = {**run_record("draft_acceptance"), "load_start": os.getloadavg()[:2]}
    out = Path(tempfile.mkdtemp(prefix="draft_acceptance-"))
    config = load_config(args.config, [f"run.steps={args.steps}", f"draft.layers={args.layers}",
                                       f"draft.learning_rate={args.draft_lr}",
                                       f"rollout.temperature={args.temperature}"])
    start, v0 = first_draft(config, out, args)
    config = load_config(args.config, [f"run.steps={args.steps}", f"draft.path={start}",
                                       f"model.path={out / 'policy_v0'}",
                                       f"draft.learning_rate={args.draft_lr}",
                                       f"rollout.temperature={args.temperature}"])
    runs = {mode: run(config, mode, out) for mode in ("online", "frozen")}
    line = {"bench": "draft_acceptance", **record, "steps": args.steps, "layers": args.layers,
            "temperature": args.temperature, "draft_lr": args.draft_lr,
            "runs": {m: {**by_version(r["rows"], args.window), "wall_s": round(r["wall_s"], 1),
                         "reward_last": r["rows"][-1]["reward_mean"]} for m, r in runs.items()},
            "v0": v0, **offline(config, out, start, args), "load_end": os.getloadavg()[:2]}
    frozen, online = line["runs"]["frozen"], line["runs"]["online"]
    line["checks"] = {"online_within_10pct_of_reference": line["alpha_online_vs_reference"] >= 0.9,
                      "frozen_falls_behind": (line["alpha_frozen_vs_reference"] < 0.9
                                              and frozen["last"] < online["last"]),
                      "frozen_decays_absolute": frozen["last"] < frozen["first"]}
    _print(line)
    append_result(args.results, line)


def _print(line: dict) -> None:
    print(f"{'run':8} {'accept first':>14} {'accept last':>13} {'draft loss first':>17} {'last':>7}")
    for m, r in line["runs"].items():
        loss = [f"{x:.3f}" if x is not None else "-" for x in (r["draft_loss_first"], r["draft_loss_last"])]
        print(f"{m:8} {r['first']:14.3f} {r['last']:13.3f} {loss[0]:>17} {loss[1]:>7}")
    print("alpha against the final policy (held out): " + ", ".join(f"{k} {v:.3f}" for k, v in line["alpha"].items())
          + f"; online / reference {line['alpha_online_vs_reference']:.3f}")
    print("checks:", line["checks"])
    print(json.dumps(line))


if __name__ == "__main__":
    main()
