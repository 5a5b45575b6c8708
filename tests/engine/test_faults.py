"""Fault injection on a real vLLM CPU engine running the in-flight worker.

- every kind of bad update is refused with an error naming the problem, while the engine
  keeps decoding; live weights and version do not change; the next good update lands;
- a trainer that stalls mid-transfer is timed out, its staging dropped, and a restarted
  trainer (a new store on the same port) is rejoined;
- a soak of 200 updates while decoding: no token mislabeled, memory flat.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import threading
import time

import msgspec
import pytest
import torch

from inflight.engine.client import tagged
from inflight.protocol import BucketHeader
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from inflight.versions import boundaries, is_monotone
from tests.engine_harness import Harness, Reference, perturbed, push_at_steps
from tests.helpers import WAIT_S, tampering, wait_until

PROMPTS = ["1+2=", "count 3 4", "lazy dog"]
TIMEOUT_S = 30.0
"""The worker's limit on every wait: a stalled trainer is dropped after this. Far above an
ordinary wait for a bucket on a loaded machine (the soak's 200 pushes share the process with
the decoding engine), and far above ``NOTICED_S``, which a dead trainer must beat."""


@pytest.fixture(scope="module")
def harness(tiny_llama, hold_port):
    h = Harness(tiny_llama, "float32", hold_port(), timeout_s=TIMEOUT_S)
    yield h
    h.close()


def _outputs(h: Harness) -> list[tuple[list[int], list[float], list[int]]]:
    return [(o.token_ids, o.logprobs, o.versions) for _, o in h.greedy(PROMPTS)]


# -- tampering with buckets (the pusher's test seam; every frame still crosses the group) ----
def _corrupt(h: BucketHeader, data: torch.Tensor):
    return h, (data.clone().bitwise_xor_(1) if h.index == 1 else data)


def _short(h: BucketHeader, data: torch.Tensor):
    return (msgspec.structs.replace(h, nbytes=h.nbytes - 1), data[:-1]) if h.index == 2 else (h, data)


def _duplicate(h: BucketHeader, data: torch.Tensor):  # bucket 1 arrives again in bucket 2's place
    return (msgspec.structs.replace(h, index=1), data) if h.index == 2 else (h, data)


def _out_of_order(h: BucketHeader, data: torch.Tensor):  # bucket 3's header shows up second
    return (msgspec.structs.replace(h, index=3), data) if h.index == 1 else (h, data)


def test_bad_updates_are_refused_while_the_engine_decodes(harness: Harness) -> None:
    from vllm import SamplingParams

    h = harness
    good = perturbed(h.base, seed=11)
    h.push(good)
    live = h.version
    before = _outputs(h)
    name = "model.layers.0.mlp.down_proj.weight"
    nan = dict(good)
    nan[name] = good[name].clone()
    nan[name][3, 5] = float("nan")
    cases = [  # (expected code, fragment the reason names, version, state, how it is pushed)
        ("stale_version", f"not newer than the live v{live}", live, good, {}),
        ("stale_version", f"not newer than the live v{live}", live - 1, good, {}),  # goes backwards
        ("unknown_tensor", "extra.weight", live + 1, good | {"extra.weight": torch.zeros(4)}, {}),
        ("missing_tensor", name, live + 1, {k: v for k, v in good.items() if k != name}, {}),
        ("bad_shape", name, live + 1, good | {name: good[name][:, :-1]}, {}),
        ("bad_dtype", name, live + 1, good | {name: good[name].double()}, {"keep_dtype": True}),
        ("checksum", "bucket 1", live + 1, good, {"tamper": _corrupt}),
        ("short_bucket", "bucket 2", live + 1, good, {"tamper": _short}),
        ("bucket_order", "bucket 2", live + 1, good, {"tamper": _duplicate}),
        ("bucket_order", "bucket 1", live + 1, good, {"tamper": _out_of_order}),
        ("nonfinite", name, live + 1, nan, {}),
    ]
    coordinator = h.coordinator()
    steps_during: list[int] = []

    def refuse_all(_: int) -> None:  # every case, once the engine has stepped 3 times
        for code, fragment, version, state, kw in cases:
            s0 = coordinator.steps
            keep = kw.pop("keep_dtype", False)
            cast, h.pusher._dtype = h.pusher._dtype, (None if keep else h.pusher._dtype)  # send as given
            try:
                with tampering(h.pusher, kw.get("tamper")), pytest.raises(
                        PushRejected, match=rf"(?s)\[{code}\] .*{re.escape(fragment)}") as exc:
                    h.pusher.push(version, state)
            finally:
                h.pusher._dtype = cast
            assert exc.value.codes == {code}, str(exc.value)
            assert fragment in str(exc.value), str(exc.value)
            steps_during.append(coordinator.steps - s0)
        with pytest.raises(PushRejected, match=rf"\[incomplete\] .*commit of v{live + 1}") as exc:  # no buckets came
            h.pusher.commit(live + 1)
        assert exc.value.codes == {"incomplete"} and f"commit of v{live + 1}" in str(exc.value)

    start = coordinator.steps
    pushes = push_at_steps(lambda: coordinator.steps - start, [3], refuse_all)
    sp = SamplingParams(temperature=1.0, max_tokens=600, logprobs=0, ignore_eos=True, seed=5)
    outs = h.llm.generate(["1+1=", "2+2="], sp, use_tqdm=False)
    pushes.join()
    for o in outs:  # decoding went on throughout, all of it on the one live version
        assert tagged(o.outputs[0]).versions == [live] * 600
    assert sum(steps_during) > 0, "the engine stopped while refusing updates"
    status = h.status()
    assert status.live_version == live and status.rejections == {
        "stale_version": 2, "unknown_tensor": 1, "missing_tensor": 1, "bad_shape": 1, "bad_dtype": 1, "checksum": 1,
        "short_bucket": 1, "bucket_order": 2, "nonfinite": 1, "incomplete": 1}
    assert _outputs(h) == before  # bit-identical: nothing reached the live weights
    # the next good update lands and is exactly the new weights
    new = perturbed(h.base, seed=12)
    h.pusher.push(live + 1, new)
    h.version = live + 1
    ref = Reference(h.model_dir, "float32").load(new)
    for prompt, out in h.greedy(PROMPTS):
        assert out.versions == [live + 1] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))


# -- a trainer that stalls mid-transfer, then is killed and restarted ------------------------
def _stall_at_bucket_2(h: BucketHeader, data: torch.Tensor):
    if h.index == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-update: the engine must not wait forever
    return h, data


def _stalling_trainer(group: GroupConfig, version: int, state: dict, ready) -> None:
    """A restarted trainer comes back where the engine looks for it, on the group's port: it
    cannot reserve a port of its own and hand it on as other child-hosted stores do, so the
    port is unheld from the previous trainer's close until this process binds it (as for any
    trainer restarted on a fixed port)."""
    pusher = WeightPusher(group, PushConfig(bucket_mb=0.25))
    ready.set()
    with tampering(pusher, _stall_at_bucket_2):
        pusher.push(version, state)


def test_stalled_trainer_is_dropped_and_a_restarted_one_rejoins(harness: Harness) -> None:
    h = harness
    live, before = h.version, _outputs(h)
    status0 = h.status()
    h.pusher.close()  # this trainer leaves; the worker waits for the next one on the same port
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_stalling_trainer, args=(h.group, live + 1, perturbed(h.base, seed=13), ready),
                         daemon=True)
    victim.start()
    try:
        assert ready.wait(WAIT_S), f"waited {WAIT_S:.0f} s for the stalling trainer to form the group"

        def dropped() -> bool:
            assert _outputs(h) == before  # the engine serves the last good version meanwhile
            return h.status().dropped_staging != status0.dropped_staging
        wait_until(dropped, f"the stalled trainer's update to be dropped at the worker's timeout ({TIMEOUT_S:g} s)",
                   poll_s=0.0, timeout_s=TIMEOUT_S + WAIT_S)
        status = h.status()
        assert status.live_version == live
        err = status.last_error  # the bucket it stalled on: gloo may not have sent the ones posted before the stop
        assert "bucket" in err and "trainer rank 0" in err and f"{TIMEOUT_S:.1f}s" in err, err
    finally:
        victim.kill()
        victim.join(10)
    assert _outputs(h) == before
    # a restarted trainer: a new store on the same port, a new generation; the worker rejoins
    h.pusher = WeightPusher(h.group, PushConfig(dtype="float32", bucket_mb=0.25))
    assert h.pusher.engine_versions == {1: live}
    new = perturbed(h.base, seed=14)
    h.push(new)
    status = h.status()
    assert status.live_version == h.version == live + 1
    assert status.rejoins >= status0.rejoins + 2  # after the clean shutdown, and after the stall
    ref = Reference(h.model_dir, "float32").load(new)
    for prompt, out in h.greedy(PROMPTS):
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))


def _killed_trainer(group: GroupConfig, version: int, state: dict, ready, early: bool) -> None:
    """A trainer that dies (SIGKILL, no goodbye) in the middle of a bucket of a transfer, its
    header sent and its bytes not: bucket 1 (early) or the bucket before the last (late)."""
    from inflight.transport.bucket import plan_tensors

    config = PushConfig(dtype="float32", bucket_mb=0.25)
    _, total = plan_tensors((n, tuple(t.shape), "float32") for n, t in state.items())
    at = 1 if early else -(-total // config.bucket_bytes) - 2

    def die(h: BucketHeader, data: torch.Tensor):
        if h.index == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return h, data
    pusher = WeightPusher(group, config)
    ready.set()
    with tampering(pusher, die):
        pusher.push(version, state)


NOTICED_S = 12.0
"""How soon a worker must notice its trainer's death, wherever in a push it lands: the poll of
a posted op asks the trainer's store every quarter second (``DataPlane._poll``), so well
under a second on an idle machine; 10 s more for a loaded one, and still far below the
worker's timeout (``TIMEOUT_S``), the only other way the update would be dropped."""
assert NOTICED_S < TIMEOUT_S / 2


