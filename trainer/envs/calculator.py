"""``calculator``: arithmetic the policy solves by calling a calculator tool (an ``EpisodeTask``).

The episode opens with a problem and a description of the tool (``template``). Each reply is answered in order:
* an ``answer: N`` line (the first ``answer:`` line) ends the episode: reward 1 if N (commas dropped, ``42.0``
  read as ``42``) is the problem's value. The line must hold the number alone (markdown ``*`` and backticks
  and a final period aside): ``answer: 1320 * 60`` is no answer, as ``answer: ten thousand`` is not;
* else a ``calc: <expression>`` line (the first one) is evaluated by ``safe_eval`` and its value, or
  ``error: ...``, is the observation, with the chat role ``tool``;
* else the observation (role ``user``) reminds the policy of the two forms.
On the last turn (``EpisodeView.last``) a reply without an answer ends it too. An episode that does not end
with the right answer earns ``tool_credit`` (< 1) once if it made at least one well-formed call (one that
returned a value, ``calls`` in its state), else 0. ``correct`` is a right answer (reward >= 1).

``safe_eval`` never runs ``eval``: it parses with ``ast`` and evaluates only int and float literals,
``+ - * / // %``, unary minus and parentheses; anything else (``**``, names, calls, attributes), expressions
longer than ``max_expression_chars`` and any value with more than ``max_result_digits`` digits are refused.
Before parsing, surrounding backticks go, anything from an ``=`` on is dropped and ``×``/``÷`` become ``*``/``/``.
Difficulty: ``digits`` per operand (1: 0-9), ``ops`` (of ``+ - *``); the tool needs ``task.episode.max_turns >= 2``.
``examples`` worked episodes open every prompt as chat messages (0: the problem alone, as plain text). The held-out
set is drawn once from its own seed; ``sample`` never returns one of its problems (nor an example's).
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Sequence

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn, lone_number
from inflight.trainer.tasks.tool_calls import ToolBox, ToolError

EVAL_SEED = 0xCA1C_E7A1
DEMO_SEED = 0xCA1C_DE70
OPS = ("+", "-", "*")
TEMPLATE = ("What is {expr}? You have a calculator: write `calc: <expression>` on a line and you will get its "
            "value. When you know the result, write `answer: <number>`.")
REMINDER = "Write `calc: <expression>` to use the calculator, or `answer: <number>` to give the result."
NATIVE_TEMPLATE = ("What is {expr}? Use the calculator tool to compute it. When you know the result, write "
                   "`answer: <number>`.")
NATIVE_REMINDER = "Call the calculator tool, or write `answer: <number>` to give the result."
FORMATS = ("text", "native")

_CALC = re.compile(r"^[\s`*>]*calc\s*:(.*)$", re.IGNORECASE | re.MULTILINE)
_ANSWER = re.compile(r"^[\s`*>]*answer\s*:(.*)$", re.IGNORECASE | re.MULTILINE)

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_NAMES = {ast.Pow: "**", ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|",
          ast.BitXor: "^", ast.UAdd: "unary +", ast.Not: "not", ast.Invert: "~"}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the policy reads."""


def _check_size(value: float, max_digits: int) -> float:
    if isinstance(value, float):  # a float is at most ~1.8e308: past 308 digits only inf is too large
        too_large = not math.isfinite(value) or (max_digits <= 308 and abs(value) >= 10.0 ** max_digits)
    else:
        too_large = len(str(abs(value))) > max_digits
    if too_large:
        raise CalcError(f"error: number too large (more than {max_digits} digits)")
    return value


MAX_NESTING = 100
"""How deep an expression may nest (unary minus and operators, each a level): checked by
count, so the answer never depends on the interpreter's recursion limit, which imports may raise."""


def _evaluate(node: ast.AST, max_digits: int, depth: int = 0) -> float:
    if depth > MAX_NESTING:
        raise CalcError("error: expression nested too deeply")
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise CalcError(f"error: {type(node.value).__name__} literals are not allowed, only numbers")
        return _check_size(node.value, max_digits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, max_digits, depth + 1)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, max_digits, depth + 1), _evaluate(node.right, max_digits, depth + 1)
        try:
            return _check_size(_BINARY[type(node.op)](left, right), max_digits)
        except ZeroDivisionError:
            raise CalcError("error: division by zero") from None
        except OverflowError:  # an int too large for a float, in / or with a float operand
            raise CalcError(f"error: number too large (more than {max_digits} digits)") from None
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = _NAMES.get(type(node.op), type(node.op).__name__)
        raise CalcError(f"error: {what} is not allowed (only + - * / // % and parentheses)")
    what = {ast.Name: "names", ast.Attribute: "attributes", ast.Call: "function calls"}.get(type(node))
    raise CalcError(f"error: {what or type(node).__name__ + ' expressions'} are not allowed "
                    "(only numbers, + - * / // % and parentheses)")


