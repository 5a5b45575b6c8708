"""The ``verifiers`` task: a verifiers 0.4 environment, trained on in flight.

``task.env_id`` names the environment's taskset (a module whose ``__all__`` names one
``vf.Taskset``: verifiers' ``taskset.id``). Its rows are the prompts; its tools (``vf.Toolset``
MCP servers), turns and rubric (``@vf.reward``) run unchanged, through verifiers' public
API, in ``inflight.trainer.rollout.verifiers_turns``. Its harness is
``inflight.trainer.envs.verifiers_harness`` (the chat loop, in-process), and every model call
is a turn that the engine samples, tagged with versions.
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn

HARNESS = "inflight.trainer.envs.verifiers_harness"


def env_config(cfg: Any) -> dict[str, Any]:
    """verifiers' environment config for ``cfg`` (a ``TrainConfig``): the taskset, our
    harness in this process, and ``task.episode.max_turns`` as the agent's ``max_turns``."""
    return {"taskset": {"id": plugin_id(cfg.task.env_id), **cfg.task.verifiers.taskset},
            "agent": {"harness": {"id": plugin_id(HARNESS)}, "runtime": {"type": "subprocess"},
                      "max_turns": cfg.task.episode.max_turns}}


_LOADED: dict[str, Any] = {}
"""Environments loaded for their rows and not yet taken by a harness, by config."""


def load_environment(cfg: Any) -> Any:
    """The environment of ``cfg``, kept for ``take_environment``; ValueError naming
    ``task.env_id`` where verifiers cannot load it."""
    env = _LOADED[_key(cfg)] = _load(cfg)
    return env


def take_environment(cfg: Any) -> Any:
    """The environment ``load_environment`` loaded for ``cfg`` in this process (the engine
    process's task drew its rows from it), or a new one; each is served by one harness."""
    env = _LOADED.pop(_key(cfg), None)
    return env if env is not None else _load(cfg)


def _load(cfg: Any) -> Any:
    import verifiers.v1 as vf

    try:
        return vf.load_environment(vf.resolve_env_config(env_config(cfg)))
    except Exception as e:  # an import error, a bad taskset config: named, with the id
        raise ValueError(f"task.env_id={cfg.task.env_id!r}: verifiers cannot load it ({type(e).__name__}: {e})") \
            from e


def _key(cfg: Any) -> str:
    return json.dumps(env_config(cfg), sort_keys=True, default=repr)


def plugin_id(module: str) -> str:
    """A verifiers plugin id for ``module``. verifiers 0.4.0 imports a taskset or harness id
    as one module name (its lookup of a dotted id fails before the import), so a dotted
    module is imported here and named in ``sys.modules`` by its dots as ``__``."""
    if "." not in module or "/" in module:
        return module
    import importlib
    import sys

    flat = module.replace(".", "__")
    sys.modules.setdefault(flat, importlib.import_module(module))
    return flat


def make_renderer(tokenizer: Any, name: str, options: dict[str, Any]) -> Any:
    """The ``renderers`` renderer ``name`` (its config's other fields ``options``) over ``tokenizer``."""
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    try:
        config = TypeAdapter(RendererConfig).validate_python({**options, "name": name})
    except ValueError as e:
        raise ValueError(f"task.verifiers.renderer={name!r} with renderer_options={options!r}: not a renderers "
                         f"config ({e})") from None
    return create_renderer(tokenizer, config)


class VerifiersTask(EpisodeTask):
    """A verifiers environment's taskset as prompts. Its episodes are the environment's own
    (``VerifiersTurns``): this class only draws the rows."""

    renders_prompt: ClassVar[bool] = True

    def __init__(self, cfg: Any) -> None:
        self.env_id = cfg.task.env_id
        env = load_environment(cfg)
        self.prompts = [Prompt(_text(t.data), meta={"row": i}) for i, t in enumerate(env.taskset)]
        if not self.prompts:
            raise ValueError(f"task.env_id={self.env_id!r}: its taskset has no rows")

    def sample(self, rng: random.Random) -> Prompt:
        return self.prompts[rng.randrange(len(self.prompts))]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return []  # the environment's own evaluation is verifiers' (vf-eval)

    def turn(self, episode: EpisodeView) -> Turn:
        raise RuntimeError(f"verifiers environment {self.env_id!r}: its turns run in its harness (VerifiersTurns)")


def _text(data: Any) -> str:
    """A row's prompt as text, for logs."""
    try:
        return str(data.prompt_text)
    except Exception:  # a taskset whose prompt is not text: its repr
        return repr(data)[:200]
