"""The shipped multi-turn tasks (``calculator``, ``guess_number``) on hand-built episodes:
no engine, no model. The calculator's evaluator refuses all but arithmetic and computes it
right; every reward rule gives exactly its value; held-out prompts are never sampled;
bad settings name themselves."""

from __future__ import annotations

import random
import sys

import pytest

from inflight.trainer.envs.calculator import TEMPLATE, CalcError, Calculator, safe_eval
from inflight.trainer.envs.guess_number import GuessNumber
from inflight.trainer.tasks.task import Completion, EpisodeView, Prompt, Turn


def _view(prompt: Prompt, *replies: str, state: dict | None = None, last: bool = False) -> EpisodeView:
    observations = tuple(f"obs {i}" for i in range(len(replies) - 1))
    return EpisodeView(prompt=prompt, replies=tuple(replies), observations=observations, state=state or {},
                       finish_reason="stop", last=last)


# ---- the calculator's evaluator ----

@pytest.mark.parametrize("expression, value", [
    ("347 * 29", 10063), ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-5 + 2", -3), ("--5", 5), ("-(4 - 10)", 6),
    ("7 // 2", 3), ("-7 // 2", -4), ("7 % 3", 1), ("7 / 2", 3.5), ("10 / 4 * 2", 5.0), ("1.5 * 4", 6.0),
    ("999999999999999 * 999999999999999", 999999999999998000000000000001), ("  12  ", 12), ("1_000 - 1", 999),
])
def test_safe_eval_computes(expression: str, value: float) -> None:
    got = safe_eval(expression)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("__import__('os')", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"),
    ("x + 1", "names are not allowed"),
    ("2 ** 3", r"\*\* is not allowed"),
    ("2 ** 100000000", r"\*\* is not allowed"),
    ("+3", "unary \\+ is not allowed"),
    ("1 << 100", "<< is not allowed"),
    ("'a' * 3", "str literals are not allowed"),
    ("True + 1", "bool literals are not allowed"),
    ("1j * 2", "complex literals are not allowed"),
    ("[1, 2]", "List expressions are not allowed"),
    ("1 < 2", "Compare expressions are not allowed"),
    ("lambda: 1", "Lambda expressions are not allowed"),
    ("1 +", r"cannot parse '1 \+'"),
    ("", "empty expression"),
    ("1" * 31, r"number too large \(more than 30 digits\)"),
    ("9" * 16 + " * " + "9" * 16, r"number too large \(more than 30 digits\)"),  # 32 digits
    ("1e29 * 100", r"number too large"),
    ("1e400", r"number too large"),
    ("1 + " * 30 + "1", r"expression longer than 100 characters"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
])
def test_safe_eval_refuses(expression: str, message: str) -> None:
    with pytest.raises(CalcError, match=message) as e:
        safe_eval(expression)
    assert str(e.value).startswith("error: ")


