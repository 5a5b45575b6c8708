"""The paired method the decode benchmarks share: one request stream, every mode, chunks paired.

Every mode of ``inflight.bench.inflight``, ``inflight.bench.inflight_lora`` and
``inflight.bench.grpo`` decodes the same workload on one in-process engine: ``PROMPT``, 16..512
new tokens each (``sampling``), ``concurrency`` requests in flight, refilled as they finish
(``RequestStream``). The modes run interleaved in chunks (``interleaved``), so a drift in
machine speed hits them alike, and since every chunk decodes the same batches at the same step,
a mode's chunk is paired step by step with the ``none`` chunk of its round (``per_round``).
``row`` turns one mode's chunks into a table row.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}
"""Every request's prompt: all rows decode the same stream."""


def sampling(rng: random.Random, n: int) -> Any:
    """The workload's ``n``-th request: 16..512 new tokens, temperature 1, streamed as deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=rng.randint(16, 512), ignore_eos=True, temperature=1.0,
                          output_kind=RequestOutputKind.DELTA, seed=n)


class RequestStream:
    """One chunk of the workload on ``engine`` (vLLM's ``LLMEngine``): requests named after
    ``mode``, drawn from ``random.Random(seed)``, each naming ``lora_request``; the wall time
    at the end of every engine step; and the update events of the chunk, each at the index
    of the step interval that held it."""

    def __init__(self, engine: Any, mode: str, seed: int, concurrency: int, lora_request: Any = None) -> None:
        self.engine, self.mode, self.rng = engine, mode, random.Random(seed)
        self.concurrency, self.lora_request = concurrency, lora_request
        self.active: set[str] = set()
        self.requests = self.tokens = 0
        self.times = [time.perf_counter()]
        self.events: list[tuple[int, dict]] = []  # (interval index, the update's report)

    def refill(self) -> None:
        """Admit requests until ``concurrency`` are in flight."""
        while len(self.active) < self.concurrency:
            rid = f"{self.mode}-{self.requests}"
            self.requests += 1
            self.engine.add_request(rid, PROMPT, sampling(self.rng, self.requests), lora_request=self.lora_request)
            self.active.add(rid)

    def step(self) -> list[Any]:
        """One engine step, timed; the requests it finished."""
        finished = []
        for out in self.engine.step():
            self.tokens += len(out.outputs[0].token_ids)
            if out.finished:
                self.active.discard(out.request_id)
                finished.append(out)
        self.times.append(time.perf_counter())
        return finished

    def event(self, report: dict, interval: int | None = None) -> None:
        """An update landed in step interval ``interval`` (1-based; default: the next one)."""
        self.events.append((len(self.times) if interval is None else interval, report))

    def end(self, every: int, skipped: int) -> dict:
        """Drop the requests in flight; the chunk's figures: its step intervals (``gaps``), those
        without an update (``quiet``) and those holding one (``event_gaps``), the updates'
        reports (``infos``) and the intervals holding them (``event_at``, 1-based), and ``skipped``,
        the due updates not sent."""
        for rid in list(self.active):
            self.engine.abort_request([rid])
        while self.engine.has_unfinished_requests():
            self.engine.step()
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        at = {i for i, _ in self.events}
        return {"mode": self.mode, "every": every, "tokens": self.tokens, "wall_s": self.times[-1] - self.times[0],
                "gaps": gaps, "steps": len(gaps), "skipped": skipped, "infos": [r for _, r in self.events],
                "event_at": [i for i, _ in self.events],
                "quiet": [g for i, g in enumerate(gaps, 1) if i not in at],
                "event_gaps": [gaps[i - 1] for i, _ in self.events if 0 < i <= len(gaps)]}


def row(model: str, engine: str, label: str, chunks: list[dict]) -> dict:
    """One row from one mode's chunks (``RequestStream.end``'s)."""
    infos = [r for c in chunks for r in c["infos"]]
    quiet = [g for c in chunks for g in c["quiet"]]
    base = statistics.median(quiet)
    events = [g for c in chunks for g in c["event_gaps"]]
    stalls = [1e3 * (g - base) for g in events]
    tokens, wall, steps = (sum(c[k] for c in chunks) for k in ("tokens", "wall_s", "steps"))
    timed = {k: round(statistics.median(r[k] for r in infos), 2) if infos and k in infos[0] else None
             for k in ("write_ms", "load_ms", "pause_ms", "commit_ms")}
    return {"model": model, "engine": engine, "mode": label, "every": chunks[0]["every"], "group": chunks[0]["every"],
            "steps": steps, "updates": len(infos), "skipped": sum(c["skipped"] for c in chunks),
            "steps_per_update": round(steps / len(infos), 1) if infos else None, "tokens": tokens,
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1), "step_ms": round(1e3 * base, 2),
            "stall_ms": round(statistics.median(stalls), 2) if stalls else 0.0,
            "bytes_per_update": infos[0]["nbytes"] if infos else 0, **timed, "_quiet": quiet, "_events": events}


def interleaved(bench: Any, modes: dict[str, str], model: str, engine: str, every: int, steps: int,
                rounds: int) -> list[dict]:
    """``modes`` (``bench.run``'s mode -> row label) on one engine, interleaved: none, a, b, a, b, none, ..."""
    chunks: dict[str, list[dict]] = {m: [] for m in modes}
    order = list(modes)
    for k in range(rounds):  # each round starts with the next mode: no mode always runs first
        for mode in order[k % len(order):] + order[:k % len(order)]:
            chunks[mode].append(bench.run(mode, every, steps // rounds))
    return [{**row(model, engine, label, chunks[mode]), **per_round(chunks, mode)} for mode, label in modes.items()]


def per_round(chunks: dict[str, list[dict]], mode: str) -> dict:
    """``mode`` against ``none``, step by step, round by round. Every mode decodes the same
    stream (the same seeds and lengths, refilled as requests finish), so step i of a chunk
    holds the same batch in every mode: decode lost = the sum over steps of (the mode's step
    - none's step i in the same round), plus, for steps a mode ran past the chunk while its
    last update landed, (that step - none's median step). This leaves out the prefill-heavy
    first steps that a plain tokens/s ratio would spread unevenly over chunks of different
    lengths. Returned: the totals (``paired_*``) and each round's ratio and loss."""
    ratios, lost, total_lost, total_none, total_wall, updates = [], [], 0.0, 0.0, 0.0, 0
    for c, n in zip(chunks[mode], chunks["none"]):
        mine, ref = c["gaps"], n["gaps"]
        common = min(len(mine), len(ref))
        over = mine[common:]
        base = statistics.median(ref)
        none_s = sum(ref[:common]) + base * len(over)  # what none takes for the same steps
        lost_s = sum(mine) - none_s
        ratios.append(round(none_s / sum(mine), 3))
        if c["infos"]:
            lost.append(round(1e3 * lost_s / len(c["infos"])))
        total_lost, total_none, total_wall, updates = (total_lost + lost_s, total_none + none_s, total_wall + sum(mine),
                                                       updates + len(c["infos"]))
    return {"paired_vs_none": round(total_none / total_wall, 4) if total_wall else None,
            "paired_lost_ms_per_update": round(1e3 * total_lost / updates, 1) if updates else None,
            "round_vs_none": ratios, "round_lost_ms": lost}
