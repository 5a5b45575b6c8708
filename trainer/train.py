"""Asynchronous GRPO with in-flight weight updates.

    python -m trainer.train --config configs/demo_cpu.toml

One story, top to bottom:
1. the policy on disk: a Hugging Face model, or a freshly built tiny one;
2. the engine process (vLLM + the in-flight worker) starts decoding groups of samples;
3. the trainer (accelerate) joins it in a torch.distributed weight group;
4. each step: a batch of groups from the rollout queue (stale ones dropped), a per-token
   truncated-importance-weighted loss, an optimizer step, and an in-flight push of the new
   weights, which the engine commits between two decode steps while it keeps sampling;
5. a checkpoint, metrics.jsonl, a PNG of reward / lag / stall, and a summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.transport.errors import TransportError, TransportTimeout
from inflight.transport.group import GroupConfig
from inflight.transport.store import reserve_port
from inflight.transport.pusher import PushConfig, PushResult, WeightPusher, named_weights
from trainer.checkpoint import TrainerState, load_state, recover, restore_rng, save_checkpoint
from trainer.config import TrainConfig, config_to_dict, load_config
from trainer.loss import collate, compute_loss, policy_logprobs
from trainer.metrics import MetricsLog, ess_warning, plot_run, summarize
from trainer.routing_replay import RoutingReplay, collate_routing
from trainer.models import resolve_model
from trainer.fleet import EngineLost, Fleet, place, visible_gpus
from trainer.tasks import build_task
from trainer.tasks.evaluate import Evaluator
from trainer.tiny_model import build_tiny_model, default_corpus

log = logging.getLogger("inflight.train")


def _push_metrics(result: PushResult) -> dict:
    commit = result.commits[min(result.commits)]
    # engines count their own steps, so what compares across a fleet is how many steps each
    # decoded between the first bucket and its commit
    waits = [c.steps_since_first_bucket for c in result.commits.values()]
    return {"pushed_version": result.version, "commit_ms": commit.commit_ms, "commit_step": commit.step,
            "committed_ranks": sorted(result.commits), "commit_steps": {r: c.step for r, c in result.commits.items()},
            "commit_spread_steps": max(waits) - min(waits),
            "push_ms": 1e3 * (result.stage_wait_s + result.commit_wait_s), "send_ms": 1e3 * result.send.send_s,
            "push_mb": result.send.nbytes / 2**20, "steps_during_transfer": result.staged[min(result.staged)].steps_during_transfer}


def train(cfg: TrainConfig) -> dict:
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)

    # -- 1. the policy on disk ---------------------------------------------------------------
    ckpt_dir = out / "checkpoint"
    # a crash between the renames of a checkpoint swap leaves only ``checkpoint.old``: resume from it
    resumed = load_state(ckpt_dir) if cfg.run.resume and (recover(ckpt_dir) or (ckpt_dir / "state.json").exists()) else None
    if resumed is not None:
        model_dir = ckpt_dir
    elif cfg.model.path:
        model_dir = resolve_model(cfg.model.path)  # a directory, a hub id, or "smollm2" (prepared once)
    else:
        model_dir = build_tiny_model(out / "init", default_corpus(), cfg.model.tiny)
    version = resumed.version if resumed else 0

    # -- 2. the engine processes (the fleet) -----------------------------------------------------
    port = cfg.transport.port or reserve_port()
    host = cfg.transport.host
    placement = place(cfg.transport.backend, spawn=cfg.engine.spawn, gpus=visible_gpus())
    engine = Fleet(cfg, model_dir, version, host, port, placement, out)
    engine.start(wait_for_version=version)

    # -- 3. the trainer, and the weight group it hosts ---------------------------------------
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.device.type == "cpu":
        torch.set_num_threads(1)  # leave the other core(s) to the engine
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  weight_decay=cfg.optim.weight_decay)
    if resumed is not None:
        optimizer.load_state_dict(torch.load(ckpt_dir / "optimizer.pt", weights_only=True))
        restore_rng(resumed)
    model, optimizer = accelerator.prepare(model, optimizer)
    replay = RoutingReplay(accelerator.unwrap_model(model), enabled=cfg.loss.routing_replay)
    group = GroupConfig(host=host, port=port, world_size=cfg.engine.world_size, timeout_s=cfg.transport.timeout_s,
                        backend=placement.backend)
    pusher = WeightPusher(group, PushConfig(bucket_mb=cfg.transport.bucket_mb, dtype=cfg.model.dtype,
                                            reply_timeout_s=cfg.transport.timeout_s),
                          join_timeout_s=cfg.transport.rejoin_timeout_s)
    queue = RolloutQueue(pusher.group.sub_store("rollout"), cfg.rollout.queue_capacity)
    buffer = RolloutBuffer(queue, admit_lag=cfg.rollout.admit_lag, mask_lag=cfg.loss.max_lag,
                           group_size=cfg.rollout.group_size,
                           pending=resumed.pending if resumed else (), stats=resumed.buffer_stats if resumed else None)
    metrics = MetricsLog(out / "metrics.jsonl", append=resumed is not None)
    # greedy accuracy on held-out prompts; row "step 0" is the policy before any update
    evaluator = Evaluator(cfg, tokenizer, build_task(cfg, tokenizer), model_dir) if cfg.eval.every else None
    if evaluator is not None and resumed is None:
        metrics.write({"step": 0, "version": version, **evaluator(accelerator.unwrap_model(model))})

    def weights() -> dict[str, torch.Tensor]:
        return named_weights(accelerator.unwrap_model(model))

    if max(pusher.engine_versions.values(), default=-1) > version:  # a resumed trainer behind a live engine
        version = engine.recover(pusher, f"engines serve {pusher.engine_versions}, ahead of v{version}", version, weights,
                                 queue)

    # -- 4. the loop ------------------------------------------------------------------------------
    start = resumed.step if resumed else 0
    in_flight = None
    pending_push: dict = {}
    try:
        for step in tqdm(range(start, cfg.run.steps), desc="train", initial=start, total=cfg.run.steps, dynamic_ncols=True):
            t0, events_before = time.perf_counter(), len(engine.events)
            if (problem := engine.exit_problem()) is not None:  # a fleet's other engines keep the queue full
                version, in_flight = engine.recover(pusher, problem, version, weights, queue), None
            while True:
                try:
                    groups = _next_groups(buffer, cfg, version, engine)
                    break
                except EngineLost as e:
                    version, in_flight = engine.recover(pusher, str(e), version, weights, queue), None
            t_wait = time.perf_counter() - t0
            batch = collate(groups, tokenizer.pad_token_id, cfg.loss.normalize_std).to(accelerator.device)
            routing = collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1]) if replay.enabled else None
            with replay.replaying(routing):  # MoE: each sampled token's position routed to the engine's experts
                logp, entropy = policy_logprobs(model, batch, cfg.rollout.temperature)
            loss, m = compute_loss(logp, entropy, batch, version=version, cfg=cfg.loss)
            m.update(replay.stats())
            if (warning := ess_warning(m, cfg.loss.ess_warn)) is not None:
                log.warning("step %d: %s", step + 1, warning)
            accelerator.backward(loss)
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)) if cfg.optim.grad_clip else 0.0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            version += 1
            # The previous push has landed by now (or this waits for it); then snapshot and send this one.
            # Rows report the push of the step before, except the last row, which reports its own;
            # ``pushes_landed`` lists every push that completed in the step (the last row: two; a
            # recovery's push of the current version too), as [version, committed ranks].
            evaluation: dict = {}
            push_wait = 0.0  # the trainer blocked on the previous push
            landed: list[list] = []  # [version, ranks] of every push that completed in this step
            try:
                if in_flight is not None:
                    t1 = time.perf_counter()
                    pending_push = _push_metrics(in_flight.result())
                    push_wait, in_flight = time.perf_counter() - t1, None
                    landed.append([pending_push["pushed_version"], pending_push["committed_ranks"]])
                if evaluator is not None and evaluator.due(step + 1):  # the new version, scored before it is
                    evaluation = evaluator(accelerator.unwrap_model(model))  # pushed: no transfer competes with it
                if step + 1 == cfg.run.steps and len(pusher.group.roster) < cfg.engine.world_size - 1:
                    engine.admit(pusher, wait=True)  # the run ends with every engine that can come on the last version
                elif pusher.knocking():  # engines back from a restart or a freeze: in before this push
                    engine.admit(pusher)
                in_flight = pusher.push_async(version, weights())
                if step + 1 == cfg.run.steps:  # the last push is waited for, so the run ends on a committed version
                    pending_push, in_flight = _push_metrics(in_flight.result()), None
                    landed.append([pending_push["pushed_version"], pending_push["committed_ranks"]])
            except TransportError as e:  # an engine is gone or silent: go on without it (see Fleet.recover)
                version = engine.recover(pusher, f"push failed: {e}", version, weights, queue, silent=getattr(e, "ranks", ()))
                in_flight = None
            row = {"step": step + 1, "version": version, "loss": float(loss.detach()), "grad_norm": grad_norm,
                   "reward_mean": float(batch.rewards.mean()), "reward_std": float(batch.rewards.std()),
                   "max_versions_per_sample": int(max(len(set(s.versions)) for g in groups for s in g.samples)),
                   "wait_ms": 1e3 * t_wait, "push_wait_ms": 1e3 * push_wait,
                   "step_ms": 1e3 * (time.perf_counter() - t0),
                   "queue_depth": queue.depth(), **buffer.stats(), **m, **pending_push,
                   "engine_failures": engine.failures, "engine_restarts": engine.restarts,
                   "engine_drops": engine.drops, "engines_live": len(pusher.group.roster) // cfg.engine.tensor_parallel_size,
                   "group_ids": [g.group_id for g in groups], "dropped_ids": buffer.dropped_ids,
                   "versions_by_engine": _versions_by_engine(groups),
                   "pushes_landed": sorted(landed + [e["pushed"] for e in engine.events[events_before:] if "pushed" in e])}
            buffer.dropped_ids = []
            metrics.write({**row, **evaluation})
            if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0:
                _checkpoint(ckpt_dir, accelerator.unwrap_model(model), tokenizer, optimizer, step + 1, version, buffer)
                engine.model_dir, engine.model_version = ckpt_dir, version  # a restarted engine starts from here
    finally:
        queue.store.set("stop", b"1")
        engine.stop()
        pusher.close()

    # -- 5. what we leave behind ------------------------------------------------------------------
    _checkpoint(ckpt_dir, accelerator.unwrap_model(model), tokenizer, optimizer, cfg.run.steps, version, buffer)
    plot_run(metrics.rows, out / "training.png")
    summary = summarize(metrics.rows)
    # the queue's ledger: every slot claimed ("put") was read, and each read is accounted for
    summary["queue"] = {"put": queue.store.add("tail", 0), "read": queue.store.add("head", 0), **buffer.stats()}
    summary["engine_events"] = engine.events
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _versions_by_engine(groups: list) -> dict[str, list[int]]:
    """The policy versions each engine's tokens in this batch were sampled with."""
    seen: dict[str, set[int]] = {}
    for g in groups:
        seen.setdefault(g.engine_id, set()).update(v for s in g.samples for v in s.versions)
    return {e: sorted(vs) for e, vs in sorted(seen.items())}


