"""A verifiers environment's model calls as token ids (``task.verifiers.renderer``), and back.

``auto`` is renderers' own renderer for a model it knows by name (Qwen3, Llama 3, GLM, ...), else
``template``: the policy's chat template (``task.chat_template``'s when set), whose every turn
after the first is the episode's ids so far and the template's text for the new messages
(``ObservationRenderer``), never a re-render of the episode. With ``task.tool_parser`` (and with
``template``, ``hermes`` where the template asks for ``<tool_call>`` blocks) a reply's tool calls
are read from its text by vLLM's tool parser, so a call spelled in several tokens is a call. A
renderer that does not fit the tokenizer is refused when the task is built, naming the setting.
"""

from __future__ import annotations

from typing import Any

from inflight.trainer.tasks.episode import ObservationRenderer

TEMPLATE = "template"
"""``task.verifiers.renderer`` of the policy's own chat template, bridged (``TemplateRenderer``)."""
AUTO = "auto"


def renderer_name(tokenizer: Any, name: str) -> str:
    """The renderer ``name`` stands for over ``tokenizer``: ``auto`` is renderers' renderer for
    the tokenizer's model name where it knows one, else ``template``."""
    if name != AUTO:
        return name
    from renderers.base import MODEL_RENDERER_MAP

    return MODEL_RENDERER_MAP.get(str(getattr(tokenizer, "name_or_path", "")), TEMPLATE)


def make_renderer(tokenizer: Any, name: str, options: dict[str, Any], tool_parser: str = "") -> Any:
    """The renderer ``name`` (its config's other fields ``options``) over ``tokenizer``, its
    replies' tool calls read by vLLM's ``tool_parser`` where one is named; ValueError naming
    ``task.verifiers.renderer`` and what to set where it does not fit the tokenizer."""
    resolved = renderer_name(tokenizer, name)
    if resolved == TEMPLATE:
        if options:
            raise ValueError(f"task.verifiers.renderer={name!r} (the chat template) takes no renderer_options "
                             f"({options!r}); name a renderers renderer for them")
        return TemplateRenderer(tokenizer, tool_parser)
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    try:
        config = TypeAdapter(RendererConfig).validate_python({**options, "name": resolved})
    except ValueError as e:
        raise ValueError(f"task.verifiers.renderer={name!r} with renderer_options={options!r}: not a renderers "
                         f"config ({e})") from None
    try:
        renderer = create_renderer(tokenizer, config)
    except Exception as e:  # renderers asserts its special tokens are in the vocabulary
        raise ValueError(f"task.verifiers.renderer={name!r} does not fit the policy's tokenizer "
                         f"({getattr(tokenizer, 'name_or_path', '?')}): {type(e).__name__}: {e}; set "
                         f"task.verifiers.renderer = 'auto' (renderers' renderer for a model it knows, else "
                         f"the chat template) or 'template' (the chat template)") from None
    return TextToolCalls(renderer, tokenizer, tool_parser) if tool_parser else renderer


class _TextParser:
    """vLLM's tool parser ``name`` over ``tokenizer``: a reply's text -> its content (the text
    besides the calls) and its calls as renderers' ``ParsedToolCall`` records."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from inflight.trainer.tasks.tool_calls import ToolCallParser

        self.calls = ToolCallParser(name, tokenizer)  # the name checked against vLLM's registry

    def parse(self, text: str) -> tuple[str, list[Any]]:
        from renderers.base import ParsedToolCall, ToolCallParseStatus

        content, calls = self.calls.extract(text)
        return content, [ParsedToolCall(raw=raw, name=name, arguments=arguments,
                                        status=ToolCallParseStatus.OK if isinstance(arguments, dict)
                                        else ToolCallParseStatus.INVALID_JSON)
                         for name, raw, arguments in calls]


def _read_calls(parser: _TextParser, renderer: Any, parsed: Any, token_ids: list[int]) -> Any:
    """``parsed`` (a renderer's ``ParsedResponse``) with its content and tool calls read from the
    reply's text (its stop tokens off, the other special tokens kept: a format's own markers)."""
    ids, stops = list(token_ids), set(renderer.get_stop_token_ids())
    while ids and ids[-1] in stops:
        ids.pop()
    parsed.content, parsed.tool_calls = parser.parse(renderer.tokenizer.decode(ids, skip_special_tokens=False))
    return parsed


class TextToolCalls:
    """A renderers renderer whose replies' tool calls are read from their text by vLLM's
    tool parser (``task.tool_parser``) in place of the renderer's own token-level parser."""

    def __init__(self, renderer: Any, tokenizer: Any, tool_parser: str) -> None:
        self.renderer, self.tokenizer = renderer, tokenizer
        self.parser = _TextParser(tool_parser, tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.renderer, name)

    def parse_response(self, token_ids: list[int], *, tools: Any = None, prompt_ids: Any = None) -> Any:
        parsed = self.renderer.parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        return _read_calls(self.parser, self, parsed, token_ids)


