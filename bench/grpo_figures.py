"""The GRPO bench's arithmetic (``inflight.bench.grpo``), pure and tested apart
(``tests/unit/test_bench_grpo.py``): where its groups start and what they hold, the cadence
in-flight achieves, the figures of every row against the ``none`` it is compared with, the
README's targets, and the report.

Columns (per engine, mode and (P, T)):
- ``tok_s``: generated tokens per second of wall time; ``vs_none``: its ratio to ``none``'s;
- ``lost_ms_per_update``: decode time lost per update, (the mode's wall - the wall ``none``
  needs for the same tokens) / updates (``inflight.bench.inflight_report.compare``); ``paired_*``:
  the step-paired estimate (``inflight.bench.paired.per_round``: step i against ``none``'s
  step i of the same round); it assumes equal batches at equal steps, which a reset's or a
  commit's restarted prefills break, so the token-based figures are the headline;
- ``updates``, ``steps_per_update`` (achieved: the chunks' steps / their updates),
  ``cadence`` (requested, per round);
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
"""

from __future__ import annotations

import argparse
import json
import statistics

from inflight.bench.inflight_report import compare

GROUP = 8
"""Samples per prompt (GRPO's group)."""
TARGET = {"prompt": 1024, "every": 16, "vs_none": 0.95}
GOAL_VS_SALT = 1.1
"""``system`` and ``multi-turn``: in-flight's tokens/s over native-salt's, the rounds' median."""
COLS = ["P", "T", "engine", "mode", "cadence", "updates", "steps_per_update", "tok_s", "vs_none", "vs_none_cache",
        "vs_native_salt_median", "vs_native_salt_spread",
        "lost_ms_per_update", "lost_ms_per_update_cache", "paired_vs_none", "paired_lost_ms_per_update", "hit_rate",
        "prompt_computed_per_update", "extra_prefill_per_update", "readmitted_per_update", "stall_ms", "pause_ms",
        "reset_ms", "commit_ms"]


# -- the workload and its arithmetic (pure; tests/unit/test_bench_grpo.py) --------------------------
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
    ``cache`` engine's ``none`` of the same (P, T, every) (without one, the row's own engine's):
    the tokens it prefills per admitted prompt token, times this row's admitted prompt
    tokens, is what this row would prefill without updates (a cacheless engine's rows then
    show the sharing they forgo)."""
    for r in rows:
        nones = {x["engine"]: x for x in rows if x["mode"] == "none" and x["group"] == r["group"]}
        ref = nones.get("cache", nones.get(r["engine"], r))
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
        ref = next((x for x in rows if (x["engine"], x["mode"], x["group"]) == ("cache", "none", r["group"])), None)
        if r["engine"] != "nocache" or ref is None:
            r["vs_none_cache"] = r["lost_ms_per_update_cache"] = None
            continue
        r["vs_none_cache"] = round(r["tok_s"] / ref["tok_s"], 3)
        lost = r["wall_s"] - r["tokens"] / ref["tok_s"]
        r["lost_ms_per_update_cache"] = round(1e3 * lost / r["updates"], 1) if r["updates"] else None


def against_native(rows: list[dict]) -> None:
    """Per ``cache`` engine row of an update mode: its tokens/s over ``native-salt``'s of the same
    (P, T, every), pooled and round by round (each round ran every mode once, in rotated order):
    the rounds' median and their spread (min, max)."""
    for r in rows:
        ref = next((x for x in rows
                    if (x["engine"], x["mode"], x["group"]) == ("cache", "native-salt", r["group"])), None)
        if r["engine"] != "cache" or r["mode"] in ("none", "native-salt") or ref is None:
            r["vs_native_salt"] = r["vs_native_salt_median"] = r["vs_native_salt_spread"] = None
            continue
        ratios = [a / b for a, b in zip(r["round_tok_s"], ref["round_tok_s"])]
        r["vs_native_salt"] = round(r["tok_s"] / ref["tok_s"], 3)
        r["vs_native_salt_median"] = round(statistics.median(ratios), 3)
        r["vs_native_salt_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]


def workload_checks(rows: list[dict], workload: str) -> list[dict]:
    """The goal on the workloads where caching across commits matters (``system``,
    ``multi-turn``): in-flight's tokens/s at least ``GOAL_VS_SALT`` x native-salt's, by the
    rounds' median, per (P, T, every)."""
    if workload == "fresh":
        return []
    return [{"group": r["group"], "vs_native_salt_median": r["vs_native_salt_median"],
             "spread": r["vs_native_salt_spread"], "hit_rate": r["hit_rate"],
             "native_salt_hit_rate": next(x["hit_rate"] for x in rows if x["group"] == r["group"]
                                          and (x["engine"], x["mode"]) == ("cache", "native-salt")),
             "pass": r["vs_native_salt_median"] >= GOAL_VS_SALT}
            for r in rows
            if (r["engine"], r["mode"]) == ("cache", "inflight") and r["vs_native_salt_median"] is not None]


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


def report(rows: list[dict], args: argparse.Namespace, model: str, load: list[float], wall_s: float,
           record: dict) -> dict:
    """Print the table and the checks; returns the run's JSON line (``record`` first)."""
    compare(rows)
    against_cache(rows)
    prefill_figures(rows)
    against_native(rows)
    targets = checks(rows) if args.workload == "fresh" else []
    goals = workload_checks(rows, args.workload)
    print(f"{model}, workload {args.workload_spec}, groups of {GROUP}, {args.groups_in_flight} groups in flight, "
          f"{args.steps} steps per mode in {args.rounds} rounds, placement {args.placement}; load average (1 min) at "
          f"start / end: {load[0]} / {load[1]}")
    print(" | ".join(COLS))
    for r in rows:
        print(" | ".join(str(r[c]) for c in COLS))
    for c in targets:
        print(f"target P={c['P']} T={c['T']} every {c['every']}: inflight vs none {c['vs_none']} "
              f"(>= {TARGET['vs_none']}: {['FAIL', 'PASS'][c['vs_none_pass']]}); {c['tok_s']} tok/s vs native "
              f"{c['native_tok_s']}: {['FAIL', 'PASS'][c['vs_native_pass']]}")
    if not targets and args.workload == "fresh":
        print(f"(the README's targets are at P={TARGET['prompt']}, every {TARGET['every']}: not in this run)")
    for g in goals:
        print(f"goal {g['group']}: in-flight / native-salt {g['vs_native_salt_median']} (rounds {g['spread']}; >= "
              f"{GOAL_VS_SALT}: {['FAIL', 'PASS'][g['pass']]}); cache hit rate {g['hit_rate']} vs native-salt "
              f"{g['native_salt_hit_rate']}")
    for r in rows:  # in-flight fell behind its rounds' cadence (staging slower than the round before's)
        native = next((x for x in rows if x["group"] == r["group"] and x["mode"] == "native-salt"), None)
        if r["mode"] == "inflight" and native and r["updates"] and native["updates"] and \
                r["steps_per_update"] > 1.2 * native["steps_per_update"]:
            print(f"note: {r['group']}: in-flight got an update per {r['steps_per_update']} steps, the native modes "
                  f"one per {native['steps_per_update']}: its staging was slower than the cadence it was asked for")
    settings = {k: v for k, v in vars(args).items() if k != "workload_spec"}
    line = {"bench": "grpo", **record, "device": "cpu", **settings, "model": model, "group": GROUP,
            "load_1m": load, "wall_s": round(wall_s, 1), "checks": targets, "goals": goals,
            "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    print(json.dumps(line))
    return line
