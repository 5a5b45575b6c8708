"""The ``verifiers`` task: a verifiers 0.4 environment, trained on in flight.

``task.env_id`` names the environment's taskset (a module whose ``__all__`` names one
``vf.Taskset``: verifiers' ``taskset.id``). Its rows are the prompts; its tools (``vf.Toolset``
MCP servers), turns and rubric (``@vf.reward``) run unchanged, through verifiers' public
API, in ``inflight.trainer.rollout.verifiers_turns``. Its harness is
``inflight.trainer.envs.verifiers_harness`` (the chat loop, in-process) in every seat the policy
plays (``task.verifiers.seats``; all of them by default), and every model call is a turn that
the engine samples, tagged with versions. Each seat of a rollout is one episode of its group.
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

from inflight.trainer.envs.verifiers_render import make_renderer
from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn

HARNESS = "inflight.trainer.envs.verifiers_harness"


def env_config(cfg: Any) -> dict[str, Any]:
    """verifiers' environment config for ``cfg`` (a ``TrainConfig``): the taskset, the
    environment's own knobs (``task.verifiers.env``), and in each seat the policy plays our
    harness in this process, with ``task.episode.max_turns`` as the seat's ``max_turns``."""
    v = cfg.task.verifiers
    ours = {"harness": {"id": plugin_id(HARNESS)}, "runtime": {"type": "subprocess"},
            "max_turns": cfg.task.episode.max_turns}
    env = {k: dict(value) if isinstance(value, dict) else value for k, value in v.env.items()}
    for seat in policy_seats(cfg):
        env[seat] = {**env.get(seat, {}), **ours}
    return {**env, "taskset": {"id": plugin_id(cfg.task.env_id), **v.taskset}}


def policy_seats(cfg: Any) -> tuple[str, ...]:
    """The seats (the environment config's ``vf.AgentConfig`` fields, ``agent`` for a plain
    taskset) the policy plays: ``task.verifiers.seats``, or every one the environment declares."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import env_config_type

    try:
        cls = env_config_type(plugin_id(cfg.task.env_id))
    except Exception as e:  # an import error: named, with the id
        raise ValueError(f"task.env_id={cfg.task.env_id!r}: verifiers cannot load it ({type(e).__name__}: {e})") \
            from e
    declared = tuple(name for name, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig))
    seats = cfg.task.verifiers.seats or declared
    if unknown := [s for s in seats if s not in declared]:
        raise ValueError(f"task.verifiers.seats={list(seats)}: {unknown} not seats of {cfg.task.env_id!r} "
                         f"(its seats: {list(declared)})")
    return tuple(seats)


def taskset_rows(env: Any, cfg: Any) -> list[Any]:
    """The environment's taskset rows: all of them, or the first ``task.verifiers.max_rows``
    (an infinite taskset, such as kuhn_poker's hands, takes 1024 without it)."""
    import itertools

    limit = cfg.task.verifiers.max_rows or (1024 if getattr(env.taskset, "INFINITE", False) else None)
    return list(itertools.islice(env.taskset, limit))


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


class VerifiersTask(EpisodeTask):
    """A verifiers environment's taskset as prompts. Its episodes are the environment's own
    (``VerifiersTurns``): this class only draws the rows."""

    renders_prompt: ClassVar[bool] = True

    def __init__(self, cfg: Any, tokenizer: Any = None) -> None:
        self.env_id = cfg.task.env_id
        self.seats = policy_seats(cfg)
        if cfg.rollout.group_size % len(self.seats):
            raise ValueError(f"rollout.group_size={cfg.rollout.group_size} must be a multiple of the {len(self.seats)} "
                             f"seats the policy plays in {self.env_id!r} ({list(self.seats)}): each of a group's "
                             "episodes is one seat of one of its rollouts")
        if tokenizer is not None:  # the renderer fits the policy's tokenizer, or the setting is named now
            v = cfg.task.verifiers
            make_renderer(tokenizer, v.renderer, v.renderer_options, cfg.task.tool_parser)
        env = load_environment(cfg)
        self.prompts = [Prompt(_text(t.data), meta={"row": i}) for i, t in enumerate(taskset_rows(env, cfg))]
        if not self.prompts:
            raise ValueError(f"task.env_id={self.env_id!r}: its taskset has no rows")

    def sample(self, rng: random.Random) -> Prompt:
        return self.prompts[rng.randrange(len(self.prompts))]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return []  # the environment's own evaluation is verifiers' (vf-eval)

    def turn(self, episode: EpisodeView) -> Turn:
        raise RuntimeError(f"verifiers environment {self.env_id!r}: its turns run in its harness (VerifiersTurns)")


def _text(data: Any) -> str:
    """A row's prompt as text, for logs (a prompt-less row, whose seats converse through
    interactions: its name)."""
    try:
        text = str(data.prompt_text or "")
    except Exception:  # a taskset whose prompt is not text: its repr
        text = ""
    return text or str(getattr(data, "name", "") or "") or repr(data)[:200]
