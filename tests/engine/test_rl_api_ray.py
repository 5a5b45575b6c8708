"""vLLM's RL API on the ``inflight`` backend through a Ray actor, with vLLM's own client.

The engine is an ``LLM`` (started with ``engine_kwargs(rl_api=True)``) inside a threaded Ray
actor on a local Ray cluster; the trainer drives vLLM's handshake through
``WeightTransferTrainerFactory`` with ``client=RayVLLMWeightSyncClient(handle)``, unmodified:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update`` and ``update_weight_version`` reach ``LLM``'s own methods as Ray calls
while the actor's engine thread decodes 16 sampled requests step by step. Every version
lands mid-request, each request's tags change exactly at the token count its commit reported,
and a transformers replay of the tags reproduces the behaviour log-probs. Skipped without Ray.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import traceback
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from vllm import LLM

from inflight.engine.client import coordinator_of, tagged
from inflight.trainer.transfer_trainer import InflightTrainerInitInfo
from inflight.transport.pusher import PushConfig
from inflight.versions import boundaries, is_monotone
from tests.engine_harness import Reference, perturbed, replay
from tests.helpers import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")]

REQUESTS = 16
TOKENS = 128
"""Each request's length: every push lands while it decodes (the actor holds it otherwise)."""
VERSIONS = 5
PUSH_AT = [10 * (k + 1) for k in range(VERSIONS)]
"""Push k starts once every request has ``PUSH_AT[k]`` tokens."""
HOLD_AT = [m + 8 for m in PUSH_AT]
"""The actor's engine thread takes no step past ``HOLD_AT[k]`` tokens before commit k+1 is
pending at the coordinator (or the trainer asks for tokens): every commit lands mid-request
however slow the machine, without a wall-clock deadline."""
WAIT_S = 300.0
"""A bound for a hang (an engine's start in an actor on a busy 2-core machine included), never a check of speed."""
ENGINE_ENV = ("HF_HUB_OFFLINE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL",
              "TOKENIZERS_PARALLELISM", "TRITON_INTERPRET")
"""What conftest sets for an in-process CPU engine; the actor's process gets the same
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: EngineCore runs in the actor, and a Ray call's
``collective_rpc`` is serialized with the engine thread's steps by the coordinator's lock)."""


class RLEngineActor(LLM):
    """An ``LLM`` as a Ray actor: ``RayVLLMWeightSyncClient`` calls its own RL methods
    (``vllm.entrypoints.rl.offline``), untouched, from Ray's threads; ``run`` decodes requests
    on an engine thread of the actor's, step by step, so those calls land between steps.

    ``progress`` reports each request's tokens and the engine's steps; ``want(n)`` lets a held
    engine thread step until every request has ``n`` tokens (the trainer waits for tokens
    after ``start_weight_update``: an event, never a deadline)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._tokens: dict[str, int] = {}
        self._done: dict[str, Any] = {}
        self._wanted = 0
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pid(self) -> int:
        return os.getpid()

    def run(self, prompts: list[list[int]], max_tokens: int, hold_at: list[int]) -> list[str]:
        """Add one sampled request per prompt (ids ``req-<i>``, seed ``i``) and decode them on
        the engine thread; returns at once with the ids."""
        from vllm import SamplingParams

        assert self._thread is None, "one run per actor"
        engine = self.llm_engine
        ids = [f"req-{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=i)
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            self._tokens[rid] = 0
        self._thread = threading.Thread(target=self._loop, args=(list(hold_at),), name="engine-loop", daemon=True)
        self._thread.start()
        return ids

    def _min_tokens(self) -> int:
        return min(self._tokens.values())

    def _loop(self, hold_at: list[int]) -> None:
        engine, coordinator = self.llm_engine, coordinator_of(self)
        base = coordinator.commits()
        try:
            while engine.has_unfinished_requests() and not self._stop.is_set():
                k = coordinator.commits() - base
                if k < len(hold_at) and self._min_tokens() >= hold_at[k]:
                    wait_until(lambda k=k: coordinator.commit_pending() or coordinator.commits() - base != k
                               or self._min_tokens() < self._wanted or self._stop.is_set(),
                               f"commit {k + 1} to be pending (held at {hold_at[k]} tokens)", poll_s=0.002,
                               timeout_s=WAIT_S)
                for out in engine.step():
                    self._tokens[out.request_id] = len(out.outputs[0].token_ids)
                    if out.finished:
                        self._done[out.request_id] = out
        except BaseException:  # reported by ``progress``
            self._error = traceback.format_exc()

    def progress(self) -> dict[str, Any]:
        """Each request's tokens so far, the engine's steps, whether the engine thread runs."""
        if self._error is not None:
            raise RuntimeError(f"the actor's engine thread failed:\n{self._error}")
        return {"tokens": dict(self._tokens), "steps": coordinator_of(self).steps,
                "running": self._thread is not None and self._thread.is_alive()}

    def want(self, tokens: int) -> None:
        self._wanted = max(self._wanted, tokens)

    def results(self) -> dict[str, dict[str, Any]]:
        """Every finished request: its prompt, tokens, behaviour log-probs and version labels."""
        assert self._thread is not None
        self._thread.join(WAIT_S)
        if self._error is not None:
            raise RuntimeError(f"the actor's engine thread failed:\n{self._error}")
        out = {}
        for rid, o in self._done.items():
            t = tagged(o.outputs[0])
            out[rid] = {"prompt": list(o.prompt_token_ids), "tokens": t.token_ids, "logprobs": t.logprobs,
                        "versions": t.versions, "labels": t.labels, "prompt_label": t.prompt_label}
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(WAIT_S)
        with contextlib.suppress(Exception):
            self.collective_rpc("inflight_stop")


class ProgressAfterStart:
    """vLLM's ``RayVLLMWeightSyncClient``, called as it is; between ``start`` and ``update``
    this trainer waits for every request to take 2 more tokens, so each update is shown to
    start while the engine decodes (an event, never a deadline)."""

    def __init__(self, client: Any, handle: Any) -> None:
        self.client, self.handle = client, handle
        self.at_start: list[dict[str, Any]] = []

    def progress(self) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.progress.remote())

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()
        self.at_start.append(self.progress())  # after start returned: at least the tokens at start

    def update_weights(self, info) -> None:
        import ray

        mark = self.at_start[-1]["tokens"]
        ray.get(self.handle.want.remote(min(mark.values()) + 2))
        wait_until(lambda: all(self.progress()["tokens"][r] >= m + 2 for r, m in mark.items()),
                   "2 tokens of every request after start_weight_update", timeout_s=WAIT_S)
        self.client.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of one CPU whose workers run at this process's priority and
    environment (as ``inflight.trainer.ray_launcher.connect`` starts one); shut down after the module."""
    import ray

    from inflight.trainer.ray_launcher import WORKER_NICENESS

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault(WORKER_NICENESS, "0")
        env = {k: os.environ[k] for k in ENGINE_ENV if k in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20,
                 runtime_env={"env_vars": env})
    yield
    if started:
        ray.shutdown()
        os.environ.pop(WORKER_NICENESS, None)


