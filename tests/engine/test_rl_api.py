"""vLLM's own RL API on the ``inflight`` backend, through ``LLM``'s offline methods.

One in-process engine started with ``engine_kwargs(rl_api=True)`` (the backend, named in
``weight_transfer_config``) is driven step by step by the test while a trainer thread drives
vLLM's handshake through ``WeightTransferTrainerFactory`` with ``client=llm``: every version
lands while 16 requests decode, each token's tag and behaviour log-prob replay exactly in
transformers, and every misuse is refused by name with the engine serving its last version.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, tagged
from inflight.engine.engine_config import engine_kwargs
from inflight.engine.transfer_engine import RLApiError
from inflight.trainer.transfer_trainer import InflightTrainerInitInfo, OfflineClient
from inflight.transport.pusher import PushConfig
from tests.engine_harness import Reference, assert_tags_change_at_commits, drive, perturbed, push_at_steps, replay
from tests.helpers import wait_until


class Rig:
    """The engine, its coordinator, the trainer and every version's weights."""

    def __init__(self, llm, trainer, base: dict[str, torch.Tensor], ref: Reference,
                 info: InflightTrainerInitInfo) -> None:
        self.llm, self.trainer, self.ref, self.info = llm, trainer, ref, info
        self.coordinator = coordinator_of(llm)
        self.states = {0: base}

    def next_state(self) -> dict[str, torch.Tensor]:
        """The trainer's source for its next version (a perturbation of the base)."""
        v = self.trainer.version + 1
        self.states[v] = perturbed(self.states[0], seed=100 + v, scale=0.02)
        self.trainer.source = self.states[v]
        return self.states[v]

    def check_serving(self) -> None:
        """The engine serves its last committed version: label, worker and greedy tokens."""
        from vllm import SamplingParams

        live = self.coordinator.live_version
        assert self.llm.get_weight_version() == str(live)
        sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
        (o,) = self.llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], sp, use_tqdm=False)
        t = tagged(o.outputs[0])
        assert set(t.versions) == {live}
        self.ref.load(self.states[live])
        assert t.token_ids == self.ref.greedy([5, 17, 42, 9], 6)


@pytest.fixture(scope="module")
def rig(tiny_qwen, hold_port):
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=1024, seed=0,
              **engine_kwargs(rl_api=True))
    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=hold_port(), push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0, join_timeout_s=120.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=base)
    rig = Rig(llm, trainer, base, Reference(tiny_qwen, "float32"), info)
    yield rig
    rig.trainer.shutdown()
    with contextlib.suppress(Exception):
        llm.collective_rpc("inflight_stop")
    del rig, llm
    gc.collect()


class StepsAfterStart(OfflineClient):
    """``LLM``'s offline methods, called as they are; between ``start`` and ``update`` this
    trainer waits for the engine to take two steps, so every update is shown to start while
    the engine decodes (an event, never a deadline)."""

    def __init__(self, llm, coordinator) -> None:
        super().__init__(llm)
        self.coordinator = coordinator
        self.waiting = False
        self.started_at: list[int] = []

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self.started_at.append(self.coordinator.steps)

    def update_weights(self, update_info) -> None:
        self.waiting = True
        try:
            wait_until(lambda: self.coordinator.steps >= self.started_at[-1] + 2, "two engine steps after start")
        finally:
            self.waiting = False
        super().update_weights(update_info)

    def needs_steps(self) -> bool:
        """The trainer waits for engine steps it has not had yet: a held engine may step (only
        then, so the requests cannot run to their end while the trainer thread sleeps)."""
        return self.waiting and self.coordinator.steps < self.started_at[-1] + 2


