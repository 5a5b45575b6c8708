"""The in-flight worker on a real vLLM CPU engine (``LLM``, in-process EngineCore).

- after an update, greedy tokens and log-probs equal a transformers reference of the new
  weights, in fp32 and bf16; rolling back restores the original outputs;
- requests in flight across several commits finish with monotone tags whose boundaries
  sit exactly at each commit's step;
- decoding goes on while a transfer is in progress.
"""

from __future__ import annotations

import pytest
import torch

from inflight.engine.client import tagged
from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.versions import boundaries, is_monotone
from tests.engine_harness import Harness, Reference, drive, perturbed, push_at_steps
from tests.helpers import tampering, wait_until

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5=", "lazy dog"]
# Measured here: fp32 <= 1.7e-6 (oneDNN vs transformers' matmuls); bf16 <= 0.016 (every
# activation rounded, in each implementation's own order).
LOGPROB_ATOL = {"float32": 1e-5, "bfloat16": 3e-2}


# (architecture, dtype, commit strategy); "auto" is the swap commit on an eager CPU engine,
# "reload" the layerwise reload that compiled or quantized CPU engines use
ENGINES = [("qwen2", "float32", "auto"), ("qwen2", "bfloat16", "auto"), ("llama", "float32", "auto"),
           ("qwen2", "float32", "reload")]


@pytest.fixture(scope="module", params=ENGINES, ids=lambda p: "-".join(p))
def harness(request, tiny_qwen, tiny_llama, hold_port):
    arch, dtype, commit = request.param
    h = Harness(tiny_qwen if arch == "qwen2" else tiny_llama, dtype, hold_port(), commit=commit, keep_base=True)
    assert h.start_report.commit == ("swap" if commit == "auto" else commit)
    yield h
    h.close()


# Checks that do not depend on dtype, architecture or commit strategy run on the first engine only.
ONCE = pytest.mark.parametrize("harness", [ENGINES[0]], indirect=True, ids=lambda p: "-".join(p))


def _check_against_reference(h: Harness, state: dict[str, torch.Tensor], expect_version: int) -> list:
    ref = Reference(h.model_dir, h.dtype).load(state)
    outs = h.greedy(PROMPTS)
    for prompt, out in outs:
        assert out.versions == [expect_version] * len(out.token_ids)
        if h.dtype == "float32":  # bf16 argmax ties can flip between two correct implementations
            assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
        want = ref.logprobs(prompt, out.token_ids)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL[h.dtype], rtol=0)
    return outs


def test_update_matches_transformers_and_rollback_restores(harness: Harness) -> None:
    h = harness
    before = h.greedy(PROMPTS)
    _check_against_reference(h, h.base, expect_version=h.version)
    new = perturbed(h.base, seed=1)
    result = h.push(new)
    assert result.commits[1].version == h.version
    _check_against_reference(h, new, expect_version=h.version)
    h.push(h.base)  # roll back by pushing the old weights as a newer version
    after = h.greedy(PROMPTS)
    for (_, a), (_, b) in zip(before, after):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
        assert b.versions == [h.version] * len(b.token_ids)


def _small_step(master: dict[str, torch.Tensor], seed: int) -> None:
    """An fp32 step that moves 5% of the elements by ~1e-3 of themselves (in bf16, many round
    back to the value they had)."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t.add_((torch.rand(t.shape, generator=g) < 0.05) * t * 1e-3 * torch.randn(t.shape, generator=g))


def _held_digests(h: Harness) -> dict[str, int]:
    """The xxh3 of each tensor of the live version's bytes the engine keeps (its sparse base)."""
    from inflight.transport.bucket import checksum

    def digests(worker) -> dict[str, int]:
        base = worker._inflight_pool.base_for()
        return {n: checksum(t.reshape(-1).view(torch.uint8), "xxh3") for n, t in base.views.items()}
    return h.llm.collective_rpc(digests)[0]


