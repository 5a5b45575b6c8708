"""The task API: built-in tasks' rewards on hand-written completions, the JSONL loader,
a user's task by dotted path, prompt encoding, greedy evaluation, and a training run with
evaluation rows."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.envs import SAMPLE, Arithmetic, JsonlFormatError, JsonlTask, RepeatDigit, build_task, load_jsonl
from inflight.trainer.tasks import Completion, Prompt, Task, encode_prompt, final_number, stop_token_ids


def _done(text: str) -> Completion:
    return Completion(text, [], "stop")


@pytest.fixture(scope="module")
def tiny_tok(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen))


def _single(tok, piece: str) -> int:
    """The id of a token whose text is exactly ``piece``."""
    ids = tok(piece, add_special_tokens=False).input_ids
    assert len(ids) == 1 and tok.decode(ids) == piece, (piece, ids)
    return ids[0]


def test_repeat_digit_rewards_hand_written_completions(tiny_tok) -> None:
    task = RepeatDigit(tiny_tok, completion_tokens=4, digit_credit=0.5)
    seven, three, word = _single(tiny_tok, "7"), _single(tiny_tok, "3"), _single(tiny_tok, "x")
    p = Prompt("repeat: 7", "7")
    cases = {(seven,) * 4: 1.0, (seven, seven, three, word): (1 + 1 + 0.5 + 0) / 4, (word,) * 4: 0.0,
             (seven,): 0.25,  # stopped after one token: the missing three count 0
             (seven,) * 6: 1.0}  # only the first completion_tokens count
    got = task.score([p] * len(cases), [Completion("", ids) for ids in cases])
    assert got == list(cases.values())
    assert [q.text for q in task.eval_prompts(32)] == [f"repeat: {d}" for d in range(10)]


@pytest.mark.parametrize("text, expected", [
    ("42", "42"), ("3 + 4 = 7", "7"), ("The answer is -12.", "-12"), ("so 1,234 in all\n#### 1,234", "1234"),
    ("#### 42 because 6 * 7", "42"), ("about 42.50 dollars", "42.5"), ("42.0", "42"), ("no number here", None),
    ("", None), ("-0", "0"),
])
def test_final_number(text: str, expected: str | None) -> None:
    assert final_number(text) == expected


def test_arithmetic_rewards_and_held_out_set() -> None:
    task = Arithmetic(digits=2, terms=2, ops=("+", "-"), eval_size=16)
    p = Prompt("What is 47 - 58? Answer with just the number.", "-11", meta={"expr": "47 - 58"})
    texts = ["-11", "47 - 58 = -11", "The answer is -11.", "11", "-11, no wait, 12", "", "minus eleven"]
    assert task.score([p] * len(texts), [_done(t) for t in texts]) == [1, 1, 1, 0, 0, 0, 0]
    held = task.eval_prompts(16)
    assert held == task.eval_prompts(16) and len({q.meta["expr"] for q in held}) == 16
    rng = random.Random(1)
    drawn = [task.sample(rng) for _ in range(3000)]
    assert not {q.meta["expr"] for q in drawn} & {q.meta["expr"] for q in held}
    for q in drawn[:200]:  # every prompt is its own expression's value, operands of exactly two digits
        a, op, b = q.meta["expr"].split()
        assert (10 <= int(a) <= 99 and 10 <= int(b) <= 99
                and q.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b)))
        assert task.score([q], [_done(f"It is {q.answer}")]) == [1.0]
    with pytest.raises(ValueError, match=r"would hold out more than half of the 100 distinct problems"):
        Arithmetic(digits=1, eval_size=60)


def test_arithmetic_settings_are_checked_in_the_config() -> None:
    cfg = config_from_dict({"task": {"name": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+", "*"], "terms": 3}}})
    assert cfg.task.arithmetic.ops == ("+", "*")
    with pytest.raises(ValueError, match=r"task.arithmetic.ops=\['/'\] must be a non-empty subset"):
        config_from_dict({"task": {"name": "arithmetic", "arithmetic": {"ops": ["/"]}}})
    with pytest.raises(ValueError, match=r"task.name='summarize' is not one of"):
        config_from_dict({"task": {"name": "summarize"}})
    with pytest.raises(ValueError, match=r"task.options=\{'x': 1\}: only a 'module:factory' task takes options"):
        config_from_dict({"task": {"name": "arithmetic", "options": {"x": 1}}})


def test_jsonl_sample_file_and_rewards() -> None:
    records = load_jsonl(SAMPLE)
    assert len(records) >= 20 and any(r.messages for r in records) and any(r.text for r in records)
    task = JsonlTask(SAMPLE, eval_size=4)
    assert task.eval_prompts(4) == records[-4:] and task.train == records[:-4]
    first = records[0]  # "Ana has 13 apples and buys 4 more ..." -> "... #### 17"
    assert first.answer.endswith("#### 17") and final_number(first.answer) == "17"
    texts = ["13 + 4 = 17.\n#### 17", "She has 17 apples now.", "#### 17.0", "#### 18", "13 + 4 = 17, plus 1 is 18", ""]
    assert task.score([first] * len(texts), [_done(t) for t in texts]) == [1, 1, 1, 0, 0, 0]


def test_jsonl_exact_match_and_messages(tmp_path) -> None:
    f = tmp_path / "qa.jsonl"
    f.write_text('{"prompt": "Capital of France?", "answer": "Paris", "id": 7}\n\n'
                 '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], '
                 '"answer": 4}\n')
    task = JsonlTask(f, match="exact")
    paris, four = task.train
    assert paris.meta == {"id": 7} and four.messages[1] == {"role": "user", "content": "2+2?"} and four.answer == "4"
    assert task.score([paris] * 3, [_done(" Paris\n"), _done("paris"), _done("Paris.")]) == [1, 0, 0]
    assert task.score([four] * 2, [_done("4"), _done("The answer is 4")]) == [1, 0]


def test_jsonl_with_a_reward_function_of_your_own(tmp_path, monkeypatch) -> None:
    """``task.jsonl.reward = "module:function"`` scores each completion with your function (the
    record's answer any string, its other keys in ``meta``); a module next to the config is
    found; a bad name is refused at load, naming the key."""
    (tmp_path / "my_reward.py").write_text(
        "def length_match(prompt, completion):\n"
        "    return float(len(completion.split()) == int(prompt.meta['words'])) + (prompt.answer in completion)\n")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "Say three words about cats.", "answer": "cat", "words": 3}\n'
                    '{"prompt": "Name a colour.", "answer": "no number here", "words": 1}\n')
    (tmp_path / "run.toml").write_text('[task]\nname = "jsonl"\n[task.jsonl]\npath = "data.jsonl"\n'
                                       'reward = "my_reward:length_match"\n')
    monkeypatch.chdir(tmp_path.parent)  # the run starts elsewhere: the config's directory is searched
    monkeypatch.setattr(sys, "path", list(sys.path))
    from inflight.trainer.config_files import load_config
    from inflight.trainer.envs import build_task

    task = build_task(load_config(tmp_path / "run.toml"), tokenizer=None)
    cats, colour = task.train
    assert (task.score([cats] * 3, [_done("cat cat cat"), _done("three cat words here"), _done("dogs")])
            == [2.0, 1.0, 0.0])
    assert task.score([colour], [_done("blue")]) == [1.0]
    with pytest.raises(ValueError, match=r"jsonl: reward='my_reward:nope': 'my_reward' has no attribute 'nope'"):
        JsonlTask(data, reward="my_reward:nope")


def _gsm_dataset(path) -> None:
    """A GSM8K-shaped ``DatasetDict`` saved to disk: ``question``, ``answer`` (``... #### N``) and an id."""
    import datasets

    def rows(n: int, start: int) -> dict:
        return {"question": [f"What is {i} + {i}?" for i in range(start, start + n)],
                "answer": [f"{i} + {i} = {2 * i}\n#### {2 * i}" for i in range(start, start + n)],
                "id": list(range(start, start + n))}

    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(6, 1)),
                          "test": datasets.Dataset.from_dict(rows(2, 100))}).save_to_disk(str(path))


