"""Asynchronous GRPO with in-flight weight updates.

    inflight train --config demo [--set run.steps=5 ...]      (or: python -m inflight.trainer.train ...)

One story, top to bottom:
1. the policy on disk: a Hugging Face model, or a freshly built tiny one;
2. the engine process (vLLM + the in-flight worker) starts decoding groups of samples;
3. the trainer (one process, or rank 0 of N: ``inflight.trainer.ranks``) forms a
   torch.distributed weight group with each engine;
4. each step: a batch of groups from the rollout queue (stale ones dropped), a per-token
   truncated-importance-weighted loss, an optimizer step, and an in-flight push of the new
   weights, which the engine commits between two decode steps while it keeps sampling;
5. a checkpoint, metrics.jsonl, a PNG of reward / lag / stall, and a summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from inflight.protocol import ProtocolError, TrainerOrder, TrainerSave, TrainerSetup, TrainerStop
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.trainer.checkpoint import TrainerState, load_state, recover
from inflight.trainer.config import TrainConfig, group_config, push_config
from inflight.trainer.config_files import add_config_arguments, config_to_dict, load_config
from inflight.trainer.console import BarText, Interrupt, quiet_libraries
from inflight.trainer.draft import DraftTrainer, checkpoint_draft, write_initial_draft
from inflight.trainer.envs import build_task
from inflight.trainer.expert_parallel import check_expert_parallel
from inflight.trainer.fleet import EngineLost, Fleet, place, visible_gpus
from inflight.trainer.lora_policy import write_first_adapter
from inflight.trainer.memory_plan import check_fits
from inflight.trainer.metrics import MetricsLog, RolloutLedger, plot_run, summarize
from inflight.trainer.models import empty_model, resolve_model
from inflight.trainer.policy import Policy, StepResult, check_ranks
from inflight.trainer.ranks import RankLost, TrainerRanks, launch_ranks
from inflight.trainer.supervisor import run_facts, supervise, supervising, write_facts
from inflight.trainer.tasks.evaluate import Evaluator
from inflight.trainer.tasks.task import Task, encode_prompt
from inflight.trainer.tasks.tool_calls import use_chat_template
from inflight.trainer.tiny_model import build_tiny_model, default_corpus
from inflight.trainer.trackers import check_trackers, open_trackers
from inflight.trainer.weight_sync import TaskFailed, WeightSync
from inflight.transport.store import reserve_port

log = logging.getLogger("inflight.train")


def train(cfg: TrainConfig, ranks: TrainerRanks | None = None) -> dict:  # ranks: this is rank 0 (follow_rank_0)
    quiet_libraries()  # one bar on the console, each warning once; the engines write to files in the run dir
    out, ckpt_dir = _run_dir(cfg)

    # -- 1. the policy on disk, 2. the engine processes (the fleet) --------------------------------
    resumed, model_dir, adapter_dir, version = _policy_on_disk(cfg, out, ckpt_dir)
    task = _task_before_engines(cfg, model_dir)  # a bad task module, dataset line or prompt length stops here
    draft = _draft_before_engines(cfg, model_dir)  # draft.*: on disk for the engines
    memory = _trainer_before_engines(cfg, model_dir, ranks)  # a trainer that cannot fit or shard stops here
    port = cfg.transport.port or reserve_port(cfg.transport.host)  # held until the trainer's store takes it
    placement = place(cfg.transport.backend, spawn=cfg.engine.spawn, gpus=visible_gpus())
    fleet = Fleet(cfg, model_dir, version, port, placement, out, adapter_dir)
    fleet.start(wait_for_version=version)

    # -- 3. the trainer, a weight group per engine on the store it hosts, the rollout queue there -----
    policy = Policy(cfg, model_dir, resumed, adapter_dir, ranks=ranks,  # loss.kl_coef's reference: the first weights
                    reference_dir=_base_model(cfg, out) if resumed and cfg.loss.kl_coef else None)
    pusher = fleet.connect(group_config(cfg, port=port, backend=placement.backend), push_config(cfg))
    queue, buffer = _rollout_queue(cfg, pusher, resumed)
    metrics = MetricsLog(out / "metrics.jsonl", append=resumed is not None, through=resumed.step if resumed else None,
                         trackers=open_trackers(cfg, out, resumed=resumed is not None))  # run.report_to
    evaluator = _evaluator(cfg, policy, task, model_dir, metrics, version, first=resumed is None)  # greedy, held out
    sync = WeightSync(cfg, pusher, fleet, queue, _pushed(policy, draft))
    version = sync.catch_up(version)

    # -- 4. the loop: batch, loss, step, push, metrics, checkpoint -----------------------------------
    done = start = resumed.step if resumed else 0  # optimizer steps taken
    bar_text, ledger, interrupt = BarText(cfg.rollout.group_size), RolloutLedger(resumed), Interrupt()  # Ctrl-C: below
    try:
        for done in (bar := tqdm(range(start + 1, cfg.run.steps + 1), desc="train", initial=start, total=cfg.run.steps,
                                 dynamic_ncols=True)):  # done: the optimizer steps taken once this one is
            t0 = time.perf_counter()
            groups, version = sync.next_batch(buffer, version)
            result = policy.step(groups, version, done - 1, before_write=sync.wait_reads)
            drafted = draft.step(groups) if draft is not None else {}  # the last push read its weights: above
            version += 1
            score = (lambda: evaluator(policy.unwrapped)) if evaluator is not None and evaluator.due(done) else dict
            version, evaluation = sync.push(version, last=done == cfg.run.steps, score=score)
            metrics.write(row := _with_rate({**_row(done, version, result, groups, t0, sync, buffer, queue, fleet),
                                             **ledger.update(groups), **drafted, **evaluation}, metrics.rows), groups)
            bar.set_postfix_str(bar_text(row), refresh=False)  # metrics.write: and samples.jsonl
            if cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0 and done < cfg.run.steps:
                policy.save(ckpt_dir, done, version, buffer, lambda: ledger.state(queue), _draft_saver(draft))
                fleet.restart_from(ckpt_dir, version)
            if interrupt.asked:  # Ctrl-C: stop after a whole step, its push landed; leave everything below behind
                version = sync.land(version)
                break
    finally:
        interrupt.restore()
        queue.store.set("stop", b"1")
        fleet.stop()
        sync.close()
        metrics.close()  # the experiment trackers' files, finished

    # -- 5. what we leave behind ---------------------------------------------------------------------
    _save_last(policy, ckpt_dir, done, version, buffer, lambda: ledger.state(queue), _draft_saver(draft))
    return _summary(out, metrics, ledger.queue_totals(queue), buffer, fleet, memory, interrupted=done < cfg.run.steps)


def _rollout_queue(cfg: TrainConfig, pusher: Any, resumed: TrainerState | None) -> tuple[RolloutQueue, RolloutBuffer]:
    """The rollout queue on the store the trainer hosts (items sealed for another run's store
    are refused), and the buffer admitting its groups (a resume's pending ones first)."""
    queue = RolloutQueue(pusher.sub_store("rollout"), cfg.rollout.queue_capacity, incarnation=pusher.incarnation)
    buffer = RolloutBuffer(queue, admit_lag=cfg.rollout.admit_lag, mask_lag=cfg.loss.max_lag,
                           group_size=cfg.rollout.group_size, sampling=cfg.rollout.sampling(),
                           pending=resumed.pending if resumed else (), stats=resumed.buffer_stats if resumed else None)
    return queue, buffer


class SetupError(ValueError):
    """The run cannot start as configured; found before any engine starts."""


def _task_before_engines(cfg: TrainConfig, model_dir: Path) -> Task:
    """The task, built here before any engine starts (its module imported, its dataset read),
    and its first prompts checked against ``engine.max_model_len``: the engines build their own
    copy, and a mistake found there would cost an engine start. ``SetupError`` naming it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = use_chat_template(AutoTokenizer.from_pretrained(str(model_dir)), cfg.task.chat_template)
        task = build_task(cfg, tokenizer)
        rng = random.Random(cfg.run.seed)
        longest = max(len(encode_prompt(tokenizer, task.sample(rng), cfg.task.chat)) for _ in range(16))
    except (ValueError, OSError, ImportError, TypeError) as e:
        raise SetupError(f"task {cfg.task.name!r}: {e}") from None
    if longest + cfg.task.completion_tokens > cfg.engine.max_model_len:
        raise SetupError(f"task {cfg.task.name!r}: a prompt of {longest} tokens and task.completion_tokens="
                         f"{cfg.task.completion_tokens} exceed engine.max_model_len={cfg.engine.max_model_len}")
    return task


def _trainer_before_engines(cfg: TrainConfig, model_dir: Path, ranks: TrainerRanks | None) -> dict[str, Any]:
    """The trainer's planned peak (``inflight.trainer.memory_plan``), checked against what the
    machine gives it, and on several ranks an MoE policy's experts checked shardable by expert,
    before any engine starts: ``SetupError`` naming the setting to change."""
    world = ranks.world if ranks else 1
    try:
        if world > 1 and cfg.optim.expert_parallel:
            check_expert_parallel(empty_model(model_dir), world)
        p = check_fits(cfg, model_dir, world)
    except ValueError as e:
        raise SetupError(str(e)) from None
    return {"peak_gb": p.peak / 1e9, "available_gb": p.available / 1e9, "micro_tokens": p.micro_tokens,
            **{f"{k}_gb": v / 1e9 for k, v in p.parts.items()}}


def _draft_before_engines(cfg: TrainConfig, model_dir: Path) -> DraftTrainer | None:
    """The run's draft (``draft``), trained here from where the engines load it
    (``inflight.trainer.draft.draft_dir``): the checkpoint's ``draft/`` when ``model_dir`` is
    one, else ``<run.out_dir>/draft_init``, written here before they start. A draft that cannot
    be built or loaded: ``SetupError``."""
    if not cfg.draft.enabled:
        return None
    try:
        return DraftTrainer(cfg, checkpoint_draft(model_dir) or write_initial_draft(cfg, model_dir))
    except (ValueError, OSError) as e:
        raise SetupError(f"draft: {e}") from None


def _evaluator(cfg: TrainConfig, policy: Policy, task: Task, model_dir: Path, metrics: MetricsLog, version: int, *,
               first: bool) -> Evaluator | None:
    """``eval``'s greedy evaluation on held-out prompts (None: off); a run that does not resume
    writes its row "step 0" here: the policy before any update."""
    evaluator = Evaluator(cfg, policy.tokenizer, task, model_dir) if cfg.eval.every else None
    if evaluator is not None and first:
        metrics.write({"step": 0, "version": version, **evaluator(policy.unwrapped)})
    return evaluator


def _pushed(policy: Policy, draft: DraftTrainer | None) -> Callable[[], dict[str, torch.Tensor]]:
    """What each push sends: the policy's tensors, and a draft's beside them (``draft.<name>``)."""
    return policy.weights if draft is None else lambda: {**policy.weights(), **draft.weights()}


def _draft_saver(draft: DraftTrainer | None) -> Callable[[Path], None] | None:
    """What a checkpoint writes of the draft: ``draft/`` in its directory."""
    return None if draft is None else lambda directory: draft.save(directory / "draft")


def _save_last(policy: Policy, *save: Any) -> None:
    """The run's last checkpoint (``Policy.save``'s arguments); then the policy leaves the
    process group it formed for itself (bf16 compute on one rank), saved or not."""
    try:
        policy.save(*save)
    finally:
        policy.close()


def _run_dir(cfg: TrainConfig) -> tuple[Path, Path]:
    """The run's directory and its checkpoint's."""
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_trackers(cfg)  # a missing tracker package fails here, before any engine starts
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    return out, out / "checkpoint"


def _policy_on_disk(cfg: TrainConfig, out: Path, ckpt_dir: Path) -> tuple[TrainerState | None, Path, Path | None, int]:
    """(the resumed state or None, the model directory the engines load, the adapter directory
    of a LoRA run, their version). A LoRA run's base never moves; its checkpoint holds the adapter.
    A run that does not resume clears the episode journals an earlier run left
    (``inflight.trainer.rollout.episode_journal``)."""
    # a crash between the renames of a checkpoint swap leaves only ``checkpoint.old``: resume from it
    resumed = (load_state(ckpt_dir) if cfg.run.resume and (recover(ckpt_dir) or (ckpt_dir / "state.json").exists())
               else None)
    _check_resume(cfg, out, ckpt_dir, resumed)
    if resumed is None:  # an earlier run's episodes in flight (inflight.trainer.rollout.episode_journal) and engine
        for journal in [*out.glob("episodes-*.journal"), *out.glob("ledger-*.json")]:  # ledgers are not this run's
            journal.unlink()
    if cfg.model.lora.enabled:
        base = _base_model(cfg, out)
        if resumed is not None:
            return resumed, base, ckpt_dir, resumed.version
        return None, base, write_first_adapter(base, cfg.model.lora, out / "adapter_init", seed=cfg.run.seed), 0
    if resumed is not None:
        return resumed, ckpt_dir, None, resumed.version
    return None, _base_model(cfg, out), None, 0


def _check_resume(cfg: TrainConfig, out: Path, ckpt_dir: Path, resumed: TrainerState | None) -> None:
    """``run.resume = true`` with nothing to resume starts over only where that loses nothing:
    not over an earlier run's metrics, which a new run would truncate; a finished run is not
    run again (``SetupError``)."""
    if not cfg.run.resume:
        return
    rows = (out / "metrics.jsonl").read_text().count("\n") if (out / "metrics.jsonl").exists() else 0
    if resumed is None and rows:
        raise SetupError(f"run.resume=true: no checkpoint in {ckpt_dir} to resume from, and {out / 'metrics.jsonl'} "
                         f"holds {rows} rows a new run would overwrite; set run.resume=false to start over there, "
                         "or another run.out_dir")
    if resumed is None:
        print(f"inflight: run.resume=true: nothing to resume in {out}: starting at step 0", flush=True)
    elif resumed.step >= cfg.run.steps:
        raise SetupError(f"run.resume=true: the checkpoint in {ckpt_dir} is at step {resumed.step}, and run.steps="
                         f"{cfg.run.steps}: nothing left to train (raise run.steps to go on)")


def _base_model(cfg: TrainConfig, out: Path) -> Path:
    if cfg.model.path:
        try:
            return resolve_model(cfg.model.path)  # a directory, a hub id, or "smollm2" (prepared once)
        except (OSError, ValueError, ImportError) as e:
            raise SetupError(str(e) if "model.path" in str(e) else f"model.path={cfg.model.path!r}: {e}") from None
    init = out / "init"
    if (init / "config.json").exists():  # a resumed LoRA run's base: the one its adapter was trained on
        return init
    return build_tiny_model(init, default_corpus(), cfg.model.tiny)


def _row(done: int, version: int, result: StepResult, groups: list, t0: float, sync: WeightSync,
         buffer: RolloutBuffer, queue: RolloutQueue, fleet: Fleet) -> dict:
    """The metrics row of one step. ``pushes_landed`` lists every push that completed in the
    step (the last row: two; a recovery's push of the current version too), as [version, ranks];
    ``engines_rejoined`` what members reported serving when a generation formed."""
    batch = result.batch
    row = {"step": done, "time": time.time(), "version": version, "loss": result.loss, "grad_norm": result.grad_norm,
           "reward_mean": float(batch.rewards.mean()), "reward_std": float(batch.rewards.std()),
           "max_versions_per_sample": int(max(len(set(s.versions)) for g in groups for s in g.samples)),
           "hybrid_token_frac": _hybrid_fraction(groups),
           "wait_ms": 1e3 * sync.batch_wait_s, "push_wait_ms": 1e3 * sync.wait_s,
           "read_wait_ms": 1e3 * sync.read_wait_s, "step_ms": 1e3 * (time.perf_counter() - t0),
           "queue_depth": queue.depth(), **buffer.stats(), **result.metrics, **sync.last,
           "engine_failures": fleet.failures, "engine_restarts": fleet.restarts, "engine_drops": fleet.drops,
           "engines_live": len(sync.pusher.live), "group_ids": [g.group_id for g in groups],
           "dropped_ids": buffer.dropped_ids, "versions_by_engine": _versions_by_engine(groups),
           "pushes_landed": sync.take_landed(), "engines_rejoined": sync.take_rejoined()}
    buffer.dropped_ids = []
    m = result.metrics
    compute_s = 1e-3 * sum(m.get(k, 0.0) for k in ("forward_ms", "backward_ms", "reference_ms", "optimizer_ms"))
    row["trainer_tokens_per_s"] = m.get("trainer_tokens", 0) / compute_s if compute_s > 0 else 0.0
    return row


def _with_rate(row: dict, rows: list[dict]) -> dict:
    """``row`` with ``engine_tokens_per_s``: the fleet's completion tokens shipped per second
    since the last row of ``rows`` (``rollout_tokens_shipped``: every engine's, dropped groups'
    too); None for a first row, and after an engine restarted its count."""
    before = next((r for r in reversed(rows) if "time" in r and "rollout_tokens_shipped" in r), None)
    row["engine_tokens_per_s"] = None
    if before is not None and "rollout_tokens_shipped" in row:
        elapsed = row["time"] - before["time"]
        shipped = row["rollout_tokens_shipped"] - before["rollout_tokens_shipped"]
        row["engine_tokens_per_s"] = shipped / elapsed if elapsed > 0 and shipped >= 0 else None
    return row


def _summary(out: Path, metrics: MetricsLog, queue: dict[str, int], buffer: RolloutBuffer, fleet: Fleet,
             memory: dict[str, Any], *, interrupted: bool) -> dict:
    plot_run(metrics.rows, out / "training.png", title=out.name)
    summary = summarize(metrics.rows)
    # the queue's ledger: every slot claimed ("put") was read, and each read is accounted for
    summary["queue"] = {**queue, **buffer.stats()}  # over every process of the run (a resume goes on)
    summary["rollout"] = _rollout_totals(metrics.rows)  # scored, failed, dropped, cancelled: every engine's
    summary["engine_events"] = fleet.events
    summary["interrupted"] = interrupted  # stopped by Ctrl-C before run.steps
    summary["memory_plan"] = memory  # the trainer's planned peak, part by part (inflight.trainer.memory_plan)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _rollout_totals(rows: list[dict]) -> dict[str, int]:
    """The engines' rollout ledger at the last step that had one (``rollout_*`` of its row)."""
    last = next((r for r in reversed(rows) if "rollout_groups_trained" in r), {})
    return {k.removeprefix("rollout_"): v for k, v in last.items() if k.startswith("rollout_")}


def _hybrid_fraction(groups: list) -> float:
    """The fraction of this batch's tokens sampled by a hybrid of a layer-granular update."""
    tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
    return sum(s.hybrid_tokens for g in groups for s in g.samples) / max(tokens, 1)


def _versions_by_engine(groups: list) -> dict[str, list[int]]:
    """The policy versions each engine's tokens in this batch were sampled with."""
    seen: dict[str, set[int]] = {}
    for g in groups:
        seen.setdefault(g.engine_id, set()).update(v for s in g.samples for v in s.versions)
    return {e: sorted(vs) for e, vs in sorted(seen.items())}


def follow_rank_0(cfg: TrainConfig, ranks: TrainerRanks) -> None:
    """A trainer rank other than 0: load the policy rank 0 names, then take its orders (a step,
    a checkpoint) until it says stop."""
    setup = ranks.receive()
    if isinstance(setup, TrainerStop):
        return
    if not isinstance(setup, TrainerSetup):
        raise ProtocolError(f"trainer rank {ranks.rank}: expected the setup, got {type(setup).__name__}")
    policy = Policy(cfg, Path(setup.model_dir), None, Path(setup.adapter_dir) if setup.adapter_dir else None,
                    reference_dir=Path(setup.reference_dir) if setup.reference_dir else None, ranks=ranks,
                    resume=setup.resume)
    while not isinstance(order := ranks.receive(), TrainerStop):
        if isinstance(order, TrainerSave):
            policy.write_optimizer(Path(order.path))
        elif isinstance(order, TrainerOrder):
            policy.follow(order)
        else:
            raise ProtocolError(f"trainer rank {ranks.rank}: unexpected {type(order).__name__}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """``inflight train`` (``prog``) and ``python -m inflight.trainer.train``: train, then print
    the summary. ``--nproc N`` runs N trainer ranks here (``launch_ranks``); under ``torchrun``
    each process is one rank. One process runs as a thin parent's child (``supervisor``), which
    names a death by the OOM killer."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if supervising(argv):  # ``python -m inflight.trainer.train`` as ``inflight train``: the trainer is a child
        sys.exit(supervise(argv, prog or os.environ.get("INFLIGHT_PROG") or Path(sys.argv[0]).name))
    ap = argparse.ArgumentParser(prog=prog or os.environ.get("INFLIGHT_PROG"), description=__doc__.splitlines()[0])
    add_config_arguments(ap)
    ap.add_argument("--nproc", type=int, default=1, metavar="N",
                    help="trainer ranks on this machine (FSDP2), launched by torch's elastic agent")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, OSError) as e:  # a usage error: the message names the bad key, value or file
        ap.error(str(e))
    if args.nproc < 1:
        ap.error(f"--nproc={args.nproc} must be >= 1")
    if args.nproc > 1:
        sys.exit(launch_ranks(args.nproc, argv, ap.prog, run_facts(cfg)))
    write_facts(cfg)  # for the parent's line, if it dies by a signal
    logging.basicConfig(level=logging.WARNING)
    ranks = TrainerRanks.from_env(cfg.run.rank_timeout_s)
    try:
        check_ranks(cfg, ranks.world if ranks else 1)  # before any engine starts: every rank says it
    except ValueError as e:
        ranks.stop()  # type: ignore[union-attr]  (one rank refuses nothing)
        sys.exit(f"{ap.prog}: error: {e}")
    try:
        if ranks is not None and ranks.rank != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to act on: it stops the others
            return follow_rank_0(cfg, ranks)
        summary = train(cfg, ranks)
    except (EngineLost, SetupError, TaskFailed, RankLost) as e:  # an engine's own error: above, in its log
        sys.exit(f"{ap.prog}: error: {e}")
    finally:
        if ranks is not None:
            ranks.stop()
    report(cfg, summary)
    if summary["interrupted"]:
        print(f"{ap.prog}: stopped by Ctrl-C after step {summary['steps']} of {cfg.run.steps}; go on with "
              "--set run.resume=true", file=sys.stderr)
        sys.exit(130)


def report(cfg: TrainConfig, summary: dict) -> None:
    """What a person reads after a run, then the summary as one JSON line for scripts."""
    print(f"reward: first 20% {summary['reward_first_20pct']:.3f} -> last 20% {summary['reward_last_20pct']:.3f}; "
          f"samples spanning >1 version: {100 * summary['frac_samples_multi_version']:.1f}% "
          f"({100 * summary['frac_samples_multi_version_after_first_commit']:.1f}% from the first step a commit "
          f"reached; max {summary['max_versions_per_sample']} versions in one sample); "
          f"engine stall per update: {summary['stall_ms_mean']:.1f} ms mean")
    if "eval_accuracy_first" in summary:
        print(f"eval (greedy, {summary['eval_prompts']} held-out prompts): accuracy "
              f"{summary['eval_accuracy_first']:.3f} -> {summary['eval_accuracy_last']:.3f}")
    r = summary.get("rollout", {})
    if r.get("groups_failed") or r.get("episodes_dropped") or r.get("turns_cancelled"):
        print(f"rollout: {r.get('groups_scored', 0)} groups scored, {r.get('groups_failed', 0)} failed"
              + (f"; episodes {r['episodes_failed']} failed, {r['episodes_dropped']} dropped, {r['turns_cancelled']} "
                 "environment turns cancelled" if "episodes_failed" in r else "")
              + f" (each failure, with its traceback, is in {cfg.run.out_dir}/engine*.log)")
    print(f"outputs: {cfg.run.out_dir} (metrics.jsonl, samples.jsonl, training.png, summary.json, checkpoint/)")
    print(json.dumps({"run": cfg.run.name, **summary}))


if __name__ == "__main__":
    main()
