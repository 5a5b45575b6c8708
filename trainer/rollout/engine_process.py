"""The engine process: keep GRPO groups decoding, tag every token, ship finished groups.

    inflight engine --config CONFIG --model-dir DIR --host TRAINER --port PORT [--engine-id 0] [--set KEY=VALUE ...]
    (or: python -m inflight.trainer.rollout.engine_process ...)

The trainer starts ``engine.count`` of them unless ``engine.spawn = false``. Engine i forms a weight group of its
own with the trainer (``GroupConfig.for_engine``; its workers are ranks 1 .. ``tensor_parallel_size``) and tags
its groups ``e<i>``. It drives vLLM's ``LLMEngine`` step by step with ``in_flight_groups`` requests of
``n = group_size`` samples in flight; a finished one's completions go to the task's scoring processes
(``inflight.trainer.rollout.episode_rollout``: decoding never waits for a verifier) and, once scored, become a
tagged ``RolloutGroup`` on the rollout queue. A new prompt takes its place unless that group would be older than
``loss.max_lag`` when the trainer reaches it (the trainer publishes its version on the queue): a faster engine
waits rather than sample what the loss would mask. Updates commit between two steps without this loop noticing.

``rollout.mode = "batch"`` is the synchronous baseline: sample one optimizer step's groups with version v, ship
them, sit idle until version v+1 is live, repeat. ``rollout.mode = "pause"`` is the baseline of today's async RL:
the same loop, but updates go through vLLM's native path, which this loop runs itself between two steps when the
trainer announces a version (``inflight.trainer.native_update.NativeUpdater``: the scheduler paused, running
requests keeping their KV); every request it adds carries the ``cache_salt`` of the version live then.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from inflight.adapter import AdapterSpec
from inflight.protocol import EngineReport, RolloutGroup, Sampling
from inflight.rollout_queue import RolloutQueue
from inflight.settings import Backend, choices
from inflight.trainer.config import TrainConfig, group_config, inflight_config
from inflight.trainer.config_files import add_config_arguments, load_config
from inflight.trainer.console import log_to_file, quiet_libraries
from inflight.trainer.rollout.engine_env import engine_environment
from inflight.trainer.rollout.failure_log import ScoringFailed
from inflight.trainer.tasks.tool_calls import task_tokenizer
from inflight.transport.errors import TransportError
from inflight.transport.group import INCARNATION
from inflight.transport.group_config import GroupConfig

log = logging.getLogger("inflight.rollout")


def sampling_of(params) -> Sampling:
    """What a group was sampled with, for the trainer's check (``inflight.rollout_queue.check_group``)."""
    return Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                    repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty)


def _fields(params: Any) -> dict[str, Any]:
    """The settings ``params`` (a ``SamplingParams``) was built with, to build a variant."""
    names = ("n", "temperature", "top_k", "top_p", "max_tokens", "logprobs", "stop_token_ids", "output_kind")
    return {name: getattr(params, name) for name in names}