def test_a_hugging_face_dataset_is_a_task(tmp_path, monkeypatch) -> None:
    """``task.name = "dataset"``: a ``save_to_disk`` directory next to the config (GSM8K's
    columns, the test split held out), and a parquet file of chat messages (the last
    ``eval.prompts`` rows held out, ``max_rows``); rewards as the ``jsonl`` task's."""
    import datasets

    from inflight.trainer.config_files import load_config

    _gsm_dataset(tmp_path / "gsm")
    (tmp_path / "run.toml").write_text('[task]\nname = "dataset"\n[task.dataset]\npath = "gsm"\n'
                                       'prompt_field = "question"\neval_split = "test"\n')
    monkeypatch.chdir(tmp_path.parent)  # the path is read next to the config
    task = build_task(load_config(tmp_path / "run.toml"), tokenizer=None)
    assert [p.text for p in task.train] == [f"What is {i} + {i}?" for i in range(1, 7)]
    assert [p.meta for p in task.eval_prompts(5)] == [{"id": 100}, {"id": 101}]
    three = task.train[2]
    assert task.score([three] * 3, [_done("3 + 3 = 6\n#### 6"), _done("It is 6."), _done("#### 7")]) == [1, 1, 0]

    chats = datasets.Dataset.from_dict({"chat": [[{"role": "user", "content": f"Say {w}."}] for w in "abcde"],
                                        "target": list("abcde")})
    chats.to_parquet(str(tmp_path / "chats.parquet"))
    cfg = config_from_dict({"eval": {"every": 5, "prompts": 1}, "task": {"name": "dataset", "dataset": {
        "path": str(tmp_path / "chats.parquet"), "messages_field": "chat", "answer_field": "target", "match": "exact",
        "max_rows": 4}}})
    task = build_task(cfg, tokenizer=None)
    assert [p.answer for p in task.train] == ["a", "b", "c"] and [p.answer for p in task.eval_prompts(1)] == ["d"]
    assert task.train[1].messages == ({"role": "user", "content": "Say b."},)
    assert task.score([task.train[1]] * 2, [_done(" b\n"), _done("B")]) == [1, 0]