def test_offline_methods_commit_five_versions_while_sixteen_requests_decode(rig) -> None:
    from vllm import SamplingParams

    coordinator = rig.coordinator
    client = StepsAfterStart(rig.llm, coordinator)
    rig.trainer.clients = [client]
    start, first = coordinator.steps, rig.trainer.version
    marks = [6, 14, 22, 30, 38]

    def push(k: int):
        rig.next_state()
        return rig.trainer.send_weights()

    pushes = push_at_steps(lambda: coordinator.steps - start, marks, push)
    sp = SamplingParams(temperature=1.0, max_tokens=64, logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(10 + i)]} for i in range(16)]
    outs = drive(rig.llm, coordinator, prompts, sp, hold_at=[m + 6 for m in marks], start=start,
                 release=client.needs_steps)
    results = pushes.join()
    rig.trainer.clients = [OfflineClient(rig.llm)]
    assert [r.version for r in results] == list(range(first + 1, first + 6))
    for r, began in zip(results, client.started_at):
        assert r.step > began - start >= 0, (r.step, began - start)  # the engine decoded between start and commit
    assert rig.llm.get_weight_version() == str(first + 5)
    assert_tags_change_at_commits(outs, results, rank=1, start=start, tokens=64)
    for o in outs[:4]:  # a transformers replay from the tags alone; a one-token shift of them fails
        t = tagged(o.outputs[0])
        prompt = list(o.prompt_token_ids)
        weights_of = lambda label: rig.states[int(label)]  # noqa: E731
        want = replay(rig.ref, weights_of, prompt, t.token_ids, t.labels, t.prompt_label)
        torch.testing.assert_close(torch.tensor(t.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
        shifted = t.labels[1:] + t.labels[-1:]
        off = replay(rig.ref, weights_of, prompt, t.token_ids, shifted, t.prompt_label)
        assert (torch.tensor(t.logprobs, dtype=torch.float64) - off).abs().max() > 1e-3


def _info(rig: Rig, version: int, **change) -> dict:
    from inflight.trainer.transfer_trainer import update_info

    info = update_info(version, rig.states[0], "float32")
    info.update(change)
    return info


def test_misuse_is_refused_by_name_and_the_engine_serves_on(rig) -> None:
    llm = rig.llm
    live = rig.coordinator.live_version
    nxt = live + 1
    with pytest.raises(RLApiError, match="update_weights before start_weight_update"):
        llm.update_weights({"update_info": _info(rig, nxt)})
    with pytest.raises(RLApiError, match="finish_weight_update without start_weight_update"):
        llm.finish_weight_update()
    llm.start_weight_update()
    with pytest.raises(RLApiError, match="start_weight_update while an update is open"):
        llm.start_weight_update()
    with pytest.raises(RLApiError, match="finish_weight_update without update_weights"):
        llm.finish_weight_update()  # closes the update: the next start is accepted
    llm.start_weight_update()
    name = next(iter(rig.states[0]))
    bad = [(_info(rig, nxt, names=["model.no_such.weight"] + _info(rig, nxt)["names"][1:]), "does not have"),
           (_info(rig, nxt, shapes=[[3, 3]] + _info(rig, nxt)["shapes"][1:]), f"{name} has shape \\(3, 3\\)"),
           (_info(rig, live), f"update_info.version={live} is not newer"),
           (_info(rig, max(live - 1, 0)), "is not newer"),
           ({"version": nxt, "tensors": []}, "expected version, names, shapes"),
           (_info(rig, nxt, names=_info(rig, nxt)["names"][:-1], shapes=_info(rig, nxt)["shapes"][:-1],
                  dtype_names=_info(rig, nxt)["dtype_names"][:-1]), "leaves out tensors")]
    for update, match in bad:
        with pytest.raises(RLApiError, match=match):
            llm.update_weights({"update_info": update})
    with pytest.raises(RLApiError, match="finish_weight_update without update_weights"):
        llm.finish_weight_update()
    with pytest.raises(RLApiError, match=f"weight_version={nxt + 7} names no update"):
        llm.update_weight_version(str(nxt + 7))
    with pytest.raises(RLApiError, match="must be an integer"):
        llm.update_weight_version("step-3")
    llm.update_weight_version(str(live))  # the live label: accepted, nothing moves
    with pytest.raises(RLApiError, match="draft model updates are refused"):
        llm.start_draft_weight_update()
    with pytest.raises(RLApiError, match=r"init_weight_transfer_engine twice with another config \(fields \['group'\]"):
        llm.init_weight_transfer_engine({"init_info": {"group": {"port": rig.info.port + 1, "world_size": 2}}})
    assert rig.coordinator.live_version == live
    rig.check_serving()


def test_a_trainer_gone_mid_update_leaves_the_engine_serving_and_a_new_one_takes_over(rig) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    live = rig.coordinator.live_version
    llm = rig.llm
    llm.start_weight_update()
    llm.update_weights({"update_info": _info(rig, live + 1)})  # announced; its trainer never pushes nor finishes
    rig.trainer.shutdown()
    rig.check_serving()
    rig.trainer = WeightTransferTrainerFactory.trainer_init(rig.info, client=llm, source=rig.states[0])
    assert rig.trainer.version == live  # it goes on from what the engine serves
    rig.next_state()
    result = rig.trainer.send_weights()
    assert result.version == live + 1 == rig.coordinator.live_version
    rig.check_serving()


def test_keep_pause_does_not_stop_decoding_and_says_so(rig) -> None:
    """``pause(mode="keep")`` on this backend leaves the engine decoding (``is_paused`` False):
    a request added while a client holds the pause finishes in as many steps as it has tokens
    (a paused scheduler would schedule nothing); ``abort`` still pauses; ``resume`` clears both."""
    from vllm import SamplingParams

    core = rig.llm.llm_engine.engine_core.engine_core
    engine = rig.llm.llm_engine
    core.pause_scheduler(mode="keep", clear_cache=False)
    assert not core.is_scheduler_paused()
    engine.add_request("held", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4,
                                                                                ignore_eos=True))
    finished = []
    for _ in range(8):  # a prefill and 3 decodes; twice that is room, not a deadline
        finished += [o for o in engine.step() if o.finished]
        if finished:
            break
    assert [len(o.outputs[0].token_ids) for o in finished] == [4]
    core.resume_scheduler()
    core.pause_scheduler(mode="abort", clear_cache=False)
    assert core.is_scheduler_paused()
    core.resume_scheduler()
    assert not core.is_scheduler_paused()
