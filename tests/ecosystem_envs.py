"""Two small environments of other ecosystems, each written against its package's public API only:
an OpenEnv environment served by openenv-core's ``create_app`` (``app``: run it with uvicorn), and a
skyrl-gym ``BaseTextEnv`` (``CountDigits``, made by its entry point ``tests.ecosystem_envs:CountDigits``).

Both play the same two-turn game, so a tiny random policy earns rewards that differ episode to episode:
the environment picks a digit (OpenEnv: ``seed % 10``; skyrl-gym: the row's ``reward_spec.ground_truth``)
and rewards each reply with ``0.25`` per occurrence of it, saying after the first reply how many it counted.
``reward`` is that rule, for the tests' own reckoning.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

TURNS = 2


def reward(digit: str, reply: str) -> float:
    return 0.25 * reply.count(digit)


class DigitAction(Action):
    message: str


class DigitObservation(Observation):
    prompt: str = ""


class DigitGame(Environment):
    """OpenEnv: the digit ``seed % 10``, two replies."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.digit, self._state = "0", State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> DigitObservation:
        self.digit, self._state = str((seed or 0) % 10), State(episode_id=episode_id, step_count=0)
        return DigitObservation(prompt=f"game {seed}: write the digit {self.digit} as often as you can")

    def step(self, action: DigitAction, timeout_s: float | None = None, **kwargs: Any) -> DigitObservation:
        self._state.step_count += 1
        done = self._state.step_count >= TURNS
        return DigitObservation(prompt=f"you wrote {action.message.count(self.digit)} of {self.digit}", done=done,
                                reward=reward(self.digit, action.message))

    @property
    def state(self) -> State:
        return self._state


app = create_app(DigitGame, DigitAction, DigitObservation, env_name="digit_game", max_concurrent_envs=32)


class CountDigits(BaseTextEnv):
    """skyrl-gym: the row's ground-truth digit, ``extras["max_turns"]`` replies (default 2)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.digit = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = int(extras.get("max_turns", TURNS))

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        said = [] if done else [{"role": "user", "content": f"you wrote {action.count(self.digit)} of {self.digit}"}]
        return BaseTextEnvStepOutput(observations=said, reward=reward(self.digit, action), done=done, metadata={})
