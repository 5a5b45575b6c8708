"""``skyrl_gym``: a skyrl-gym text environment (``skyrl_gym.make``) as an ``EpisodeTask``, rewarded by itself.

The prompts are rows of a SkyRL dataset (JSON lines or parquet, as SkyRL's examples write them): ``prompt`` (chat
messages, or a string), and whatever the environment reads from its ``extras`` (``reward_spec``, ``extra_info``);
a row's ``env_class`` names its environment (else ``task.skyrl_gym.env``). Each episode's environment is made as
SkyRL's generator makes it, ``skyrl_gym.make(env_class, env_config=..., extras=row)``; its ``init(prompt)`` is the
opening prompt, each reply one ``step``: its observations the next turn's messages, its ``done`` the end. The
episode's reward is the sum of its steps' rewards (SkyRL's GRPO outcome: the per-turn rewards summed); cut short by
``task.episode.max_turns`` or the token budget, the sum so far.

Invariant: a turn may run in any scoring process, and a skyrl-gym environment is a stateful object, so each turn
makes the environment anew and replays the episode's earlier replies before stepping the last; a replay whose
observations are not the episode's (an environment that is not deterministic) fails the episode, named.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import ROLES, EpisodeView, Prompt, Turn

WHERE = "task.skyrl_gym"


@dataclass(frozen=True, kw_only=True)
class SkyRLGymConfig:
    """The ``skyrl_gym`` task (``inflight.trainer.envs.skyrl_gym_env``): a skyrl-gym environment on a SkyRL dataset."""

    env: str = "gsm8k"
    """The environment of rows without an ``env_class``: a skyrl-gym id (``gsm8k``, ``gsm8k_multi_turn``,
    ``aime``, ...; ``skyrl_gym.registry``) or an entry point ``"pkg.module:EnvClass"`` of your own."""
    path: str = ""
    """The training rows: a .jsonl or .parquet file of SkyRL dataset rows (``prompt``, ``reward_spec``, ...)."""
    eval_path: str = ""
    """Held-out rows for evaluation (empty: the last ``eval.prompts`` rows of ``path``)."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """The environment's ``env_config`` (SkyRL's ``environment.skyrl_gym.<env>`` table: ``db_path``, ...)."""

    def __post_init__(self) -> None:
        if not self.env:
            raise ValueError(f"{WHERE}.env is empty: name a skyrl-gym environment (e.g. 'gsm8k')")
        for name in ("path", "eval_path"):
            value = getattr(self, name)
            if value and Path(value).suffix not in (".jsonl", ".parquet"):
                raise ValueError(f"{WHERE}.{name}={value!r} must be a .jsonl or .parquet file")


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError:
        raise ImportError("task.name = 'skyrl_gym' needs the skyrl-gym package: pip install 'inflight[skyrl]'") \
            from None
    return skyrl_gym


def check_env(name: str, where: str) -> str:
    """``name`` as skyrl-gym makes it: a registered id, or an entry point registered under its own name;
    ValueError naming ``where``, the value and the closest ids otherwise."""
    gym = _skyrl_gym()
    if name in gym.registry:
        return name
    if ":" in name:
        try:
            gym.envs.registration.load_env_creator(name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{where}={name!r}: cannot load the entry point ({type(e).__name__}: {e})") from None
        gym.register(id=name, entry_point=name)
        return name
    close = difflib.get_close_matches(name, sorted(gym.registry), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"registered: {', '.join(sorted(gym.registry))}"
    raise ValueError(f"{where}={name!r} is not a skyrl-gym environment ({hint}; or 'pkg.module:EnvClass')")


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of {{'role': str, 'content': str}}, "
                     f"not {str(prompt)[:80]!r}")


def _plain(value: Any) -> Any:
    """A parquet row's arrays and numpy scalars as JSON values (SkyRL's rows as its datasets hold them)."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def load_rows(path: str, default_env: str) -> list[dict[str, Any]]:
    """The rows of ``path``, each with its ``env_class`` checked; ValueError naming the file and row."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{WHERE}: no such file {path!r}")
    if p.suffix == ".parquet":
        import pandas

        rows = [_plain(r) for r in pandas.read_parquet(p).to_dict(orient="records")]
    else:
        rows = []
        for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rows.append(json.loads(line)) if line.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        _messages(row.get("prompt"), where)
        row["env_class"] = check_env(row.get("env_class") or default_env, f"{where}: env_class")
    if not rows:
        raise ValueError(f"{WHERE}: {path!r} holds no rows")
    return rows


class SkyRLGymTask(EpisodeTask):
    """Episodes of skyrl-gym environments on a SkyRL dataset's rows (see the module docstring)."""

    def __init__(self, cfg: SkyRLGymConfig, *, eval_size: int = 0) -> None:
        if not cfg.path:
            raise ValueError(f"{WHERE}.path is empty: name a .jsonl or .parquet file of SkyRL dataset rows")
        check_env(cfg.env, f"{WHERE}.env")
        self.env_config = dict(cfg.env_config)
        rows = load_rows(cfg.path, cfg.env)
        if cfg.eval_path:
            held = load_rows(cfg.eval_path, cfg.env)[:eval_size]
        else:
            if eval_size >= len(rows):
                raise ValueError(f"{WHERE}: {eval_size} eval prompts leave none of the {len(rows)} rows of "
                                 f"{cfg.path!r} to train on (set {WHERE}.eval_path)")
            rows, held = (rows[:-eval_size], rows[-eval_size:]) if eval_size else (rows, [])
        self.train = [self.to_prompt(r, f"{cfg.path} row {i}") for i, r in enumerate(rows)]
        self.held_out = [self.to_prompt(r, f"{cfg.eval_path or cfg.path} row {i + (0 if cfg.eval_path else len(rows))}")
                         for i, r in enumerate(held)]

    def make(self, row: Mapping[str, Any]) -> Any:
        """The row's environment, as SkyRL's generator makes it."""
        from omegaconf import OmegaConf

        gym = _skyrl_gym()
        check_env(row["env_class"], "env_class")  # registered in this process too (an entry point)
        return gym.make(row["env_class"], env_config=OmegaConf.create(self.env_config), extras=dict(row))

    def to_prompt(self, row: dict[str, Any], where: str = "a row") -> Prompt:
        """The row's opening: its environment's ``init`` of the row's prompt; ValueError naming ``where``
        when the environment refuses the row (a field it needs missing)."""
        try:
            env = self.make(row)
            try:
                messages, _ = env.init(_messages(row["prompt"], where))
            finally:
                env.close()
        except Exception as e:  # the environment's own check of its extras: an assert, a KeyError, ...
            raise ValueError(f"{where}: skyrl-gym {row['env_class']!r} refused it ({type(e).__name__}: {e})") from e
        return Prompt(messages=tuple(_messages(messages, f"{where}: {row['env_class']}.init")), meta={"row": row})

    def sample(self, rng: random.Random) -> Prompt:
        return self.train[rng.randrange(len(self.train))]

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > len(self.held_out):
            raise ValueError(f"{WHERE}: {n} eval prompts asked, {len(self.held_out)} rows held out")
        return self.held_out[:n]

    def correct(self, reward: float) -> bool:
        return reward >= 1.0

    def turn(self, episode: EpisodeView) -> Turn:
        row = episode.prompt.meta["row"]
        env = self.make(row)
        try:
            env.init([dict(m) for m in episode.prompt.messages])
            total = 0.0
            for i, reply in enumerate(episode.replies):
                out = env.step(reply)
                total += float(out["reward"] or 0.0)
                observation = list(out.get("observations") or [])
                if i == len(episode.replies) - 1:
                    break
                if out["done"] or _text(observation) != episode.observations[i]:
                    said = "the end" if out["done"] else repr(_text(observation)[:80])
                    raise ValueError(f"skyrl-gym {row['env_class']!r}: replaying reply {i} gave {said}, not the "
                                     f"episode's observation {episode.observations[i][:80]!r} (the environment is "
                                     "not deterministic)")
        finally:
            env.close()
        if out["done"] or episode.last:
            return Turn(done=True, reward=total)
        bad = [m.get("role") for m in observation if m.get("role") not in ROLES]
        if bad:
            raise ValueError(f"skyrl-gym {row['env_class']!r}: an observation of role {bad[0]!r} (one of "
                             f"{list(ROLES)} only)")
        if not observation:
            return Turn(observation="", role="user")
        return Turn(messages=tuple(observation))


def _text(messages: Sequence[Mapping[str, str]]) -> str:
    """Observations as ``EpisodeView.observations`` shows them (``ObservationRenderer.text``)."""
    return "\n".join(m["content"] for m in messages)