@pytest.fixture(scope="module")
def actor(ray_cluster, tiny_qwen):
    import ray

    from inflight.engine.engine_config import engine_kwargs

    handle = ray.remote(RLEngineActor).options(num_cpus=1, max_concurrency=8, max_restarts=0).remote(
        str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, **engine_kwargs(rl_api=True))
    ray.get(handle.pid.remote(), timeout=WAIT_S)  # the engine has started
    yield handle
    with contextlib.suppress(Exception):
        ray.get(handle.stop.remote(), timeout=60)
    ray.kill(handle, no_restart=True)


def test_ray_client_pushes_five_versions_while_sixteen_requests_decode_in_an_actor(actor, tiny_qwen, hold_port) -> None:
    import ray
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    base = load_file(str(tiny_qwen / "model.safetensors"))
    states = {0: base}
    info = InflightTrainerInitInfo(rank=0, port=hold_port(), push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0, join_timeout_s=WAIT_S)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=RayVLLMWeightSyncClient(actor), source=base)
    try:
        (ray_client,) = trainer.clients  # one engine: vLLM's Ray client over the one handle, as it is
        assert type(ray_client) is RayVLLMWeightSyncClient and ray_client.handles == [actor]
        assert trainer.version == 0 and ray.get(actor.get_weight_version.remote()) == "0"
        client = ProgressAfterStart(ray_client, actor)
        trainer.clients = [client]
        prompts = [[3 + (7 * i + j) % 200 for j in range(8 + i)] for i in range(REQUESTS)]
        ids = ray.get(actor.run.remote(prompts, TOKENS, HOLD_AT))
        results = []
        for k, mark in enumerate(PUSH_AT):
            wait_until(lambda mark=mark: min(client.progress()["tokens"].values()) >= mark,
                       f"every request at {mark} tokens", timeout_s=WAIT_S)
            states[k + 1] = trainer.source = perturbed(base, seed=400 + k, scale=0.02)
            results.append(trainer.send_weights())
        assert client.progress()["running"], "the requests ended before every commit landed"
        assert ray.get(actor.get_weight_version.remote()) == str(VERSIONS)
        outs = ray.get(actor.results.remote(), timeout=WAIT_S)
    finally:
        trainer.shutdown()

    assert [r.version for r in results] == list(range(1, VERSIONS + 1))
    assert sorted(outs) == sorted(ids)
    for r, at_start in zip(results, client.at_start):
        c = r.commits[1]
        assert c.step > at_start["steps"], (r.version, c.step, at_start["steps"])  # the engine stepped in the update
        # the engine's request ids: the user's (vLLM's random suffix stripped), every request unfinished
        assert set(c.tokens_at_commit) == set(ids), sorted(c.tokens_at_commit)
        for rid in ids:
            assert c.tokens_at_commit[rid] >= at_start["tokens"][rid] + 2, (r.version, rid)
    for rid in ids:
        o = outs[rid]
        assert len(o["tokens"]) == len(o["logprobs"]) == TOKENS and is_monotone(o["versions"])
        first = boundaries(o["versions"])
        assert set(first) == set(range(VERSIONS + 1)), (rid, first)
        assert [first[r.version] for r in results] == [r.commits[1].tokens_at_commit[rid] for r in results], rid
    ref = Reference(tiny_qwen, "float32")
    weights_of = lambda label: states[int(label)]  # noqa: E731
    for rid in ids[:3]:  # a transformers replay from the labels alone; a one-token shift of them fails
        o = outs[rid]
        got = torch.tensor(o["logprobs"], dtype=torch.float64)
        want = replay(ref, weights_of, o["prompt"], o["tokens"], o["labels"], o["prompt_label"])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        labels = o["labels"]
        off = replay(ref, weights_of, o["prompt"], o["tokens"], labels[1:] + labels[-1:], o["prompt_label"])
        assert (got - off).abs().max() > 1e-3
