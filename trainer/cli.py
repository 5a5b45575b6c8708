"""The ``inflight`` command: training, a remote engine, the benchmarks and model preparation.

    inflight train --config demo [--set run.steps=5 ...]      # a packaged config by name, or a TOML file
    inflight engine --config CONFIG --model-dir DIR --host TRAINER --port PORT [--engine-id I]
    inflight bench NAME [ARGS ...]                           # python -m bench.NAME ARGS ...
    inflight prepare-model [smollm2 | DIR | ORG/NAME]        # prints the model directory

Each command imports what it runs only when it runs: torch and vLLM take seconds to import,
and ``inflight --help`` should not wait for them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

BENCHES = {
    "inflight": "in-flight vs native pause+update vs batch-boundary, like for like",
    "inflight_lora": "adapter-only in-flight vs vLLM's own adapter reload vs whole-model updates",
    "grpo": "GRPO groups on shared prompts: in-flight with prefix caching vs vLLM's salted and reset caches",
    "spec": "n-gram speculation on a copy-heavy workload, with and without it: in-flight vs native pause",
    "draft_acceptance": "a draft distilled online vs one frozen at version 0, against a draft of the final policy",
    "transport": "bucketed transfer vs a raw broadcast",
    "slow_link": "a shaped link between network namespaces (tbf): its achieved bytes/s",
    "sparse": "sparse updates on real RL steps: bytes against dense, the encodings compared, CPU cost",
    "e2e": "the training loop end to end: in-flight vs native pause+update vs batch-boundary, interleaved rounds",
    "scoring": "decoding while a slow verifier scores: in the scoring processes vs inline",
    "hung_tool": "what a hung tool costs the other episodes' environment turns",
    "profile_staging": "one update's staging time, phase by phase and thread by thread",
    "staging_memory": "what an engine's staging costs in resident memory vs what it accounts",
    "trainer_push": "what a push costs the trainer: resident memory, optimizer step time (--nproc N: on N ranks)",
    "trainer_step": "the trainer's optimizer step on a config's batches: padded, packed, prefix-shared side by side",
    "trainer_ranks": "N trainer ranks against one: bytes held per rank, the gather into rank 0's push copy",
    "trainer_ranks_e2e": "inflight train on N ranks against one, alternated: reward per step, versions per sample",
    "kernels": "the Triton kernels vs their references",
    "staleness": "the staleness study",
    "scale": "GPU fleets at scale, on paper: in-flight vs pause vs batch-boundary",
    "suite_record": "record one make test run (its summary, wall time, revision) for the README's suite row",
    "train_record": "record one inflight train run (its summary, pushes per engine, wall time) for the README",
}
"""The ``bench`` modules that are programs (the others are their parts)."""


def _train(argv: list[str]) -> None:
    from inflight.trainer.supervisor import supervise, supervising

    if supervising(argv):  # the trainer in a child process, watched from here without torch
        sys.exit(supervise(argv, prog="inflight train"))
    from inflight.trainer.train import main

    main(argv, prog="inflight train")


def _engine(argv: list[str]) -> None:
    from inflight.trainer.rollout.engine_process import main

    main(argv, prog="inflight engine")


def _bench(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="inflight bench", description="Run a benchmark: python -m bench.NAME ARGS",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="benchmarks:\n" + "\n".join(f"  {n:<16} {d}" for n, d in BENCHES.items()))
    ap.add_argument("name", choices=list(BENCHES), metavar="NAME", help="one of the benchmarks below")
    ap.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                    help="its own arguments (inflight bench NAME --help)")
    args = ap.parse_args(argv)
    sys.stdout.flush()
    # its own interpreter, exactly as `python -m inflight.bench.NAME`: its argv, its __main__ (which the
    # spawned processes of some benchmarks re-import), its exit status
    os.execv(sys.executable, [sys.executable, "-m", f"inflight.bench.{args.name}", *args.args])


def _prepare_model(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="inflight prepare-model",
                                 description="Make a policy model ready as a local directory and print its path.")
    ap.add_argument("model", nargs="?", default="smollm2",
                    help="smollm2 (SmolLM2-135M-Instruct from the smollm2 extra, converted once into $INFLIGHT_CACHE, "
                         "default ~/.cache/inflight), a model directory, or a Hugging Face hub id (downloaded)")
    args = ap.parse_args(argv)
    from inflight.trainer.models import resolve_model

    try:
        path = resolve_model(args.model)
    except (FileNotFoundError, ModuleNotFoundError) as e:  # the message says what to install or fix
        ap.error(str(e))
    print(path)


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "train": (_train, "train a policy: --config NAME|PATH [--set key.path=value ...]"),
    "engine": (_engine, "a remote engine process (vLLM + the in-flight worker) for a trainer elsewhere"),
    "bench": (_bench, "run a benchmark: inflight bench NAME [ARGS ...]"),
    "prepare-model": (_prepare_model, "prepare a model directory (smollm2 by default) and print its path"),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="inflight", description="In-flight weight updates for async RL: training, "
                                 "a remote engine, the benchmarks, model preparation.",
                                 epilog="inflight COMMAND --help: that command's options")
    commands = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        # each command parses its own arguments (and --help) once it runs: these only name it
        commands.add_parser(name, help=help_text, add_help=False)
    args, rest = ap.parse_known_args(argv)
    COMMANDS[args.command][0](rest)


if __name__ == "__main__":
    main()
