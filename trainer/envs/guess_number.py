"""``guess_number``: find a secret number from higher/lower feedback (an ``EpisodeTask``).

The episode opens with the rules (``template``, with ``{lo}`` and ``{hi}``); the secret is the prompt's
``meta["secret"]`` (and its ``answer``, as a string). A reply's guess is the reply itself read as a number
(``base.lone_number``: a reply that holds nothing else, commas dropped, ``42.0`` read as ``42``, markdown ``*``,
backticks and a final period aside), so text around a number earns nothing. Each reply is answered (role ``user``):
* the secret: the episode ends with the win reward;
* a whole number in [lo, hi] that is not the secret: ``higher than G`` or ``lower than G`` (where the secret is);
* a whole number outside [lo, hi]: ``G is out of range: my number is between lo and hi.``;
* no number, or one that is not whole: ``Reply with just a whole number between lo and hi.``.
On the last turn (``EpisodeView.last``) a reply that is not the secret ends it.

Rewards: a win on the k-th reply earns ``max(1 - turn_penalty * (k - 1), 0.5)``; an episode that ends without one
earns ``closeness_credit * (1 - |G - secret| / (hi - lo)) + consistency_credit * C / R`` for its last valid guess G
(0 with none), where C of its R replies were whole numbers inside the interval the feedback so far leaves open.
``closeness_credit + consistency_credit`` < 0.5, so every win earns at least 0.5 and every loss less: ``correct`` (a
win) is ``reward >= 0.5``. Stateless: guesses are re-read from ``EpisodeView.replies`` each turn. Binary search
needs ``ceil(log2(hi - lo + 2))`` guesses: set ``task.episode.max_turns`` accordingly. ``examples`` demonstration
games open every prompt as chat messages (0: the rules alone, as plain text). The held-out set is ``eval_size``
distinct secrets drawn once from their own seed; ``sample`` never draws one of them (nor a demonstration's).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn, lone_number

EVAL_SEED = 0x6E55_E7A1
DEMO_SEED = 0x6E55_DE70
WIN_FLOOR = 0.5
"""Every win earns at least this, every loss less: what ``correct`` tells apart."""
TEMPLATE = ("I am thinking of a whole number between {lo} and {hi}. Guess it: reply with just a number, "
            "and I will tell you whether my number is higher or lower.")


def _format_ok(template: str) -> bool:
    try:
        return "{lo}" in template and "{hi}" in template and bool(template.format(lo=1, hi=2))
    except (KeyError, IndexError, ValueError):
        return False


def _check_settings(lo: int, hi: int, turn_penalty: float, closeness_credit: float, consistency_credit: float,
                    template: str, examples: int) -> None:
    if type(lo) is not int or type(hi) is not int:  # bool and float are not whole numbers here
        raise ValueError(f"guess_number: lo={lo!r} and hi={hi!r} must be whole numbers")
    if hi - lo < 3 or abs(lo) > 10 ** 12 or abs(hi) > 10 ** 12:
        raise ValueError(f"guess_number: lo={lo}, hi={hi} must have hi >= lo + 3, both within +-10**12")
    if isinstance(turn_penalty, bool) or not 0 <= turn_penalty <= 1 - WIN_FLOOR:
        raise ValueError(f"guess_number: turn_penalty={turn_penalty} must be in [0, {1 - WIN_FLOOR}]")
    if isinstance(closeness_credit, bool) or not 0 <= closeness_credit < WIN_FLOOR:
        raise ValueError(f"guess_number: closeness_credit={closeness_credit} must be in [0, {WIN_FLOOR}) "
                         f"(a win earns at least {WIN_FLOOR})")
    if isinstance(consistency_credit, bool) or not 0 <= consistency_credit < WIN_FLOOR - closeness_credit:
        raise ValueError(f"guess_number: consistency_credit={consistency_credit} must be in [0, "
                         f"{WIN_FLOOR - closeness_credit:g}) (with closeness_credit={closeness_credit}, a loss earns "
                         f"less than a win's {WIN_FLOOR})")
    if not _format_ok(template):
        raise ValueError(f"guess_number: template={template!r} needs {{lo}} and {{hi}} placeholders and no "
                         "other braces (write {{ and }} for literal ones)")
    if type(examples) is not int or not 0 <= examples <= min(4, hi - lo - 2):
        raise ValueError(f"guess_number: examples={examples} must be in 0..{min(4, hi - lo - 2)}")


class GuessNumber(EpisodeTask):
    def __init__(self, *, lo: int = 1, hi: int = 100, turn_penalty: float = 0.0, closeness_credit: float = 0.2,
                 consistency_credit: float = 0.0, show_range: bool = False, template: str = TEMPLATE,
                 examples: int = 1, eval_size: int = 0) -> None:
        _check_settings(lo, hi, turn_penalty, closeness_credit, consistency_credit, template, examples)
        space = hi - lo + 1 - examples
        if eval_size < 0 or eval_size > space // 2:
            raise ValueError(f"guess_number: eval_size={eval_size} must be in 0..{space // 2} (at most half of "
                             f"the {space} secrets in {lo}..{hi} less the {examples} examples)")
        self.lo, self.hi, self.template = lo, hi, template
        self.turn_penalty, self.closeness_credit = float(turn_penalty), float(closeness_credit)
        self.consistency_credit, self.show_range = float(consistency_credit), bool(show_range)
        self.rules = template.format(lo=lo, hi=hi)
        demos = self._demo_secrets(examples)
        self._demo: list[dict[str, str]] = []
        for i, secret in enumerate(demos):
            self._demo += self._demo_game(secret, after=demos[i - 1] if i else None)
        rng, eval_secrets = random.Random(EVAL_SEED), dict[int, None]()
        while len(eval_secrets) < eval_size:
            secret = rng.randint(lo, hi)
            if secret not in demos:
                eval_secrets.setdefault(secret, None)
        self._eval = [self._prompt(s) for s in eval_secrets]
        self._excluded = set(demos) | set(eval_secrets)

    def _demo_secrets(self, n: int) -> list[int]:
        """``n`` distinct secrets that binary search finds on its third guess or later."""
        rng, secrets = random.Random(DEMO_SEED), []
        while len(secrets) < n:
            secret = rng.randint(self.lo, self.hi)
            if secret not in secrets and len(self._bisect(secret)) >= 3:
                secrets.append(secret)
        return secrets

    def _bisect(self, secret: int) -> list[int]:
        lo, hi, guesses = self.lo, self.hi, [(self.lo + self.hi) // 2]
        while guesses[-1] != secret:
            lo, hi = (guesses[-1] + 1, hi) if secret > guesses[-1] else (lo, guesses[-1] - 1)
            guesses.append((lo + hi) // 2)
        return guesses

    def _opening(self, after: int | None) -> dict[str, str]:
        """The user turn that opens a game: the rules, after the previous game's secret if any."""
        return {"role": "user", "content": self.rules if after is None else
                f"Right, my number was {after}. New game. {self.rules}"}

    def _demo_game(self, secret: int, after: int | None) -> list[dict[str, str]]:
        """One game played by binary search, from its opening to its winning guess."""
        messages, guesses = [self._opening(after)], self._bisect(secret)
        for i, g in enumerate(guesses):
            open_ = self._walk(secret, [str(x) for x in guesses[: i + 1]])[:2] if self.show_range else None
            messages.append({"role": "assistant", "content": str(g)})
            messages.append({"role": "user", "content": self.feedback(secret, g, open_)})
        return messages[:-1]

    def _prompt(self, secret: int) -> Prompt:
        if not self._demo:
            return Prompt(self.rules, str(secret), meta={"secret": secret})
        opening = self._opening(int(self._demo[-1]["content"]))
        return Prompt(self.rules, str(secret), messages=(*self._demo, opening), meta={"secret": secret})

    def sample(self, rng: random.Random) -> Prompt:
        while True:
            secret = rng.randint(self.lo, self.hi)
            if secret not in self._excluded:
                return self._prompt(secret)

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > len(self._eval):
            raise ValueError(f"guess_number: {n} eval prompts asked, {len(self._eval)} held out (eval_size)")
        return self._eval[:n]

    def correct(self, reward: float) -> bool:
        return reward >= WIN_FLOOR

    @staticmethod
    def guess(reply: str) -> int | None:
        """The reply's guess: the whole number it consists of, else None."""
        number = lone_number(reply)
        if number is None or not number.lstrip("-").isdigit():
            return None
        return int(number)

    def _valid(self, reply: str) -> int | None:
        g = self.guess(reply)
        return g if g is not None and self.lo <= g <= self.hi else None

    def win_reward(self, turns: int) -> float:
        return max(1.0 - self.turn_penalty * (turns - 1), WIN_FLOOR)

    def _walk(self, secret: int, replies: Sequence[str]) -> tuple[int, int, int]:
        """(lo, hi, consistent): the interval the feedback to ``replies`` leaves open, and how
        many of them guessed a whole number inside the interval open before each."""
        lo, hi, count = self.lo, self.hi, 0
        for g in map(self.guess, replies):
            if g is None:
                continue
            count += lo <= g <= hi
            if self.lo <= g <= self.hi and g != secret:  # the environment's answer narrows the interval
                lo, hi = (max(lo, g + 1), hi) if secret > g else (lo, min(hi, g - 1))
        return lo, hi, count

    def consistent(self, secret: int, replies: Sequence[str]) -> int:
        """How many ``replies`` guess a whole number that the feedback before each leaves open."""
        return self._walk(secret, replies)[2]

    def loss_reward(self, secret: int, replies: Sequence[str]) -> float:
        guesses = [g for g in map(self._valid, replies) if g is not None]
        close = 1 - abs(guesses[-1] - secret) / (self.hi - self.lo) if guesses else 0.0
        share = self.consistent(secret, replies) / len(replies) if replies else 0.0
        return self.closeness_credit * close + self.consistency_credit * share

    def turn(self, episode: EpisodeView) -> Turn:
        secret = int(episode.prompt.meta["secret"])
        g = self.guess(episode.reply)
        if g == secret:
            return Turn(done=True, reward=self.win_reward(len(episode.replies)))
        if episode.last:
            return Turn(done=True, reward=self.loss_reward(secret, episode.replies))
        open_ = self._walk(secret, episode.replies)[:2] if self.show_range else None
        return Turn(observation=self.feedback(secret, g, open_), role="user")

    def feedback(self, secret: int, g: int | None, open_: tuple[int, int] | None = None) -> str:
        """What the environment says to a guess ``g`` (None: no whole number) that is not
        ``secret``; ``open_``: the interval the feedback so far leaves open, to name (``show_range``)."""
        if g is None:
            return f"Reply with just a whole number between {self.lo} and {self.hi}."
        if not self.lo <= g <= self.hi:
            return f"{g} is out of range: my number is between {self.lo} and {self.hi}."
        said = f"{'higher' if secret > g else 'lower'} than {g}"
        return said if open_ is None else f"{said}: my number is between {open_[0]} and {open_[1]}."