def test_a_bad_dataset_is_refused_before_any_engine_starts(tmp_path, tiny_qwen) -> None:
    """Each mistake is one line naming the key or the row, from the trainer's own build of the
    task (``_task_before_engines``), before an engine starts."""
    import datasets

    from inflight.trainer.train import SetupError, _task_before_engines

    _gsm_dataset(tmp_path / "gsm")
    datasets.Dataset.from_dict({"prompt": ["1+1?", "2+2?", "3+3?"], "answer": ["2", None, "6"]}).to_json(
        str(tmp_path / "holes.jsonl"))

    def refusal(**dataset) -> str:
        cfg = config_from_dict({"task": {"name": "dataset", "dataset": dataset}})
        with pytest.raises(SetupError, match=rf"(?s)^task 'dataset': .*{re.escape(dataset['path'])}") as e:
            _task_before_engines(cfg, tiny_qwen)
        return str(e.value)

    gsm = str(tmp_path / "gsm")
    assert refusal(path=gsm) == (f"task 'dataset': {gsm}[train]: no column 'prompt' (columns: ['question', 'answer', "
                                 "'id']); set task.dataset.prompt_field")
    assert refusal(path=gsm, prompt_field="question", split="validation").endswith(
        "no split 'validation' (it has ['test', 'train'])")
    holes = str(tmp_path / "holes.jsonl")
    assert refusal(path=holes).endswith(f"{holes}[train] row 1: 'answer' must be a string or a number, got None")
    nowhere = str(tmp_path / "nowhere.parquet")
    assert refusal(path=nowhere) == f"task 'dataset': task.dataset.path={nowhere!r}: no such file or directory"
    with pytest.raises(ValueError, match=r"task.name = 'dataset' needs task.dataset.path"):
        config_from_dict({"task": {"name": "dataset"}})
    with pytest.raises(ValueError, match=r"task.dataset.max_rows=-1 must be >= 0"):
        config_from_dict({"task": {"name": "dataset", "dataset": {"path": gsm, "max_rows": -1}}})


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "answer": "1"', r"not valid JSON \(Expecting ',' delimiter at column 30\)"),
    ('{"prompt": "a"}', r"no 'answer'"),
    ('{"prompt": "a", "messages": [], "answer": 1}', r"needs exactly one of 'prompt' or 'messages'"),
    ('["prompt", "answer"]', r"expected a JSON object, got list"),
    ('{"messages": [{"role": "user"}], "answer": 1}', r"'messages' must be a non-empty list"),
    ('{"prompt": "a", "answer": "none"}', r"match = 'number' but the answer 'none' holds no number"),
    ('{"prompt": "a", "answer": null}', r"'answer' must be a string or a number, got None"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line: str, message: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "What is 1+1?", "answer": 2}\n\n' + line + "\n")
    with pytest.raises(JsonlFormatError, match=rf"^{re.escape(str(f))}:3: {message}"):
        load_jsonl(f)


