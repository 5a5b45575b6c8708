"""The engine process: keep GRPO groups decoding, tag every token, ship finished groups.

    python -m trainer.engine_process --config CONFIG --model-dir DIR --host TRAINER --port PORT [--engine-id 0]

(the trainer starts ``engine.count`` of them itself unless ``engine.spawn = false``; engine i
joins the weight group with the ranks ``engine.ranks(i)``, one per tensor parallel worker,
and tags its groups ``e<i>``). It drives vLLM's
``LLMEngine`` step by step with ``in_flight_groups`` requests of ``n = group_size``
samples in flight; whenever one finishes, its completions, behaviour log-probs and
per-token versions become a ``RolloutGroup`` on the rollout queue and a new prompt takes
its place, unless that group would be older than ``loss.max_lag`` by the time the trainer
reaches it (the trainer publishes its version on the queue): an engine faster than its
trainer waits instead of sampling what the loss would mask. Weight updates commit between
two of these steps, without this loop noticing: the worker extension and EngineCore's
commit coordinator do it.

``rollout.mode = "batch"`` is the synchronous baseline: sample one optimizer step's groups
with version v, ship them, sit idle until version v+1 is live, repeat.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections import deque

from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from trainer.config import TrainConfig, load_config

log = logging.getLogger("inflight.rollout")


def engine_environment(cfg: TrainConfig, cuda_devices: str | None = None) -> None:
    """vLLM reads these at import: an in-process EngineCore, and the CPU KV cache size; and
    the GPUs the engine may use (set before anything touches CUDA)."""
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.engine.kv_cache_gb))
    if cfg.engine.tensor_parallel_size > 1:  # a CPU engine's workers must each be bound to cores of their own
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(cfg.engine.tensor_parallel_size))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cpu_binding(workers: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``workers`` ranks: the cores this
    process may use, split into that many runs ("0|1", "0,1,2,3|4,5,6,7"; vLLM hands each to
    libnuma's cpu-string parser). vLLM's default binds by NUMA node and refuses more workers
    than nodes ("Not enough allowed NUMA nodes")."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < workers:
        raise ValueError(f"engine.tensor_parallel_size={workers} needs a core per worker; this process may use {cores}")
    per = len(cores) // workers
    runs = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(",".join(map(str, r)) for r in runs)


def sampling_of(params) -> Sampling:
    """What a group was sampled with, for the trainer's check (``inflight.rollout_queue.check_group``)."""
    return Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                    repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty)