def _parent_gone(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid


class RolloutLoop:
    """One engine's sampling loop: keeps groups decoding, ships finished ones to the queue.

    Ordering invariants: every ``llm_engine.step()`` runs on this thread, and a commit lands
    only at a step boundary (or while idle), so each group's tokens carry exact version tags;
    a group is started only when ``may_start_group`` says the trainer will train on it
    within ``loss.max_lag``; a finished group that the full queue has no room for waits in
    ``backlog`` while the running requests hold still, except for one step whenever a
    commit is pending (the trainer may wait for that commit before it reads the queue)."""

    def __init__(self, cfg: TrainConfig, llm: Any, model_dir: str, group: GroupConfig, engine_index: int, rank: int,
                 parent_pid: int | None, lora_request: Any = None) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from inflight.engine.client import coordinator_of
        from inflight.trainer.envs import build_task
        from inflight.trainer.rollout.episode_rollout import EpisodeRollout
        from inflight.trainer.tasks import model_stop_ids
        from inflight.trainer.tasks.task import is_episodic

        self.cfg, self.llm, self.group, self.parent_pid = cfg, llm, group, parent_pid
        self.lora_request = lora_request  # an adapter engine: every request names the policy adapter
        self.engine_id = f"e{engine_index}"
        self.llm_engine = llm.llm_engine
        self.coordinator = coordinator_of(llm)
        self.tokenizer = task_tokenizer(model_dir, cfg.task.chat_template, llm.get_tokenizer())
        self.task = build_task(cfg, self.tokenizer)
        self.rng = random.Random(cfg.run.seed * 1000 + rank)
        # a chat model ends its turn with a token only its generation config may name (<|im_end|>)
        self.params = SamplingParams(n=1, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                                     top_p=cfg.rollout.top_p, max_tokens=cfg.task.completion_tokens,
                                     logprobs=0, stop_token_ids=model_stop_ids(model_dir, self.tokenizer),
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        self.queue = RolloutQueue(group.connect("rollout"), cfg.rollout.queue_capacity)
        self.episodes = EpisodeRollout(cfg, model_dir, self.engine_id, sampling_of(self.params), self.tokenizer,
                                       self._add_turn, self._abort, episodic=is_episodic(self.task),
                                       journal=Path(cfg.run.out_dir) / f"episodes-{self.engine_id}.journal")
        self.episodes.on_report = self._report  # the trainer shows scoring failures, and stops on a fatal one
        self._turn_params: dict[tuple[int, int], Any] = {}
        self.prompts: dict[str, Any] = {}
        self.backlog: deque[RolloutGroup] = deque()
        self.tokens_shipped = 0
        """Completion tokens of every group this process queued (its ledger's ``tokens_shipped``)."""
        self.counter = 0
        self.steps = 0
        self._next_version = 0
        self.native: Any = None  # pause mode: vLLM's native update, run between two steps (``_native_update``)
        if cfg.rollout.mode == "pause":
            from inflight.trainer.native_update import NativeUpdater

            self.native = NativeUpdater(llm, self.coordinator)

    # -- the two modes ------------------------------------------------------------------------
    def run_inflight(self) -> None:
        """Sample continuously; the worker commits pushed versions between two steps."""
        self._loop(self._start_inflight)

    def run_batch(self, next_version: int) -> None:
        """The synchronous baseline: sample one step's groups with version v, ship them, wait
        idle until v+1 is live, repeat."""
        self._next_version = next_version
        self._loop(self._start_batch)

    def run_pause(self) -> None:
        """Sample continuously, as inflight; each announced version is loaded by vLLM's
        native path with the engine paused, between two steps (``_native_update``)."""
        if self.native is None:
            raise ValueError("run_pause: the engine was not started with rollout.mode='pause'")
        self._loop(self._start_inflight)

    def _start_inflight(self) -> bool | None:
        # as many groups decoding as configured, and at most as many more waiting for their rewards
        cap = self.cfg.rollout.in_flight_groups
        while self.episodes.decoding() < cap and len(self.episodes) < cap and self._room_to_start():
            self._add_group()
        if not self.prompts:  # the trainer is loss.max_lag behind: idle (an idle engine commits without steps)
            return None if self._held() else False
        return True

    def _start_batch(self) -> bool | None:
        if not self.prompts and len(self.episodes):  # the batch's last groups are being scored
            return None if self._held() else False
        if not self.prompts:  # the last batch is shipped: wait, idle, for the next version
            if not self.wait_for_version(self._next_version):
                return None
            self._next_version += 1
            for _ in range(self.cfg.rollout.groups_per_step):
                self._add_group()
        return True

    def _loop(self, start_groups: Callable[[], bool | None]) -> None:
        """Ship, start groups (``start_groups``: True to step, False to look again, None to
        stop), step; until the trainer asks to stop."""
        while True:
            if self.native is not None:
                self._native_update()
            self.backlog.extend(map(self._with_spec_stats, self.episodes.collect()))
            if not self._ship_backlog():
                return
            if self.backlog:
                if not self.coordinator.commit_pending():
                    if self._held():
                        return
                    continue
            else:
                started = start_groups()
                if started is None:
                    return
                if not started:
                    continue
            if not self._step():
                return

    def _native_update(self) -> None:
        """Pause mode: load the version the trainer announced, if any, before the next step."""
        try:
            version = self.native.due(self.queue.store)
        except (RuntimeError, TransportError):  # the trainer's store is gone: stop_requested handles it
            return
        if version is not None:
            self.native.update(self.queue.store, version, self.steps)

    def wait_for_version(self, version: int) -> bool:
        """Wait, idle, until ``version`` is live; False if the trainer asked to stop meanwhile."""
        while self.coordinator.live_version < version:
            if self.stop_requested():
                return False
            time.sleep(0.002)
        return True

    # -- steps and groups ---------------------------------------------------------------------
    def _step(self) -> bool:
        """One engine step; finished groups go to the backlog. False once the trainer asked to stop."""
        for out in self.llm_engine.step():
            if out.finished and out.request_id in self.prompts:  # scored in the scorer's processes
                self.episodes.submit(out, self.prompts.pop(out.request_id))
        self.steps += 1
        if self.steps % 16 == 0 and self.stop_requested():
            log.info("rollout: the trainer asked to stop after %d engine steps", self.steps)
            return False
        return True

    def _add_group(self) -> None:
        from inflight.trainer.tasks import encode_prompt

        prompt = self.task.sample(self.rng)
        rid = f"{self.engine_id}.{INCARNATION[:8]}.{self.counter}"  # unique across engine restarts
        self.counter += 1
        # token ids, not text: the chat template already holds the special tokens (the engine's own
        # tokenization would add a BOS in front of it), and evaluation encodes the same way
        ids = None if self.task.renders_prompt else encode_prompt(self.tokenizer, prompt, self.cfg.task.chat)
        self.episodes.start_group(rid, prompt, ids)  # its turns come back via _add_turn

    def _add_turn(self, rid: str, prompt: Any, ids: list[int], max_tokens: int, n: int) -> None:
        """One turn of a group's episodes: a request that continues their token ids, ``n`` samples of it."""
        from vllm import SamplingParams

        if (max_tokens, n) not in self._turn_params:
            self._turn_params[max_tokens, n] = SamplingParams(**{**_fields(self.params), "max_tokens": max_tokens,
                                                                 "n": n})
        self.prompts[rid] = prompt
        self._add_request(rid, ids, self._turn_params[max_tokens, n])

    def _add_request(self, rid: str, ids: list[int], params: Any) -> None:
        """Add one request; in pause mode salted with the live version (vLLM does not invalidate
        its prefix cache on a native update: a salt per version keeps older weights' blocks out)."""
        request: dict[str, Any] = {"prompt_token_ids": ids}
        if self.native is not None:
            request["cache_salt"] = self.native.salt()
        internal = self.llm_engine.add_request(rid, request, params, lora_request=self.lora_request)
        if self.native is not None:
            self.native.observe(internal)

    def _abort(self, rids: list[str]) -> None:
        self.llm_engine.abort_request(rids)
        for rid in rids:
            self.prompts.pop(rid, None)

    # -- the queue, across trainer restarts ---------------------------------------------------
    def _with_spec_stats(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` with the engine's speculation so far, per version (``RolloutGroup.engine_spec``)."""
        if self.coordinator.spec_decode is None:
            return group
        return msgspec.structs.replace(group, engine_spec=self.coordinator.spec_decode.stats())

    def _ship_backlog(self) -> bool:
        """Queue what the backlog holds while there is room; False: stop."""
        while self.backlog:
            shipped = self._ship(self.backlog[0], wait=not self.llm_engine.has_unfinished_requests())
            if shipped is False:
                return False
            if shipped is None:
                return True
            self.backlog.popleft()
        return True

    def _ship(self, item: RolloutGroup, *, wait: bool) -> bool | None:
        """Queue a finished group, across a trainer restart if need be, its ledger counting the
        completion tokens this engine has shipped (``tokens_shipped``). True: queued; None: the
        queue is full and ``wait`` is False; False: stop."""
        tokens = self.tokens_shipped + sum(len(s.token_ids) for s in item.samples)
        item = msgspec.structs.replace(item, engine_ledger={**item.engine_ledger, "tokens_shipped": tokens})
        while True:
            try:
                self.queue.put(item, timeout_s=(0.05 if self.native is not None else 1.0) if wait else 0.0)
                self.tokens_shipped = tokens
                return True
            except TimeoutError:  # the queue is full: the trainer is busy, or done with us
                if not wait:
                    return None
                if self.stop_requested():
                    return False
                if self.native is not None:  # the trainer may wait for an update before it reads the queue
                    self._native_update()
            except (RuntimeError, TransportError) as e:
                log.warning("rollout: queue unreachable (%s); holding group %s", e, item.group_id)
                if self.stop_requested():
                    return False

    def _room_to_start(self) -> bool:
        try:  # groups ahead of a new one: queued, or decoding on each engine of the fleet (the
            # others' share estimated as this one's)
            in_flight = self.episodes.decoding() + len(self.episodes)
            ahead = self.queue.depth() + in_flight * self.cfg.engine.count
            trainer = self.queue.consumer_version()
        except (RuntimeError, TransportError):  # the trainer's store is gone: hold for the next trainer
            return False
        return may_start_group(ahead=ahead, trainer_version=trainer, live_version=self.coordinator.live_version,
                               groups_per_step=self.cfg.rollout.groups_per_step, max_lag=self.cfg.loss.max_lag)

    def _held(self) -> bool:
        """Wait a moment without stepping; True once the trainer asked to stop."""
        time.sleep(0.005)
        self.steps += 1  # counts the stop check below, so a stop is seen while held
        return self.steps % 16 == 0 and self.stop_requested()

    def _report(self, report: EngineReport) -> None:
        try:
            self.queue.report(report)
        except (RuntimeError, TransportError) as e:  # the trainer's store is gone: the log has it
            log.warning("rollout: could not report to the trainer (%s): %s", e, report.message)

    def stop_requested(self) -> bool:
        while True:
            if _parent_gone(self.parent_pid):
                return True
            try:
                return self.queue.store.check(["stop"])
            except (RuntimeError, TransportError):  # the trainer's store is gone: wait for the next trainer
                time.sleep(1.0)
                try:
                    self.queue = RolloutQueue(self.group.connect("rollout"), self.cfg.rollout.queue_capacity)
                except TransportError:
                    pass


def run_engine(cfg: TrainConfig, model_dir: str, host: str, port: int, engine_index: int = 0, initial_version: int = 0,
               wait_for_version: int = 0, parent_pid: int | None = None, *, backend: Backend | None = None,
               cuda_devices: str | None = None, adapter_dir: str | None = None, log_file: str | None = None) -> None:
    """Serve rollouts until the trainer says stop (or, when spawned by it, until it is gone).

    ``initial_version`` labels the weights in ``model_dir``; with ``wait_for_version`` above
    it (a restart mid-run), sampling starts only once the trainer has pushed that version,
    (in a LoRA run ``model_dir`` is the base and ``adapter_dir`` the adapter of that version);
    so no group is spent on weights the trainer already moved past. ``backend`` (default
    ``transport.backend``) must be the trainer's; ``cuda_devices`` limits the engine's GPUs.
    ``log_file``: where this process and its workers write (the trainer's spawned engines);
    None keeps the console (an engine started by hand).
    """
    if parent_pid is not None:  # the trainer's: its Ctrl-C stops the run, which stops this engine
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (ignored in its scoring and worker processes too)
    if log_file is not None:
        log_to_file(log_file, f"engine {engine_index} (process {os.getpid()})")
    engine_environment(cfg, cuda_devices)
    quiet_libraries()  # after the environment: huggingface_hub reads HF_HUB_OFFLINE at import
    from inflight.engine.client import policy_lora, start_inflight

    if not 0 <= engine_index < cfg.engine.count:
        raise ValueError(f"engine index {engine_index} outside engine.count={cfg.engine.count}")
    rank = cfg.engine.ranks(engine_index)[0]  # its fleet rank: seeds differ across the fleet
    group = dataclasses.replace(group_config(cfg, port=port, backend=backend), host=host)  # the rollout queue's store
    # its weight group: the trainer and its workers
    own = group.for_engine(engine_index, cfg.engine.tensor_parallel_size)
    adapter = AdapterSpec(path=adapter_dir) if adapter_dir else None
    llm = _engine(cfg, model_dir, rank, adapter)
    config = inflight_config(cfg, own, rank=1, initial_version=initial_version, adapter=adapter)
    start_inflight(llm, config)
    if cfg.rollout.mode == "pause":  # the native group, on the trainer's store beside the in-flight one
        _join_native(llm, group)
    loop = RolloutLoop(cfg, llm, model_dir, group, engine_index, rank, parent_pid,
                       lora_request=policy_lora(config) if adapter else None)
    next_version = max(initial_version, wait_for_version)  # batch mode: the version the next batch is sampled with
    try:
        loop.episodes.wait_ready()  # a task its scoring processes cannot build fails here, with its own error
        if not loop.wait_for_version(wait_for_version):
            return
        loop.episodes.resume()  # episodes an earlier process of this engine left running (its journal)
        if cfg.rollout.mode == "batch":
            loop.run_batch(next_version)
        elif cfg.rollout.mode == "pause":
            loop.run_pause()
        else:
            loop.run_inflight()
    except ScoringFailed:  # reported to the trainer, which stops the run: no restart would help
        while not loop.stop_requested():
            time.sleep(0.1)
    finally:
        loop.episodes.close()


def _join_native(llm: Any, group: GroupConfig) -> None:
    """Pause mode: the engine's worker joins the trainer's native group (rank 1 of 2)."""
    from inflight.trainer.native_update import native_group

    g = native_group(group)
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
        "host": g.host, "port": g.port, "world_size": g.world_size, "rank": 1, "name": g.name,
        "timeout_s": g.timeout_s, "insecure": g.insecure}})


def _engine(cfg: TrainConfig, model_dir: str, rank: int, adapter: AdapterSpec | None) -> Any:
    """The rollout engine's ``vllm.LLM``, seeded by its fleet ``rank``; in a LoRA run it
    serves ``adapter`` on ``model_dir``'s base."""
    import torch
    from vllm import LLM

    from inflight.engine.engine_config import engine_kwargs

    extra: dict = {} if torch.cuda.is_available() else {"enforce_eager": True}
    if cfg.engine.tensor_parallel_size > 1:  # one worker process per rank (the in-process executor holds one)
        extra.update(tensor_parallel_size=cfg.engine.tensor_parallel_size, distributed_executor_backend="mp")
    if torch.cuda.is_available():
        extra["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
    if cfg.loss.routing_replay:  # routing is read after a step's forward: one batch in flight at a time
        extra["async_scheduling"] = False
    if cfg.engine.speculative_tokens:  # n-gram lookup; speculation runs with synchronous steps
        extra.update(async_scheduling=False, speculative_config={
            "method": "ngram", "num_speculative_tokens": cfg.engine.speculative_tokens, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1})
    if cfg.draft.enabled:  # the run's draft (``inflight.trainer.draft``), committed with every update
        from inflight.trainer.draft import draft_dir

        extra.update(async_scheduling=False, speculative_config={
            "method": "draft_model", "model": str(draft_dir(cfg, model_dir)),
            "num_speculative_tokens": cfg.draft.speculative_tokens})
    if cfg.rollout.mode == "pause":  # vLLM's native update path, over gloo (``inflight.trainer.native_update``)
        from inflight.trainer.native_update import BACKEND, register

        register()
        extra["weight_transfer_config"] = {"backend": BACKEND}
    if not cfg.engine.prefix_caching:  # otherwise on, unless the model rules it out (``engine_kwargs``)
        extra["enable_prefix_caching"] = False
    return LLM(dtype=cfg.model.dtype, max_num_seqs=cfg.engine.max_num_seqs, max_model_len=cfg.engine.max_model_len,
               seed=cfg.run.seed + rank, **engine_kwargs(model=model_dir, adapter=adapter, **extra))


def may_start_group(*, ahead: int, trainer_version: int | None, live_version: int, groups_per_step: int,
                    max_lag: int) -> bool:
    """Whether a group started now, with ``ahead`` groups before it, is trained on within
    ``max_lag`` of the version that samples its first token (``live_version``).

    It is trained ``ahead // groups_per_step`` batches after the trainer's next one, which the
    trainer (at ``trainer_version``, its last published; None: not yet) may already be
    computing: one version more. An engine faster than its trainer waits instead of sampling
    what the loss would mask. Groups that finish out of order can still overtake it; the
    trainer's admission (``RolloutBuffer(mask_lag=...)``) catches what slips through.
    """
    behind = 0 if trainer_version is None else max(0, trainer_version - live_version)
    return behind + 1 + ahead // groups_per_step <= max_lag


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """``inflight engine`` (``prog``) and ``python -m inflight.trainer.rollout.engine_process``."""
    ap = argparse.ArgumentParser(prog=prog, description="inflight engine process (vLLM + in-flight worker)")
    add_config_arguments(ap)  # the trainer's config and --set overrides: both sides must read the same settings
    ap.add_argument("--model-dir", required=True, help="the model directory to serve (the trainer's model.path)")
    ap.add_argument("--host", default="127.0.0.1", help="the trainer's host: its group store")
    ap.add_argument("--port", type=int, required=True, help="the trainer's store port (transport.port)")
    ap.add_argument("--engine-id", type=int, default=0, help="this engine's index in the fleet (0 .. engine.count - 1)")
    ap.add_argument("--initial-version", type=int, default=0, help="version of the weights in --model-dir")
    ap.add_argument("--adapter-dir", help="a LoRA run: the PEFT directory of --initial-version's adapter")
    ap.add_argument("--backend", choices=choices(Backend), help="the trainer's (default: transport.backend)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, OSError) as e:  # a usage error: the message names the bad key, value or file
        ap.error(str(e))
    run_engine(cfg, args.model_dir, args.host, args.port, args.engine_id, args.initial_version,
               backend=args.backend, adapter_dir=args.adapter_dir)


if __name__ == "__main__":
    main()
