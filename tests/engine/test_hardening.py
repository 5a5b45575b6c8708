"""Hardening, on a real vLLM CPU engine where one can run.

- bad input on the public API gets an error naming the problem, and the engine keeps serving;
- random bytes a stray client writes to the group's store keys are named, not crashed on;
- a commit that fails after the group re-formed restores the live version, not the disk's;
- the commit's per-request token counts survive requests being added meanwhile;
- an engine whose model sets sampling defaults refuses to start; the queue refuses groups
  sampled with transforms the trainer does not apply, with a count;
- checkpoints: atomic swap, buffer counters restored, CUDA RNG saved; rejection codes are
  classified by structure, not by matching message text.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from torch.distributed import HashStore, PrefixStore, TCPStore

from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.transport.errors import TransportError
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushRejected
from inflight.transport.store import wait_key
from tests.engine_harness import Harness, Reference, perturbed
from tests.helpers import fail_after_applying


@pytest.fixture(scope="module")
def harness(tiny_llama, hold_port):
    h = Harness(tiny_llama, "float32", hold_port(), commit="reload", timeout_s=20.0)
    yield h
    h.close()


def _serves(h: Harness, version: int) -> None:
    """The engine still decodes, every token on ``version``."""
    (_, out), = h.greedy(["1+2="], max_tokens=4)
    assert out.versions == [version] * 4


# -- bad input ---------------------------------------------------------------------------
def test_pusher_refuses_bad_input_by_name_and_the_engine_keeps_serving(harness: Harness) -> None:
    h = harness
    h.push(perturbed(h.base, seed=1))
    live, good = h.version, perturbed(h.base, seed=2)
    name = "model.layers.0.mlp.down_proj.weight"
    tied = ({k: v for k, v in good.items() if k != "lm_head.weight"}
            | {"lm_head.weight": good["model.embed_tokens.weight"]})
    cases = [  # (state, version, fragment the error names)
        ({}, live + 1, "nothing to push"),
        (good | {name: good[name].to(torch.int32)}, live + 1, f"{name}: dtype torch.int32 is not floating point"),
        (good | {name: torch.empty(good[name].shape, device="meta")}, live + 1, f"{name}: on device meta"),
        (tied, live + 1, "'model.embed_tokens.weight' and 'lm_head.weight' are one tied parameter"),
        (good, -1, "version=-1"),
        (good, True, "version=True"),
    ]
    for state, version, fragment in cases:
        with pytest.raises((ValueError, TypeError), match=re.escape(fragment)) as exc:
            h.pusher.push(version, state)
        assert fragment in str(exc.value), str(exc.value)
    # version 0: the engines' loaded weights, refused by them
    with pytest.raises(PushRejected, match=r"(?s)\[stale_version\] .*versions start at 1") as rejected:
        h.pusher.push(0, good)
    assert rejected.value.codes == {"stale_version"} and "versions start at 1" in str(rejected.value)
    assert h.status().live_version == live
    _serves(h, live)
    # the next good update lands, exactly, even with a non-contiguous tensor (packed by value)
    transposed_back = good[name].t().contiguous().t()
    assert not transposed_back.is_contiguous()
    h.push(good | {name: transposed_back})
    ref = Reference(h.model_dir, "float32").load(good)
    for prompt, out in h.greedy(["1+2=", "count 3 4"]):
        assert out.versions == [h.version] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))


def test_inflight_config_json_with_unknown_fields_is_refused_by_name() -> None:
    good = InflightConfig(group=GroupConfig(port=29999)).to_json()
    assert InflightConfig.from_json(good) == InflightConfig(group=GroupConfig(port=29999))
    data = json.loads(good)
    with pytest.raises(ValueError, match=r"InflightConfig: unknown fields \['keep_rolback'\]"):
        InflightConfig.from_json(json.dumps(data | {"keep_rolback": False}))
    data["group"]["hots"] = "10.0.0.1"
    with pytest.raises(ValueError, match=r"InflightConfig.group: unknown fields \['hots'\]"):
        InflightConfig.from_json(json.dumps(data))
    pinned = InflightConfig(group=GroupConfig(port=29999), listener_cpus=(0, 1))
    assert InflightConfig.from_json(pinned.to_json()) == pinned
    for bad in ((0, 0), (-1,)):
        with pytest.raises(ValueError, match=rf"InflightConfig.listener_cpus={re.escape(str(bad))} must be distinct"):
            InflightConfig(group=GroupConfig(port=29999), listener_cpus=bad)


def test_stray_bytes_in_the_group_store_are_named_and_the_engine_keeps_serving(harness: Harness) -> None:
    h = harness
    live = h.version
    g = h.pusher.group.generation
    # a stray client: it knows the key layout, not the protocol
    stray = PrefixStore(h.group.name, TCPStore(h.group.host, h.group.port, is_master=False, wait_for_workers=False))
    noise = bytes(range(7, 250, 3))
    seq = h.pusher.control.seq
    stray.set(f"gen{g}/ctl/msg/{seq}", noise)  # the next control message, before the trainer posts it
    wait_key(stray, f"gen{g}/ctl/rep/{seq}/ack/1", timeout_s=60, stop=None, what="the refusal", who="test")  # read
    with pytest.raises(PushRejected, match=r"(?s)\[bad_message\] .*bad control message") as exc:
        h.push(perturbed(h.base, seed=3))
    assert exc.value.codes == {"bad_message"} and "bad control message" in str(exc.value)
    _serves(h, live)
    stray.set(f"gen{g + 1}/hello/1", noise)  # the worker's hello to the next generation
    with pytest.raises(TransportError, match=rf"unreadable hello of worker rank 1 at gen{g + 1}/hello/1"):
        h.pusher.rejoin(10.0)
    _serves(h, live)
    h.pusher.rejoin(60.0)  # the next generation forms, and updates land again
    h.push(perturbed(h.base, seed=4))
    _serves(h, h.version)


# -- races and recovery -------------------------------------------------------------------
def test_failed_commit_after_a_rejoin_restores_the_live_version(harness: Harness) -> None:
    h = harness
    live_state = perturbed(h.base, seed=5)
    h.push(live_state)
    live = h.version
    h.pusher.rejoin(60.0)  # a new generation: the worker runs a new listener, which never committed
    h.llm.collective_rpc(fail_after_applying)
    with pytest.raises(PushRejected, match=r"(?s)\[commit_failed\] .*injected failure") as exc:
        h.pusher.push(live + 1, perturbed(h.base, seed=6))
    assert exc.value.codes == {"commit_failed"} and "injected failure" in str(exc.value)
    status = h.status()
    assert status.live_version == status.engine.live_version == live and not status.engine.broken
    ref = Reference(h.model_dir, "float32").load(live_state)  # exactly the live version, not the checkpoint
    for prompt, out in h.greedy(["1+2=", "count 3 4"]):
        assert out.versions == [live] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
    h.push(perturbed(h.base, seed=6))  # the same version again: it must not read the failed attempt's outcome
    assert h.status().live_version == h.version == live + 1


def test_commit_reports_token_counts_while_requests_come_and_go(harness: Harness) -> None:
    """An in-process engine with nothing running commits from the coordinator's thread and
    reads ``scheduler.requests`` there, while the user's thread adds and aborts requests.

    A guard, not a proof: the coordinator copies the dict with one ``list(...items())``, a
    single C call under the GIL, so no add or abort can interleave with the read; iterating
    the live dict instead is unsafe in principle, but its window is a few bytecodes and this
    test does not reliably hit it."""
    from vllm import SamplingParams

    h = harness
    engine = h.llm.llm_engine
    stop = threading.Event()
    sp = SamplingParams(max_tokens=4)

    def churn() -> None:
        i = 0
        while not stop.is_set():
            engine.add_request(f"churn{i}", "1+1=", sp)
            engine.abort_request([f"churn{i}"])
            i += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        states = [perturbed(h.base, seed=s, scale=0.01) for s in (7, 8)]
        for k in range(20):
            result = h.push(states[k % 2])
            assert result.commits[1].version == h.version
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(switch)
    assert h.status().live_version == h.version


# -- sampling mismatch --------------------------------------------------------------------
def test_engine_with_model_sampling_defaults_refuses_to_start(tiny_llama, tmp_path, port) -> None:
    from vllm import LLM

    from inflight.engine.client import start_inflight

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(gen | {"top_k": 20, "top_p": 0.8,
                                                                    "repetition_penalty": 1.05}))
    assert engine_kwargs()["generation_config"] == "vllm"
    llm = LLM(str(model), enforce_eager=True, dtype="float32", max_model_len=256,
              **engine_kwargs(generation_config="auto"))
    try:
        config = InflightConfig(group=GroupConfig(port=port, world_size=2))
        with pytest.raises(Exception, match=r"top_k=20, top_p=0.8, repetition_penalty=1.05.*generation_config='vllm'"):
            start_inflight(llm, config)
    finally:
        del llm


def _group(gid: str, sampling: Sampling | None, **sample) -> RolloutGroup:
    fields = dict(sample_id=f"{gid}-0", group_id=gid, prompt_ids=[1], token_ids=[5, 6], logprobs=[-0.5, -0.7],
                  versions=[0, 0], reward=1.0) | sample
    return RolloutGroup(group_id=gid, samples=(RolloutSample(**fields),), sampling=sampling)


def test_queue_refuses_groups_sampled_from_a_distribution_the_trainer_does_not_score() -> None:
    from vllm import SamplingParams

    from inflight.trainer.rollout.engine_process import sampling_of

    assert sampling_of(SamplingParams(temperature=0.7)).transforms() == []
    assert sampling_of(SamplingParams(top_k=20, top_p=0.8)).transforms() == ["top_k=20", "top_p=0.8"]
    queue = RolloutQueue(HashStore(), capacity=10)
    buffer = RolloutBuffer(queue, admit_lag=4, group_size=1)
    queue.put(_group("plain", sampling_of(SamplingParams(temperature=0.7))))
    queue.put(_group("topp", sampling_of(SamplingParams(temperature=0.7, top_p=0.8))))
    queue.put(_group("penalty", Sampling(repetition_penalty=1.05)))
    queue.put(_group("unknown", None))  # a producer that does not report: admitted
    assert buffer.drain(current_version=0) == 4
    assert [g.group_id for g in buffer.pending] == ["plain", "unknown"]
    assert buffer.stats()["rejected"] == {"sampling_mismatch": 2}
    # a trainer that mirrors top-p 0.8 at temperature 0.7 admits exactly that distribution
    mirrored = RolloutBuffer(queue, admit_lag=4, group_size=1, sampling=Sampling(temperature=0.7, top_p=0.8))
    queue.put(_group("plain", sampling_of(SamplingParams(temperature=0.7))))
    queue.put(_group("topp", sampling_of(SamplingParams(temperature=0.7, top_p=0.8))))
    queue.put(_group("hotter", sampling_of(SamplingParams(temperature=1.0, top_p=0.8))))
    queue.put(_group("topk", sampling_of(SamplingParams(temperature=0.7, top_p=0.8, top_k=5))))
    assert mirrored.drain(current_version=0) == 4
    assert [g.group_id for g in mirrored.pending] == ["topp"]
    assert mirrored.stats()["rejected"] == {"sampling_mismatch": 3}


# -- checkpoints and counters -------------------------------------------------------------
class _Model:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def save_pretrained(self, path: str, **_: object) -> None:
        (Path(path) / "model.txt").write_text(self.marker)


def _optimizer_dir(path: Path) -> None:  # what the optimizer holds is not these tests' matter
    path.mkdir()


def _save(path: Path, marker: str, step: int) -> None:
    from inflight.trainer.checkpoint import TrainerState, save_checkpoint

    state = TrainerState(step=step, version=step, python_rng=random.getstate(),
                         torch_rng=torch.get_rng_state(), buffer_stats={"admitted": step}, pending=[])
    save_checkpoint(path, _Model(marker), _Model(marker), _optimizer_dir, state)


def test_a_crash_during_a_checkpoint_swap_leaves_a_complete_checkpoint(tmp_path, monkeypatch) -> None:
    from inflight.trainer.checkpoint import load_state

    path = tmp_path / "checkpoint"
    _save(path, "first", 1)
    real = Path.rename
    calls = []

    def crash_on_second_rename(self: Path, target):  # the process dies between two renames
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-swap")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second_rename)
    try:
        _save(path, "second", 2)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(Path, "rename", real)
    assert (path / "state.json").exists(), sorted(p.name for p in tmp_path.iterdir())
    assert load_state(path).step in (1, 2)
    # a checkpoint left as <path>.old alone (by a fallback swap that crashed) is moved back
    old = tmp_path / "checkpoint.old"
    path.rename(old)
    state = load_state(path)
    assert path.exists() and not old.exists() and state.step in (1, 2)


def test_buffer_counters_survive_a_checkpoint(tmp_path) -> None:
    from inflight.trainer.checkpoint import TrainerState, load_state, save_checkpoint

    queue = RolloutQueue(HashStore(), capacity=10)
    buffer = RolloutBuffer(queue, admit_lag=0, group_size=1)
    queue.put(_group("ok", None))
    queue.put(_group("nan", None, logprobs=[-0.5, math.nan]))
    queue.put_raw(b"\x93garbage")
    buffer.drain(current_version=0)
    buffer.next_batch(1, current_version=0, timeout_s=1.0)
    saved = buffer.stats()
    save_checkpoint(tmp_path / "ck", _Model("m"), _Model("m"), _optimizer_dir, TrainerState(
        step=1, version=1, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
        buffer_stats=saved, pending=list(buffer.pending)))
    state = load_state(tmp_path / "ck")
    resumed = RolloutBuffer(RolloutQueue(HashStore(), capacity=10), admit_lag=0, group_size=1,
                            pending=state.pending, stats=state.buffer_stats)
    assert resumed.stats() == saved and saved["rejected"] == {"nonfinite_logprob": 1, "bad_message": 1}


@pytest.mark.gpu
def test_cuda_rng_state_is_saved_and_restored(tmp_path) -> None:
    from inflight.trainer.checkpoint import TrainerState, load_state, restore_rng, save_checkpoint

    torch.cuda.manual_seed_all(123)
    save_checkpoint(tmp_path / "ck", _Model("m"), _Model("m"), _optimizer_dir, TrainerState(
        step=1, version=1, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
        buffer_stats={}, pending=[]))
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(999)
    restore_rng(load_state(tmp_path / "ck"))
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_rejections_are_classified_by_structure_not_by_message_text() -> None:
    queue = RolloutQueue(HashStore(), capacity=10)
    buffer = RolloutBuffer(queue, admit_lag=4)
    misfiled = {"kind": "group", "group_id": "g", "samples": [  # filed under another group; named "log-probs"
        {"kind": "sample", "sample_id": "log-probs", "group_id": "h", "prompt_ids": [1], "token_ids": [1],
         "logprobs": [-1.0], "versions": [0], "reward": 0.0}]}
    short = {"kind": "group", "group_id": "s", "samples": [
        {"kind": "sample", "sample_id": "x", "group_id": "s", "prompt_ids": [1], "token_ids": [1, 2],
         "logprobs": [-1.0, -1.0], "versions": [0], "reward": 0.0}]}
    queue.put_raw(msgspec.msgpack.encode(misfiled))
    queue.put_raw(msgspec.msgpack.encode(short))
    buffer.drain(current_version=0)
    assert buffer.stats()["rejected"] == {"bad_message": 1, "length_mismatch": 1}
