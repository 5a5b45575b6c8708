"""The fleet's engines as Ray actors (``engine.launcher = "ray"``) on a local Ray cluster:
two engines, each an actor in a placement group of its own, train the tiny demo and take
every update; an actor SIGKILLed mid-run is found dead, restarted in its placement group
and let back in while the other engine keeps taking every update, and the queue's ledger
balances, as with engine processes (``tests/engine/test_fleet.py``). Skipped without Ray."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from tests.helpers import engines_that_fed, run_config, train_beside, wait_admitted, wait_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")]

# two vLLM engines start in Ray actors at once: on a 2-core machine under other load (8) that
# took over 180 s, so the start's deadline is 600 s (what it bounds is a start, not a recovery)
RAY_FLEET = {"engine": {"count": 2, "launcher": "ray"}, "rollout": {"in_flight_groups": 2, "queue_capacity": 6},
             "transport": {"rejoin_timeout_s": 600.0}}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    import ray

    from inflight.trainer.ray_launcher import WORKER_NICENESS, connect

    connect()  # a local cluster of this machine, as a run without engine.ray_address starts
    yield
    ray.shutdown()
    os.environ.pop(WORKER_NICENESS, None)


def test_a_local_clusters_engines_run_at_the_trainers_priority() -> None:
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)


def test_ray_actors_train_and_a_killed_actor_is_restarted_while_the_other_takes_every_update(tmp_path) -> None:
    import ray

    out = tmp_path / "run"
    cfg = run_config(out, steps=12, **RAY_FLEET)

    killed: list[int] = []

    # once the trainer admitted a group of engine 1's: "both engines fed the run" is then not a race
    def killer() -> None:
        wait_rows(out, 3)
        wait_admitted("e1")
        killed.append(int((out / "engine1.pid").read_text()))
        os.kill(killed[0], signal.SIGKILL)  # the actor's process: what a lost node does to it

    summary, rows = train_beside(cfg, killer, kill_before_last_step=True)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["engine_restarts"] == 1
    assert all(1 in r["committed_ranks"] for r in rows if "committed_ranks" in r)  # the survivor took every push
    assert rows[-1]["committed_ranks"] == [1, 2] and rows[-1]["pushed_version"] == rows[-1]["version"]
    restarts = [e for e in summary["engine_events"] if e["restarted"]]
    assert [e["restarted"] for e in restarts] == [[1]], summary["engine_events"]
    assert engines_that_fed(summary, rows, out) == {"e0", "e1"}
    # a new actor took its place, and its engine wrote to the same log
    assert int((out / "engine1.pid").read_text()) != killed[0]
    assert "vllm" in (out / "engine1.log").read_text().lower()
    # the placement groups were given back at the end
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]


def test_an_actor_whose_engine_fails_at_start_stops_the_run_with_its_error(tmp_path) -> None:
    """A setting vLLM refuses at start (a context longer than the model's): the actor's run
    ends with vLLM's error, and the trainer stops at once naming it, not after the join's
    ``transport.rejoin_timeout_s`` (1500 s here) with a transport timeout."""
    import ray

    from inflight.trainer.fleet import EngineLost
    from inflight.trainer.train import train

    # optim.micro_batch_tokens follows, or the trainer refuses the config before any engine starts
    cfg = run_config(tmp_path / "run", steps=2, engine={"launcher": "ray", "max_model_len": 1 << 20},
                     optim={"micro_batch_tokens": 1 << 20}, transport={"rejoin_timeout_s": 1500.0})
    t0 = time.monotonic()
    with pytest.raises(EngineLost, match=r"engine 0 \(Ray actor, process \d+\) ended: ValidationError: .*"
                       r"User-specified max_model_len \(1048576\) is greater than the derived.*before joining"):
        train(cfg)
    # an actor's start (over 180 s at load 8) and the watcher's half-second look, far below the timeout
    assert time.monotonic() - t0 < 600, time.monotonic() - t0
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