@pytest.mark.parametrize("harness", ENGINES[:2], indirect=True, ids=lambda p: "-".join(p))
def test_ten_sparse_pushes_equal_transformers_and_a_dense_push(harness: Harness) -> None:
    """Ten sparse updates in a row: the engine's bytes are, bit for bit, the trainer's weights
    cast as a dense push casts them; its outputs equal transformers' (fp32) and, bit for bit,
    its outputs after a dense push of the same weights (bf16 and fp32)."""
    from inflight.transport.bucket import checksum
    from inflight.transport.pusher import PushConfig

    h = harness
    master = {n: t.clone() for n, t in h.base.items()}
    with h.pushing_with(PushConfig(dtype=h.dtype, bucket_mb=0.25, encoding="sparse")):
        assert h.push(master).send.changed_frac is None  # the trainer holds no base yet: dense
        for k in range(10):
            _small_step(master, seed=k)
            send = h.push(master).send
            assert send.changed_frac is not None and send.nbytes < 0.5 * send.dense_bytes, send
        want = {n: checksum(t.to(getattr(torch, h.dtype)).reshape(-1).view(torch.uint8), "xxh3")
                for n, t in master.items()}
        assert _held_digests(h) == want
        sparse = h.greedy(PROMPTS)
        if h.dtype == "float32":
            _check_against_reference(h, master, expect_version=h.version)
    assert h.push(master).send.changed_frac is None  # the harness's own pusher: dense
    dense = h.greedy(PROMPTS)
    for (_, a), (_, b) in zip(sparse, dense):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@ONCE
def test_a_sparse_update_the_engine_cannot_rebuild_is_refused_and_live_stays(harness: Harness) -> None:
    """The engine lost its base: the delta is refused by name and goes again dense. Its base
    bytes are not the version's any more: the rebuilt tensor fails its checksum, the update
    is refused, and the engine serves what it served, bit for bit."""
    from inflight.transport.pusher import PushConfig, PushRejected

    h = harness
    master = {n: t.clone() for n, t in h.base.items()}
    with h.pushing_with(PushConfig(dtype=h.dtype, bucket_mb=0.25, encoding="sparse")):
        h.push(master)

        def lose_base(worker) -> None:
            pool = worker._inflight_pool
            pool.give(pool.base.flat)
            pool.base = None
        h.llm.collective_rpc(lose_base)
        _small_step(master, seed=20)
        assert h.push(master).send.changed_frac is None  # refused, then sent dense
        status = h.status()
        assert status.rejections.get("wrong_base") == 1
        assert f"v{h.version} is a sparse update against v{h.version - 1}, and this worker holds no base bytes" \
            in status.last_error
        before, live = h.greedy(PROMPTS), h.version

        def corrupt_base(worker) -> None:
            worker._inflight_pool.base.views["model.norm.weight"].mul_(2.0)
        h.llm.collective_rpc(corrupt_base)
        _small_step(master, seed=21)
        with pytest.raises(PushRejected, match=r"\[checksum\] v\d+: model.norm.weight rebuilt on v\d+ has checksum"):
            h.push(master)
        assert h.status().live_version == live
        after = h.greedy(PROMPTS)
        for (_, a), (_, b) in zip(before, after):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and b.versions == [live] * len(b.token_ids)
    h.push(master)  # dense (the harness's pusher): the engine serves the harness's version again
    assert h.status().live_version == h.version


