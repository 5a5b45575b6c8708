"""What N trainer ranks hold and what their push costs: bytes of parameters, gradients and
AdamW state per rank, and the time and bytes of each step's gather into rank 0's push copy.

    python -m inflight.bench.trainer_ranks [--model smollm2|DIR] [--nproc 2] [--steps 3]
    (also: python -m inflight.bench.trainer_push --nproc 2 ...)

One run of ``--nproc 1`` and one of ``--nproc N``, each in fresh processes: every rank loads
the policy as ``inflight train`` does (``Policy``, fp32 master weights; with N > 1 sharded by
``TrainerRanks``), takes ``--steps`` optimizer steps on the same synthetic groups, and counts,
after the last backward and its optimizer step, the bytes of the tensors it holds: its
parameters' local shards, their gradients, the optimizer's state (``exp_avg``,
``exp_avg_sq``, ``step``). Rank 0 also times ``GatheredWeights.gather`` (every tensor
gathered once over gloo into its host copy: the trainer's side of a push) and reports the
copy's bytes. The resident set of each rank is reported beside the counts, now and at its
peak (a following rank builds the model on the meta device and never holds all of it). One JSON line is
appended to ``bench/results/trainer_ranks.jsonl`` (command, start, git revision, load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results" / "trainer_ranks.jsonl"


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _held(policy) -> dict[str, int]:
    """The bytes of this rank's parameters, gradients and optimizer state."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    state = [v for s in policy.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {"param_bytes": sum(_local_bytes(p) for p in params),
            "grad_bytes": sum(_local_bytes(p) for p in params),  # one per parameter at the step (fp32, same shard)
            "optimizer_bytes": sum(_local_bytes(v) for v in state)}


def _rank(rank: int, world: int, port: int, model_dir: str, steps: int, out) -> None:
    """One rank: load, ``steps`` optimizer steps, report (rank 0 orders, the others follow)."""

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.policy import Policy
    from inflight.trainer.ranks import TrainerRanks
    from inflight.trainer.train import follow_rank_0

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    cfg = config_from_dict({"model": {"path": model_dir}, "rollout": {"group_size": 4, "groups_per_step": 4},
                            "loss": {"max_lag": 2}})
    ranks = TrainerRanks.from_env()
    if ranks is not None and rank:
        follow_rank_0(cfg, ranks)
        out.send({"rank": rank, "rss_bytes": _rss(), "peak_rss_bytes": _peak_rss()})
        ranks.stop()
        return
    policy = Policy(cfg, Path(model_dir), None, ranks=ranks)
    for step in range(steps):
        policy.step(_groups(step, policy.tokenizer.vocab_size), version=0, step=step)
    report = {"rank": 0, **_held(policy), "rss_bytes": _rss(), "peak_rss_bytes": _peak_rss()}
    if policy.gathered is not None:
        report["push_copy_bytes"] = sum(t.numel() * t.element_size() for t in policy.gathered.copy.values())
        report["gather_s"] = policy.gathered.seconds
    out.send(report)
    if ranks is not None:
        ranks.stop("done")


def _peak_rss() -> int:
    """This process's largest resident set so far (a rank that loads the whole model shows it)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _groups(step: int, vocab: int) -> list:
    """4 groups of 4 samples: 32 prompt tokens, 64 sampled at version 0, rewards 0 or 1."""
    import torch

    from inflight.protocol import RolloutGroup, RolloutSample

    g = torch.Generator().manual_seed(step)
    return [RolloutGroup(group_id=f"{step}-{i}", samples=tuple(RolloutSample(
        sample_id=f"{step}-{i}-{j}", group_id=f"{step}-{i}",
        prompt_ids=torch.randint(vocab, (32,), generator=g).tolist(),
        token_ids=torch.randint(vocab, (64,), generator=g).tolist(), logprobs=[-2.0] * 64, versions=[0] * 64,
        reward=float(j % 2)) for j in range(4))) for i in range(4)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model_dir: Path, world: int, steps: int) -> dict:
    """One run on ``world`` ranks (fresh processes): rank 0's report, the others' resident sets
    under ``followers``."""
    from inflight.transport.store import release_port, reserve_port

    ctx = mp.get_context("spawn")
    port = reserve_port()
    release_port("127.0.0.1", port)
    receive, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(model_dir), steps, send)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = {}
        while len(reports) < world:
            if not receive.poll(1800):
                raise RuntimeError(f"reports from {sorted(reports)} of {world} ranks in 30 min")
            report = receive.recv()
            reports[report.pop("rank")] = report
        return {**reports[0], "followers": [reports[r] for r in range(1, world)]}
    finally:
        for p in procs:
            p.join(120)
            if p.exitcode is None:
                p.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, or a model directory")
    ap.add_argument("--nproc", type=int, default=2, help="trainer ranks, measured against one")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from inflight.bench.run_record import run_record
    from inflight.trainer.models import resolve_model

    record, load = run_record("trainer_ranks", argv), os.getloadavg()[0]
    model = resolve_model(args.model)
    one, many = measure(model, 1, args.steps), measure(model, args.nproc, args.steps)
    held = ("param_bytes", "grad_bytes", "optimizer_bytes")
    ratio = sum(many[k] for k in held) / sum(one[k] for k in held)
    row = {**record, "model": args.model, "nproc": args.nproc, "load": [round(load, 2), round(os.getloadavg()[0], 2)],
           "one": one, "many": many, "held_ratio": round(ratio, 4),
           "gather_s_median": statistics.median(many["gather_s"]), "gather_s_spread": [min(many["gather_s"]),
                                                                                       max(many["gather_s"])]}
    MiB = float(1 << 20)
    print("| ranks | parameters MiB | gradients MiB | AdamW MiB | resident MiB |\n| --- | --- | --- | --- | --- |")
    for n, r in ((1, one), (args.nproc, many)):
        print(f"| {n} | {r['param_bytes'] / MiB:.0f} | {r['grad_bytes'] / MiB:.0f} | {r['optimizer_bytes'] / MiB:.0f} "
              f"| {r['rss_bytes'] / MiB:.0f} |")
    print(f"peak resident MiB: one rank {one['peak_rss_bytes'] / MiB:.0f}; of {args.nproc}, rank 0 "
          f"{many['peak_rss_bytes'] / MiB:.0f}, the others " + " ".join(f"{f['peak_rss_bytes'] / MiB:.0f}"
                                                                     for f in many["followers"]))
    print(f"held per rank at {args.nproc} ranks: {ratio:.3f}x of one; gather into rank 0's push copy "
          f"({many['push_copy_bytes'] / MiB:.0f} MiB): median {row['gather_s_median']:.2f} s per step")
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
