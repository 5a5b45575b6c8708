"""An ``EpisodeRollout`` on an engine of the test's process, stepped from the test thread,
and the pushes that land commits in the middle of its episodes (by engine steps and events)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inflight.engine.client import coordinator_of, start_inflight
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.trainer.config_files import config_from_dict
from inflight.trainer.tasks.task import Prompt
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import perturbed, stop_engine
from tests.helpers import WAIT_S, wait_until


@contextlib.contextmanager
def engine_with_pusher(model_dir: Path, port: int, max_model_len: int) -> Iterator[dict]:
    """An in-flight engine of this process (fp32) and a trainer's pusher on one group: the
    ``engine`` a ``Driver`` and ``push_until_pending`` take (``versions``: the weights of each
    version pushed, the first ones the model's)."""
    from safetensors.torch import load_file
    from vllm import LLM

    llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", seed=0, max_model_len=max_model_len,
              **engine_kwargs())
    group = GroupConfig(port=port, world_size=2, timeout_s=120)
    start_inflight(llm, InflightConfig(group=group))
    pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25))
    try:
        yield {"llm": llm, "model_dir": model_dir, "pusher": pusher,
               "versions": {0: load_file(str(Path(model_dir) / "model.safetensors"))}}
    finally:
        pusher.close()
        stop_engine(llm)
        del llm
        gc.collect()


class Driver:
    """An engine of this process stepped from the test thread, episodes driven by an ``EpisodeRollout``."""

    def __init__(self, engine: dict, journal: Path | None = None, episodic: bool = True, *,
                 stop: list[int] | None = None, max_model_len: int = 1024, **task: Any) -> None:
        """``task``: the ``[task]`` table over ``tests.episode_envs:make`` (3 turns of 6 tokens);
        ``stop``: the turns' stop token ids (None: every turn runs to its ``max_tokens``)."""
        from inflight.trainer.rollout.episode_rollout import EpisodeRollout

        self.llm, self.model_dir, self.stop = engine["llm"], engine["model_dir"], stop
        cfg = config_from_dict({
            "task": {"name": "tests.episode_envs:make", "completion_tokens": 6, "options": {"turns": 3},
                     **task},
            "rollout": {"group_size": 2}, "engine": {"max_model_len": max_model_len}})
        self.cfg = cfg
        self.requests: dict[str, Any] = {}
        self.texts: dict[str, str] = {}  # each turn's reply, as the environment read it
        self.steps = 0
        self.groups: list[RolloutGroup] = []
        self.rollout = EpisodeRollout(cfg, str(self.model_dir), "e0", Sampling(), self.llm.get_tokenizer(),
                                      self._add, self._abort, episodic=episodic, journal=journal)
        self.rollout.wait_ready()

    def _add(self, rid: str, prompt: Any, ids: list[int], max_tokens: int, n: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=self.stop is None,
                            stop_token_ids=self.stop, output_kind=RequestOutputKind.FINAL_ONLY)
        self.requests[rid] = prompt
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, sp)

    def _abort(self, rids: list[str]) -> None:
        self.llm.llm_engine.abort_request(rids)
        for rid in rids:
            self.requests.pop(rid, None)

    def start(self, gid: str, prompt: Prompt) -> None:
        """Group ``gid`` of ``prompt``; a verifiers environment renders its opening itself."""
        from inflight.trainer.tasks.task import encode_prompt

        opening = None if self.cfg.task.name == "verifiers" else encode_prompt(self.llm.get_tokenizer(), prompt, "auto")
        self.rollout.start_group(gid, prompt, opening)

    def run(self, on_step=lambda: None, until=lambda: False) -> None:
        """Until every group started has finished or failed (or ``until()``); ``on_step``
        after each engine step."""
        deadline = time.monotonic() + WAIT_S  # renewed at each engine step: a bound for a hang
        while self.rollout.groups and not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {WAIT_S:.0f} s for the episodes' next engine step or environment answer "
                                     f"(groups left: {sorted(self.rollout.groups)})")
            self.groups += self.rollout.collect()
            if not self.llm.llm_engine.has_unfinished_requests():
                time.sleep(0.005)  # every live episode waits on its environment
                continue
            deadline = time.monotonic() + WAIT_S
            for out in self.llm.llm_engine.step():
                if out.finished and out.request_id in self.requests:
                    self.texts[out.request_id] = out.outputs[0].text
                    self.rollout.submit(out, self.requests.pop(out.request_id))
            self.steps += 1
            on_step()



def push_until_pending(engine: dict, version: int, scale: float = 0.05) -> threading.Thread:
    """Push ``version`` (the first weights, ``perturbed`` by ``scale``) from a trainer thread;
    return once its commit waits for the next step."""
    engine["versions"][version] = perturbed(engine["versions"][0], seed=500 + version, scale=scale)
    errors: list[BaseException] = []

    def push() -> None:
        try:
            engine["pusher"].push(version, engine["versions"][version])
        except BaseException as e:  # re-raised by the test
            errors.append(e)
    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    wait_until(lambda: coordinator_of(engine["llm"]).commit_pending() or errors, f"v{version} to be pending",
               poll_s=0.002)
    assert not errors, errors
    return thread


def policy_runs(s: RolloutSample) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of policy tokens."""
    runs, start = [], None
    for i, obs in enumerate(s.observation + [True]):
        if not obs and start is None:
            start = i
        elif obs and start is not None:
            runs.append((start, i))
            start = None
    return runs
