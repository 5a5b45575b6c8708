"""vLLM's ``nccl`` wire on the ``inflight`` backend: TRL's init and update info, its packed broadcast.

A trainer sends what vLLM's ``nccl`` backend's trainers send (TRL's ``WeightTransferClient``):
``init_weight_transfer_engine`` with ``master_address``/``master_port``/``rank_offset``/
``world_size``/``packed``, then for each update ``start_weight_update``, ``update_weights``
with ``names``/``dtype_names``/``shapes`` beside the packed broadcast, and
``finish_weight_update()`` with no version. On CPU the broadcast is gloo, packed by vLLM's own
``pack_tensors`` (``send_packed``): the receive is tested against vLLM's chunking and byte
layout. The same sequence on NCCL, with vLLM's own producer, is the ``gpu`` test.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, tagged
from inflight.engine.engine_config import engine_kwargs
from inflight.engine.transfer_engine import RLApiError
from inflight.transport.packed_wire import GlooWire, chunk_plan, send_packed
from tests.engine_harness import Reference, check_serving, drive, perturbed, push_at_steps, replay
from tests.helpers import wait_until

BUFFER = 192 * 1024
"""The packed chunk size of these tests: the tiny model travels in several chunks."""


def test_chunks_follow_vllms_pack_tensors() -> None:
    """``chunk_plan`` cuts where vLLM's ``pack_tensors`` (the producer) cuts, and a chunk's
    bytes are the tensors' bytes back to back (what the receiver slices)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        dtypes = [(torch.float32, torch.bfloat16, torch.int64)[int(i)]
                  for i in torch.randint(0, 3, (n,), generator=gen)]
        tensors = [(f"t{i}", torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen).to(d))
                   for i, d in enumerate(dtypes)]
        buffer = int(torch.randint(1, 400, (1,), generator=gen))
        it, produced = iter(tensors), []
        while (chunk := pack_tensors(it, lambda item: item[1], buffer)) is not None:
            produced.append(chunk)
        plan = chunk_plan([t.numel() * t.element_size() for _, t in tensors], buffer)
        assert [[f"t{i}" for i in r] for r in plan] == [c.names for c in produced], (trial, buffer)
        for r, chunk in zip(plan, produced):
            want = torch.cat([tensors[i][1].contiguous().view(-1).view(torch.uint8) for i in r])
            assert torch.equal(chunk.packed_tensor, want)
    assert chunk_plan([], 8) == []
    with pytest.raises(ValueError, match="packed_buffer_size_bytes=0"):
        chunk_plan([1], 0)


class WireTrainer:
    """The trainer's side, as TRL's ``WeightTransferClient`` runs it, on gloo."""

    def __init__(self, llm, port: int, packed: bool = True) -> None:
        self.llm, self.port, self.packed = llm, port, packed
        self.wire: GlooWire | None = None
        self.chunks: list[list[list[str]]] = []
        self.started_at: list[int] = []

    def init(self) -> None:
        info = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1, "world_size": 2,
                "packed": self.packed, "packed_buffer_size_bytes": BUFFER}
        got: list[GlooWire] = []
        rank0 = threading.Thread(target=lambda: got.append(GlooWire("127.0.0.1", self.port, 0, 2, timeout_s=60.0)))
        rank0.start()  # both sides rendezvous together, as TRL's trainer thread and its HTTP call do
        self.llm.init_weight_transfer_engine({"init_info": info})
        rank0.join()
        self.wire = got[0]

    def send(self, state: dict[str, torch.Tensor], coordinator=None) -> None:
        """start, update_weights beside the broadcast, finish with no version."""
        self.llm.start_weight_update()
        if coordinator is not None:
            self.started_at.append(coordinator.steps)
        info = {"names": list(state), "dtype_names": [str(t.dtype).split(".")[-1] for t in state.values()],
                "shapes": [list(t.shape) for t in state.values()]}
        self.llm.update_weights({"update_info": info})
        if self.packed:
            self.chunks.append(send_packed(state.items(), self.wire, BUFFER))
        else:
            for t in state.values():
                self.wire.broadcast(t.contiguous(), src=0)
        self.llm.finish_weight_update()

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()


@pytest.fixture(scope="module")
def wired(tiny_qwen, hold_port):
    from vllm import LLM

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=1024, seed=0,
              **engine_kwargs(rl_api=True))
    trainer = WireTrainer(llm, hold_port())
    trainer.init()
    base = load_file(str(tiny_qwen / "model.safetensors"))
    yield llm, trainer, {0: base}, Reference(tiny_qwen, "float32")
    trainer.close()
    with contextlib.suppress(Exception):
        llm.collective_rpc("inflight_stop")
    del llm
    gc.collect()