@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_a_trainer_killed_mid_push_is_noticed_before_the_timeout_and_a_new_one_pushes(harness: Harness,
                                                                                      early: bool) -> None:
    h = harness
    live, before = h.version, _outputs(h)
    status0 = h.status()
    h.pusher.close()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_killed_trainer, args=(h.group, live + 1, perturbed(h.base, seed=15), ready, early),
                         daemon=True)
    victim.start()
    assert ready.wait(WAIT_S), f"waited {WAIT_S:.0f} s for the trainer to form the group"
    victim.join(WAIT_S)
    assert victim.exitcode == -signal.SIGKILL, f"the trainer did not die at its bucket: exit code {victim.exitcode}"
    dead = time.monotonic()
    while h.status().dropped_staging == status0.dropped_staging:  # the half-received update is dropped
        # at once, not at the worker's timeout
        assert time.monotonic() - dead < NOTICED_S, f"not dropped within {NOTICED_S:g} s: {h.status()}"
    assert "trainer" in h.status().last_error, h.status().last_error  # gloo saw the reset, or the heartbeat the death
    assert _outputs(h) == before and h.status().live_version == live  # the last version, still served
    h.pusher = WeightPusher(h.group, PushConfig(dtype="float32", bucket_mb=0.25))  # a new trainer pushes
    assert h.pusher.engine_versions == {1: live}
    new = perturbed(h.base, seed=16)
    h.push(new)
    assert h.status().live_version == h.version == live + 1
    ref = Reference(h.model_dir, "float32").load(new)
    for prompt, out in h.greedy(PROMPTS):
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))