def _next_groups(buffer: RolloutBuffer, cfg: TrainConfig, version: int, engine: Fleet) -> list:
    """The next batch of groups; waits in short slices so a dead engine process is noticed
    at once rather than after ``rollout.queue_timeout_s``, and a slot claimed by a frozen
    producer is skipped (holed) while other producers' groups wait behind it."""
    buffer.queue.publish_version(version)  # the engines keep what they sample within loss.max_lag of it
    deadline = time.monotonic() + cfg.rollout.queue_timeout_s
    while True:
        try:
            return buffer.next_batch(cfg.rollout.groups_per_step, version, timeout_s=1.0)
        except TransportTimeout:
            buffer.queue.skip_stalled()
            problem = engine.exit_problem()
            if problem is not None:
                raise EngineLost(problem) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout group within rollout.queue_timeout_s={cfg.rollout.queue_timeout_s}s "
                                   "from a live engine: is it stuck?") from None


def _checkpoint(path: Path, model, tokenizer, optimizer, step: int, version: int, buffer: RolloutBuffer) -> None:
    buffer.drain(version)  # queued groups live in this process's store: keep them with the checkpoint
    save_checkpoint(path, model, tokenizer, optimizer, TrainerState(
        step=step, version=version, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
        buffer_stats=buffer.stats(), pending=list(buffer.pending)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="TOML file (see configs/)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(args.config)
    summary = train(cfg)
    print(f"reward: first 20% {summary['reward_first_20pct']:.3f} -> last 20% {summary['reward_last_20pct']:.3f}; "
          f"samples spanning >1 version: {100 * summary['frac_samples_multi_version']:.1f}% "
          f"(max {summary['max_versions_per_sample']} versions in one sample); "
          f"engine stall per update: {summary['stall_ms_mean']:.1f} ms mean")
    if "eval_accuracy_first" in summary:
        print(f"eval (greedy, {summary['eval_prompts']} held-out prompts): accuracy {summary['eval_accuracy_first']:.3f} "
              f"-> {summary['eval_accuracy_last']:.3f}")
    print(json.dumps({"demo": cfg.run.name, **summary}))


if __name__ == "__main__":
    main()