def safe_eval(expression: str, *, max_digits: int = 30, max_chars: int = 100) -> int | float:
    """The value of an arithmetic expression, or ``CalcError`` saying why not. Never calls
    ``eval``: only int/float literals, ``+ - * / // %``, unary minus and parentheses, no
    value (literal or intermediate) over ``max_digits`` digits, at most ``max_chars`` characters."""
    expression = expression.strip()
    if len(expression) > max_chars:
        raise CalcError(f"error: expression longer than {max_chars} characters")
    if not expression:
        raise CalcError("error: empty expression")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        shown = expression if len(expression) <= 40 else expression[:37] + "..."
        raise CalcError(f"error: cannot parse {shown!r}") from None
    except (RecursionError, MemoryError):
        raise CalcError("error: expression nested too deeply") from None
    try:
        return _evaluate(tree.body, max_digits)
    except RecursionError:
        raise CalcError("error: expression nested too deeply") from None


def show(value: float) -> str:
    """A value as the calculator prints it: ints in full, integral floats as ints, else 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def clean_expression(text: str) -> str:
    """A ``calc:`` line's expression as the calculator reads it: backticks stripped, anything
    from ``=`` on dropped, ``×``/``÷`` as ``*``/``/``."""
    text = text.split("=", 1)[0].replace("×", "*").replace("÷", "/")
    return text.strip().strip("`").strip()


def _check_settings(digits: int, ops: Sequence[str], max_result_digits: int, max_expression_chars: int,
                    tool_credit: float, template: str, examples: int, call_format: str) -> None:
    if call_format not in FORMATS:
        raise ValueError(f"calculator: format={call_format!r} must be one of {list(FORMATS)}")
    if type(digits) is not int or not 1 <= digits <= 9:
        raise ValueError(f"calculator: digits={digits} must be in 1..9")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"calculator: ops={list(ops)} must be a non-empty subset of {list(OPS)}")
    if not 2 * digits <= max_result_digits <= 1000:
        raise ValueError(f"calculator: max_result_digits={max_result_digits} must be in {2 * digits}..1000 "
                         f"(a product of two {digits}-digit operands has up to {2 * digits} digits)")
    if not 2 * digits + 3 <= max_expression_chars <= 1000:
        raise ValueError(f"calculator: max_expression_chars={max_expression_chars} must be in "
                         f"{2 * digits + 3}..1000 (the problem itself has up to {2 * digits + 3} characters)")
    if isinstance(tool_credit, bool) or not 0 <= tool_credit < 1:
        raise ValueError(f"calculator: tool_credit={tool_credit} must be in [0, 1) (1 is a right answer)")
    try:
        ok = "{expr}" in template and bool(template.format(expr="1 + 1"))
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"calculator: template={template!r} needs a {{expr}} placeholder and no other "
                         "braces (write {{ and }} for literal ones)")
    if type(examples) is not int or not 0 <= examples <= 4:
        raise ValueError(f"calculator: examples={examples} must be in 0..4")


class Calculator(EpisodeTask):
    def __init__(self, *, digits: int = 2, ops: Sequence[str] = ("*",), max_result_digits: int = 30,
                 max_expression_chars: int = 100, tool_credit: float = 0.2, template: str = TEMPLATE,
                 examples: int = 1, format: str = "text", eval_size: int = 0) -> None:  # the config's name
        if format == "native" and template == TEMPLATE:
            template = NATIVE_TEMPLATE
        _check_settings(digits, ops, max_result_digits, max_expression_chars, tool_credit, template, examples, format)
        self.native = format == "native"
        self.tools = ToolBox([self.calculator]) if self.native else None
        self.lo, self.hi = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
        self.ops, self.template, self.tool_credit = tuple(ops), template, float(tool_credit)
        self.max_result_digits, self.max_expression_chars = max_result_digits, max_expression_chars
        space = (self.hi - self.lo + 1) ** 2 * len(self.ops)
        if eval_size < 0 or eval_size > (space - examples) // 2:
            raise ValueError(f"calculator: eval_size={eval_size} must be in 0..{(space - examples) // 2} (at most "
                             f"half of the {space - examples} distinct problems at digits={digits}, ops={list(ops)}, "
                             f"less the {examples} examples)")
        demos = self._draw_distinct(random.Random(DEMO_SEED), examples, set())
        self._demo = tuple(message for expr, value in demos for message in (
            {"role": "user", "content": template.format(expr=expr)}, self._demo_call(expr),
            {"role": "tool", "content": value}, {"role": "assistant", "content": f"answer: {value}"}))
        self._eval = [self._prompt(*problem) for problem in
                      self._draw_distinct(random.Random(EVAL_SEED), eval_size, {expr for expr, _ in demos})]
        self._excluded = {expr for expr, _ in demos} | {p.meta["expr"] for p in self._eval}

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        """An expression and its value."""
        a, op, b = rng.randint(self.lo, self.hi), rng.choice(self.ops), rng.randint(self.lo, self.hi)
        return f"{a} {op} {b}", str({"+": a + b, "-": a - b, "*": a * b}[op])

    def _draw_distinct(self, rng: random.Random, n: int, exclude: set[str]) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        while len(seen) < n:
            expr, value = self._problem(rng)
            if expr not in exclude:
                seen.setdefault(expr, value)
        return list(seen.items())

    def _demo_call(self, expr: str) -> dict:
        """A worked example's call: a ``calc:`` line, or a native call the template renders."""
        if not self.native:
            return {"role": "assistant", "content": f"calc: {expr}"}
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function",
                                "function": {"name": "calculator", "arguments": {"expression": expr}}}]}

    def _prompt(self, expr: str, value: str) -> Prompt:
        text = self.template.format(expr=expr)
        messages = (*self._demo, {"role": "user", "content": text}) if self._demo or self.native else ()
        return Prompt(text, value, messages=messages, meta={"expr": expr},
                      tools=self.tools.schemas if self.tools is not None else ())

    def sample(self, rng: random.Random) -> Prompt:
        while True:
            expr, value = self._problem(rng)
            if expr not in self._excluded:
                return self._prompt(expr, value)

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > len(self._eval):
            raise ValueError(f"calculator: {n} eval prompts asked, {len(self._eval)} held out (eval_size)")
        return self._eval[:n]

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression and returns its value.

        Args:
            expression: Numbers joined by + - * / // % and parentheses, e.g. 47 * 29.
        """
        try:
            return self._value(expression)
        except CalcError as e:
            raise ToolError(str(e).removeprefix("error: ")) from None

    def calculate(self, expression: str) -> str:
        """What the calculator prints for an expression: its value, or ``error: ...``."""
        try:
            return self._value(expression)
        except CalcError as e:
            return str(e)

    def _value(self, expression: str) -> str:
        return show(safe_eval(clean_expression(expression), max_digits=self.max_result_digits,
                              max_chars=self.max_expression_chars))

    def _end(self, prompt: Prompt, answer: str | None, calls: int) -> Turn:
        if answer is not None and answer == prompt.answer:
            return Turn(done=True, reward=1.0)
        return Turn(done=True, reward=self.tool_credit if calls > 0 else 0.0)

    def turn(self, episode: EpisodeView) -> Turn:
        if self.native:
            return self._native_turn(episode)
        calls = int(episode.state.get("calls", 0))
        reply = episode.reply
        call, line = _CALC.search(reply), _ANSWER.search(reply)
        answer = lone_number(line.group(1)) if line else None
        observation = self.calculate(call.group(1)) if call else None
        if observation is not None and not observation.startswith("error"):
            calls += 1
        if answer is not None or episode.last:
            return self._end(episode.prompt, answer, calls)
        if observation is None:
            return Turn(observation=REMINDER, role="user")
        return Turn(observation=observation, role="tool", state={**episode.state, "calls": calls})

    def _native_turn(self, episode: EpisodeView) -> Turn:
        """Native calls (``EpisodeView.tool_calls``): each answered by a ``role: tool`` message;
        a reply without one is read for ``answer:`` as in the text format."""
        calls = int(episode.state.get("calls", 0))
        line = _ANSWER.search(episode.reply)
        answer = lone_number(line.group(1)) if line else None
        assert self.tools is not None
        results = [self.tools.run(call) for call in episode.tool_calls]
        calls += sum(r.ok for r in results)
        if (answer is not None and not results) or episode.last:
            return self._end(episode.prompt, answer, calls)
        if not results:
            return Turn(observation=NATIVE_REMINDER, role="user")
        return Turn(messages=tuple(r.message for r in results),
                    state={**episode.state, "calls": calls})
