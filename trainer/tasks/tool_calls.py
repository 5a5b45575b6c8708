"""Native tool calls: Python functions as tools, in the model's own tool-call format.

A tool is a function with type hints and a Google-style docstring; its JSON schema is
transformers' ``get_json_schema``, and the schemas reach the model through the chat
template's ``tools=`` (``Prompt.tools``). The engine process reads each reply's calls with
vLLM's tool parser for the model's format (``ToolCallParser``, ``task.tool_parser``:
``hermes`` for ChatML/Qwen, ``pythonic``, ...) and hands them to the environment in
``EpisodeView.tool_calls``; the environment runs them (``ToolBox.run``) in its scoring
process and answers with one ``role: tool`` message per call (``Turn.messages``).

Two kinds of failure, kept apart:
- the policy's mistake (a tool that does not exist, arguments that do not fit its
  signature) is the call's result, ``{"error": ...}``, for the policy to read;
- the tool's own (it raises, or returns what JSON cannot hold) is ``ToolFailed``: the turn
  fails with the tool's name and error, as a hang past ``task.scoring.timeout_s`` does.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHATML_TOOLS = "chatml_tools"
"""``task.chat_template`` of the shipped ChatML template with Hermes tool calls
(``trainer/tasks/data/chatml_tools.jinja``), for chat models whose own template has no tools."""


class ToolFailed(RuntimeError):
    """A tool raised, or returned a value JSON cannot hold: the environment's fault, not the policy's."""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s JSON schema (transformers' ``get_json_schema``), ValueError naming the function."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema ({type(e).__name__}: {e}); a tool "
                         "needs type hints and a docstring with an Args: section describing each argument") from None


class ToolError(Exception):
    """Raise it in a tool for a mistake of the policy's (an expression that does not parse, a
    unit it does not know): the policy reads ``{"error": message}`` and the episode goes on."""


@dataclass(frozen=True)
class ToolResult:
    """One call's result as the policy reads it."""

    content: str
    """The tool's string as is, anything else as JSON; a mistake of the policy's as ``{"error": ...}``."""
    ok: bool
    """False for a mistake of the policy's: no such tool, arguments that do not bind, a ``ToolError``."""

    @property
    def message(self) -> dict[str, str]:
        """The ``role: tool`` message that answers the call (``Turn.messages``)."""
        return {"role": "tool", "content": self.content}


class ToolBox:
    """Tools by name: their schemas for the template, and ``run`` for the policy's calls."""

    def __init__(self, functions: Sequence[Callable[..., Any]]) -> None:
        self.functions = {fn.__name__: fn for fn in functions}
        if len(self.functions) != len(functions):
            raise ValueError(f"tools: two tools share a name ({[fn.__name__ for fn in functions]})")
        self.schemas = tuple(tool_schema(fn) for fn in functions)

    def run(self, call: Mapping[str, Any]) -> ToolResult:
        """One call ``{"name", "arguments"}``. The policy's mistakes are results (``ok`` False);
        ``ToolFailed`` when the tool itself fails (raises, or returns what JSON cannot hold)."""
        name, arguments = call.get("name"), call.get("arguments")
        fn = self.functions.get(name) if isinstance(name, str) else None
        if fn is None:
            return _mistake(f"no tool named {name!r}; the tools are {sorted(self.functions)}")
        if not isinstance(arguments, Mapping):
            return _mistake(f"{name}: arguments must be a JSON object, not {type(arguments).__name__}")
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return _mistake(f"{name}: {e}")
        try:
            result = fn(**arguments)
        except ToolError as e:
            return _mistake(f"{name}: {e}")
        except Exception as e:
            raise ToolFailed(f"tool {name!r} raised {type(e).__name__}: {e}") from e
        if isinstance(result, str):
            return ToolResult(result, ok=True)
        try:
            return ToolResult(json.dumps(result), ok=True)
        except (TypeError, ValueError) as e:
            raise ToolFailed(f"tool {name!r} returned {type(result).__name__}, which JSON cannot hold ({e})") from None


def _mistake(error: str) -> ToolResult:
    return ToolResult(json.dumps({"error": error}), ok=False)


class ToolCallParser:
    """vLLM's tool parser ``name`` (its registry, ``ToolParserManager``) over one tokenizer:
    ``parse(text)`` -> the calls in a reply, ``({"name", "arguments"}, ...)``. Runs in the
    engine process, which has vLLM; a reply whose call does not parse has no calls."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"task.tool_parser={name!r} is not one of vLLM's tool parsers "
                             f"({sorted(ToolParserManager.lazy_parsers)})") from None
        self.name, self.parser = name, parser_cls(tokenizer)
        self._request = ChatCompletionRequest(messages=[], model="inflight")

    def parse(self, text: str) -> tuple[dict[str, Any], ...]:
        return tuple({"name": name, "arguments": arguments} for name, _, arguments in self.extract(text)[1])

    def extract(self, text: str) -> tuple[str, list[tuple[str, str, Any]]]:
        """A reply's text -> its content (the text besides the calls; all of it without calls)
        and its calls as (name, raw arguments, arguments parsed where they are JSON)."""
        logger = logging.getLogger("vllm.tool_parsers")
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # a call that does not parse is the policy's: no traceback per reply
        try:
            got = self.parser.extract_tool_calls(text, self._request)
        finally:
            logger.setLevel(level)
        if not got.tools_called:
            return text, []
        calls = []
        for call in got.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except (TypeError, ValueError):
                arguments = call.function.arguments
            calls.append((call.function.name, call.function.arguments, arguments))
        return got.content or "", calls


def chat_template_text(name_or_path: str) -> str:
    """The Jinja text ``task.chat_template`` names: ``chatml_tools`` (shipped) or a file."""
    from pathlib import Path

    if name_or_path == CHATML_TOOLS:
        return (Path(__file__).parent / "data" / "chatml_tools.jinja").read_text()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"task.chat_template={name_or_path!r} is neither {CHATML_TOOLS!r} nor a Jinja file")
    return path.read_text()


def use_chat_template(tokenizer: Any, name_or_path: str) -> Any:
    """``tokenizer`` with the template ``task.chat_template`` names in place of its own (empty: as it is)."""
    if name_or_path and tokenizer is not None:
        tokenizer.chat_template = chat_template_text(name_or_path)
    return tokenizer


def task_tokenizer(model_dir: Any, chat_template: str, engine_tokenizer: Any = None) -> Any:
    """The tokenizer an engine process renders the task with: vLLM's own (``engine_tokenizer``),
    or with ``task.chat_template`` one loaded from ``model_dir`` with that template. vLLM 0.32's
    tokenizer (``TokenizerPool``) routes ``apply_chat_template`` to copies made when it loaded,
    which a template set on it later never reaches."""
    if not chat_template and engine_tokenizer is not None:
        return engine_tokenizer
    from transformers import AutoTokenizer

    return use_chat_template(AutoTokenizer.from_pretrained(str(model_dir)), chat_template)
