"""A sharded trainer: two trainer processes on gloo, the model ``fully_shard``-ed (FSDP2),
pushing in flight to a TP=1 and to a TP=2 engine through a ``ShardedSource``.

- every push gathers the parameters one tensor at a time over a process group of the
  source's own, rank 0 sending each bucket as it is packed, rank 1 following in lockstep;
- updates land while the engine decodes, with exact tags, and the engine then equals
  transformers with the trainer's weights (``full_tensor``, fp32, 1e-5);
- a trainer rank killed mid-push (inside one of its gathers) gives the other rank a
  ``SourceError`` naming the push, the engine drops the update and keeps serving the last
  good version, bit for bit.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
from datetime import timedelta

import pytest
import torch

from inflight.engine.client import coordinator_of, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus, as_result
from inflight.transport.group_config import GroupConfig
from tests.engine_harness import Reference, drive, push_at_steps, stop_engine

PROMPTS = ["1+2=", "count 3 4", "the quick brown"]


def _trainer_rank(rank: int, model_dir: str, world: int, commands, results) -> None:
    """One trainer rank: FSDP2 over a 1-D CPU mesh; per command, one optimizer step, then
    rank 0 pushes and rank 1 follows. Rank 0 hosts the trainer's rendezvous store and the
    weight group's store, on ports it holds and hands on."""
    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from inflight.transport.pusher import PushConfig, WeightPusher
    from inflight.transport.sources import ShardedSource
    from inflight.transport.store import host_store, reserve_port

    torch.set_num_threads(1)
    if rank == 0:
        rendezvous, weights_port = reserve_port(), reserve_port()
        store = host_store("127.0.0.1", rendezvous, 2, timedelta(seconds=300))
        results.put(("ports", rendezvous, weights_port))
    else:
        rendezvous = commands.get()
        store = TCPStore("127.0.0.1", rendezvous, 2, False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=PrefixStore("trainer", store), rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    source = ShardedSource(model, dist.new_group(backend="gloo"))  # the push's own group: not FSDP's
    pusher = None
    if rank == 0:
        pusher = WeightPusher(GroupConfig(port=weights_port, world_size=world, timeout_s=120),
                              PushConfig(dtype="float32", bucket_mb=0.25), join_timeout_s=600)
    results.put(("ready", rank))
    while (command := commands.get()) is not None:
        version, die_rank, die_after = command
        torch.manual_seed(version)
        ids = torch.randint(0, model.config.vocab_size, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        full = {n: t.full_tensor() for n, t in source.named.items()}  # the reference: DTensor's own gather
        if rank == 0:
            safetensors.torch.save_file(full, os.path.join(model_dir, "..", f"pushed_v{version}.safetensors"))
        if die_after and rank == die_rank:
            _die_inside_a_gather(source, die_after)
        try:
            if rank == 0:
                result = pusher.push(version, source)
                results.put(("pushed", version, result.send.nbytes, sorted(result.commits)))
            else:
                results.put(("followed", version, source.follow(version)))
        except Exception as e:  # reported to the test, which checks the message
            results.put(("error", rank, version, type(e).__name__, str(e)))
    if pusher is not None:
        pusher.close()
    dist.destroy_process_group()


def _die_inside_a_gather(source, n: int) -> None:
    real, count = source._gather, [0]

    def gather(name):
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-push: rank 0 has sent buckets already
        return real(name)
    source._gather = gather


class _Trainer:
    """The two trainer processes, driven by commands; their reports in ``results``."""

    def __init__(self, model_dir, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue(), ctx.Queue()]
        self.ranks = [ctx.Process(target=_trainer_rank, args=(r, str(model_dir), world, self.commands[r], self.results),
                                  daemon=True) for r in range(2)]
        for p in self.ranks:
            p.start()
        kind, rendezvous, self.port = self.results.get(timeout=300)
        assert kind == "ports"
        self.commands[1].put(rendezvous)

    def wait_ready(self) -> None:
        got = sorted(self.results.get(timeout=900)[1] for _ in range(2))
        assert got == [0, 1]

    def step_and_push(self, version: int, *, die_rank: int = 1, die_after: int = 0) -> list[tuple]:
        """One step and push of ``version``; with ``die_after``, trainer rank ``die_rank`` is
        killed inside its ``die_after``-th gather of the push (only the other rank reports)."""
        for q in self.commands:
            q.put((version, die_rank, die_after))
        return sorted((self.results.get(timeout=900) for _ in range(1 if die_after else 2)), key=lambda r: r[0])

    def close(self) -> None:
        for q, p in zip(self.commands, self.ranks):
            if p.is_alive():
                q.put(None)
        for p in self.ranks:
            p.join(60)
            if p.is_alive():
                p.kill()


def _assert_serves(llm, model_dir, state, version: int) -> list:
    from vllm import SamplingParams

    ref = Reference(model_dir, "float32").load(state)
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
    outs = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        out = tagged(o.outputs[0])
        prompt = list(o.prompt_token_ids)
        assert out.versions == [version] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref.logprobs(prompt, out.token_ids),
                                   atol=1e-5, rtol=0)
        outs.append((out.token_ids, out.logprobs, out.versions))
    return outs


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fsdp2_trainer_pushes_in_flight_and_survives_losing_a_rank(tiny_llama, monkeypatch, tp: int) -> None:
    import vllm.envs
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from inflight.versions import boundaries, is_monotone

    trainer = _Trainer(tiny_llama, world=1 + tp)
    extra = {}
    if tp == 2:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (vLLM CPU refuses TP=2 without it)
        extra = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    vllm.envs.disable_envs_cache()
    llm = LLM(str(tiny_llama), enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **extra,
              **engine_kwargs())
    try:
        start_inflight(llm, InflightConfig(group=GroupConfig(port=trainer.port, world_size=1 + tp, timeout_s=120)))
        trainer.wait_ready()
        coordinator = coordinator_of(llm)
        start, marks = coordinator.steps, (10, 40)
        replies: list = []
        pushes = push_at_steps(lambda: coordinator.steps - start, marks,
                               lambda k: replies.append(trainer.step_and_push(k + 1)))
        sp = SamplingParams(temperature=1.0, max_tokens=70, logprobs=0, ignore_eos=True, seed=3)
        outs = drive(llm, coordinator, [f"{i}+{i}=" for i in range(4)], sp, hold_at=[m + 25 for m in marks],
                     start=start)
        pushes.join()
        full = sum(t.numel() * 4 for t in load_file(str(tiny_llama / "model.safetensors")).values())
        for version, (followed, pushed) in enumerate(replies, start=1):  # sorted by kind
            assert pushed[:2] == ("pushed", version) and pushed[3] == list(range(1, 1 + tp)), pushed
            assert followed[:2] == ("followed", version) and followed[2] > 0, followed
            # TP=1: the whole model once; TP=2: each rank its shards plus what both read whole
            assert (pushed[2] >= full) if tp == 1 else (full < pushed[2] < 2 * full), (pushed[2], full)
        for o in outs:
            versions = tagged(o.outputs[0]).versions
            assert is_monotone(versions) and set(boundaries(versions)) == {0, 1, 2}, versions
        v2 = load_file(str(tiny_llama.parent / "pushed_v2.safetensors"))
        before = _assert_serves(llm, tiny_llama, v2, 2)

        # rank 1 dies inside its 5th gather of v3: rank 0 has already sent buckets
        (error,) = trainer.step_and_push(3, die_rank=1, die_after=5)
        assert error[:3] == ("error", 0, 3) and error[3] == "SourceError", error
        assert "v3" in error[4] and "trainer rank" in error[4], error
        trainer.ranks[1].join(60)
        assert trainer.ranks[1].exitcode == -signal.SIGKILL
        assert coordinator.live_version == 2 and not coordinator.broken
        assert _assert_serves(llm, tiny_llama, v2, 2) == before  # the last good version, bit for bit
        # each worker's status says the trainer called v3 off, and why
        for st in (as_result(r, WorkerStatus) for r in llm.collective_rpc("inflight_status")):
            assert (st.aborted == 1 and st.last_error.startswith("[aborted] v3: ")
                    and "a trainer rank died" in st.last_error), st
    finally:
        trainer.close()
        stop_engine(llm)
        del llm
        gc.collect()
        monkeypatch.undo()
        vllm.envs.disable_envs_cache()


def test_a_follower_gets_a_clear_error_when_rank_0_dies_mid_push(tiny_llama) -> None:
    """Rank 0, the one that sends, killed inside a gather of its push: the follower's next
    gather fails at once (gloo sees the peer gone) and says which push and which rank; the
    receiving worker (a plain peer: the engine side of a trainer lost mid-bucket is
    ``test_faults``') is not what the follower waits on."""
    from inflight.transport.peer import run_peer

    trainer = _Trainer(tiny_llama, world=2)
    peer = mp.get_context("spawn").Process(
        target=run_peer, args=(GroupConfig(port=trainer.port, world_size=2, timeout_s=120), 1, None), daemon=True)
    peer.start()
    try:
        trainer.wait_ready()
        (followed, pushed) = trainer.step_and_push(1)
        assert followed[:2] == ("followed", 1) and pushed[:2] == ("pushed", 1), (followed, pushed)
        (error,) = trainer.step_and_push(2, die_rank=0, die_after=5)
        assert error[:4] == ("error", 1, 2, "SourceError"), error
        assert "trainer rank 1" in error[4] and "for v2" in error[4], error
        trainer.ranks[0].join(60)
        assert trainer.ranks[0].exitcode == -signal.SIGKILL
    finally:
        trainer.close()
        peer.kill()
        peer.join(30)


def test_a_model_fused_at_load_is_refused_by_name(tiny_moe, tiny_qwen) -> None:
    """transformers fuses a MoE's experts at load: the checkpoint form's split experts would be
    copies made once, stale after the first step, so ``ShardedSource(module)`` refuses it,
    naming them and what to pass instead (before it touches any process group). What it
    checks is memory, not names: each tensor must live in a parameter or buffer (a tied
    embedding's lm_head does)."""
    from transformers import AutoModelForCausalLM

    from inflight.transport.sources import ShardedSource, _copies, checkpoint_form, named_weights

    model = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.float32)
    live = {n: p.detach() for n, p in model.named_parameters()}
    assert any(".experts.0." in n for n in named_weights(model)) and not any(".experts.0." in n for n in live)
    with pytest.raises(ValueError,
                       match=r"checkpoint form differs .*\.experts\.0\..* stale after the first optimizer step"):
        ShardedSource(model, None)  # type: ignore[arg-type]
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.float32)  # tied embeddings
    tied = {"lm_head.weight": plain.lm_head.weight.detach()}  # the embedding's memory
    assert _copies(plain, {**named_weights(plain), **tied}) == []
    assert _copies(plain, {**named_weights(plain), "extra": torch.zeros(2)}) == ["extra"]
    # what GatheredWeights does instead: the live tensors, in checkpoint form when read, see a step
    copies = named_weights(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "experts" in n).add_(1.0)
    fresh, moved = checkpoint_form(model, live), named_weights(model)
    assert fresh.keys() == moved.keys() and all(torch.equal(fresh[k], moved[k]) for k in moved)
    assert any(not torch.equal(copies[k], moved[k]) for k in moved if ".experts." in k)  # the copies went stale