class TemplateRenderer:
    """``template``: the first prompt rendered by the chat template (renderers' ``DefaultRenderer``),
    each later one bridged from the episode's ids (its new messages, then the generation
    prompt, as the template renders them after a reply); tool calls read from the reply's text."""

    def __init__(self, tokenizer: Any, tool_parser: str = "") -> None:
        from renderers import DefaultRenderer

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"task.verifiers.renderer = 'template': the policy's tokenizer "
                             f"({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; set "
                             "task.chat_template (e.g. 'chatml_tools') or a renderers renderer")
        self.tokenizer, self.default = tokenizer, DefaultRenderer(tokenizer)
        self.observations = ObservationRenderer(tokenizer, "auto")
        self.tool_parser = tool_parser or _template_parser(self.observations)
        self.parser = _TextParser(self.tool_parser, tokenizer) if self.tool_parser else None

    def render(self, messages: list, *, tools: Any = None, add_generation_prompt: bool = False) -> Any:
        return self.default.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def get_stop_token_ids(self) -> list[int]:
        return self.default.get_stop_token_ids()

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list, *, tools: Any = None) -> Any:
        """The episode's ids, then what the template renders for ``new_messages`` after the reply."""
        from renderers.base import RenderedTokens, extract_message_tool_names

        if not previous_prompt_ids or not new_messages:
            return None
        messages = [dict(m) for m in new_messages]
        stopped = bool(previous_completion_ids) and previous_completion_ids[-1] in self.get_stop_token_ids()
        closing = self.observations.closing
        if stopped and closing.startswith(stop := self.tokenizer.decode(previous_completion_ids[-1:])):
            closing = closing[len(stop):]
        text = closing + self.observations.message_text(messages)
        ends = _message_ends(self.observations, messages, len(closing))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        indices = [_owner(start, len(closing), ends) for start, _ in encoded["offset_mapping"]]
        previous = list(previous_prompt_ids) + list(previous_completion_ids)
        return RenderedTokens(token_ids=previous + list(encoded["input_ids"]),
                              message_indices=[-1] * len(previous) + indices,
                              message_roles=[m.get("role") or "" for m in messages],
                              message_tool_names=extract_message_tool_names(messages))

    def parse_response(self, token_ids: list[int], *, tools: Any = None, prompt_ids: Any = None) -> Any:
        parsed = self.default.parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        return _read_calls(self.parser, self, parsed, token_ids) if self.parser is not None else parsed


def _message_ends(observations: ObservationRenderer, messages: list[dict], offset: int) -> list[int]:
    """Where each of ``messages`` ends in the bridge's text (``offset``: the closing before them):
    the template's text for the messages up to it, less the generation prompt."""
    prompt = observations.message_text([])  # the generation prompt alone
    ends = []
    for i in range(len(messages)):
        part = observations.message_text(messages[:i + 1])
        ends.append(offset + len(part) - (len(prompt) if part.endswith(prompt) else 0))
    return ends


def _owner(start: int, offset: int, ends: list[int]) -> int:
    """The message a token starting at character ``start`` belongs to (-1: the closing before
    the messages, or the generation prompt after them)."""
    if start < offset:
        return -1
    return next((i for i, end in enumerate(ends) if start < end), -1)


def _template_parser(observations: ObservationRenderer) -> str:
    """``hermes`` where the chat template's tool prompt asks for ``<tool_call>`` blocks, else none."""
    tool = {"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}
    try:
        text = observations.tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=[tool],
                                                          tokenize=False)
    except Exception:  # a template that takes no tools
        return ""
    return "hermes" if "<tool_call>" in text else ""
