"""A failed commit never reads the disk inside the engine's stall.

The weights the engine loaded are read into the rollback buffer at ``inflight_start``, so a
first commit that fails restores them from memory; without a rollback copy
(``keep_rollback=False``) the engine fails closed, with the reason. (Own module: each test
starts an engine of its own at version 0, which must not share a process's vLLM state with a
module-scoped engine.)
"""

from __future__ import annotations

import pytest

from inflight.transport.pusher import PushRejected
from tests.engine_harness import Harness, Reference, perturbed
from tests.helpers import fail_after_applying


def _count_disk_reloads(worker) -> int:
    """Inside the worker: count vLLM reloads of the checkpoint from disk (no weights given)."""
    runner = worker._inflight_target.strategy.runner
    real = runner.reload_weights
    worker.disk_reloads = 0

    def reload_weights(*args, **kwargs):
        if kwargs.get("weights_iterator") is None:
            worker.disk_reloads += 1
        return real(*args, **kwargs)

    runner.reload_weights = reload_weights
    return 1


@pytest.mark.parametrize("keep_rollback", [True, False])
def test_a_failed_first_commit_never_reads_the_disk_inside_the_stall(tiny_llama, port, keep_rollback: bool) -> None:
    """The weights the engine loaded are in memory before any commit (read at start), so a
    first commit that fails restores them from there; without a rollback copy the engine fails
    closed, with the reason, instead of reloading its checkpoint under the step lock."""
    h = Harness(tiny_llama, "float32", port, commit="reload", timeout_s=20.0, keep_rollback=keep_rollback)
    try:
        h.llm.collective_rpc(_count_disk_reloads)
        h.llm.collective_rpc(fail_after_applying)
        with pytest.raises(PushRejected, match=r"(?s)\[commit_failed\] .*injected failure") as exc:
            h.pusher.push(1, perturbed(h.base, seed=8))
        assert exc.value.codes == {"commit_failed"} and "injected failure" in str(exc.value)
        assert h.llm.collective_rpc(lambda worker: worker.disk_reloads) == [0]
        status = h.status()
        if keep_rollback:
            assert status.live_version == status.engine.live_version == 0 and not status.engine.broken
            ref = Reference(h.model_dir, "float32").load(h.base)  # exactly what the engine loaded
            for prompt, out in h.greedy(["1+2=", "count 3 4"]):
                assert out.versions == [0] * len(out.token_ids)
                assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
        else:
            assert "keep_rollback=False" in status.engine.broken and "fails closed" in status.engine.broken
    finally:
        h.close()
