"""``DraftedCommit`` (``inflight.engine.commit.drafted``): each strategy gets its own tensors
under its own names, and target and draft go live all or nothing. The strategies here record
what they are handed (the real ones run in ``tests/engine/test_spec_decode.py``)."""

from __future__ import annotations

import pytest

from inflight.engine.commit.drafted import DRAFT_PREFIX, DraftedCommit


class Recording:
    name = "swap"
    needs_rollback_copy = False

    def __init__(self, fail_apply: bool = False) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail_apply = fail_apply

    def __getattr__(self, method: str):
        def call(*args):
            self.calls.append((method, args[0] if args else None))
            if method == "apply" and self.fail_apply:
                raise RuntimeError("draft apply failed")
            return 0 if method == "held_bytes" else None
        return call


UPDATE = {"w": 1, f"{DRAFT_PREFIX}w": 2, f"{DRAFT_PREFIX}b": 3}


def test_each_strategy_is_fed_its_own_tensors_by_its_own_names() -> None:
    target, draft = Recording(), Recording()
    commit = DraftedCommit(target, draft)
    commit.feed(UPDATE)
    commit.prepare(UPDATE)
    commit.apply()
    assert target.calls == [("feed", {"w": 1}), ("prepare", {"w": 1}), ("apply", None)]
    assert draft.calls == [("feed", {"w": 2, "b": 3}), ("prepare", {"w": 2, "b": 3}), ("apply", None)]
    assert commit.shard_plan() is None and commit.held_bytes() == 0 and commit.name == "swap"


def test_a_draft_that_fails_to_apply_takes_the_targets_apply_back() -> None:
    target, draft = Recording(), Recording(fail_apply=True)
    commit = DraftedCommit(target, draft)
    with pytest.raises(RuntimeError, match="draft apply failed"):
        commit.apply()
    commit.restore(UPDATE)  # what the engine does after a failed apply, with the last good weights
    assert target.calls == [("apply", None), ("undo", {"w": 1})]
    assert draft.calls == [("apply", None), ("restore", {"w": 2, "b": 3})]


def test_a_target_that_fails_to_apply_is_restored_alone() -> None:
    target, draft = Recording(fail_apply=True), Recording()
    commit = DraftedCommit(target, draft)
    with pytest.raises(RuntimeError):
        commit.apply()
    commit.restore(None)
    assert target.calls == [("apply", None), ("restore", None)] and draft.calls == []
    commit.undo(UPDATE)  # after a successful apply another rank failed: both taken back
    assert draft.calls == [("undo", {"w": 2, "b": 3})] and target.calls[-1] == ("undo", {"w": 1})
