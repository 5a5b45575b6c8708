"""What a hung tool costs the other episodes: environment turns in the scoring processes.

    python -m inflight.bench.hung_tool [--streams 4] [--tool-s 0.05] [--turns 40] [--rounds 6]
                                       [--workers 1] [--max-workers 4] [--out bench/results/hung_tool.jsonl]

``--streams`` episodes each run ``--turns`` environment turns one after the other (a turn is
submitted when the last came back, as an episode's next turn waits for its reply), every
turn a tool call of ``--tool-s`` seconds (a sleep: an I/O-bound tool), in one
``ScoringPool`` of ``--workers`` processes that may grow to ``--max-workers``
(``task.scoring``). Two modes, interleaved over ``--rounds``, the order alternating:

- ``clean``: every stream's turns return;
- ``hung``: stream 0's first turn hangs (past any timeout), the others run as in ``clean``;
  at the round's end the hung turn is cancelled, as dropping its group does.

The figure: the healthy streams' (1..N-1) turns per second in ``hung`` over ``clean``, per
round, their median and spread. Two rounds come first, apart (``cold``): a hung one on the
pool as it starts (the first hang of a run: the others wait ``GROW_AFTER_S`` for a second
process, then its start), which grows the pool, then a clean one. The load average is
recorded with the run.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from inflight.bench.run_record import run_record
from inflight.trainer.rollout.scoring_pool import ScoringPool
from inflight.trainer.tasks.task import Completion, Prompt, Task


class ToolTask(Task):
    """A turn that sleeps ``meta["tool_s"]``, or forever with ``meta["hang"]``."""

    def sample(self, rng):
        return Prompt("q")

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        meta = prompts[0].meta
        time.sleep(3600.0 if meta.get("hang") else meta["tool_s"])
        return [1.0] * len(completions)


def _call(tool_s: float, hang: bool = False) -> tuple[list[Prompt], list[Completion]]:
    return [Prompt("q", meta={"tool_s": tool_s, "hang": hang})], [Completion("a", [0])]


def run_round(pool: ScoringPool, streams: int, turns: int, tool_s: float, hung: bool, tag: str) -> float:
    """One round; the healthy streams' turns per second (stream 0 is the hung one in ``hung``)."""
    left = {s: turns for s in range(streams)}
    if hung:
        pool.submit(f"{tag}.hang", *_call(tool_s, hang=True))
        del left[0]
    t0 = time.perf_counter()
    finished: dict[int, float] = {}
    for s in left:
        pool.submit(f"{tag}.{s}.{left[s]}", *_call(tool_s))
    while len(finished) < len(left):
        for scored in pool.poll():
            if scored.key.endswith(".hang"):
                continue
            assert scored.rewards is not None, scored.error
            _, s, _ = scored.key.rsplit(".", 2)
            s = int(s)
            left[s] -= 1
            if left[s]:
                pool.submit(f"{tag}.{s}.{left[s]}", *_call(tool_s))
            else:
                finished[s] = time.perf_counter() - t0
        time.sleep(0.001)
    if hung:
        pool.cancel([f"{tag}.hang"], "the round ended")
        while not any(s.key == f"{tag}.hang" for s in pool.poll()):
            time.sleep(0.01)
    healthy = [s for s in finished if s != 0]
    return len(healthy) * turns / max(finished[s] for s in healthy)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tool-s", type=float, default=0.05)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-workers", type=int, default=4)
    ap.add_argument("--out", default="bench/results/hung_tool.jsonl")
    return ap.parse_args()


def main() -> None:
    args = parse()
    record = run_record("hung_tool")
    tool_task = importlib.import_module("inflight.bench.hung_tool").ToolTask  # by module name, not __main__: picklable
    pool = ScoringPool(functools.partial(tool_task), workers=args.workers, max_workers=args.max_workers,
                       timeout_s=7200.0, memory_mb=None)
    pool.wait_ready()
    cold = {"hung": run_round(pool, args.streams, args.turns, args.tool_s, hung=True, tag="cold"),  # grows the pool
            "clean": run_round(pool, args.streams, args.turns, args.tool_s, hung=False, tag="warm")}
    print(json.dumps({"cold": cold}), flush=True)
    rounds = []
    for r in range(args.rounds):
        got = {}
        for mode in (("clean", "hung") if r % 2 == 0 else ("hung", "clean")):
            got[mode] = run_round(pool, args.streams, args.turns, args.tool_s, hung=mode == "hung", tag=f"r{r}{mode}")
        rounds.append({"round": r, **{m: round(v, 2) for m, v in got.items()},
                       "ratio": round(got["hung"] / got["clean"], 4)})
        print(json.dumps(rounds[-1]), flush=True)
    counts = dict(pool.counts)
    pool.close()
    ratios = [x["ratio"] for x in rounds]
    result = {**record, "streams": args.streams, "tool_s": args.tool_s, "turns": args.turns, "workers": args.workers,
              "max_workers": args.max_workers, "load_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
              "cold": {m: round(v, 2) for m, v in cold.items()}, "rounds": rounds,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios), "ideal_turns_per_s": round((args.streams - 1) / args.tool_s, 2),
              "pool_counts": counts}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
