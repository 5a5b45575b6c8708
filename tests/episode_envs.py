"""Environments of the multi-turn tests (``task.name = "tests.episode_envs:make"``): importable
by the scoring processes, which build the task from the engine's ``sys.path``."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Task, Turn

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it")


class Echo(EpisodeTask):
    """``turns`` turns: each reply is answered ``obs <i>`` (as a tool; the second as raw token
    ids, ``observation_ids``, of `` ids 2 ``); the last earns the number of characters the
    policy wrote. A prompt's ``meta["fault"]`` makes every turn of
    its episodes raise, hang, answer garbage or run out of memory; ``overlong``: the first
    observation is 300 words long; ``one_hangs``: the first
    turn to create the file ``meta["marker"]`` hangs, every other one raises once it exists."""

    def __init__(self, tokenizer, turns: int, prompt_chars: int) -> None:
        self.tokenizer, self.turns, self.prompt_chars = tokenizer, turns, prompt_chars

    def sample(self, rng: random.Random) -> Prompt:
        text = ""
        while len(text) < self.prompt_chars:
            text += rng.choice(WORDS) + " "
        return Prompt(text[: self.prompt_chars])

    def turn(self, episode: EpisodeView) -> Turn:
        fault = episode.prompt.meta.get("fault", "")
        if fault == "raise":
            raise RuntimeError("the tool crashed")
        if fault == "hang":
            time.sleep(3600)
        if fault == "one_hangs":
            _one_hangs(Path(episode.prompt.meta["marker"]))
        if fault == "garbage":
            return {"observation": 42}  # type: ignore[return-value]
        if fault == "memory":
            return Turn(observation=str(len(bytearray(64 << 30))))
        if fault == "overlong" and len(episode.replies) == 1:  # past the server's context: its next turn is refused
            return Turn(observation=" obs" * 300)
        if episode.last or len(episode.replies) >= self.turns:
            return Turn(done=True, reward=float(sum(len(r) for r in episode.replies)))
        n = len(episode.replies)
        if n == 2:
            return Turn(observation_ids=self.tokenizer(f" ids {n} ", add_special_tokens=False).input_ids)
        return Turn(observation=f" obs {n} ", state={"turn": n})

    def eval_prompts(self, n: int) -> list[Prompt]:
        rng = random.Random(7)
        return [self.sample(rng) for _ in range(n)]


def _one_hangs(marker: Path) -> None:
    """Hang if this call creates ``marker`` first; else raise (it exists)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        raise RuntimeError("the other episode's tool hangs") from None
    time.sleep(3600)


def make(tokenizer, turns: int = 3, prompt_chars: int = 300) -> Echo:
    return Echo(tokenizer, turns, prompt_chars)


class Distinct(Task):
    """A single-turn task: each completion earns its number of distinct tokens, plus a thousandth
    per completion scored in the same call (so a group's rewards show it was scored at once)."""

    def sample(self, rng: random.Random) -> Prompt:
        return Prompt(" ".join(rng.choice(WORDS) for _ in range(60)))

    def score(self, prompts, completions) -> list[float]:
        return [len(set(c.token_ids)) + len(completions) / 1000 for c in completions]


def make_single(tokenizer) -> Distinct:
    return Distinct()
