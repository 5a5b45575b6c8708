"""One weight update, from the push to the commit, runs code in exactly the project files this
test names for its path (a whole-model swap, a sparse push, a layer-granular push, a LoRA
push), and each of those files is in docs/design.md's list (*One update in twelve files*).

The engine is started with a profiler set for every thread the test process starts from then
on (``threading.setprofile``: the in-process EngineCore's helpers, the worker's listener and
its re-pack thread); the push itself runs on this thread (``sys.setprofile``). While one push
lands, the profiler records each project file one of whose functions ran, in the order each
was first entered. The first three stage files (``train.py``, ``weight_sync.py``,
``fleet_pusher.py``) are the training loop's way into the pusher, which the training runs of
``tests/engine/test_train.py`` take; this test pushes with ``WeightPusher`` directly.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.engine_harness import Harness, perturbed

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(ROOT / d) + "/" for d in ("inflight", "engine_patches", "trainer", "kernels"))

COMMON = {
    "inflight/transport/pusher.py", "inflight/transport/sources.py", "inflight/transport/layout.py",
    "inflight/protocol.py", "inflight/transport/group.py", "inflight/auth.py", "inflight/transport/store.py",
    "inflight/transport/poll.py", "inflight/transport/listener.py", "engine_patches/worker.py", "inflight/staging.py",
    "inflight/transport/data_plane.py", "inflight/transport/errors.py", "engine_patches/coordinator.py",
    "engine_patches/rpc.py", "engine_patches/prefix_cache.py", "inflight/layer_groups.py",
}
"""What every push runs, from the pusher to the commit (an idle engine commits without a step,
so the step hook, ``engine_patches/patch.py``, does not run)."""
SWAP = COMMON | {"inflight/shard_plan.py", "engine_patches/commit/swap.py", "engine_patches/commit/loaders.py"}
"""A whole-model push committed by the ``swap`` strategy."""
PATHS = {
    "swap": SWAP,
    "sparse": SWAP | {"inflight/transport/delta.py"},
    "layer": SWAP,  # the same files: the layer groups' announces, stages and commits
    "lora": COMMON | {"engine_patches/commit/lora_slot.py", "engine_patches/commit/lora_plan.py"},
}
"""Each path's exact set of project files."""
STRATEGIES = {"engine_patches/commit/lora_slot.py", "engine_patches/commit/lora_plan.py"}
"""Files docs/design.md names as another strategy's, in place of ``swap.py`` and ``loaders.py``."""


def _listed() -> tuple[list[str], set[str]]:
    """docs/design.md's stage files, in order, and its libraries."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## One update in twelve files", 1)[1].split("\n## ", 1)[0]
    stages = re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)
    libraries = section.split("Libraries the stages call", 1)[1].split("\n\n", 1)[0]
    return stages, set(re.findall(r"`([\w/]+\.py)`", libraries))


class Recorder:
    """The project files whose functions ran while recording, in the order each was first entered."""

    def __init__(self) -> None:
        self.ran: dict[str, None] = {}
        self.recording = threading.Event()

    def __call__(self, frame, event, arg):  # noqa: ARG002  sys.setprofile's signature
        if event == "call" and self.recording.is_set():
            name = frame.f_code.co_filename
            if name.startswith(PROJECT):
                self.ran.setdefault(str(Path(name).relative_to(ROOT)), None)

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        """Profile every thread started inside (an engine's, its listener's, the re-pack thread)."""
        threading.setprofile(self)
        try:
            yield
        finally:
            threading.setprofile(None)  # threads started from here on (other tests') are not profiled

    def record(self, push: Callable[[], object]) -> tuple[object, list[str]]:
        """``push()``'s result and the files it ran, first entered first."""
        self.ran = {}
        self.recording.set()
        sys.setprofile(self)
        try:
            result = push()
        finally:
            sys.setprofile(None)
            self.recording.clear()
        return result, list(self.ran)


def check_path(path: str, ran: list[str]) -> None:
    want = PATHS[path]
    assert set(ran) == want, (f"{path}: ran but not named: {sorted(set(ran) - want)}; named but never ran: "
                              f"{sorted(want - set(ran))}; run order: {ran}")


def test_the_docs_list_twelve_stage_files_that_exist() -> None:
    stages, libraries = _listed()
    assert len(stages) == 12 and len(set(stages)) == 12, stages
    assert all((ROOT / f).is_file() for f in [*stages, *libraries]), [f for f in [*stages, *libraries]
                                                                     if not (ROOT / f).is_file()]
    assert not set(stages) & libraries
    named = set().union(*PATHS.values())
    assert named <= set(stages) | libraries | STRATEGIES, named - set(stages) - libraries
    assert set(stages[3:]) <= SWAP


def test_a_swap_and_a_sparse_push_run_exactly_their_files(tiny_qwen, port) -> None:
    from inflight.transport.pusher import PushConfig

    rec = Recorder()
    with rec.threads():
        h = Harness(tiny_qwen, "float32", port, keep_base=True)
        try:
            result, ran = rec.record(lambda: h.push(perturbed(h.base, seed=5, scale=0.01)))
            assert result.version == 1 and result.commits
            check_path("swap", ran)
            master = perturbed(h.base, seed=6, scale=0.01)
            with h.pushing_with(PushConfig(dtype="float32", bucket_mb=0.25, encoding="sparse")):
                h.push(master)  # the trainer holds no base yet: dense
                master = {n: t.clone() for n, t in master.items()}
                next(iter(master.values())).view(-1)[:7] += 1e-3
                result, ran = rec.record(lambda: h.push(master))
            assert result.send.changed_frac is not None and result.commits
            check_path("sparse", ran)
        finally:
            h.close()


def test_a_layer_push_runs_exactly_its_files(tiny_qwen, port) -> None:
    rec = Recorder()
    with rec.threads():
        h = Harness(tiny_qwen, "float32", port, commit_unit="layer")
        try:
            result, ran = rec.record(lambda: h.push(perturbed(h.base, seed=7, scale=0.01)))
            assert result.version == 1 and result.commits
            check_path("layer", ran)
        finally:
            h.close()


def test_a_lora_push_runs_exactly_its_files(tiny_llama, tmp_path, port) -> None:
    from tests.lora_harness import LoRAEngine, write_adapter

    v0 = write_adapter(tiny_llama, tmp_path / "v0", seed=13)
    rec = Recorder()
    with rec.threads():
        engine = LoRAEngine(tiny_llama, tmp_path / "v0", v0, port)
        try:
            result, ran = rec.record(lambda: engine.push({n: t + 0.01 for n, t in v0.items()}))
            assert result.version == 1 and result.commits
            check_path("lora", ran)
        finally:
            engine.close()