def _parent_gone(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid


def run_engine(cfg: TrainConfig, model_dir: str, host: str, port: int, engine_index: int = 0, initial_version: int = 0,
               wait_for_version: int = 0, parent_pid: int | None = None, *, backend: str | None = None,
               cuda_devices: str | None = None) -> None:
    """Serve rollouts until the trainer says stop (or, when spawned by it, until it is gone).

    ``initial_version`` labels the weights in ``model_dir``; with ``wait_for_version`` above
    it (a restart mid-run), sampling starts only once the trainer has pushed that version,
    so no group is spent on weights the trainer already moved past. ``backend`` (default
    ``transport.backend``) must be the trainer's; ``cuda_devices`` limits the engine's GPUs.
    """
    engine_environment(cfg, cuda_devices)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from engine_patches.config import InflightConfig, engine_kwargs
    from engine_patches.client import coordinator_of, inflight_status, start_inflight, tagged
    from engine_patches.routing import routing_fields
    from inflight.rollout_queue import RolloutQueue
    from inflight.transport.errors import TransportError
    from inflight.transport.group import GroupConfig, INCARNATION
    from trainer.tasks import Completion, build_task, encode_prompt, model_stop_ids

    if not 0 <= engine_index < cfg.engine.count:
        raise ValueError(f"engine index {engine_index} outside engine.count={cfg.engine.count}")
    rank, engine_id = cfg.engine.ranks(engine_index)[0], f"e{engine_index}"
    group = GroupConfig(host=host, port=port, world_size=cfg.engine.world_size, timeout_s=cfg.transport.timeout_s,
                        backend=backend or cfg.transport.backend)
    extra: dict = {} if torch.cuda.is_available() else {"enforce_eager": True}
    if cfg.engine.tensor_parallel_size > 1:  # one worker process per rank (the in-process executor holds one)
        extra.update(tensor_parallel_size=cfg.engine.tensor_parallel_size, distributed_executor_backend="mp")
    if torch.cuda.is_available():
        extra["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
    llm = LLM(model_dir, dtype=cfg.model.dtype, max_num_seqs=cfg.engine.max_num_seqs,
              max_model_len=cfg.engine.max_model_len, seed=cfg.run.seed + rank, **extra, **engine_kwargs())
    start_inflight(llm, InflightConfig(group=group, rank=rank, initial_version=initial_version,
                                       stale_timeout_s=cfg.transport.timeout_s, record_routing=cfg.loss.routing_replay))
    store = group.connect("rollout")
    queue = RolloutQueue(store, cfg.rollout.queue_capacity)

    def stop_requested() -> bool:
        nonlocal store, queue
        while True:
            if _parent_gone(parent_pid):
                return True
            try:
                return store.check(["stop"])
            except (RuntimeError, TransportError):  # the trainer's store is gone: wait for the next trainer
                time.sleep(1.0)
                try:
                    store = group.connect("rollout")
                    queue = RolloutQueue(store, cfg.rollout.queue_capacity)
                except TransportError:
                    pass

    def ship(item: RolloutGroup, *, wait: bool = True) -> bool | None:
        """Queue a finished group, across a trainer restart if need be. True: queued; None: the
        queue is full and ``wait`` is False; False: stop."""
        while True:
            try:
                queue.put(item, timeout_s=1.0 if wait else 0.0)
                return True
            except TimeoutError:  # the queue is full: the trainer is busy, or done with us
                if not wait:
                    return None
                if stop_requested():
                    return False
            except (RuntimeError, TransportError) as e:
                log.warning("rollout: queue unreachable (%s); holding group %s", e, item.group_id)
                if stop_requested():
                    return False
    tokenizer = llm.get_tokenizer()
    task = build_task(cfg, tokenizer)
    rng = random.Random(cfg.run.seed * 1000 + rank)
    # a chat model ends its turn with a token only its generation config may name (<|im_end|>)
    params = SamplingParams(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                            max_tokens=cfg.task.completion_tokens, stop_token_ids=model_stop_ids(model_dir, tokenizer),
                            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    engine = llm.llm_engine
    prompts: dict[str, object] = {}
    counter = 0
    steps = 0
    batch_mode = cfg.rollout.mode == "batch"
    next_version = max(initial_version, wait_for_version)  # batch mode: the version the next batch is sampled with
    while inflight_status(llm).live_version < wait_for_version:
        if stop_requested():
            return
        time.sleep(0.01)

    def add_group() -> None:
        nonlocal counter
        prompt = task.sample(rng)
        rid = f"{engine_id}.{INCARNATION[:8]}.{counter}"  # unique across engine restarts
        counter += 1
        prompts[rid] = prompt
        # token ids, not text: the chat template already holds the special tokens (the engine's own
        # tokenization would add a BOS in front of it), and evaluation encodes the same way
        engine.add_request(rid, {"prompt_token_ids": encode_prompt(tokenizer, prompt, cfg.task.chat)}, params)

    # Finished groups the full queue has no room for yet. While they wait, the running requests
    # hold still, except for one step whenever a pushed version is ready to commit: it commits
    # only at a step boundary, and the trainer may wait for that commit before it reads the
    # queue again (a big model stages for seconds, long enough for the queue to fill). With
    # nothing running, the engine is idle, commits without steps, and waiting blocks nobody.
    backlog: deque[RolloutGroup] = deque()
    gate = coordinator_of(llm)

    def room_to_start() -> bool:
        try:  # groups ahead of a new one: queued, or decoding on each engine of the fleet (the
            # others' share estimated as this one's)
            ahead, trainer = queue.depth() + len(prompts) * cfg.engine.count, queue.consumer_version()
        except (RuntimeError, TransportError):  # the trainer's store is gone: hold for the next trainer
            return False
        return may_start_group(ahead=ahead, trainer_version=trainer, live_version=gate.live_version,
                               groups_per_step=cfg.rollout.groups_per_step, max_lag=cfg.loss.max_lag)

    def held() -> bool:
        """Wait a moment without stepping; True once the trainer asked to stop."""
        nonlocal steps
        time.sleep(0.005)
        steps += 1  # counts the stop check below, so a stop is seen while held
        return steps % 16 == 0 and stop_requested()

    while True:
        while backlog:
            shipped = ship(backlog[0], wait=not engine.has_unfinished_requests())
            if shipped is False:
                return
            if shipped is None:
                break
            backlog.popleft()
        if backlog:
            if not gate.commit_pending():
                if held():
                    return
                continue
        elif not batch_mode:
            while len(prompts) < cfg.rollout.in_flight_groups and room_to_start():
                add_group()
            if not prompts:  # the trainer is loss.max_lag behind: idle (an idle engine commits without steps)
                if held():
                    return
                continue
        elif not prompts:  # the last batch is shipped: wait, idle, for the next version
            while inflight_status(llm).live_version < next_version:
                if stop_requested():
                    return
                time.sleep(0.002)
            next_version += 1
            for _ in range(cfg.rollout.groups_per_step):
                add_group()
        for out in engine.step():
            if not out.finished:
                continue
            prompt = prompts.pop(out.request_id)
            rewards = task.score([prompt] * len(out.outputs),
                                 [Completion(c.text, c.token_ids, c.finish_reason or "") for c in out.outputs])
            samples = []
            for i, completion in enumerate(out.outputs):
                t = tagged(completion)
                routing = routing_fields(completion) if cfg.loss.routing_replay else {}
                samples.append(RolloutSample(
                    sample_id=f"{out.request_id}-{i}", group_id=out.request_id, prompt_ids=list(out.prompt_token_ids),
                    token_ids=t.token_ids, logprobs=t.logprobs, versions=t.versions,
                    reward=float(rewards[i]), finish_reason=t.finish_reason or "",
                    prompt_text=prompt.display, completion_text=t.text, **routing,
                ))
            backlog.append(RolloutGroup(group_id=out.request_id, samples=tuple(samples), engine_id=engine_id,
                                        sampling=sampling_of(params)))
        steps += 1
        if steps % 16 == 0 and stop_requested():
            log.info("rollout: the trainer asked to stop after %d engine steps", steps)
            return


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


def main() -> None:
    ap = argparse.ArgumentParser(description="inflight engine process (vLLM + in-flight worker)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-id", type=int, default=0, help="this engine's index in the fleet (0 .. engine.count - 1)")
    ap.add_argument("--initial-version", type=int, default=0, help="version of the weights in --model-dir")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], help="the trainer's (default: transport.backend)")
    args = ap.parse_args()
    run_engine(load_config(args.config), args.model_dir, args.host, args.port, args.engine_id, args.initial_version,
               backend=args.backend)


if __name__ == "__main__":
    main()
