"""The training loop survives its engine and its own restart, and loses no queued group.

- the engine process is SIGKILLed mid-run: the trainer notices within the transport
  timeout, restarts it, rejoins the weight group, and the groups that were queued are
  all trained on (the queue's ledger balances);
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

from inflight.rollout_queue import RolloutQueue
from inflight.protocol import RolloutGroup, RolloutSample
from inflight.transport.group import GroupConfig
from tests.helpers import check_ledger, metrics_rows, pending_ids, run_config, train_beside, wait_rows
from trainer.train import train


def test_engine_killed_mid_run_is_restarted_and_no_queued_group_is_lost(tmp_path) -> None:
    out = tmp_path / "run"
    cfg = run_config(out, steps=8)
    killed: dict = {}

    def killer() -> None:
        wait_rows(out, 3)
        pid = int((out / "engine0.pid").read_text())
        killed["t"] = time.time()
        os.kill(pid, signal.SIGKILL)

    summary, rows = train_beside(cfg, killer)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["engine_restarts"] == 1 and rows[-1]["engine_failures"] == 1
    (event,) = summary["engine_events"]
    # noticed within the transport timeout (a push failing, or the process found dead while waiting)
    assert 0 <= event["t"] - killed["t"] < cfg.transport.reply_timeout_s + 2, event
    assert event["restarted"] and ("exited" in event["reason"] or "push failed" in event["reason"]), event
    assert rows[-1]["pushed_version"] == rows[-1]["version"] and rows[-1]["version"] >= 8
    consumed = check_ledger(summary, rows, pending_ids(out))
    incarnations = {g.rsplit(".", 1)[0] for g in consumed}
    assert len(incarnations) == 2, incarnations  # trained on groups of both engine processes


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
    import trainer.policy as policy_module

    out = tmp_path / "run"
    # a loose max lag lets the engine run ahead of the trainer (trainer.engine_process.may_start_group)
    first = run_config(out, steps=3, transport={"port": port}, loss={"max_lag": 8})
    forward, calls = policy_module.policy_logprobs, []

    def last_step_waits_for_a_full_queue(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # an event, not a deadline: the checkpoint after this step has groups to keep
            queue = RolloutQueue(GroupConfig(port=port).connect("rollout"), capacity=4)
            while queue.depth() < 4:
                time.sleep(0.01)
        return forward(*args, **kwargs)

    monkeypatch.setattr(policy_module, "policy_logprobs", last_step_waits_for_a_full_queue)

    def inject() -> None:  # malformed rollouts arrive on the queue while the first run trains
        wait_rows(out, 1)
        _inject_malformed(port)

    summary_a, rows_a = train_beside(first, inject)
    pending_a = pending_ids(out)
    consumed_a = check_ledger(summary_a, rows_a, pending_a)
    assert summary_a["queue"]["rejected"] == {"nonfinite_logprob": 1, "length_mismatch": 1}
    assert len(pending_a) >= 2, "the checkpoint should hold the full queue (4, less 2 malformed at most)"
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["version"] == 3 and state["buffer_stats"]["rejected"] == summary_a["queue"]["rejected"]

    monkeypatch.setattr(policy_module, "policy_logprobs", forward)
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
    opt = torch.load(out / "checkpoint" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in opt["state"].values()} == {6.0}
    assert summary_b["queue"]["put"] == summary_b["queue"]["read"]