USER_TASK = '''
from inflight.trainer.tasks import Prompt, Task

class Echo(Task):
    def __init__(self, word):
        self.word = word
    def sample(self, rng):
        return Prompt(f"say {self.word}", self.word)
    def score(self, prompts, completions):
        return [float(c.text.strip() == p.answer) for p, c in zip(prompts, completions)]

def make(tokenizer, word="yes"):
    assert tokenizer == "the tokenizer"
    return Echo(word)

not_a_task = lambda tokenizer: 42
'''


def test_user_task_by_dotted_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_tasks_14.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict({"task": {"name": "my_tasks_14:make", "options": {"word": "ok"}}})
    task = build_task(cfg, "the tokenizer")
    assert isinstance(task, Task) and task.sample(random.Random(0)) == Prompt("say ok", "ok")
    assert task.score([Prompt("say ok", "ok")] * 2, [_done(" ok "), _done("no")]) == [1.0, 0.0]
    assert len(task.eval_prompts(3)) == 3  # the default: a fixed draw from sample
    with pytest.raises(ValueError, match=r"task.name='my_tasks_14:missing': 'my_tasks_14' has no attribute 'missing'"):
        build_task(config_from_dict({"task": {"name": "my_tasks_14:missing"}}), None)
    with pytest.raises(ValueError, match=r"task.name='no_such_module_14:make': cannot import 'no_such_module_14'"):
        build_task(config_from_dict({"task": {"name": "no_such_module_14:make"}}), None)
    with pytest.raises(TypeError, match=r"returned int, not a inflight.trainer.tasks.Task"):
        build_task(config_from_dict({"task": {"name": "my_tasks_14:not_a_task"}}), None)


def test_prompt_encoding_uses_the_chat_template_and_eos(tiny_tok) -> None:
    import copy

    plain = Prompt("What is 2+3?", "5")
    assert encode_prompt(tiny_tok, plain, "auto") == tiny_tok("What is 2+3?").input_ids  # no template: raw text
    with pytest.raises(ValueError, match="has chat messages but the model has no chat template"):
        encode_prompt(tiny_tok, Prompt(messages=({"role": "user", "content": "hi"},)), "auto")
    chat_tok = copy.deepcopy(tiny_tok)
    chat_tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")
    rendered = "<|endoftext|>user: What is 2+3?\n<|endoftext|>assistant: "
    ids = encode_prompt(chat_tok, plain, "auto")
    assert ids == chat_tok(rendered, add_special_tokens=False).input_ids
    assert ids.count(chat_tok.eos_token_id) == 2  # the template's special tokens, parsed as such, nothing added
    assert encode_prompt(chat_tok, plain, "off") == tiny_tok("What is 2+3?").input_ids
    msgs = Prompt(messages=({"role": "system", "content": "S"}, {"role": "user", "content": "U"}))
    assert chat_tok.decode(encode_prompt(chat_tok, msgs, "auto")) == (
        "<|endoftext|>system: S\n<|endoftext|>user: U\n<|endoftext|>assistant: ")
    eos = tiny_tok.eos_token_id
    assert stop_token_ids(tiny_tok) == [eos] and stop_token_ids(tiny_tok, [eos, 9, 9]) == [eos, 9]


