"""``inflight.bench.scoring``'s verifiers without an engine: a CPU-bound one computes for its time
(process CPU time, not a sleep), and the verifier's capacity counts a CPU-bound one's workers
no further than the cores they run on."""

from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(scope="module")
def scoring():
    saved = dict(os.environ)
    from inflight.bench import scoring  # it sets the engine's environment defaults: not for the tests after

    os.environ.clear()
    os.environ.update(saved)
    return scoring


def test_a_cpu_bound_verifier_computes_for_its_time(scoring) -> None:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    assert scoring.burn_cpu(0.2) > 0
    used = time.process_time() - cpu0
    assert 0.2 <= used and used <= time.perf_counter() - wall0 + 0.01  # CPU time, all of it this process's


def test_the_verifiers_capacity(scoring) -> None:
    assert scoring.verifier_rate(4, 2.0, cpu=False, scoring_cores=1) == 2.0  # asleep: every worker at once
    assert scoring.verifier_rate(4, 2.0, cpu=True, scoring_cores=1) == 0.5  # computing: one core, one at a time
    assert scoring.verifier_rate(1, 0.5, cpu=True, scoring_cores=2) == 2.0