@ONCE
def test_requests_span_many_versions_with_exact_boundaries(harness: Harness) -> None:
    from vllm import SamplingParams

    h = harness
    coordinator = h.coordinator()
    n_steps, commit_at = 160, (20, 55, 90, 125)
    start = coordinator.steps
    pushes = push_at_steps(lambda: coordinator.steps - start, commit_at,
                           lambda k: h.push(perturbed(h.base, seed=100 + k, scale=0.02)).commits[1])
    sp = SamplingParams(temperature=1.0, max_tokens=n_steps, logprobs=0, ignore_eos=True, seed=7)
    # each commit lands within 30 steps of its mark, however slow the machine: see ``drive``
    outs = drive(h.llm, coordinator, [f"{i}+{i}=" for i in range(12)], sp, hold_at=[a + 30 for a in commit_at],
                 start=start)
    commits = pushes.join()
    assert len(commits) == len(commit_at)
    for o in outs:
        tc = tagged(o.outputs[0])
        assert len(tc.token_ids) == n_steps and is_monotone(tc.versions)
        first = boundaries(tc.versions)
        assert set(first) == {h.version - 4, *(c.version for c in commits)}, first
        for c in commits:
            # the first token of v is exactly the request's token count at the commit...
            assert first[c.version] == c.tokens_at_commit[o.request_id]
            # ...and all requests started together, so that is the commit's step index
            assert first[c.version] == c.step - start
    # commits that landed mid-generation ran at a step boundary, on the thread that runs the
    # forward passes; an idle in-process engine's commit runs under the step lock instead
    landed = {c.version for c in commits}
    records = [r for r in coordinator.history if r.version in landed]
    assert {r.via for r in records} == {"step"}, [(r.version, r.via) for r in records]
    assert all(w.execution_thread is True for r in records for w in r.workers)


@ONCE
def test_the_worker_counts_model_steps_without_a_forward_hook(harness: Harness) -> None:
    """A step that replays a full CUDA graph never calls the model's forward, so the worker
    counts its steps in ``execute_model`` (``count_worker_steps``): no forward hook of ours is
    on the model, and the worker's count moves with the engine's, step for step."""
    from inflight.engine.client import inflight_status

    h = harness
    assert h.llm.collective_rpc(lambda self: len(self.model_runner.get_model()._forward_pre_hooks)) == [0]
    before = inflight_status(h.llm)
    h.greedy(PROMPTS[:2], max_tokens=7)
    after = inflight_status(h.llm)
    assert after.model_steps - before.model_steps == after.engine.steps - before.engine.steps >= 7


@ONCE
def test_decoding_continues_while_buckets_arrive(harness: Harness) -> None:
    from vllm import SamplingParams

    h = harness
    h.pusher.sender.bucket_bytes = 16384  # ~80 buckets
    result: dict = {}
    coordinator = h.coordinator()
    start = coordinator.steps

    def hold_bucket_20(header, data):  # the sender waits at bucket 20 until the engine stepped 3 more times
        if header.index == 20:
            at = coordinator.steps
            result["sender_waiting"] = True
            wait_until(lambda: coordinator.steps >= at + 3, f"engine step {at + 3} (the sender held at bucket 20)",
                       poll_s=0.001)
            result["sender_waiting"] = False
        return header, data

    def stage_then_commit(_: int) -> None:  # once the engine stepped 5 times
        h.version += 1
        with tampering(h.pusher, hold_bucket_20):
            stats, staged = h.pusher.send(h.version, perturbed(h.base, seed=7))
        result["staged"] = staged[1]
        result["steps_staged"] = coordinator.steps
        # staged, not committed: the engine keeps serving
        wait_until(lambda: coordinator.steps >= result["steps_staged"] + 3,
                   f"engine step {result['steps_staged'] + 3} (the update staged, its commit held)", poll_s=0.001)
        result["steps_before_commit"] = coordinator.steps
        result["commit"] = h.pusher.commit(h.version)[1]

    try:
        pushes = push_at_steps(lambda: coordinator.steps - start, [5], stage_then_commit)
        # long requests, held near their end until the commit; on a busy machine staging may
        # outlast 990 steps, so the hold lets the engine step while the trainer waits for its
        # steps (and only then), and the commit still lands before the end
        sp = SamplingParams(temperature=1.0, max_tokens=1000, logprobs=0, ignore_eos=True, seed=3)

        def waiting_for_steps() -> bool:  # the sender at bucket 20, or the trainer after staging
            return result.get("sender_waiting", False) or ("steps_staged" in result
                                                           and "steps_before_commit" not in result)

        outs = drive(h.llm, coordinator, ["1+1=", "2+2="], sp, hold_at=[990], start=start, release=waiting_for_steps)
        pushes.join()
    finally:
        h.pusher.sender.bucket_bytes = h.pusher.config.bucket_bytes
    staged, commit = result["staged"], result["commit"]
    assert staged.steps_during_transfer >= 3, "fewer engine steps than the sender waited for while buckets arrived"
    assert result["steps_before_commit"] >= result["steps_staged"] + 3
    assert commit.steps_since_first_bucket >= staged.steps_during_transfer + 3
    for o in outs:
        versions = tagged(o.outputs[0]).versions
        first_new = boundaries(versions)[commit.version]
        # every token sampled while the update was in flight carries the old version
        assert first_new == commit.tokens_at_commit[o.request_id] >= staged.steps_during_transfer


