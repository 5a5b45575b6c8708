"""The fleet's engines as Ray actors (``engine.launcher = "ray"``) on a local Ray cluster:
two engines, each an actor in a placement group of its own, train the tiny demo and take
every update; an actor SIGKILLed mid-run is found dead, restarted in its placement group
and let back in while the other engine keeps taking every update, and the queue's ledger
balances, as with engine processes (``tests/test_fleet.py``). Skipped without Ray."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from tests.helpers import check_ledger, pending_ids, run_config, train_beside, wait_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")]

# two vLLM engines start in Ray actors at once: on a 2-core machine under other load (8) that
# took over 180 s, so the start's deadline is 600 s (what it bounds is a start, not a recovery)
RAY_FLEET = {"engine": {"count": 2, "launcher": "ray"}, "rollout": {"in_flight_groups": 2, "queue_capacity": 6},
             "transport": {"rejoin_timeout_s": 600.0}}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    import ray

    # one CPU per engine actor (engine.ray_cpus), on a local cluster of this machine
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    yield
    ray.shutdown()


def test_ray_actors_train_and_a_killed_actor_is_restarted_while_the_other_takes_every_update(tmp_path) -> None:
    import ray

    out = tmp_path / "run"
    cfg = run_config(out, steps=12, **RAY_FLEET)

    killed: list[int] = []

    def killer() -> None:  # once engine 1 fed a batch
        wait_rows(out, 3, where=lambda rows: any("e1" in r["versions_by_engine"] for r in rows))
        killed.append(int((out / "engine1.pid").read_text()))
        os.kill(killed[0], signal.SIGKILL)  # the actor's process: what a lost node does to it

    summary, rows = train_beside(cfg, killer, kill_before_last_step=True)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["engine_restarts"] == 1
    assert all(1 in r["committed_ranks"] for r in rows if "committed_ranks" in r)  # the survivor took every push
    assert rows[-1]["committed_ranks"] == [1, 2] and rows[-1]["pushed_version"] == rows[-1]["version"]
    restarts = [e for e in summary["engine_events"] if e["restarted"]]
    assert [e["restarted"] for e in restarts] == [[1]], summary["engine_events"]
    consumed = check_ledger(summary, rows, pending_ids(out))
    assert {g.split(".", 1)[0] for g in consumed} == {"e0", "e1"}
    # a new actor took its place, and its engine wrote to the same log
    assert int((out / "engine1.pid").read_text()) != killed[0]
    assert "vllm" in (out / "engine1.log").read_text().lower()
    # the placement groups were given back at the end
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