def test_safe_eval_never_calls_eval(monkeypatch) -> None:
    import builtins

    def refuse(*args, **kwargs):
        raise AssertionError("eval called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert safe_eval("(2 + 3) * 4 - 6 / 3") == 18.0
    assert Calculator(digits=3).calculate("347 * 29") == "10063"


def test_safe_eval_bounds_are_settings() -> None:
    assert safe_eval("1 + " * 30 + "1", max_chars=200) == 31
    with pytest.raises(CalcError, match=r"more than 5 digits"):
        safe_eval("400 * 300", max_digits=5)
    assert safe_eval("400 * 250", max_digits=6) == 100000
    with pytest.raises(CalcError, match="nested too deeply"):
        safe_eval("-" * 999 + "1", max_chars=1000)
    with pytest.raises(CalcError, match="nested too deeply"):  # by count, whatever the recursion limit
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(100_000)
        try:
            safe_eval("-" * 150 + "1", max_chars=1000)
        finally:
            sys.setrecursionlimit(limit)
    assert safe_eval("-" * 99 + "1") == -1
    with pytest.raises(CalcError, match="number too large"):  # an int too large for a float
        safe_eval("1" + "0" * 400 + " / 3", max_digits=500, max_chars=1000)


# ---- the calculator's episodes ----

def _calc_prompt(task: Calculator) -> Prompt:
    return Prompt(task.template.format(expr="347 * 29"), "10063", meta={"expr": "347 * 29"})


def test_calculator_prompt_text() -> None:
    p = Calculator(digits=3).sample(random.Random(3))
    a, op, b = p.meta["expr"].split()
    assert op == "*" and 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and p.answer == str(int(a) * int(b))
    assert p.text == (f"What is {a} * {b}? You have a calculator: write `calc: <expression>` on a line and you will "
                      "get its value. When you know the result, write `answer: <number>`.") == \
        TEMPLATE.format(expr=p.meta["expr"])
    # one worked example before the problem, as chat messages
    assert [m["role"] for m in p.messages] == ["user", "assistant", "tool", "assistant", "user"]
    demo = p.messages[1]["content"].removeprefix("calc: ")
    x, y = (int(n) for n in demo.split(" * "))
    assert 100 <= x <= 999 and 100 <= y <= 999 and demo != p.meta["expr"]
    assert [m["content"] for m in p.messages] == [TEMPLATE.format(expr=demo), f"calc: {demo}", str(x * y),
                                                  f"answer: {x * y}", p.text]
    assert Calculator(digits=3, examples=0).sample(random.Random(3)) == Prompt(p.text, p.answer, meta=p.meta)
    two = Calculator(digits=3, examples=2).sample(random.Random(3))
    assert len(two.messages) == 9 and two.messages[:4] == p.messages[:4] and two.messages[5] != p.messages[1]


def test_calculator_calls_the_tool() -> None:
    task = Calculator(digits=3)
    p = _calc_prompt(task)
    assert task.turn(_view(p, "calc: 347 * 29")) == Turn(observation="10063", role="tool", state={"calls": 1})
    assert task.turn(_view(p, "Let me compute.\n`calc: 347 × 29 = ?`\n")) == \
        Turn(observation="10063", role="tool", state={"calls": 1})
    assert task.turn(_view(p, "x", "CALC: 7 / 2", state={"calls": 1})) == \
        Turn(observation="3.5", role="tool", state={"calls": 2})
    assert task.turn(_view(p, "calc: 6 / 3")).observation == "2"
    assert task.turn(_view(p, "calc: 347 ** 29")) == \
        Turn(observation="error: ** is not allowed (only + - * / // % and parentheses)", role="tool",
             state={"calls": 0})
    assert task.turn(_view(p, "calc: 1 / 0", state={"calls": 2, "other": "kept"})) == \
        Turn(observation="error: division by zero", role="tool", state={"calls": 2, "other": "kept"})
    reminder = task.turn(_view(p, "I think it is about ten thousand"))
    assert reminder == Turn(observation="Write `calc: <expression>` to use the calculator, or `answer: <number>` "
                                        "to give the result.", role="user")


@pytest.mark.parametrize("replies, state, last, reward", [
    (("answer: 10063",), {}, False, 1.0),                      # right without the tool
    (("calc: 347 * 29", "answer: 10,063"), {"calls": 1}, False, 1.0),
    (("answer: 10063.0",), {}, False, 1.0),
    (("**Answer:** 10063",), {}, False, 1.0),
    (("answer: `10063`.",), {}, False, 1.0),
    (("calc: 347 * 29", "answer: 10063 * 60"), {"calls": 1}, True, 0.2),  # a junk tail: no answer
    (("answer: 10063 * 60",), {}, False, None),                # ... a reminder before the last turn
    (("answer: 10063 is the result",), {}, True, 0.0),
    (("answer: 10063 * 60\nanswer: 10063",), {}, True, 0.0),   # the first answer line decides
    (("answer: 10064",), {}, False, 0.0),                      # wrong, no call
    (("calc: 347 * 29", "answer: 10064"), {"calls": 1}, False, 0.2),  # wrong after a good call: the credit
    (("calc: 347 * 29", "answer: 10064"), {"calls": 3}, False, 0.2),  # paid once
    (("calc: 347 * 29\nanswer: 10064",), {}, False, 0.2),     # the call in the answering reply counts
    (("calc: 347 ** 29\nanswer: 10064",), {}, False, 0.0),    # a refused call does not
    (("answer: ten thousand",), {}, True, 0.0),                # malformed answer on the last turn
    (("answer: ten thousand",), {}, False, None),              # ... before it: a reminder, not the end
    (("no idea",), {}, True, 0.0),                             # last turn, no call ever
    (("calc: 347 * 29", "calc: 10063 + 0"), {"calls": 1}, True, 0.2),  # last turn, calls but no answer
    (("calc: 347 * 29",), {}, True, 0.2),
    (("calc: x",), {}, True, 0.0),
    (("The result is 10063",), {}, True, 0.0),                 # the number alone is not an answer
])
def test_calculator_rewards(replies: tuple[str, ...], state: dict, last: bool, reward: float | None) -> None:
    task = Calculator(digits=3)
    got = task.turn(_view(_calc_prompt(task), *replies, state=state, last=last))
    if reward is None:
        assert not got.done and got.role == "user"
    else:
        assert got.done and got.reward == reward
        assert task.correct(got.reward) == (reward == 1.0)


def test_calculator_tool_credit_is_a_setting() -> None:
    task = Calculator(digits=3, tool_credit=0.0)
    assert task.turn(_view(_calc_prompt(task), "calc: 347 * 29", "answer: 1", state={"calls": 1})).reward == 0.0
    task = Calculator(digits=3, tool_credit=0.5)
    assert task.turn(_view(_calc_prompt(task), "calc: 347 * 29", last=True)).reward == 0.5


def test_calculator_max_result_digits_is_the_tools_bound() -> None:
    task = Calculator(digits=2, max_result_digits=4)
    p = Prompt("q", "1", meta={"expr": "1 * 1"})
    assert task.turn(_view(p, "calc: 99 * 99")).observation == "9801"
    assert task.turn(_view(p, "calc: 99 * 99 * 2")).observation == "error: number too large (more than 4 digits)"


def test_calculator_eval_prompts_are_held_out() -> None:
    task = Calculator(digits=1, ops=("+", "*"), eval_size=99)  # 200 distinct problems, 1 example, 99 held out
    held = task.eval_prompts(99)
    assert held == task.eval_prompts(99) and len({p.meta["expr"] for p in held}) == 99
    assert task.eval_prompts(10) == held[:10]
    demo = held[0].messages[1]["content"].removeprefix("calc: ")
    rng = random.Random(7)
    drawn = {task.sample(rng).meta["expr"] for _ in range(5000)}
    assert len(drawn) == 100 and not drawn & ({p.meta["expr"] for p in held} | {demo})
    with pytest.raises(ValueError, match=r"100 eval prompts asked, 99 held out"):
        task.eval_prompts(100)


@pytest.mark.parametrize("kwargs, message", [
    ({"digits": 0}, r"digits=0 must be in 1\.\.9"),
    ({"digits": 10}, r"digits=10 must be in 1\.\.9"),
    ({"digits": 2.5}, r"digits=2.5 must be in 1\.\.9"),
    ({"ops": ("/",)}, r"ops=\['/'\] must be a non-empty subset"),
    ({"ops": ()}, r"ops=\[\] must be a non-empty subset"),
    ({"digits": 3, "max_result_digits": 5}, r"max_result_digits=5 must be in 6\.\.1000"),
    ({"max_expression_chars": 4}, r"max_expression_chars=4 must be in 7\.\.1000"),
    ({"tool_credit": 1.0}, r"tool_credit=1.0 must be in \[0, 1\)"),
    ({"tool_credit": -0.1}, r"tool_credit=-0.1 must be in \[0, 1\)"),
    ({"template": "What is it?"}, r"template='What is it\?' needs a \{expr\} placeholder"),
    ({"template": "{expr} {oops}"}, r"template='\{expr\} \{oops\}' needs a \{expr\}"),
    ({"digits": 1, "eval_size": 50}, r"eval_size=50 must be in 0\.\.49 \(at most half of the 99 distinct problems"),
    ({"digits": 1, "eval_size": 51, "examples": 0}, r"eval_size=51 must be in 0\.\.50 \(at most half of the 100 "),
    ({"examples": 5}, r"examples=5 must be in 0\.\.4"),
    ({"examples": -1}, r"examples=-1 must be in 0\.\.4"),
    ({"eval_size": -1}, r"eval_size=-1 must be in"),
])
def test_calculator_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Calculator(**kwargs)


def test_a_single_turn_task_is_a_one_turn_episode_and_a_task_answers_one_way() -> None:
    """A task defines score() or turn(): a single-turn task's episode ends at its one reply,
    rewarded by its own score(); an episode task's turn() is its own; a task with neither is
    refused when its class is made."""
    from inflight.trainer.envs import Arithmetic
    from inflight.trainer.tasks import EpisodeView, Task
    from inflight.trainer.tasks.task import is_episodic

    task = Arithmetic(digits=2)
    prompt = task.sample(random.Random(3))
    for reply in (prompt.answer, str(int(prompt.answer) + 1), "no number"):
        view = EpisodeView(prompt=prompt, replies=(reply,), observations=(), finish_reason="stop", reply_ids=(5, 6))
        turn = task.turn(view)
        assert turn.done and turn.reward == task.score([prompt], [Completion(reply, [5, 6], "stop")])[0]
    assert [turn.reward for turn in (task.turn(EpisodeView(prompt=prompt, replies=(r,), observations=()))
                                     for r in (prompt.answer, "x"))] == [1.0, 0.0]
    assert not is_episodic(task) and is_episodic(Calculator())
    with pytest.raises(NotImplementedError, match=r"^Calculator defines turn\(\), not score\(\)"):
        Calculator().score([Prompt("q", "1")], [Completion("1", [])])
    with pytest.raises(TypeError, match=r"^Neither defines neither score\(\) \(a single-turn task\) nor turn\(\)"):
        class Neither(Task):
            def sample(self, rng):
                return Prompt("q", "1")


# ---- guess_number ----

def _game(task: GuessNumber, secret: int) -> Prompt:
    return Prompt(task.template.format(lo=task.lo, hi=task.hi), str(secret), meta={"secret": secret})


RULES = ("I am thinking of a whole number between 1 and 100. Guess it: reply with just a number, and I will tell "
         "you whether my number is higher or lower.")


def test_guess_number_prompt_text() -> None:
    p = GuessNumber().sample(random.Random(5))
    assert p.text == RULES and p.answer == str(p.meta["secret"]) and 1 <= p.meta["secret"] <= 100
    # one demonstration game (secret 41, found by binary search), then the game to play
    demo = [RULES, "50", "lower than 50", "25", "higher than 25", "37", "higher than 37", "43", "lower than 43", "40",
            "higher than 40", "41", f"Right, my number was 41. New game. {RULES}"]
    assert [m["content"] for m in p.messages] == demo
    assert [m["role"] for m in p.messages] == ["user"] + ["assistant", "user"] * 6
    assert GuessNumber(examples=0).sample(random.Random(5)) == Prompt(RULES, p.answer, meta=p.meta)
    two = GuessNumber(examples=2).sample(random.Random(5))
    assert two.messages[:12] == p.messages[:12] and two.messages[12]["content"].startswith("Right, my number was 41. ")
    assert two.messages[-1]["content"].startswith("Right, my number was ") and two.messages[-1] != p.messages[-1]


def test_guess_number_feedback() -> None:
    task = GuessNumber()
    p = _game(task, 37)
    assert task.turn(_view(p, "50")) == Turn(observation="lower than 50", role="user")
    assert task.turn(_view(p, "50", " **25.** ")) == Turn(observation="higher than 25", role="user")
    for wordy in ("My guess is 25.", "19? No, 25", "between 1 and 25"):  # the rules ask for just a number
        assert task.turn(_view(p, wordy)).observation == "Reply with just a whole number between 1 and 100."
    assert task.turn(_view(p, "I don't know")) == \
        Turn(observation="Reply with just a whole number between 1 and 100.", role="user")
    assert task.turn(_view(p, "36.5")).observation == "Reply with just a whole number between 1 and 100."
    assert task.turn(_view(p, "1,000")) == \
        Turn(observation="1000 is out of range: my number is between 1 and 100.", role="user")
    assert task.turn(_view(p, "-3")).observation == "-3 is out of range: my number is between 1 and 100."


def test_guess_number_can_name_the_interval_left() -> None:
    task = GuessNumber(show_range=True)
    p = _game(task, 37)
    assert task.turn(_view(p, "50")).observation == "lower than 50: my number is between 1 and 49."
    assert task.turn(_view(p, "50", "25")).observation == "higher than 25: my number is between 26 and 49."
    assert task.turn(_view(p, "50", "25", "60")).observation == "lower than 60: my number is between 26 and 49."
    assert task.turn(_view(p, "50", "x")).observation == "Reply with just a whole number between 1 and 100."
    demo = [m["content"] for m in task.sample(random.Random(5)).messages]  # the example game speaks the same way
    assert demo[1:5] == ["50", "lower than 50: my number is between 1 and 49.", "25",
                         "higher than 25: my number is between 26 and 49."]


@pytest.mark.parametrize("kwargs, replies, last, reward", [
    ({}, ("37",), False, 1.0),
    ({}, ("50", "25", "37.0"), False, 1.0),                           # no turn penalty by default
    ({"turn_penalty": 0.1}, ("50", "25", "37"), False, 0.8),
    ({"turn_penalty": 0.1}, ("50",) * 9 + ("37",), True, 0.5),        # floored at 0.5
    ({"turn_penalty": 0.5}, ("50", "37"), False, 0.5),
    ({}, ("50",), True, 0.2 * (1 - 13 / 99)),                         # closeness of the last valid guess
    ({}, ("50", "36", "no idea", "500"), True, 0.2 * (1 - 1 / 99)),   # invalid replies do not count
    ({}, ("100", "1"), True, 0.2 * (1 - 36 / 99)),
    ({}, ("nothing",), True, 0.0),
    ({"closeness_credit": 0.0}, ("36",), True, 0.0),
    ({"closeness_credit": 0.4}, ("38",), True, 0.4 * (1 - 1 / 99)),
    # secret 37: 50 (1..100 open), 20 (1..49 open), 30 (21..49) and 31 (31..49) are consistent; 60 is not
    # (32..49 open) and "x", no guess, is not either: 4 of 6 replies
    ({"closeness_credit": 0.0, "consistency_credit": 0.3}, ("50", "20", "30", "x", "31", "60"), True, 0.3 * 4 / 6),
    ({"closeness_credit": 0.1, "consistency_credit": 0.3}, ("50", "20", "30", "x", "31", "60"), True,
     0.1 * (1 - 23 / 99) + 0.3 * 4 / 6),
    ({"closeness_credit": 0.0, "consistency_credit": 0.3}, ("50", "51", "200", "40"), True, 0.3 * 2 / 4),
    ({"consistency_credit": 0.29}, ("nothing",), True, 0.0),
])
def test_guess_number_rewards(kwargs: dict, replies: tuple[str, ...], last: bool, reward: float) -> None:
    task = GuessNumber(**kwargs)
    got = task.turn(_view(_game(task, 37), *replies, last=last))
    assert got.done and got.reward == pytest.approx(reward, abs=1e-12)
    assert task.correct(got.reward) == (replies[-1] in ("37", "37.0"))


def test_guess_number_binary_search_wins_within_seven_turns() -> None:
    task = GuessNumber()
    for secret in range(1, 101):
        lo, hi, replies = 1, 100, []
        for turn in range(1, 8):  # seven turns at most: the seventh is the episode's last
            replies.append(str((lo + hi) // 2))
            out = task.turn(_view(_game(task, secret), *replies, last=turn == 7))
            if out.done:
                break
            lo, hi = ((lo + hi) // 2 + 1, hi) if out.observation.startswith("higher") else (lo, (lo + hi) // 2 - 1)
        assert out.done and out.reward == 1.0 and task.correct(out.reward), (secret, replies)


def test_guess_number_eval_prompts_are_held_out() -> None:
    task = GuessNumber(lo=1, hi=100, eval_size=49)  # 100 secrets less the example's (41), half held out
    held = task.eval_prompts(49)
    secrets = {p.meta["secret"] for p in held}
    assert held == task.eval_prompts(49) and len(secrets) == 49 and secrets <= set(range(1, 101)) - {41}
    rng = random.Random(11)
    drawn = {task.sample(rng).meta["secret"] for _ in range(3000)}
    assert drawn == set(range(1, 101)) - secrets - {41}
    with pytest.raises(ValueError, match=r"50 eval prompts asked, 49 held out"):
        task.eval_prompts(50)
    assert len(GuessNumber(eval_size=50, examples=0).eval_prompts(50)) == 50


@pytest.mark.parametrize("kwargs, message", [
    ({"lo": 5, "hi": 7}, r"lo=5, hi=7 must have hi >= lo \+ 3"),
    ({"lo": 1.5}, r"lo=1.5 and hi=100 must be whole numbers"),
    ({"hi": 10 ** 13}, r"hi=10000000000000 must have"),
    ({"turn_penalty": 0.6}, r"turn_penalty=0.6 must be in \[0, 0.5\]"),
    ({"turn_penalty": -0.1}, r"turn_penalty=-0.1 must be in"),
    ({"closeness_credit": 0.5}, r"closeness_credit=0.5 must be in \[0, 0.5\)"),
    ({"consistency_credit": 0.3}, r"consistency_credit=0.3 must be in \[0, 0.3\) \(with closeness_credit=0.2"),
    ({"consistency_credit": -0.1}, r"consistency_credit=-0.1 must be in"),
    ({"template": "Guess between {lo} and 10"}, r"template='Guess between \{lo\} and 10' needs \{lo\} and \{hi\}"),
    ({"lo": 1, "hi": 10, "eval_size": 5}, r"eval_size=5 must be in 0\.\.4 \(at most half of the 9 secrets in 1\.\.10 "),
    ({"lo": 1, "hi": 10, "eval_size": 6, "examples": 0}, r"eval_size=6 must be in 0\.\.5 \(at most half of the 10 "),
    ({"examples": 5}, r"examples=5 must be in 0\.\.4"),
    ({"lo": 1, "hi": 4, "examples": 2}, r"examples=2 must be in 0\.\.1"),
])
def test_guess_number_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuessNumber(**kwargs)
