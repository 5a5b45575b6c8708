"""One weight update, from the push to the commit, runs code in the files docs/design.md lists
(*One update in twelve files*) and in no other file of the project.

The engine is started with a profiler set for every thread the test process starts from then
on (``threading.setprofile``: the in-process EngineCore's helpers, the worker's listener and
its re-pack thread); the push itself runs on this thread (``sys.setprofile``). While one
whole-model push lands, the profiler records each project file one of whose functions ran.
The first three stage files (``train.py``, ``weight_sync.py``, ``fleet_pusher.py``) are the
training loop's way into the pusher, which the training runs of ``tests/test_train.py`` take;
this test pushes with ``WeightPusher`` directly and checks the other nine and the libraries.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from tests.engine_harness import Harness, perturbed

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tuple(str(ROOT / d) + "/" for d in ("inflight", "engine_patches", "trainer", "kernels"))


def _listed() -> tuple[list[str], set[str]]:
    """docs/design.md's stage files, in order, and its libraries."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## One update in twelve files", 1)[1].split("\n## ", 1)[0]
    stages = re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)
    libraries = section.split("Libraries the stages call", 1)[1].split("\n\n", 1)[0]
    return stages, set(re.findall(r"`([\w/]+\.py)`", libraries))


def test_the_docs_list_twelve_stage_files_that_exist() -> None:
    stages, libraries = _listed()
    assert len(stages) == 12 and len(set(stages)) == 12, stages
    assert all((ROOT / f).is_file() for f in [*stages, *libraries]), [f for f in [*stages, *libraries]
                                                                     if not (ROOT / f).is_file()]
    assert not set(stages) & libraries


def test_one_update_runs_in_the_listed_files_only(tiny_qwen, port) -> None:
    stages, libraries = _listed()
    ran: set[str] = set()
    recording = threading.Event()

    def profile(frame, event, arg):  # noqa: ARG001  sys.setprofile's signature
        if event == "call" and recording.is_set():
            name = frame.f_code.co_filename
            if name.startswith(PROJECT):
                ran.add(str(Path(name).relative_to(ROOT)))

    threading.setprofile(profile)  # until the push landed: the re-pack thread starts with the first update
    try:
        h = Harness(tiny_qwen, "float32", port)
    except BaseException:
        threading.setprofile(None)
        raise
    try:
        state = perturbed(h.base, seed=5, scale=0.01)
        recording.set()
        sys.setprofile(profile)
        try:
            result = h.push(state)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # threads started from here on (other tests') are not profiled
            recording.clear()
        assert result.version == 1 and result.commits
        unlisted = ran - set(stages) - libraries
        assert not unlisted, f"files the update ran code in that docs/design.md does not list: {sorted(unlisted)}"
        assert set(stages[3:]) <= ran, f"stage files the update never ran: {sorted(set(stages[3:]) - ran)}"
    finally:
        h.close()
