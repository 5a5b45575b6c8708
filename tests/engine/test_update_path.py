"""One weight update, from the push to the commit, runs code in exactly the project files this
test names for its path (a whole-model swap, a sparse push, a layer-granular push, a LoRA
push), reaches docs/design.md's stage files in the order it lists them (*One update in ten
files*), and every file it runs is in that list or among its libraries.

The engine is started with a profiler set for every thread the test process starts from then
on (``threading.setprofile``: the in-process EngineCore's helpers, the worker's listener and
its re-pack thread); the push itself runs on this thread (``sys.setprofile``). While one push
lands, the profiler records each project function that ran, in the order each was first
entered. Each stage of the list names the function where the update enters its file; those
are called only for an update, so their order is the update's order, whatever the engine's
idle pollers (the coordinator's watcher, the listener's loop) run meanwhile.
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
SECTION = "## One update in ten files"

COMMON = {
    "inflight/transport/pusher.py", "inflight/transport/sources.py", "inflight/transport/bucket.py",
    "inflight/protocol.py", "inflight/transport/group.py", "inflight/auth.py", "inflight/transport/store.py",
    "inflight/transport/poll.py", "inflight/transport/listener.py", "inflight/transport/schema.py",
    "inflight/staging.py", "inflight/transport/data_plane.py", "inflight/transport/errors.py",
    "engine_patches/commit/target.py", "engine_patches/coordinator.py", "engine_patches/worker.py",
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
ENTRIES = {
    "layer": {"inflight/transport/listener.py": "UpdateListener._on_layer_announce",
              "engine_patches/commit/swap.py": "LayerSwapStrategy.feed"},
    "lora": {"engine_patches/commit/swap.py": ("engine_patches/commit/lora_slot.py", "LoRASlotStrategy.feed"),
             "engine_patches/commit/loaders.py": ("engine_patches/commit/lora_plan.py", "SlotPlan.images")},
}
"""Where a path enters a stage other than as docs/design.md lists it: another function of the
stage's file, or (file, function) of the strategy that replaces it; docs/design.md says so too."""


def _listed() -> tuple[list[tuple[str, str]], set[str]]:
    """docs/design.md's stages in order, as (file, entry function), and its libraries."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    stages = re.findall(r"^\d+\. `([\w/]+\.py)` \(`([\w.]+)`\)", section, flags=re.M)
    libraries = section.split("Libraries the stages call", 1)[1].split("\n\n", 1)[0]
    return stages, set(re.findall(r"`([\w/]+\.py)`", libraries))


def stages_of(path: str) -> list[tuple[str, str]]:
    """The (file, entry function) a push of ``path`` reaches, in the listed order."""
    stages, _ = _listed()
    out = []
    for file, entry in stages:
        sub = ENTRIES.get(path, {}).get(file, entry)
        out.append(sub if isinstance(sub, tuple) else (file, sub))
    return out


class Recorder:
    """The project functions that ran while recording, as ``file:qualname``, in the order each
    was first entered."""

    def __init__(self) -> None:
        self.ran: dict[str, None] = {}
        self.recording = threading.Event()

    def __call__(self, frame, event, arg):  # sys.setprofile's signature
        if event == "call" and self.recording.is_set():
            name = frame.f_code.co_filename
            if name.startswith(PROJECT):
                self.ran.setdefault(f"{Path(name).relative_to(ROOT)}:{frame.f_code.co_qualname}", None)

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        """Profile every thread started inside (an engine's, its listener's, the re-pack thread)."""
        threading.setprofile(self)
        try:
            yield
        finally:
            threading.setprofile(None)  # threads started from here on (other tests') are not profiled

    def record(self, push: Callable[[], object]) -> tuple[object, list[str]]:
        """``push()``'s result and the functions it ran (``file:qualname``), first entered first."""
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
    """The files ``ran`` touched are exactly ``path``'s, and its stages' entries came in order."""
    files = list(dict.fromkeys(r.split(":", 1)[0] for r in ran))
    want = PATHS[path]
    assert set(files) == want, (f"{path}: ran but not named: {sorted(set(files) - want)}; named but never ran: "
                                f"{sorted(want - set(files))}")
    entries = [f"{file}:{entry}" for file, entry in stages_of(path)]
    missing = [e for e in entries if e not in ran]
    assert not missing, f"{path}: stage entries that never ran: {missing}"
    order = sorted(entries, key=ran.index)
    assert order == entries, f"{path}: stages reached in the order {order}, the docs list {entries}"


def test_the_docs_list_at_most_ten_stage_files_that_exist() -> None:
    stages, libraries = _listed()
    files = [f for f, _ in stages]
    assert len(files) <= 10 and len(set(files)) == len(files), files
    assert all((ROOT / f).is_file() for f in [*files, *libraries]), [f for f in [*files, *libraries]
                                                                     if not (ROOT / f).is_file()]
    assert not set(files) & libraries
    named = set().union(*PATHS.values())
    strategies = {sub[0] for subs in ENTRIES.values() for sub in subs.values() if isinstance(sub, tuple)}
    assert named <= set(files) | libraries | strategies, named - set(files) - libraries
    assert set(files) <= SWAP


def test_the_order_check_finds_stages_out_of_order() -> None:
    """The check has power: the same run with two stages' first calls swapped fails it."""
    ran = [f"{f}:{e}" for f, e in stages_of("swap")] + sorted(SWAP)
    check_path("swap", ran)  # every file named, the entries in order
    swapped = [ran[1], ran[0], *ran[2:]]
    try:
        check_path("swap", swapped)
    except AssertionError as e:
        assert "in the order" in str(e)
    else:
        raise AssertionError("stages out of order passed the check")


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