def test_trls_sequence_on_the_packed_wire_commits_in_flight(wired) -> None:
    """Three versions (the third sent in bfloat16, cast by the receiver) land while 16 requests
    decode; each lands with engine steps between its start and its commit, the label moves
    at the commit, and a transformers replay from the tags alone gives the behaviour
    log-probs within 1e-4, where a one-token shift of the tags does not."""
    from vllm import SamplingParams

    llm, trainer, states, ref = wired
    coordinator = coordinator_of(llm)
    start, first = coordinator.steps, coordinator.live_version
    sent = {first + 1: perturbed(states[0], seed=201, scale=0.02),
            first + 2: perturbed(states[0], seed=202, scale=0.02)}
    bf16 = {k: v.to(torch.bfloat16) for k, v in perturbed(states[0], seed=203, scale=0.02).items()}
    sent[first + 3] = bf16
    states.update({v: {k: t.float() for k, t in s.items()} for v, s in sent.items()})
    marks = [6, 16, 26]
    pushes = push_at_steps(lambda: coordinator.steps - start, marks,
                           lambda k: trainer.send(sent[first + 1 + k], coordinator))
    sp = SamplingParams(temperature=1.0, max_tokens=48, logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(10 + i)]} for i in range(16)]
    outs = drive(llm, coordinator, prompts, sp, hold_at=[m + 5 for m in marks], start=start)
    pushes.join()
    landed = [h for h in coordinator.history if h.ok and h.version > first]
    assert [h.version for h in landed] == [first + 1, first + 2, first + 3]
    assert all(len(chunks) > 1 for chunks in trainer.chunks[-3:])  # packed in several chunks each
    for h, began in zip(landed, trainer.started_at[-3:]):
        assert h.step > began, (h.step, began)  # the engine decoded between start and the commit
    assert llm.get_weight_version() == str(first + 3)
    weights_of = lambda label: states[int(label)]  # noqa: E731
    for o in outs[:4]:
        t = tagged(o.outputs[0])
        assert set(t.versions) == {first, first + 1, first + 2, first + 3}
        prompt = list(o.prompt_token_ids)
        want = replay(ref, weights_of, prompt, t.token_ids, t.labels, t.prompt_label)
        torch.testing.assert_close(torch.tensor(t.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
        off = replay(ref, weights_of, prompt, t.token_ids, t.labels[1:] + t.labels[-1:], t.prompt_label)
        assert (torch.tensor(t.logprobs, dtype=torch.float64) - off).abs().max() > 1e-3
    check_serving(llm, states, ref, first + 3)


def test_bad_updates_on_the_wire_are_refused_by_name_and_the_engine_serves_on(wired, hold_port) -> None:
    """Refused before any byte (update_weights raises): an unknown tensor, a wrong shape, a
    dtype it cannot take, a packing other than the init's. Refused after the bytes came (the
    group stays in step): a NaN, reported by the next start. A restarted trainer's init
    joins its new group, and its update lands, numbered after the refused one."""
    llm, trainer, states, ref = wired
    live = coordinator_of(llm).live_version
    base = states[0]
    names, shapes = list(base), [list(t.shape) for t in base.values()]
    dtypes = ["float32"] * len(names)
    bad = [({"names": ["model.no_such.weight"] + names[1:], "dtype_names": dtypes, "shapes": shapes}, "does not have"),
           ({"names": names, "dtype_names": dtypes, "shapes": [[3, 3]] + shapes[1:]}, "has shape \\(3, 3\\)"),
           ({"names": names, "dtype_names": ["int32"] + dtypes[1:], "shapes": shapes}, "travels as 'int32'"),
           ({"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": False}, "packed=False"),
           ({"names": names, "dtype_names": dtypes, "shapes": shapes, "chunks": 3}, "unknown fields \\['chunks'\\]")]
    llm.start_weight_update()
    for update, match in bad:
        with pytest.raises(RLApiError, match=match):
            llm.update_weights({"update_info": update})
    llm.update_weights({"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}})
    poisoned = perturbed(base, seed=301, scale=0.02)
    poisoned[names[-1]] = poisoned[names[-1]].clone()
    poisoned[names[-1]].view(-1)[7] = float("nan")
    send_packed(poisoned.items(), trainer.wire, BUFFER)
    llm.finish_weight_update()
    with pytest.raises(RLApiError, match=f"v{live + 1} did not commit: {names[-1]} has NaN or Inf"):
        wait_until(lambda: _refused_start(llm), "the receiver to refuse the poisoned update")
    check_serving(llm, states, ref, live)

    trainer.close()  # a restarted trainer: a new group on a new port
    trainer.port = hold_port()
    trainer.init()
    states[live + 2] = perturbed(base, seed=302, scale=0.02)  # v{live + 1} was refused: numbers are never reused
    trainer.send(states[live + 2])
    wait_until(lambda: coordinator_of(llm).live_version == live + 2, "the new trainer's update to commit")
    check_serving(llm, states, ref, live + 2)


def _refused_start(llm) -> bool:
    """Start (and close) an update: False while the poisoned one is still being received;
    raises once the receiver refused it."""
    llm.start_weight_update()
    with pytest.raises(RLApiError, match="without update_weights"):
        llm.finish_weight_update()  # closes the update it opened
    return False


@pytest.mark.gpu
def test_vllms_own_nccl_producer_lands_in_flight(tiny_qwen) -> None:
    """On a GPU: the same sequence with vLLM's ``packed_nccl_broadcast_producer`` over its
    ``PyNcclCommunicator`` (TRL's code path), into an engine on the inflight backend."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (NCCL)")
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
    from vllm.utils.network_utils import get_open_port

    llm = LLM(str(tiny_qwen), dtype="float32", max_model_len=1024, seed=0, gpu_memory_utilization=0.3,
              **engine_kwargs(rl_api=True))
    port = get_open_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True,
            "packed_buffer_size_bytes": BUFFER}
    group: list = []
    rank0 = threading.Thread(target=lambda: group.append(trainer_init(info)))
    rank0.start()
    llm.init_weight_transfer_engine({"init_info": info})
    rank0.join()
    state = {k: v.cuda() for k, v in perturbed(load_file(str(tiny_qwen / "model.safetensors")), seed=401).items()}
    llm.start_weight_update()
    llm.update_weights({"update_info": {"names": list(state), "dtype_names": ["float32"] * len(state),
                                        "shapes": [list(t.shape) for t in state.values()]}})
    packed_nccl_broadcast_producer(iter(state.items()), group[0], 0, lambda item: item[1], BUFFER, 2)
    llm.finish_weight_update()
    coordinator = coordinator_of(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    wait_until(lambda: (llm.generate([{"prompt_token_ids": [5, 6]}], sp, use_tqdm=False)
                        and coordinator.live_version == 1), "v1 to commit")
    ref = Reference(tiny_qwen, "float32").load({k: v.cpu() for k, v in state.items()})
    (o,) = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], sp, use_tqdm=False)
    assert list(o.outputs[0].token_ids) == ref.greedy([5, 17, 42, 9], 4)


def test_a_trainer_gone_mid_transfer_leaves_the_engine_serving(wired, hold_port) -> None:
    """The trainer sends one chunk of an update and dies: the receiver's next chunk fails, its
    buffer goes back, the engine serves its last version, and the next start asks for a new
    init; the new trainer's update lands."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    llm, trainer, states, ref = wired
    coordinator = coordinator_of(llm)
    live = coordinator.live_version
    base = states[0]
    llm.start_weight_update()
    llm.update_weights({"update_info": {"names": list(base), "dtype_names": ["float32"] * len(base),
                                        "shapes": [list(t.shape) for t in base.values()]}})
    first = pack_tensors(iter(perturbed(base, seed=601, scale=0.02).items()), lambda item: item[1], BUFFER)
    trainer.wire.broadcast(first.packed_tensor, src=0)  # one chunk of several
    trainer.wire.plane.abort()  # the trainer process is gone: its sockets close
    llm.finish_weight_update()
    with pytest.raises(RLApiError, match="the trainer's group failed .*call init_weight_transfer_engine again"):
        wait_until(lambda: _refused_start(llm), "the receiver to find the trainer gone")
    check_serving(llm, states, ref, live)
    trainer.port = hold_port()
    trainer.init()
    v = coordinator.live_version + 2  # the lost update's number is not reused
    states[v] = perturbed(base, seed=602, scale=0.02)
    trainer.send(states[v])
    wait_until(lambda: coordinator.live_version == v, "the new trainer's update to commit")
    check_serving(llm, states, ref, v)


def test_a_packed_chunk_lands_whole_even_where_a_tensor_starts_unaligned(hold_port) -> None:
    """vLLM's packing has no alignment: a float32 after a bfloat16 of odd length starts at an
    offset a float32 view cannot take. The receiver lands every tensor of such a chunk, cast
    to its staging dtype, over a real gloo pair."""
    from inflight.engine.packed_receiver import PackedReceiver, WireUpdate
    from inflight.transport.schema import TensorSchema

    sent = {"a": torch.arange(3, dtype=torch.float32).to(torch.bfloat16), "b": torch.randn(5),
            "c": torch.randn(2, 3).to(torch.bfloat16), "d": torch.arange(7, dtype=torch.int64)}
    port = hold_port()
    ends: list[GlooWire] = []
    rank0 = threading.Thread(target=lambda: ends.append(GlooWire("127.0.0.1", port, 0, 2, timeout_s=30.0)))
    rank0.start()
    worker = GlooWire("127.0.0.1", port, 1, 2, timeout_s=30.0)
    rank0.join()
    schema = TensorSchema({"a": ((3,), "float32"), "b": ((5,), "float32"), "c": ((2, 3), "float32"),
                           "d": ((7,), "int64")})
    receiver = PackedReceiver(worker, packed=True, buffer_size_bytes=1 << 20, target=None, schema=schema, pool=None,
                              plan=None, stats=None, check_finite=True, device=torch.device("cpu"))
    views = {n: torch.zeros(shape, dtype=getattr(torch, d)) for n, (shape, d) in schema.tensors.items()}
    job = WireUpdate(1, list(sent), [list(t.shape) for t in sent.values()], [t.dtype for t in sent.values()])
    sender = threading.Thread(target=lambda: send_packed(sent.items(), ends[0], 1 << 20))
    sender.start()
    try:
        receiver._land_all(job, views)
    finally:
        sender.join()
        worker.close()
        ends[0].close()
    for name, t in sent.items():
        assert torch.equal(views[name], t.to(views[name].dtype)), name
