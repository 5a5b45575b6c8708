"""A fleet: one trainer, two engines, one rollout queue.

- two in-process engines (ranks 1 and 2) in one weight group, stepped in turn by one thread,
  take every update while both decode, each with exact tags at its own commit step; a
  version goes live on both or is refused on both (a group spanning engines is atomic);
- on a group per engine (``FleetPusher``, what the training loop uses), an engine frozen or
  killed in the middle of a transfer costs the fleet one transport timeout: its heartbeat
  names it, it is dropped without a second wait while the other engine's group is left as
  it was, and a frozen one that thaws is let back in still serving the version it had;
- the training loop with ``engine.count = 2``: rollouts of both engines reach the queue
  with their engine id; an engine SIGKILLed mid-run is restarted and let back in while the
  other keeps taking every update; an engine SIGSTOPped is dropped, the run goes on, and
  after SIGCONT it rejoins, never tagging its tokens with a version it did not commit;
  the queue's ledger balances throughout.
Pushes and signals are driven by engine steps and by the run's own metrics rows, never
by wall-clock time racing the engines.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.rollout_queue import RolloutQueue
from inflight.trainer.config_files import config_from_dict
from inflight.trainer.fleet import Fleet, Placement
from inflight.trainer.train import train
from inflight.transport.fleet_pusher import FleetPusher, FleetPushError, collect
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from inflight.versions import boundaries, is_monotone
from tests.engine_harness import idle_engine, perturbed, push_at_steps
from tests.helpers import (
    check_ledger,
    engines_that_fed,
    metrics_rows,
    pending_ids,
    run_config,
    tampering,
    train_beside,
    wait_admitted,
    wait_rows,
    wait_until,
)


def test_two_engines_take_every_update_with_exact_tags_on_each(tiny_qwen, port) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    group = GroupConfig(port=port, world_size=3, timeout_s=60)
    llms = [LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=512, seed=i, **engine_kwargs())
            for i in range(2)]
    for i, llm in enumerate(llms):
        start_inflight(llm, InflightConfig(group=group, rank=1 + i))
    pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25))
    base = load_file(str(tiny_qwen / "model.safetensors"))
    coordinators = [coordinator_of(llm) for llm in llms]
    try:
        assert sorted(pusher.engine_versions) == [1, 2]
        # vLLM 0.32 keeps one forward context per process (a module global of
        # vllm.forward_context), so two engines of one process must never run forward passes
        # at once: one reads the other's attention metadata and KV cache, and the process
        # crashes. This thread steps both in turn; a deployed fleet runs an engine per process.
        # Four requests per engine decode until every push returned, so each commit lands
        # mid-decode on both; pushes are triggered by engine steps, never by wall-clock time.
        engines = [llm.llm_engine for llm in llms]
        active: list[set[str]] = [set(), set()]
        finished: list[dict] = [{}, {}]
        n_req, rounds = 0, 0
        pushes = push_at_steps(lambda: rounds, (30, 60, 90),
                               lambda k: pusher.push(k + 1, perturbed(base, seed=60 + k, scale=0.02)))
        while pushes.alive() or any(active):
            for i, engine in enumerate(engines):
                while pushes.alive() and len(active[i]) < 4:
                    n_req += 1
                    sp = SamplingParams(temperature=1.0, max_tokens=110, logprobs=0, ignore_eos=True, seed=n_req,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(f"e{i}r{n_req}", f"{i}+{n_req}=", sp)
                    active[i].add(f"e{i}r{n_req}")
                for out in engine.step():
                    if out.finished:
                        active[i].discard(out.request_id)
                        finished[i][out.request_id] = tagged(out.outputs[0])
            rounds += 1
        results = pushes.join()
        assert [r.version for r in results] == [1, 2, 3]
        for i, rank in enumerate((1, 2)):
            spanning = 0
            for r in results:  # this engine's own commit: its step, its token counts
                assert any(n > 0 for n in r.commits[rank].tokens_at_commit.values()), (rank, r.version)
            for rid, tc in finished[i].items():
                assert is_monotone(tc.versions)
                first = boundaries(tc.versions)
                spanning += len(first) > 1
                for r in results:
                    c = r.commits[rank]
                    if c.version in first:
                        assert first[c.version] == c.tokens_at_commit.get(rid, 0), (rank, rid, c.version)
            assert spanning > 0
            assert coordinators[i].live_version == 3
        # a version one engine refuses goes live on neither
        bad = dict(perturbed(base, seed=70, scale=0.02))
        bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
        with pytest.raises(PushRejected, match=r"update v4 refused at announce: worker rank \d: \[bad_shape\] "
                                               r"model.norm.weight: "):
            pusher.push(4, bad)
        assert [c.live_version for c in coordinators] == [3, 3]
    finally:
        pusher.close()
        for llm in llms:
            llm.collective_rpc("inflight_stop")
        del llms


@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_an_engine_lost_mid_transfer_costs_the_fleet_one_timeout(tiny_qwen, tmp_path, port, sig: str) -> None:
    """The training loop's recovery (``Fleet.recover``) on a group per engine: the engine lost
    between two of its buckets is dropped by its heartbeat, without a second timeout; the
    other engine took the update meanwhile and its group is left as it was."""
    timeout_s = 20.0  # the heartbeat's window (2 s) and a loaded machine's slowness stay far below it
    base = GroupConfig(port=port, timeout_s=timeout_s)
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=idle_engine, args=(str(tiny_qwen), base.for_engine(e, 1), 1, ready[e]), daemon=True)
             for e in range(2)]
    for p in procs:
        p.start()
    pusher = FleetPusher(base, [1, 1], PushConfig(dtype="float32", bucket_mb=0.25, reply_timeout_s=timeout_s),
                         join_timeout_s=300)
    cfg = config_from_dict({"run": {"out_dir": str(tmp_path)}, "engine": {"spawn": False, "count": 2},
                            "transport": {"collective_timeout_s": timeout_s, "reply_timeout_s": timeout_s,
                                          "stale_timeout_s": timeout_s}})
    fleet = Fleet(cfg, tiny_qwen, 0, base.port, Placement(backend="gloo", engine_devices=None), tmp_path)
    weights = load_file(str(tiny_qwen / "model.safetensors"))
    try:
        for e in ready:
            assert e.wait(300), "an engine did not start"
        assert sorted(pusher.push(1, perturbed(weights, seed=1, scale=0.01))) == [0, 1]
        generation_0 = pusher.pushers[0].group.generation
        lost: dict[str, float] = {}

        def lose_engine_1(header, data):  # the pusher's tamper seam: engine 1 goes away between buckets
            if header.index == 2 and not lost:
                os.kill(procs[1].pid, getattr(signal, sig))
                lost["t"] = time.monotonic()
            return header, data

        v2 = perturbed(weights, seed=2, scale=0.01)
        with pytest.raises(FleetPushError) as failed, tampering(pusher.pushers[1], lose_engine_1):
            collect(2, pusher.push_async(2, v2))
        assert sorted(failed.value.landed) == [0] and sorted(failed.value.failed) == [1]
        queue = RolloutQueue(pusher.sub_store("rollout"), 4)
        t0 = time.monotonic()
        version = fleet.recover(pusher, str(failed.value), 2, lambda: v2, queue, failed.value.failed)
        recovered_s = time.monotonic() - t0
        assert version == 2 and pusher.live == [0]
        assert pusher.pushers[0].group.generation == generation_0  # engine 0's group untouched
        assert fleet.drops == 1 and fleet.events[-1]["members"] == [1]
        # the failed push waited its one timeout; the recovery does not wait a second one for
        # engine 1: its heartbeat's silence (a 2 s window) says it is gone
        assert recovered_s < timeout_s, recovered_s
        if sig == "SIGKILL":  # the survivor goes on alone
            assert sorted(pusher.push(3, perturbed(weights, seed=3, scale=0.01))) == [0]
            return
        os.kill(procs[1].pid, signal.SIGCONT)
        # it finds its transfer failed, drops the staging, knocks
        wait_until(lambda: pusher.knocking() == [1], "the thawed engine 1 to knock")
        # back in: engine 1 still serves v1 under v1's label, never the v2 it was frozen in the
        # middle of; engine 0 serves v2 (fleet ranks 1 and 2)
        assert fleet.admit(pusher) == {2: 1}
        assert fleet.serving(pusher.engine_versions) == {1: 2, 2: 1}
        assert sorted(pusher.push(3, perturbed(weights, seed=3, scale=0.01))) == [0, 1]
    finally:
        pusher.close()
        for p in procs:
            p.kill()
            p.join(10)


FLEET = {"engine": {"count": 2}, "rollout": {"in_flight_groups": 2, "queue_capacity": 6}}


def _committed_on(rows: list[dict], rank: int) -> set[int]:
    # every push that landed, not only the one a row reports: the last row has two (a run
    # whose thawed engine tagged its last batch with the second-to-last version failed here);
    # and what the engine reported serving when it rejoined: an engine frozen after its
    # commit of v, before its reply, committed v though the trainer's push of v failed
    landed = {v for r in rows for v, ranks in r["pushes_landed"] + r["engines_rejoined"] if rank in ranks}
    return {0} | landed


def test_a_killed_engine_is_restarted_while_the_other_takes_every_update(tmp_path) -> None:
    out = tmp_path / "run"
    cfg = run_config(out, steps=10, **FLEET)

    # once the trainer admitted a group of engine 1's: "both engines fed the run" is then not a race
    def killer() -> None:
        wait_rows(out, 3)
        wait_admitted("e1")
        os.kill(int((out / "engine1.pid").read_text()), signal.SIGKILL)

    summary, rows = train_beside(cfg, killer, kill_before_last_step=True)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[-1]["engine_restarts"] == 1
    # the survivor (rank 1) committed every version the trainer pushed
    assert all(1 in r["committed_ranks"] for r in rows if "committed_ranks" in r)
    pushed = {r["pushed_version"] for r in rows if "pushed_version" in r}
    assert pushed <= _committed_on(rows, 1)
    # the restarted engine was let back in and took the last update with the survivor
    assert rows[-1]["committed_ranks"] == [1, 2] and rows[-1]["pushed_version"] == rows[-1]["version"]
    # the kill is one recovery that restarts engine 1 (on a loaded machine a slow engine may
    # also be dropped once for silence, and let back in: that is a recovery without a restart)
    restarts = [e for e in summary["engine_events"] if e["restarted"]]
    assert [e["restarted"] for e in restarts] == [[1]], summary["engine_events"]
    assert engines_that_fed(summary, rows, out) == {"e0", "e1"}


def test_a_frozen_engine_is_dropped_and_rejoins_without_stale_tags(tmp_path) -> None:
    out = tmp_path / "run"
    cfg = run_config(out, steps=16, **FLEET)
    marks: dict = {}

    def freezer() -> None:
        wait_rows(out, 3)
        pid = int((out / "engine1.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        rows = wait_rows(out, 0, where=lambda rows: rows[-1]["engine_drops"] >= 1)  # dropped; the run went on
        marks["dropped_at"] = rows[-1]["step"]
        wait_rows(out, rows[-1]["step"] + 2)  # two more updates without it
        os.kill(pid, signal.SIGCONT)

    summary, rows = train_beside(cfg, freezer)
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert rows[-1]["engine_restarts"] == 0 and rows[-1]["engine_drops"] >= 1
    alone = [r for r in rows if r.get("committed_ranks") == [1]]
    assert len(alone) >= 2, "the run did not go on without the frozen engine"
    assert rows[-1]["committed_ranks"] == [1, 2], "the thawed engine did not rejoin"
    # every version e1 tagged a token with is one that was committed on e1 (rank 2)
    on_e1 = _committed_on(rows, 2)
    tagged_by_e1 = {v for r in rows for v in r["versions_by_engine"].get("e1", [])}
    assert tagged_by_e1 <= on_e1, (sorted(tagged_by_e1 - on_e1), sorted(on_e1))
    # no push made while it was out reached it; the one exception is the version it reported
    # serving when it rejoined: frozen after that commit and before its reply, it committed
    # the version whose push then failed, the first one pushed without it (CI hit this)
    pushed_alone = {r["pushed_version"] for r in alone}
    rejoined_at = {v for r in rows for v, ranks in r["engines_rejoined"] if 2 in ranks}
    assert (pushed_alone - rejoined_at).isdisjoint(on_e1), (sorted(pushed_alone), sorted(on_e1))
    assert all(v <= min(pushed_alone) for v in rejoined_at), (sorted(rejoined_at), sorted(pushed_alone))
    check_ledger(summary, rows, pending_ids(out))


def test_spawned_engines_split_the_engine_gpus_evenly() -> None:
    from inflight.trainer.fleet import engine_share

    assert [engine_share("1,2,3,4", 2, i) for i in range(2)] == ["1,2", "3,4"]
    assert [engine_share("5,7", 2, i) for i in range(2)] == ["5", "7"]
    assert engine_share(None, 3, 2) is None  # no GPUs: every engine inherits the trainer's view (CPU)
    with pytest.raises(ValueError, match=r"engine.count=3 engines of engine.tensor_parallel_size=1 need 3 GPUs"):
        engine_share("1,2", 3, 0)
    assert [engine_share("0,1,2,3", 2, i, 2) for i in range(2)] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 need 4 GPUs"):
        engine_share("0,1,2", 2, 0, 2)


def test_a_tensor_parallel_engine_takes_every_update_on_both_workers(tmp_path) -> None:
    """``engine.tensor_parallel_size = 2``: the spawned engine's two workers (vLLM's ``mp``
    executor, one core each) take weight-group ranks 1 and 2, and every push commits on both."""
    out = tmp_path / "run"
    summary = train(run_config(out, steps=4, engine={"tensor_parallel_size": 2}))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["committed_ranks"] == [1, 2] for r in rows if "committed_ranks" in r)
    assert rows[-1]["pushed_version"] == rows[-1]["version"] == 4 and rows[-1]["engines_live"] == 1
    assert all(len(set(r["commit_steps"].values())) == 1 for r in rows if "commit_steps" in r)  # one engine, one step
    check_ledger(summary, rows, pending_ids(out))
