"""The unit tier: no vLLM engine, no model download; ``make check`` runs it in minutes.

While a test of this folder runs, building an engine (vLLM's ``LLM``, ``AsyncLLM`` or an
``EngineCore``) raises at once, naming the tier the test belongs in: ``tests/engine/``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from typing import Any

import pytest

ENGINES = {"vllm.entrypoints.llm": "LLM", "vllm.v1.engine.async_llm": "AsyncLLM", "vllm.v1.engine.core": "EngineCore"}
"""Module -> the class whose construction starts an engine."""


class _EngineGuard(importlib.abc.MetaPathFinder):
    """Refuses the engine classes of ``ENGINES`` (those loaded, and those whose modules load
    while it is installed) until ``lift``."""

    def __init__(self) -> None:
        self.refused: list[tuple[type, Any]] = []

    def refuse(self, cls: type) -> None:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"a unit test built a vLLM {cls.__name__}: engine tests go in tests/engine/")

        self.refused.append((cls, cls.__dict__.get("__init__")))
        cls.__init__ = init

    def lift(self) -> None:
        for cls, init in reversed(self.refused):
            if init is None:
                del cls.__init__
            else:
                cls.__init__ = init
        self.refused.clear()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in ENGINES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.refuse(getattr(module, ENGINES[fullname]))

        spec.loader.exec_module = exec_module
        return spec


@pytest.fixture(autouse=True)
def _no_engine() -> Iterator[None]:
    guard = _EngineGuard()
    for name, cls in ENGINES.items():
        if name in sys.modules:
            guard.refuse(getattr(sys.modules[name], cls))
    sys.meta_path.insert(0, guard)
    try:
        yield
    finally:
        sys.meta_path.remove(guard)
        guard.lift()
