"""Decoding while a slow verifier scores: rewards in the engine's scoring processes vs inline.

    python -m bench.scoring [--model smollm2|DIR | --size S] [--sleep-s 2] [--workers 2]
                            [--groups-in-flight 4] [--completion-tokens 64] [--steps 300] [--rounds 3]

One in-process engine samples GRPO groups (``n = 8``, a fresh prompt each, exactly
``--completion-tokens`` tokens, temperature 1) with ``--groups-in-flight`` groups decoding,
refilled as they finish, as the training loop's engine process does. Each finished group is
scored by a verifier that sleeps ``--sleep-s`` seconds per group (``SlowVerifier``: the
``repeat_digit`` reward after the sleep). Modes, interleaved in ``--rounds`` chunks of equal
engine steps, the order rotated each round:

1. ``instant``: the same verifier without the sleep, in the scoring processes
   (``trainer.rollout_scoring.GroupScorer``, ``--workers`` of them), the ceiling;
2. ``pool``: the sleeping verifier in the scoring processes: the loop submits a finished
   group and steps on; a new group starts while fewer than ``--groups-in-flight`` decode and
   fewer than that many wait for their rewards (the training loop's admission);
3. ``inline``: the sleeping verifier called between two engine steps, as the engine process
   scored before ``trainer.rollout_scoring``: every sequence waits for it.

Reports generated tokens per second of wall time per mode and its ratio to ``instant``'s, and
the groups scored. The verifier's throughput must cover the engine's group rate
(``--workers`` x 1 / ``--sleep-s`` groups per second), or admission waits for it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trainer.tasks import Completion, encode_prompt  # noqa: E402
from trainer.tasks.digits import RepeatDigit  # noqa: E402

GROUP = 8


class SlowVerifier(RepeatDigit):
    """``repeat_digit``, its ``score`` taking ``sleep_s`` seconds a group (a sandbox, a judge)."""

    def __init__(self, tokenizer: Any, completion_tokens: int, sleep_s: float) -> None:
        super().__init__(tokenizer, completion_tokens)
        self.sleep_s = sleep_s

    def score(self, prompts, completions):  # noqa: ANN001, ANN201  (Task's signature)
        time.sleep(self.sleep_s)
        return super().score(prompts, completions)


def make(tokenizer: Any, completion_tokens: int, sleep_s: float) -> SlowVerifier:
    """``task.name = "bench.scoring:make"``."""
    return SlowVerifier(tokenizer, completion_tokens, sleep_s)


class Loop:
    """One mode's sampling loop on the shared engine (``scorer``: None scores inline with ``task``)."""

    def __init__(self, llm: Any, mode: str, params: Any, groups: int, scorer: Any, task: Any) -> None:
        self.llm, self.mode, self.params, self.groups, self.scorer, self.task = llm, mode, params, groups, scorer, task
        self.rng, self.prompts, self.counter, self.scored = random.Random(0), {}, 0, 0

    def run(self, steps: int) -> dict:
        engine, tokens, t0 = self.llm.llm_engine, 0, time.perf_counter()
        for _ in range(steps):
            while len(self.prompts) < self.groups and (self.scorer is None or len(self.scorer) < self.groups):
                self._start()
            for out in engine.step():
                if out.finished:
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                    prompt = self.prompts.pop(out.request_id)
                    if self.scorer is None:
                        self.task.score([prompt] * GROUP, [Completion(c.text, c.token_ids, c.finish_reason or "")
                                                           for c in out.outputs])
                        self.scored += 1
                    else:
                        self.scorer.submit(out, prompt)
            if self.scorer is not None:
                self.scored += len(self.scorer.collect())
        return {"tokens": tokens, "wall_s": time.perf_counter() - t0}

    def _start(self) -> None:
        prompt = self.task.sample(self.rng)
        rid = f"{self.mode}-{self.counter}"
        self.counter += 1
        self.prompts[rid] = prompt
        ids = encode_prompt(self.llm.get_tokenizer(), prompt, "auto")
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, self.params)

    def drain(self) -> None:
        """Finish what this mode has in flight (untimed), so the next mode starts on an empty engine."""
        for rid in list(self.prompts):
            self.llm.llm_engine.abort_request([rid])
        self.prompts.clear()
        while self.llm.llm_engine.has_unfinished_requests():
            self.llm.llm_engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a model directory, hub id or 'smollm2' (trainer/models.py)")
    ap.add_argument("--sleep-s", type=float, default=2.0, help="the verifier's time per group")
    ap.add_argument("--workers", type=int, default=2, help="task.scoring.workers")
    ap.add_argument("--groups-in-flight", type=int, default=4)
    ap.add_argument("--completion-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300, help="engine steps per mode")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from engine_patches.config import engine_kwargs
    from trainer.config_files import config_from_dict
    from trainer.models import resolve_model
    from trainer.engine_process import sampling_of
    from trainer.rollout_scoring import GroupScorer

    model_dir = str(resolve_model(args.model))
    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
              max_num_seqs=GROUP * args.groups_in_flight, **engine_kwargs())
    # no updates here: the outputs carry version 0, as an in-flight engine's do before its first commit
    llm.llm_engine.engine_core.engine_core._weight_version = "0"
    load = [round(os.getloadavg()[0], 2)]
    params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=args.completion_tokens, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    def scorer(sleep_s: float) -> GroupScorer:
        cfg = config_from_dict({"task": {"name": "bench.scoring:make", "completion_tokens": args.completion_tokens,
                                         "options": {"completion_tokens": args.completion_tokens, "sleep_s": sleep_s},
                                         "scoring": {"workers": args.workers, "timeout_s": 10 * args.sleep_s + 30}}})
        s = GroupScorer(cfg, model_dir, "e0", sampling_of(params))
        s.wait_ready()
        return s
    task = make(llm.get_tokenizer(), args.completion_tokens, args.sleep_s)
    scorers = {"instant": scorer(0.0), "pool": scorer(args.sleep_s)}
    loops = {m: Loop(llm, m, params, args.groups_in_flight, scorers.get(m), task)
             for m in ("instant", "pool", "inline")}
    totals = {m: {"tokens": 0, "wall_s": 0.0} for m in loops}
    order = list(loops)
    for m in order:  # untimed: the engine's first steps and each pool's first calls
        loops[m].run(8)
        loops[m].drain()
    for r in range(args.rounds):
        for m in order[r % 3:] + order[:r % 3]:
            got = loops[m].run(args.steps // args.rounds)
            loops[m].drain()
            totals[m] = {k: totals[m][k] + got[k] for k in got}
    for s in scorers.values():
        s.close()
    load.append(round(os.getloadavg()[0], 2))
    ceiling = totals["instant"]["tokens"] / totals["instant"]["wall_s"]
    rows = [{"mode": m, "tok_s": round(t["tokens"] / t["wall_s"], 1),
             "vs_instant": round(t["tokens"] / t["wall_s"] / ceiling, 3), "groups_scored": loops[m].scored}
            for m, t in totals.items()]
    print(f"{Path(model_dir).name}: verifier {args.sleep_s} s per group, {args.workers} scoring workers, "
          f"{args.groups_in_flight} groups of {GROUP} x {args.completion_tokens} tokens; load {load[0]} -> {load[1]}")
    for row in rows:
        print(f"  {row['mode']:8} {row['tok_s']:8} tok/s  {row['vs_instant']:.3f} of instant  "
              f"{row['groups_scored']} groups scored")
    print(json.dumps({"bench": "scoring", **vars(args), "load_1m": load, "rows": rows}))


if __name__ == "__main__":
    main()