@ONCE
def test_behaviour_logprobs_honour_temperature(harness: Harness) -> None:
    from vllm import SamplingParams

    h = harness
    h.push(h.base)
    ref = Reference(h.model_dir, h.dtype).load(h.base)
    sp = SamplingParams(temperature=0.7, max_tokens=16, logprobs=0, ignore_eos=True, seed=11)
    for o in h.llm.generate(PROMPTS, sp, use_tqdm=False):
        out = tagged(o.outputs[0])
        want = ref.logprobs(list(o.prompt_token_ids), out.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0)


@ONCE
@pytest.mark.parametrize("top_k,top_p", [(8, 1.0), (0, 0.8), (12, 0.9)])
def test_behaviour_logprobs_under_top_k_and_top_p_equal_the_trainers(harness: Harness, top_k: int,
                                                                      top_p: float) -> None:
    """The engine's processed log-probs of what it sampled under top-k/top-p, against the
    trainer's ``policy_logprobs`` of the same weights (collated as for training). A position
    whose filter cut lies within 2e-5 of a kept logit or cumulative probability may fall on
    either side in two implementations 1.7e-6 apart: those are counted, not compared."""
    from vllm import SamplingParams

    from inflight.trainer.loss import collate, policy_logprobs

    h = harness
    h.push(h.base)
    ref = Reference(h.model_dir, h.dtype).load(h.base)
    sampling = Sampling(temperature=0.7, top_k=top_k, top_p=top_p)
    sp = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, max_tokens=16, logprobs=0, ignore_eos=True, seed=13)
    samples = []
    for i, o in enumerate(h.llm.generate(PROMPTS * 2, sp, use_tqdm=False)):
        out = tagged(o.outputs[0])
        samples.append(RolloutSample(sample_id=f"s{i}", group_id="g", prompt_ids=list(o.prompt_token_ids),
                                     token_ids=out.token_ids, logprobs=out.logprobs, versions=out.versions, reward=i))
    batch = collate([RolloutGroup(group_id="g", samples=tuple(samples))], pad_id=0, normalize_std=False)
    with torch.no_grad():
        logp, _ = policy_logprobs(ref.model, batch, sampling, impl="torch")
        near = _near_the_cut(ref.model, batch, sampling)
    real = batch.completion_mask > 0
    assert int((real & near).sum()) <= 0.1 * int(real.sum()), "the filter cut sits too close to too many tokens"
    compared = real & ~near
    assert torch.isfinite(logp[compared]).all(), "the trainer's filter dropped a token the engine sampled"
    torch.testing.assert_close(logp[compared], batch.behaviour_logp[compared], atol=1e-5, rtol=0)


