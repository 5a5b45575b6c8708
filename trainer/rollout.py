"""The engine process: keep GRPO groups decoding, tag every token, ship finished groups.

    python -m trainer.rollout --config CONFIG --model-dir DIR --host TRAINER --port PORT [--engine-id 0]

(the trainer starts ``engine.count`` of them itself unless ``engine.spawn = false``; engine i
joins the weight group as rank i + 1 and tags its groups ``e<i>``). It drives vLLM's
``LLMEngine`` step by step with ``in_flight_groups`` requests of ``n = group_size``
samples in flight; whenever one finishes, its completions, behaviour log-probs and
per-token versions become a ``RolloutGroup`` on the rollout queue and a new prompt takes
its place. Weight updates commit between two of these steps, without this loop noticing:
the worker extension and EngineCore's commit coordinator do it.

``rollout.mode = "batch"`` is the synchronous baseline: sample one optimizer step's groups
with version v, ship them, sit idle until version v+1 is live, repeat.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time

from inflight.protocol import RolloutGroup, RolloutSample
from trainer.config import TrainConfig, load_config

log = logging.getLogger("inflight.rollout")


def engine_environment(cfg: TrainConfig, cuda_devices: str | None = None) -> None:
    """vLLM reads these at import: an in-process EngineCore, and the CPU KV cache size; and
    the GPUs the engine may use (set before anything touches CUDA)."""
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.engine.kv_cache_gb))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    from engine_patches.engine import inflight_status, start_inflight, tagged
    from inflight.buffer import RolloutQueue
    from inflight.transport.group import INCARNATION, GroupConfig, TransportError, connect_store
    from trainer.task import RepeatDigit

    if not 0 <= engine_index < cfg.engine.count:
        raise ValueError(f"engine index {engine_index} outside engine.count={cfg.engine.count}")
    rank, engine_id = engine_index + 1, f"e{engine_index}"
    group = GroupConfig(host=host, port=port, world_size=1 + cfg.engine.count, timeout_s=cfg.transport.timeout_s,
                        backend=backend or cfg.transport.backend)
    extra = {} if torch.cuda.is_available() else {"enforce_eager": True}
    if torch.cuda.is_available():
        extra["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
    llm = LLM(model_dir, dtype=cfg.model.dtype, max_num_seqs=cfg.engine.max_num_seqs,
              max_model_len=cfg.engine.max_model_len, seed=cfg.run.seed + rank, **extra, **engine_kwargs())
    start_inflight(llm, InflightConfig(group=group, rank=rank, initial_version=initial_version,
                                       stale_timeout_s=cfg.transport.timeout_s))
    store = connect_store(group, "rollout")
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
                    store = connect_store(group, "rollout")
                    queue = RolloutQueue(store, cfg.rollout.queue_capacity)
                except TransportError:
                    pass

    def ship(item: RolloutGroup) -> bool:
        """Queue a finished group, across a trainer restart if need be; False: stop."""
        while True:
            try:
                queue.put(item, timeout_s=1.0)
                return True
            except TimeoutError:  # the queue is full: the trainer is busy, or done with us
                if stop_requested():
                    return False
            except (RuntimeError, TransportError) as e:
                log.warning("rollout: queue unreachable (%s); holding group %s", e, item.group_id)
                if stop_requested():
                    return False
    task = RepeatDigit(llm.get_tokenizer(), cfg.task.completion_tokens, cfg.task.digit_credit)
    rng = random.Random(cfg.run.seed * 1000 + rank)
    params = SamplingParams(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                            max_tokens=cfg.task.completion_tokens, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    engine = llm.llm_engine
    prompts: dict[str, object] = {}
    counter = 0
    steps = 0
    batch_mode = cfg.rollout.mode == "batch"
    next_version = max(initial_version, wait_for_version)  # batch mode: the version the next batch is sampled with
    while inflight_status(llm)["live_version"] < wait_for_version:
        if stop_requested():
            return
        time.sleep(0.01)

    def add_group() -> None:
        nonlocal counter
        prompt = task.sample_prompt(rng)
        rid = f"{engine_id}.{INCARNATION[:8]}.{counter}"  # unique across engine restarts
        counter += 1
        prompts[rid] = prompt
        engine.add_request(rid, prompt.text, params)

    while True:
        if not batch_mode:
            while len(prompts) < cfg.rollout.in_flight_groups:
                add_group()
        elif not prompts:  # the last batch is shipped: wait, idle, for the next version
            while inflight_status(llm)["live_version"] < next_version:
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
            samples = []
            for i, completion in enumerate(out.outputs):
                t = tagged(completion)
                samples.append(RolloutSample(
                    sample_id=f"{out.request_id}-{i}", group_id=out.request_id, prompt_ids=list(out.prompt_token_ids),
                    token_ids=t.token_ids, logprobs=t.logprobs, versions=t.versions,
                    reward=task.reward(prompt, t.token_ids), finish_reason=t.finish_reason or "",
                    prompt_text=prompt.text, completion_text=t.text,
                ))
            if not ship(RolloutGroup(group_id=out.request_id, samples=tuple(samples), engine_id=engine_id)):
                return
        steps += 1
        if steps % 16 == 0 and stop_requested():
            log.info("rollout: the trainer asked to stop after %d engine steps", steps)
            return


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
