"""The training loop survives its engine and its own restart, and loses no queued group.

- the engine process is SIGKILLed mid-run, with multi-turn episodes in flight: the trainer
  notices within the transport timeout, restarts it, rejoins the weight group, and the
  groups that were queued are all trained on (the queue's ledger balances); the new process
  resumes every episode its journal held at the kill, and each of their groups is trained
  on, dropped as stale, pending, or still in flight at the end: none is silently lost;
- a run stopped at a checkpoint and resumed continues the version counter and the
  optimizer, and neither repeats nor drops a group;
- malformed rollouts (NaN log-probs, tokens without tags) are refused at the queue and
  counted in the run's metrics.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import msgspec
import torch

from inflight.protocol import RolloutGroup, RolloutSample
from inflight.rollout_queue import RolloutQueue
from inflight.trainer.rollout.episode_journal import peek
from inflight.trainer.train import train
from inflight.transport.group_config import GroupConfig
from tests.helpers import (
    WAIT_S,
    check_ledger,
    metrics_rows,
    pending_ids,
    run_config,
    train_beside,
    wait_rows,
    wait_until,
)


def _kill_with_episodes_in_flight(out, killed: dict) -> None:
    """SIGKILL the engine process once its journal holds episodes in flight: the process is
    stopped (SIGSTOP) while the journal is read, so what it holds is what the kill leaves."""
    wait_rows(out, 3)
    pid, journal = int((out / "engine0.pid").read_text()), out / "episodes-e0.journal"
    deadline = time.monotonic() + WAIT_S
    while True:
        os.kill(pid, signal.SIGSTOP)
        held = peek(journal)
        if any(not done for g in held.groups.values() for done in g.done):
            killed["t"], killed["held"] = time.time(), held
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S:.0f} s for {journal} to hold an episode in flight")
        time.sleep(0.05)


def test_engine_killed_mid_run_is_restarted_and_no_queued_group_is_lost(tmp_path) -> None:
    out = tmp_path / "run"
    cfg = run_config(out, steps=8, task={"name": "tests.episode_envs:make", "completion_tokens": 6,
                                         "options": {"turns": 3, "prompt_chars": 40}})
    killed: dict = {}

    def killer() -> None:
        _kill_with_episodes_in_flight(out, killed)

    summary, rows = train_beside(cfg, killer)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["engine_restarts"] == 1 and rows[-1]["engine_failures"] == 1
    (event,) = summary["engine_events"]
    # noticed within the transport timeout (a push failing, or the process found dead while
    # waiting), with a margin for a loaded machine: twice the timeout, 10 s more at least
    timeout = max(cfg.transport.reply_timeout_s, cfg.transport.collective_timeout_s)
    assert 0 <= event["t"] - killed["t"] < max(2 * timeout, timeout + 10), (event, timeout)
    assert event["restarted"] and ("exited" in event["reason"] or "push failed" in event["reason"]), event
    assert rows[-1]["pushed_version"] == rows[-1]["version"] and rows[-1]["version"] >= 8
    consumed = check_ledger(summary, rows, pending_ids(out))
    incarnations = {g.rsplit(".", 1)[0] for g in consumed}
    assert len(incarnations) == 2, incarnations  # trained on groups of both engine processes
    held = killed["held"]  # the episodes in flight at the kill: resumed by the next process
    running = sum(not done for g in held.groups.values() for done in g.done)
    assert running > 0 and rows[-1]["rollout_episodes_resumed"] == running
    assert rows[-1]["rollout_episodes_started"] > held.counts["started"]  # the ledger went on from the journal
    dropped = [g for r in rows for g in r["dropped_ids"]]
    still = peek(out / "episodes-e0.journal").groups
    for gid in held.groups:
        assert gid in set(consumed) | set(dropped) | set(pending_ids(out)) | set(still), gid


def _inject_malformed(port: int) -> None:
    store = GroupConfig(port=port).connect("rollout")
    queue = RolloutQueue(store, capacity=1000)
    nan = RolloutSample(sample_id="bad-0", group_id="bad", prompt_ids=[1], token_ids=[5, 6], logprobs=[-0.5, math.nan],
                        versions=[0, 0], reward=1.0)
    queue.put_raw(msgspec.msgpack.encode(RolloutGroup(group_id="bad", samples=(nan,) * 4)))
    queue.put_raw(msgspec.msgpack.encode({"kind": "group", "group_id": "short", "samples": [
        {"kind": "sample", "sample_id": "s", "group_id": "short", "prompt_ids": [1], "token_ids": [1, 2, 3],
         "logprobs": [-1.0, -1.0, -1.0], "versions": [0, 0], "reward": 0.0}] * 4}))


def test_resume_continues_without_repeating_or_dropping_groups(tmp_path, monkeypatch, port) -> None:
    import inflight.trainer.policy as policy_module

    out = tmp_path / "run"
    # a loose max lag lets the engine run ahead of the trainer (inflight.trainer.rollout.engine_process.may_start_group)
    first = run_config(out, steps=3, transport={"port": port}, loss={"max_lag": 8})
    forward, calls = policy_module.collate, []  # called once a step, before its forward

    def last_step_waits_for_a_full_queue(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # an event, not a deadline: the checkpoint after this step has groups to keep
            queue = RolloutQueue(GroupConfig(port=port).connect("rollout"), capacity=4)
            wait_until(lambda: queue.depth() >= 4, "a full rollout queue (4 groups) before the last step", poll_s=0.01)
        return forward(*args, **kwargs)

    monkeypatch.setattr(policy_module, "collate", last_step_waits_for_a_full_queue)

    def inject() -> None:  # malformed rollouts arrive on the queue while the first run trains
        wait_rows(out, 1)
        _inject_malformed(port)

    summary_a, rows_a = train_beside(first, inject)
    pending_a = pending_ids(out)
    consumed_a = check_ledger(summary_a, rows_a, pending_a)
    assert summary_a["queue"]["rejected"] == {"nonfinite_logprob": 1, "length_mismatch": 1}
    assert len(pending_a) >= 2, "the checkpoint should hold the full queue (4, less 2 malformed at most)"
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert (state["step"] == 3 and state["version"] == 3
            and state["buffer_stats"]["rejected"] == summary_a["queue"]["rejected"])

    monkeypatch.setattr(policy_module, "collate", forward)
    summary_b = train(run_config(out, steps=6, run={"resume": True}, loss={"max_lag": 8}))
    rows_b = metrics_rows(out)[len(rows_a):]
    assert [r["step"] for r in rows_b] == [4, 5, 6] and [r["version"] for r in rows_b] == [4, 5, 6]
    # the buffer's counters continue from the checkpoint (nothing was injected the second time)
    assert rows_b[-1]["rejected"] == summary_a["queue"]["rejected"] and rows_b[0]["admitted"] > rows_a[-1]["admitted"]
    consumed_b = [g for r in rows_b for g in r["group_ids"]]
    dropped_b = [g for r in rows_b for g in r["dropped_ids"]]
    assert not set(consumed_a) & set(consumed_b), "a group was trained on twice"
    # the groups queued at the checkpoint come first, in order, and none is lost
    taken = [g for g in consumed_b + dropped_b if g in set(pending_a)]
    assert taken == pending_a[: len(taken)]
    pending_b = pending_ids(out)
    assert set(pending_a) <= set(consumed_b) | set(dropped_b) | set(pending_b)
    # the optimizer continued: Adam's step count is the total number of steps
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out / "checkpoint" / "optimizer", out / "optimizer.pt")  # the sharded checkpoint as one file
    opt = torch.load(out / "optimizer.pt", weights_only=True)["optimizer"]
    assert {float(s["step"]) for s in opt["state"].values()} == {6.0}
    assert summary_b["queue"]["put"] == summary_b["queue"]["read"]