def _near_the_cut(model, batch, sampling: Sampling, margin: float = 2e-5) -> torch.Tensor:
    """(B, T) positions whose top-k cut (the k-th and k+1-th logits) or top-p cut (the
    cumulative probability against 1 - top_p) is within ``margin``."""
    t = batch.completion_ids.shape[1]
    z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
              logits_to_keep=t + 1).logits[:, :t].double() / sampling.temperature
    zs = z.sort(-1, descending=True).values
    near = torch.zeros(z.shape[:-1], dtype=torch.bool)
    if sampling.top_k:
        near |= (zs[..., sampling.top_k - 1] - zs[..., sampling.top_k]).abs() < margin
        zs = zs.masked_fill(zs < zs[..., sampling.top_k - 1: sampling.top_k], float("-inf"))
    if sampling.top_p < 1:
        above = zs.softmax(-1).cumsum(-1) - zs.softmax(-1)  # probability ranked above each token
        near |= ((above - sampling.top_p).abs() < margin).any(-1)
    return near


def test_misconfigured_engine_is_refused(tiny_llama, port) -> None:
    from vllm import LLM

    from inflight.engine.client import start_inflight
    from inflight.engine.engine_config import WORKER_EXTENSION, InflightConfig
    from inflight.transport.group_config import GroupConfig

    llm = LLM(str(tiny_llama), enforce_eager=True, max_model_len=256, worker_extension_cls=WORKER_EXTENSION,
              enable_prefix_caching=True)
    with pytest.raises(Exception, match="inflight cannot run on this engine: .*need 'processed_logprobs'") as exc:
        start_inflight(llm, InflightConfig(group=GroupConfig(port=port)))
    assert "need 'processed_logprobs'" in str(exc.value)
    assert "prefix" not in str(exc.value)  # prefix caching is kept exact across commits, not refused
    assert getattr(llm.llm_engine.engine_core.engine_core, "_inflight_coordinator", None) is None  # nothing attached
    del llm


def test_engines_without_a_between_steps_boundary_are_refused(tiny_llama, port) -> None:
    """Pipeline and data parallelism, and ranks beyond the group, are refused by name, on the
    real engine configuration with only the parallel layout changed."""
    import copy

    from vllm import LLM

    from inflight.engine.coordinator import check_engine
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig

    llm = LLM(str(tiny_llama), enforce_eager=True, max_model_len=256, **engine_kwargs())
    real = llm.llm_engine.vllm_config
    config = InflightConfig(group=GroupConfig(port=port, world_size=3))
    assert check_engine(real, config) == 1

    def layout(**sizes: int):
        vc = copy.copy(real)
        vc.parallel_config = copy.copy(real.parallel_config)
        for k, v in sizes.items():
            setattr(vc.parallel_config, k, v)
        vc.parallel_config.world_size = (vc.parallel_config.tensor_parallel_size
                                         * vc.parallel_config.pipeline_parallel_size)
        return vc

    with pytest.raises(RuntimeError, match="pipeline_parallel_size=2 is not supported: vLLM's batch queue"):
        check_engine(layout(pipeline_parallel_size=2), config)
    with pytest.raises(RuntimeError, match="data_parallel_size=2 is not supported"):
        check_engine(layout(data_parallel_size=2), config)
    assert check_engine(layout(tensor_parallel_size=2), config) == 2  # ranks 1, 2 of 3
    with pytest.raises(RuntimeError,
                       match=r"4 workers, which take weight-group ranks 1..4, but GroupConfig.world_size=3"):
        check_engine(layout(tensor_parallel_size=4), config)
    # async scheduling commits between batches (tests/engine/test_prefix_cache.py), but routing is read
    # after a step's forward, when the next batch's forward has already run
    async_config = copy.copy(real)
    async_config.scheduler_config = copy.copy(real.scheduler_config)
    async_config.scheduler_config.async_scheduling = True
    assert check_engine(async_config, config) == 1
    with pytest.raises(RuntimeError, match="record_routing needs async_scheduling=False"):
        check_engine(async_config, InflightConfig(group=config.group, record_routing=True))
    del llm