def test_greedy_eval_matches_unbatched_generation(tiny_qwen, tiny_tok) -> None:
    """Left padding in the batch changes nothing: each prompt's greedy tokens are those of
    generating it alone, and the reward is the task's on them."""
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.trainer.tasks.evaluate import greedy_eval

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.float32).train()
    task = RepeatDigit(tiny_tok, completion_tokens=6)
    prompts = task.eval_prompts(10) + [Prompt("repeat: 7 7 7 7 7 7", "7")]  # a longer prompt forces padding
    got = greedy_eval(model, tiny_tok, task, prompts, chat="auto", max_new_tokens=6, stop_ids=[tiny_tok.eos_token_id],
                      batch_size=4)
    rewards = []
    for p in prompts:
        ids = torch.tensor([encode_prompt(tiny_tok, p, "auto")])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             eos_token_id=tiny_tok.eos_token_id, pad_token_id=tiny_tok.pad_token_id)
        rewards.append(task.reward(p, out[0, ids.shape[1]:].tolist()))
    assert got["eval_prompts"] == 11 and got["eval_reward"] == pytest.approx(sum(rewards) / 11, abs=1e-12)
    assert got["eval_accuracy"] == sum(r >= 1 for r in rewards) / 11
    assert model.training  # evaluation put it back in training mode


def test_training_run_logs_evaluation(tmp_path) -> None:
    """The arithmetic task on the tiny model: row "step 0" is the evaluation before training,
    then every 2 steps and after the last; the summary and plot carry them."""
    from inflight.trainer.train import train

    cfg = config_from_dict({
        "run": {"steps": 3, "seed": 1, "out_dir": str(tmp_path / "run")},
        "model": {"tiny": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}},
        "task": {"name": "arithmetic", "completion_tokens": 8},
        "eval": {"every": 2, "prompts": 8},
        "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 2},
        "transport": {"bucket_mb": 0.05},
    })
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["version"] for r in rows if "eval_accuracy" in r] == [0, 2, 3]
    assert "reward_mean" not in rows[0] and all(r["eval_prompts"] == 8 for r in rows if "eval_accuracy" in r)
    # arithmetic rewards are 0 or 1: accuracy and mean reward are one figure
    assert all(0 <= r["eval_accuracy"] == r["eval_reward"] <= 1 for r in rows if "eval_accuracy" in r)
    assert all("What is" in r["eval_examples"][0]["prompt"] for r in rows if "eval_accuracy" in r)
    assert summary["steps"] == 3 and summary["eval_versions"] == [0, 3]
    assert summary["eval_accuracy_last"] == rows[-1]["eval_accuracy"]
    assert (tmp_path / "run" / "training.png").stat().st_size > 10_000


def _documented_toml(heading: str) -> str:
    """The first TOML block after ``heading`` in docs/training.md."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    after = text[text.index(heading + "\n"):]
    return after.split("```toml\n", 1)[1].split("```", 1)[0]


def _reasoning_gym_reference(text: str, entry: dict) -> float:
    """reasoning-gym's own score of a completion: its ``extract_answer``, then the entry's
    dataset's ``score_answer`` (no answer tag: 0, as its evaluations count it)."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    return (0.0 if answer is None
            else reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry))


