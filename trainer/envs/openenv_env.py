"""``openenv``: an OpenEnv environment server, driven through openenv-core's client, as an ``EpisodeTask``.

``task.openenv.url`` names a running OpenEnv server (``uvicorn my_env.server.app:app``, a Docker container, a
Hugging Face Space). An episode is one session of it (``GenericEnvClient``, WebSocket): ``reset(seed=s,
**task.openenv.reset)``'s observation is the opening prompt, each reply is the action ``{action_field: reply}``
of one ``step``, whose observation is the next user turn, until its ``done``. The episode's reward is the sum of
its steps' rewards (None counts 0; as verifiers' OpenEnv taskset sums them); cut short by
``task.episode.max_turns`` or the token budget, the sum so far. Training seeds are drawn below ``eval_seed``; the
held-out episodes reset with ``eval_seed``, ``eval_seed + 1``, ...

Invariants: a turn may run in any scoring process and a session lives on one connection, so each turn opens a
session, resets it with the episode's seed and replays the earlier replies before stepping the last; a replay
whose opening or observations are not the episode's (a server that is not deterministic under its seed) fails
the episode, named. Opening prompts come from a reset each (``sample``: in the engine process, bounded by
``timeout_s``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn

WHERE = "task.openenv"


@dataclass(frozen=True, kw_only=True)
class OpenEnvConfig:
    """The ``openenv`` task (``inflight.trainer.envs.openenv_env``): an OpenEnv environment server."""

    url: str = ""
    """The OpenEnv server's base URL (``http://127.0.0.1:8000``, a Space's ``https://<owner>-<env>.hf.space``)."""
    action_field: str = ""
    """The action's field that carries the policy's reply (empty: the one required field of the server's
    action schema, ``GET /schema``)."""
    observation_field: str = ""
    """The observation's field the policy reads (empty: the whole observation, as JSON)."""
    reset: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every ``reset``, besides ``seed``."""
    eval_seed: int = 1_000_000
    """Held-out episodes reset with seeds ``eval_seed``, ``eval_seed + 1``, ...; training seeds are below it."""
    timeout_s: float = 10.0
    """The longest a connection, a reset or a step may take."""

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"{WHERE}.url={self.url!r} must be an http(s):// or ws(s):// URL")
        if "seed" in self.reset:
            raise ValueError(f"{WHERE}.reset.seed={self.reset['seed']!r}: each episode's seed is drawn (eval_seed)")
        if self.eval_seed < 1:
            raise ValueError(f"{WHERE}.eval_seed={self.eval_seed} must be >= 1 (training seeds lie below it)")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"{WHERE}.timeout_s={self.timeout_s} must be a number of seconds > 0")


def action_schema(url: str, timeout_s: float) -> dict[str, Any]:
    """The server's action schema (``GET /schema``); ValueError naming ``task.openenv.url`` when no
    OpenEnv server answers there."""
    import httpx

    base = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        response = httpx.get(f"{base}/schema", timeout=timeout_s)
        response.raise_for_status()
        return dict(response.json()["action"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{WHERE}.url={url!r}: no OpenEnv server answers GET /schema there "
                         f"({type(e).__name__}: {e})") from None


def pick_action_field(schema: dict[str, Any], field_name: str) -> str:
    """``field_name``, checked against the schema's properties, or the schema's one required field."""
    properties = sorted(schema.get("properties", {}))
    if field_name:
        if field_name not in properties:
            raise ValueError(f"{WHERE}.action_field={field_name!r} is not a field of the server's action "
                             f"{schema.get('title', '')!r} (its fields: {properties})")
        return field_name
    required = [r for r in schema.get("required", []) if r != "metadata"]
    if len(required) != 1:
        raise ValueError(f"{WHERE}.action_field is empty and the server's action {schema.get('title', '')!r} "
                         f"requires {required}, not one field: name the field that carries the reply")
    return required[0]


class OpenEnvTask(EpisodeTask):
    """Episodes of an OpenEnv server (see the module docstring)."""

    def __init__(self, cfg: OpenEnvConfig, *, eval_size: int = 0) -> None:
        try:
            import openenv  # noqa: F401
        except ImportError:
            raise ImportError("task.name = 'openenv' needs openenv-core: pip install 'inflight[openenv]'") from None
        if not cfg.url:
            raise ValueError(f"{WHERE}.url is empty: name a running OpenEnv server (http://host:port)")
        self.cfg, self.eval_size = cfg, eval_size
        self.action_field = pick_action_field(action_schema(cfg.url, cfg.timeout_s), cfg.action_field)
        self._held_out: list[Prompt] | None = None

    def client(self) -> Any:
        from openenv import GenericEnvClient

        return GenericEnvClient(base_url=self.cfg.url, connect_timeout_s=self.cfg.timeout_s,
                                message_timeout_s=self.cfg.timeout_s)

    def text(self, observation: Any) -> str:
        """What the policy reads of an observation."""
        name = self.cfg.observation_field
        if not name:
            return json.dumps(observation, sort_keys=True, ensure_ascii=False)
        if not isinstance(observation, dict) or name not in observation:
            raise ValueError(f"{WHERE}.observation_field={name!r} is not in the server's observation "
                             f"(its fields: {sorted(observation) if isinstance(observation, dict) else observation!r})")
        value = observation[name]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)

    def opening(self, seed: int) -> Prompt:
        with self.client().sync() as env:
            result = env.reset(seed=seed, **self.cfg.reset)
        return Prompt(self.text(result.observation), meta={"seed": seed})

    def sample(self, rng: random.Random) -> Prompt:
        return self.opening(rng.randrange(self.cfg.eval_seed))

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > self.eval_size:
            raise ValueError(f"{WHERE}: {n} eval prompts asked, {self.eval_size} held out (eval.prompts)")
        if self._held_out is None:
            self._held_out = [self.opening(self.cfg.eval_seed + i) for i in range(self.eval_size)]
        return self._held_out[:n]

    async def turn(self, episode: EpisodeView) -> Turn:
        seed, last = episode.prompt.meta["seed"], len(episode.replies) - 1
        async with self.client() as env:
            result = await env.reset(seed=seed, **self.cfg.reset)
            said = [self.text(result.observation)]
            total = 0.0
            for i, reply in enumerate(episode.replies):
                result = await env.step({self.action_field: reply})
                total += float(result.reward or 0.0)
                if i == last:
                    break
                said.append("the end" if result.done else self.text(result.observation))
        if said != [episode.prompt.text, *episode.observations[:last]]:
            raise ValueError(f"OpenEnv server {self.cfg.url!r}: replaying the episode of seed {seed} gave "
                             f"{said!r}, not its {[episode.prompt.text, *episode.observations[:last]]!r} (the "
                             "environment is not deterministic under its seed)")
        if result.done or episode.last:
            return Turn(done=True, reward=total)
        return Turn(observation=self.text(result.observation), role="user")