# -- soak --------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_200_updates_while_decoding(harness: Harness) -> None:
    from vllm import SamplingParams

    h = harness
    states = [perturbed(h.base, seed=s, scale=0.02) for s in (21, 22)]
    n_updates, warmup = 200, 20
    commits = []
    rss: dict[str, int] = {}
    errors: list[BaseException] = []
    done = threading.Event()

    def trainer() -> None:
        try:
            for k in range(n_updates):
                if k == warmup:
                    rss["warm"] = _rss_bytes()
                commits.append(h.push(states[k % 2]).commits[1])
            rss["end"] = _rss_bytes()
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    outs = []
    sp = SamplingParams(temperature=1.0, max_tokens=120, logprobs=0, ignore_eos=True)
    landed, deadline = 0, time.monotonic() + WAIT_S  # renewed at each commit: a bound for a hang
    while not done.is_set():
        outs += h.llm.generate([f"{i}+{i}=" for i in range(8)], sp, use_tqdm=False)
        if len(commits) > landed:
            landed, deadline = len(commits), time.monotonic() + WAIT_S
        assert time.monotonic() < deadline, f"waited {WAIT_S:.0f} s for update {landed + 1} of {n_updates} to commit"
    t.join(WAIT_S)
    assert not t.is_alive(), f"waited {WAIT_S:.0f} s for the trainer thread to end"
    assert not errors, errors
    assert len(commits) == n_updates and h.status().live_version == h.version
    by_version = {c.version: c for c in commits}
    spanning = 0
    for o in outs:
        tc = tagged(o.outputs[0])
        assert is_monotone(tc.versions)
        first = boundaries(tc.versions)
        spanning += len(first) > 1
        for v, index in list(first.items())[1:]:  # each version change sits exactly at its commit
            assert index == by_version[v].tokens_at_commit[o.request_id], (o.request_id, v)
        for c in commits:  # and every commit during the request left its boundary
            n = c.tokens_at_commit.get(o.request_id)
            if n is not None and n < len(tc.versions):
                assert tc.versions[n] >= c.version and (n == 0 or tc.versions[n - 1] < c.version)
    assert spanning > 0
    growth = rss["end"] / rss["warm"]
    assert growth < 1.10, f"RSS grew {100 * (growth - 1):.1f}% over {n_updates - warmup} updates"