def test_the_documented_reasoning_gym_mix_is_a_task(tmp_path) -> None:
    """docs/training.md's ``[task.reasoning_gym]`` block, as written: its options reach the
    datasets, the weights the draws, nothing held out is sampled, the held-out set is the
    same on every build, and the reward is reasoning-gym's own score."""
    from inflight.trainer.config_files import load_config

    (tmp_path / "run.toml").write_text(_documented_toml("### reasoning-gym") + "\n[eval]\nevery = 5\nprompts = 40\n")
    cfg = load_config(tmp_path / "run.toml")
    task, again = build_task(cfg, tokenizer=None), build_task(cfg, tokenizer=None)
    held = task.eval_prompts(40)
    assert len(held) == 40 and held == again.eval_prompts(40)
    rng = random.Random(5)
    drawn = [task.sample(rng) for _ in range(600)]
    assert not {p.meta["entry"]["question"] for p in drawn} & {p.meta["entry"]["question"] for p in held}
    sources = [p.meta["entry"]["metadata"]["source_dataset"] for p in drawn]
    assert set(sources) == {"basic_arithmetic", "leg_counting"}
    assert abs(sources.count("basic_arithmetic") / 600 - 2 / 3) < 4 * (2 / 9 / 600) ** 0.5  # weights 2:1, 4 sigma
    assert all(p.meta["entry"]["metadata"]["num_terms"] <= 2
               for p in drawn if "num_terms" in p.meta["entry"]["metadata"])
    assert drawn[0].text.startswith("Given a problem") and drawn[0].text.endswith(drawn[0].meta["entry"]["question"])
    for p in drawn[:40]:
        right, entry = p.answer, p.meta["entry"]
        texts = [f"<answer>{right}</answer>", f"<answer>0</answer> no: <answer>{right}</answer>",
                 f"<answer>{right}1</answer>", right, ""]
        rewards = task.score([p] * 5, [_done(t) for t in texts])
        assert rewards == [_reasoning_gym_reference(t, entry) for t in texts]
        assert rewards[:2] == [1.0, 1.0] and rewards[2] < 1 and rewards[3:] == [0.0, 0.0]
    # reasoning-gym seeds entry i with seed + i: under seed 1, entries 1..40 are eval_seed 2's
    # 40 held-out ones, so entry 0 is the only one left to draw
    shifted = build_task(config_from_dict({"eval": {"every": 5, "prompts": 40}, "task": {
        "name": "reasoning_gym", "reasoning_gym": {"datasets": ["leg_counting"], "size": 41, "seed": 1,
                                                   "eval_seed": 2}}}), tokenizer=None)
    held_questions = {p.meta["entry"]["question"] for p in shifted.eval_prompts(40)}
    assert shifted.train[1]["question"] in held_questions and shifted.train[0]["question"] not in held_questions
    assert {shifted.sample(rng).meta["entry"]["question"] for _ in range(30)} == {shifted.train[0]["question"]}


