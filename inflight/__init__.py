"""inflight: in-flight weight updates for async RL. One import namespace:

    inflight.transport   the weight group: trainer and worker sides of a push
    inflight.engine      the vLLM side: the worker extension, commits (folder engine_patches/)
    inflight.trainer     the training entry point, fleet, tasks (folder trainer/)
    inflight.kernels     Triton kernels with their torch references (folder kernels/)
    inflight.bench       benchmarks (folder bench/)

The public API, imported on first use (``import inflight`` loads neither torch nor vLLM):

    engine:   InflightConfig, engine_kwargs, start_inflight, start_inflight_async, tagged,
              stream_tagged, inflight_status
    trainer:  WeightPusher, PushConfig, GroupConfig, FleetPusher, ShardedSource
    training: TrainConfig, train

An installed wheel holds the four subpackages inside ``inflight/``. A checkout of the
repository keeps them as top-level folders beside it (the project's layout); there
``_CheckoutFinder`` maps each name to its folder, so the code imports them by one name either
way and a module is never loaded twice under two names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import Any

_FOLDERS = {"engine": "engine_patches", "trainer": "trainer", "kernels": "kernels", "bench": "bench"}
"""Each subpackage's folder in a checkout of the repository."""

_API = {
    "InflightConfig": "inflight.engine.engine_config", "engine_kwargs": "inflight.engine.engine_config",
    "start_inflight": "inflight.engine.client", "start_inflight_async": "inflight.engine.client",
    "tagged": "inflight.engine.client", "stream_tagged": "inflight.engine.client",
    "inflight_status": "inflight.engine.client",
    "WeightPusher": "inflight.transport.pusher", "PushConfig": "inflight.transport.pusher",
    "GroupConfig": "inflight.transport.group_config", "FleetPusher": "inflight.transport.fleet_pusher",
    "ShardedSource": "inflight.transport.sources",
    "TrainConfig": "inflight.trainer.config", "train": "inflight.trainer.train",
}
__all__ = sorted(_API)


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """``inflight.<name>`` -> the checkout's ``_FOLDERS[name]`` folder (its submodules follow
    from the package's ``__path__``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in _FOLDERS:
            return None
        folder = self.root / _FOLDERS[name]
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _in_a_checkout() -> Path | None:
    """The repository's root, when this package runs from a checkout (not from a wheel)."""
    here = Path(__file__).resolve().parent
    root = here.parent
    if (here / "engine").is_dir() or not (root / "engine_patches" / "worker.py").is_file():
        return None
    return root


_root = _in_a_checkout()
if _root is not None and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder(_root))


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'inflight' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