def test_reasoning_gym_rewards_are_its_own_not_a_number_match(tiny_tok) -> None:
    """A dataset whose answers are words (``spell_backward``) and a chat model: the system
    prompt and question go through the chat template, and a word answer scores as
    reasoning-gym scores it."""
    import copy

    chat_tok = copy.deepcopy(tiny_tok)
    chat_tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")
    cfg = config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": {
        "datasets": ["spell_backward"], "system_prompt": "simple"}}})
    task = build_task(cfg, tokenizer=chat_tok)
    p = task.sample(random.Random(1))
    assert ([m["role"] for m in p.messages] == ["system", "user"]
            and p.messages[1]["content"] == p.meta["entry"]["question"])
    assert chat_tok.decode(encode_prompt(chat_tok, p, "auto")).count(p.meta["entry"]["question"]) == 1
    assert build_task(cfg, tokenizer=tiny_tok).sample(random.Random(1)).text.endswith(p.meta["entry"]["question"])
    # worked examples: reasoning-gym entries (none of them the problem) answered in tags, before it
    shots = build_task(config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": {
        "datasets": ["spell_backward"], "examples": 2}}}), tokenizer=chat_tok).sample(random.Random(1))
    roles = [m["role"] for m in shots.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"], roles
    assert shots.messages[-1]["content"] == p.meta["entry"]["question"] and shots.messages[1:3] != shots.messages[3:5]
    for question, reply in (shots.messages[1:3], shots.messages[3:5]):
        assert question["content"] != p.meta["entry"]["question"]
        word = reply["content"].removeprefix("<answer>").removesuffix("</answer>")
        assert _reasoning_gym_reference(reply["content"], {**p.meta["entry"], "answer": word}) == 1.0
        assert question["content"].count(word[::-1]) >= 1  # the example's answer is its own question's
    with pytest.raises(ValueError, match=r"examples=1: worked examples are chat turns"):
        build_task(config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": {"examples": 1}}}), None)
    word = p.answer
    texts = [f"<answer>{word}</answer>",
             f"<answer>{word[::-1]}</answer>" if word != word[::-1] else "<answer>x</answer>"]
    assert task.score([p] * 2, [_done(t) for t in texts]) == [1.0, _reasoning_gym_reference(texts[1], p.meta["entry"])]
    assert task.score([p], [_done(texts[1])])[0] < 1


@pytest.mark.parametrize(("table", "named"), [
    ({"datasets": ["basic_arithmetc"]}, r"'basic_arithmetc' is not a reasoning-gym dataset \(did you mean "
                                        r"basic_arithmetic"),
    ({"datasets": ["leg_counting", "leg_counting"]}, r"must name one dataset or more, each once"),
    ({"datasets": ["leg_counting"], "weights": [1, 2]}, r"weights=\[1, 2\] must have one weight per dataset \(1\)"),
    ({"datasets": ["leg_counting"], "weights": [0]}, r"weights=\[0\] must all be finite and > 0"),
    ({"datasets": ["leg_counting"], "options": {"basic_arithmetic": {}}}, r"options names \['basic_arithmetic'\]"),
    ({"seed": 3, "eval_seed": 3}, r"eval_seed=3 must differ from seed"),
])
def test_a_bad_reasoning_gym_table_is_refused_at_load(table: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": table}})


def test_a_reasoning_gym_option_its_dataset_refuses_stops_the_build(tiny_tok) -> None:
    cfg = config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": {
        "datasets": ["leg_counting"], "options": {"leg_counting": {"max_legs": 3}}}}})
    with pytest.raises(ValueError, match=r"reasoning-gym refused the mix \['leg_counting'\] .*unexpected keyword "
                                         r"argument 'max_legs'"):
        build_task(cfg, tokenizer=tiny_tok)
    with pytest.raises(ValueError, match=r"system_prompt='socratic' is not one of \['DeepSeekZero', "):
        build_task(config_from_dict({"task": {"name": "reasoning_gym",
                                              "reasoning_gym": {"system_prompt": "socratic"}}}),
                   tokenizer=None)


def test_the_documented_learning_runs_are_the_committed_ones() -> None:
    """Each SmolLM2 learning run that docs/training.md quotes is a line of
    ``bench/results/learning.jsonl`` (its per-step series), and the quote is that line's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "training.md").read_text()
    runs = [json.loads(line) for line in (root / "bench" / "results" / "learning.jsonl").read_text().splitlines()]
    quoted = 0
    for run in runs:
        evals = run["evals"]
        line = (f"{run['run']}: sampled reward, first 20% of steps {run['reward_first_20pct']:.3f} -> last 20% "
                f"{run['reward_last_20pct']:.3f}")
        if evals:
            line += (f"; greedy accuracy on {evals[0]['prompts']} held-out prompts "
                     + " / ".join(f"{e['accuracy']:.3f}" for e in evals) + " at steps "
                     + " / ".join(str(e["step"]) for e in evals))
        assert len(run["steps"]) >= 10 and run["start"] < run["end"], run["run"]
        quoted += line in doc
    assert quoted == len(runs), f"{len(runs) - quoted} of the committed runs are not quoted as recorded"
