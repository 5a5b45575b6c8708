"""Multi-turn episodes (``inflight.trainer.tasks.episode``, ``inflight.trainer.rollout.episode_rollout``).

- Observation tokens render as the chat template continues the conversation, and receive
  no gradient: the loss, its entropy term and every correction see the policy's tokens only.
- On a real vLLM CPU engine (in-process EngineCore, tiny Llama fp32, prefix caching on),
  episodes of 3 turns run while two commits land in the middle of them: each turn is a
  request continuing the episode's token ids, the environment answers in the scoring
  processes, and a transformers replay of every policy turn from its tags alone matches the
  behaviour log-probs within 1e-4 (fp32); one episode spans both commits.
- An environment that raises, hangs past its timeout, answers garbage or runs out of its
  memory cap fails its episode with an error naming the task and the cause; the group is
  dropped (or, with ``on_failure = "reward"``, trains with ``failure_reward``); the other
  groups finish, and the episode ledger balances.
Commits are driven by engine steps and events, never by wall-clock time.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch

from inflight.protocol import RolloutGroup, RolloutSample, Sampling, decode_group, encode
from inflight.trainer.loss_config import LossConfig
from inflight.trainer.tasks.episode import ObservationRenderer
from inflight.trainer.tasks.task import Prompt, Turn
from tests.engine_harness import Reference, replay
from tests.episode_driver import Driver, engine_with_pusher, policy_runs, push_until_pending
from tests.helpers import WAIT_S, wait_until

EXACT = 1e-4
ENV_TIMEOUT_S = 10.0
"""The scoring timeout of the faulty-environment test: what a hanging environment is cut off
at, far above an ordinary turn's time on a loaded machine (an echo: milliseconds)."""


# -- no engine -----------------------------------------------------------------------------------
def test_an_observation_continues_the_chat_template_exactly() -> None:
    from transformers import AutoTokenizer

    from inflight.trainer.models import resolve_model
    from inflight.trainer.tasks.task import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    r = ObservationRenderer(tok, "auto")
    prompt = encode_prompt(tok, Prompt("What is 6 * 7?"), "auto")
    reply = tok("calc: 6 * 7<|im_end|>", add_special_tokens=False).input_ids
    assert reply[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    ids = r.ids(Turn(observation="42", role="tool"), reply, "stop")
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    conversation = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "calc: 6 * 7"},
                    {"role": "tool", "content": "42"}]
    want = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompt + reply + ids) == want
    # a reply cut at the token budget never sampled its end of turn: the observation closes it
    cut = r.ids(Turn(observation="higher", role="user"), reply[:-1], "length")
    assert tok.decode(cut) == "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    # raw token ids are taken as they are (the environment renders them itself), shown decoded
    raw = tok("\n<|im_start|>user\nlower<|im_end|>\n", add_special_tokens=False).input_ids
    turn = Turn(observation_ids=raw, role="user")
    assert r.ids(turn, reply, "stop") == raw and r.text(turn) == "\n<|im_start|>user\nlower<|im_end|>\n"
    assert r.text(Turn(observation="lower", observation_ids=raw)) == "lower"
    with pytest.raises(ValueError, match=f"observation_ids holds {len(tok)}, past the tokenizer's {len(tok)} ids"):
        r.ids(Turn(observation_ids=[1, len(tok)]), reply, "stop")
    for bad in ([1, -2], [True], [1.0]):
        with pytest.raises(ValueError, match=f"observation_ids holds {bad[-1]!r}: token ids are non-negative"):
            Turn(observation_ids=bad)
    with pytest.raises(ValueError, match="needs a finite reward"):
        Turn(done=True, reward=float("nan"))
    with pytest.raises(ValueError, match="role"):
        Turn(observation="x", role="system")


def test_greedy_evaluation_caps_each_turn_at_the_episodes_budget(tiny_llama) -> None:
    """``greedy_episodes`` caps a turn as the engine does (``Transcript.room``): the turn that
    meets ``task.episode.max_tokens`` is cut there, and is the episode's last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight.trainer.tasks.evaluate import greedy_episodes
    from tests.episode_envs import make

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    task = make(tok, turns=2, prompt_chars=40)
    prompts = task.eval_prompts(2)
    obs = len(tok(" obs 1 ", add_special_tokens=False).input_ids)

    def play(max_tokens: int) -> tuple[list[float], list[list[str]]]:
        rewards, texts = greedy_episodes(model, tok, task, prompts, chat="off", max_new_tokens=6, stop_ids=[10 ** 6],
                                         max_turns=2, max_tokens=max_tokens, max_model_len=1024, pad=0)
        return rewards, [t.split(" [ obs 1 ] ") for t in texts]
    (full_r, full), (exact_r, exact) = play(100), play(6 + obs + 6)
    assert exact == full and exact_r == full_r and all(r > 0 for r in full_r)  # room for the whole second turn
    capped_r, capped = play(6 + obs + 4)  # room for 4 of its 6 tokens: cut there, and the episode ends
    for (a1, a2), (b1, b2) in zip(full, capped):
        assert a1 == b1 and a2 != b2 and a2.startswith(b2), (a2, b2)
    assert all(0 < c < f for c, f in zip(capped_r, full_r))  # Echo's reward: the characters the policy wrote
    assert play(6 + obs)[0] == [0.0, 0.0]  # the observation leaves no room: the episode fails, as on the engine


def test_observation_tokens_receive_no_gradient(tiny_llama) -> None:
    """The loss (with its entropy term) differentiated by each token's log-prob and entropy:
    exactly zero on every observation token, nonzero on every policy token."""
    from inflight.trainer.loss import collate, compute_loss, policy_logprobs

    ref = Reference(tiny_llama, "float32")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (reward, obs) in enumerate([(1.0, [0, 0, 0, 1, 1, 0, 0]), (0.0, [0, 1, 1, 1, 0, 0, 0, 0, 0])]):
        tokens = torch.randint(3, 250, (len(obs),), generator=g).tolist()
        samples.append(RolloutSample(sample_id=f"g-{i}", group_id="g", prompt_ids=[5, 6, 7, 8][: 3 + i],
                                     token_ids=tokens, logprobs=[-0.5 if not o else 0.0 for o in obs],
                                     versions=[0] * len(obs), reward=reward, observation=[bool(o) for o in obs]))
    group = RolloutGroup(group_id="g", samples=tuple(samples))
    assert decode_group(encode(group)) == group  # the queue and the checkpoint's pending groups keep the flags
    with pytest.raises(ValueError, match="observation flags"):
        RolloutSample(**{**{f: getattr(samples[0], f) for f in samples[0].__struct_fields__},
                         "observation": [True] * 7})
    batch = collate([group], pad_id=0, normalize_std=False)
    logp, entropy = policy_logprobs(ref.model, batch, Sampling(temperature=1.0), impl="torch")
    logp.retain_grad()
    entropy.retain_grad()
    loss, metrics = compute_loss(logp, entropy, batch, version=0, cfg=LossConfig(entropy_coef=0.01), impl="torch")
    loss.backward()
    for i, s in enumerate(samples):
        obs = torch.tensor(s.observation + [False] * (logp.shape[1] - len(s.observation)))
        policy = torch.zeros_like(obs)
        policy[: len(s.observation)] = ~obs[: len(s.observation)]
        assert torch.all(logp.grad[i][obs] == 0) and torch.all(entropy.grad[i][obs] == 0), i
        assert torch.all(logp.grad[i][policy] != 0) and torch.all(entropy.grad[i][policy] != 0), i
    assert metrics["tokens_in_loss"] == sum(not o for s in samples for o in s.observation)


# -- a real engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama, hold_port):
    with engine_with_pusher(tiny_llama, hold_port(), 1024) as engine:
        yield engine


def test_episodes_span_commits_and_replay_from_their_tags(engine) -> None:
    d = Driver(engine)
    pushes: list[threading.Thread] = []

    def on_step() -> None:  # v1 in the episodes' first turn; v2 once a third turn is decoding
        third = any(rid.endswith(".2") for rid in d.requests)
        if (d.steps == 3 and not pushes) or (third and len(pushes) == 1):
            pushes.append(push_until_pending(engine, len(pushes) + 1))
    try:
        rng = __import__("random").Random(1)
        for gid in ("a", "b"):
            d.start(gid, Prompt(_text(rng)))
        d.run(on_step)
    finally:
        d.rollout.close()
    for k, t in enumerate(pushes, 1):
        t.join(WAIT_S)
        assert not t.is_alive(), f"waited {WAIT_S:.0f} s for the push of v{k} to return"
    assert len(pushes) == 2 and sorted(g.group_id for g in d.groups) == ["a", "b"]
    ref = Reference(engine["model_dir"], "float32")
    weights = lambda label: engine["versions"][int(label)]  # noqa: E731
    spans = []
    tok = engine["llm"].get_tokenizer()
    for s in (s for g in d.groups for s in g.samples):
        runs = policy_runs(s)
        assert len(runs) == 3 and all(b - a == 6 for a, b in runs), runs
        for j, ((_, b), (a, _)) in enumerate(zip(runs, runs[1:])):  # the environment's answers, as rendered
            want = (f" obs {j + 1} " if j != 1 else  # the second given as token ids, taken as they are
                    tok(" ids 2 ", add_special_tokens=False).input_ids)
            assert (tok.decode(s.token_ids[b:a]) if j != 1 else s.token_ids[b:a]) == want
            assert s.logprobs[b:a] == [0.0] * (a - b)
        # the environment read each reply as the engine decoded it (its reward: their length)
        gid, k = s.sample_id.rsplit("-", 1)
        assert s.reward == float(sum(len(d.texts[f"{gid}.{k}.{t}"]) for t in range(3)))
        for a, b in runs:
            context, labels = s.prompt_ids + s.token_ids[:a], [str(v) for v in s.versions[a:b]]
            want = replay(ref, weights, context, s.token_ids[a:b], labels, labels[0])
            err = float((torch.tensor(s.logprobs[a:b], dtype=torch.float64) - want).abs().max())
            assert err < EXACT, (s.sample_id, a, b, labels, err)
            if labels != ["0"] * len(labels):  # the tags matter: the first weights do not reproduce it
                stale = replay(ref, weights, context, s.token_ids[a:b], ["0"] * len(labels), "0")
                assert float((torch.tensor(s.logprobs[a:b], dtype=torch.float64) - stale).abs().max()) > 10 * EXACT
        spans.append(len({v for v, o in zip(s.versions, s.observation) if not o}))
    assert max(spans) == 3, spans  # an episode sampled by v0, v1 and v2: it spans both commits
    c = d.rollout.counts
    assert c == {"started": 4, "finished": 4, "failed": 0, "dropped": 0, "shipped": 4, "groups_scored": 2,
                 "groups_failed": 0, "resumed": 0, "turns_cancelled": 0}, c


def _text(rng) -> str:
    from tests.episode_envs import WORDS

    text = ""
    while len(text) < 300:
        text += rng.choice(WORDS) + " "
    return text[:300]


def test_a_faulty_environment_fails_its_episode_and_the_ledger_balances(engine, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inflight.rollout")
    d = Driver(engine, scoring={"workers": 2, "timeout_s": ENV_TIMEOUT_S, "memory_mb": 3072})
    rng = __import__("random").Random(2)
    try:
        for fault in ("raise", "hang", "garbage", "memory", ""):
            d.start(f"f-{fault or 'none'}", Prompt(_text(rng), meta={"fault": fault}))
        d.run()
    finally:
        d.rollout.close()
    assert [g.group_id for g in d.groups] == ["f-none"]
    c = d.rollout.counts
    assert c["groups_failed"] == 4 and c["shipped"] == 2 and c["finished"] == 2, c
    assert c["started"] == 10 == c["finished"] + c["failed"] + c["dropped"], c
    log = caplog.text
    for error in ("Echo.turn raised RuntimeError: the tool crashed", f"timeout_s={ENV_TIMEOUT_S:g}", "not a Turn",
                  "Echo.turn ran out of memory (MemoryError) under the worker's cap of memory_mb=3072 MiB"):
        line = next((r.getMessage() for r in caplog.records
                     if r.name == "inflight.rollout" and error in r.getMessage()), "")
        assert re.match(r"rollout: task tests\.episode_envs:make: episode f-\w+\.[01] \(turn 1\) failed "
                        r"\(prompt '.*'\): .*; its group is dropped \(\d+ failed so far, \d+ scored\)", line), line
    assert "Traceback (most recent call last)" in log and 'raise RuntimeError("the tool crashed")' in log
    # with on_failure = "reward", a failed episode trains with failure_reward
    d = Driver(engine, episode={"on_failure": "reward", "failure_reward": -1.0}, scoring={"timeout_s": 30.0})
    try:
        d.start("r-raise", Prompt(_text(rng), meta={"fault": "raise"}))
        d.run()
    finally:
        d.rollout.close()
    (g,) = d.groups
    assert [s.reward for s in g.samples] == [-1.0, -1.0] and d.rollout.counts["failed"] == 2
    assert g.engine_ledger["episodes_shipped"] == 2 and g.engine_ledger["groups_failed"] == 0


def test_a_hung_tool_holds_one_worker_and_its_dropped_group_turn_is_cancelled(engine, tmp_path, caplog) -> None:
    """One scoring worker to start with: one episode's tool hangs (no timeout the test could
    reach), its group's other episode fails, which drops the group. The hung turn is
    cancelled (its worker killed) and counted; three other groups, started with it, finish on
    the workers the pool grew for them; the failure is one log line naming the task, the
    episode and the error, the environment's traceback after it."""
    caplog.set_level(logging.INFO, logger="inflight.rollout")
    d = Driver(engine, scoring={"workers": 1, "max_workers": 3, "timeout_s": 3600.0})
    rng = __import__("random").Random(3)
    try:
        d.start("h", Prompt(_text(rng), meta={"fault": "one_hangs", "marker": str(tmp_path / "hung")}))
        for gid in ("ok1", "ok2", "ok3"):
            d.start(gid, Prompt(_text(rng)))
        d.run()  # every group finished or failed
        wait_until(lambda: d.rollout.collect() == [] and d.rollout.counts["turns_cancelled"] == 1,
                   "the hung turn's cancellation to come back")
        counts, pool = dict(d.rollout.counts), dict(d.rollout.pool.counts)
    finally:
        d.rollout.close()
    assert sorted(g.group_id for g in d.groups) == ["ok1", "ok2", "ok3"]
    assert counts == {"started": 8, "finished": 6, "failed": 1, "dropped": 1, "shipped": 6, "groups_scored": 3,
                      "groups_failed": 1, "resumed": 0, "turns_cancelled": 1}, counts
    assert pool["cancelled"] == 1 and pool["timeouts"] == 0 and pool["grown"] >= 1, pool
    [line] = [r.getMessage() for r in caplog.records if "the other episode's tool hangs" in r.getMessage()]
    assert re.match(r"rollout: task tests\.episode_envs:make: episode h\.[01] \(turn 1\) failed \(prompt '.*'\): "
                    r"Echo\.turn raised RuntimeError: the other episode's tool hangs \(at tests/episode_envs\.py:\d+ "
                    r"in _one_hangs\); its group is dropped "
                    r"\(1 failed so far, \d+ scored\)\nTraceback \(most recent call last\):", line), line


def test_a_single_turn_group_is_one_request_scored_at_once_and_resumed_from_its_journal(engine, tmp_path) -> None:
    """A single-turn task's group is a one-turn episode each: one request of n = K, its K
    replies scored by one ``Task.score`` call, tagged across a commit. When the engine
    process stops, the next one scores again a group whose replies came back (nothing sampled
    again) and samples anew one that was decoding."""
    journal = tmp_path / "episodes-e0.journal"
    d = Driver(engine, journal, episodic=False, name="tests.episode_envs:make_single", options={})
    d.rollout.resume()
    rng = __import__("random").Random(5)
    d.start("s1", Prompt(_text(rng)))
    d.run(until=lambda: d.steps == 2)
    d.start("s2", Prompt(_text(rng)))
    assert sorted(d.requests) == ["s1.*.0", "s2.*.0"]  # a request per group, each of n = K
    d.run(until=lambda: "s1.*.0" not in d.requests)
    sampled = [list(e.token_ids) for e in d.rollout.groups["s1"].episodes]
    assert (all(len(ids) == 6 for ids in sampled)
            and not any(d.rollout.groups["s2"].episodes[k].token_ids for k in (0, 1)))
    d._abort(list(d.requests))  # the process dies with s1's scoring call and s2's request
    d.rollout.pool.close()
    d.rollout.journal.close()

    d2 = Driver(engine, journal, episodic=False, name="tests.episode_envs:make_single", options={})
    version, pushes = max(engine["versions"]) + 1, []
    try:
        d2.rollout.resume()
        assert sorted(d2.requests) == ["s2.*.0"]  # s1 is being scored again, from its journaled replies
        d2.run(on_step=lambda: pushes or pushes.append(push_until_pending(engine, version)))
    finally:
        d2.rollout.close()
    pushes[0].join(WAIT_S)
    c = d2.rollout.counts
    assert c == {"started": 4, "finished": 4, "failed": 0, "dropped": 0, "shipped": 4, "groups_scored": 2,
                 "groups_failed": 0, "resumed": 4, "turns_cancelled": 0}, c
    groups = {g.group_id: g for g in d2.groups}
    assert sorted(groups) == ["s1", "s2"] and [s.token_ids for s in groups["s1"].samples] == sampled
    ref = Reference(engine["model_dir"], "float32")
    weights = lambda label: engine["versions"][int(label)]  # noqa: E731
    spans = set()
    for s in (s for g in groups.values() for s in g.samples):
        assert s.reward == len(set(s.token_ids)) + 2 / 1000 and s.observation == [] and len(s.token_ids) == 6
        labels = [str(v) for v in s.versions]
        want = replay(ref, weights, s.prompt_ids, s.token_ids, labels, labels[0])
        assert float((torch.tensor(s.logprobs, dtype=torch.float64) - want).abs().max()) < EXACT, s.sample_id
        spans.add(tuple(sorted(set(labels))))
    assert any(len(span) == 2 for span in spans), spans  # s2 was sampled across the commit


@pytest.mark.parametrize("on_restart", ["resume", "drop"])
def test_episodes_in_flight_when_their_engine_process_stops_are_resumed_or_dropped(engine, tmp_path, on_restart):
    """An engine process stops (a crash: no goodbye) with episodes between turns and mid-turn;
    the next process of the same engine finds them in the journal and resumes them, keeping
    every token, log-prob and tag sampled before, or drops them; the ledger counts them
    either way and goes on from the last process's totals."""
    journal = tmp_path / "episodes-e0.journal"
    d = Driver(engine, journal, episode={"on_restart": on_restart})
    d.rollout.resume()
    rng = __import__("random").Random(3)
    for gid in ("x", "y"):
        d.start(gid, Prompt(_text(rng)))
    d.run(until=lambda: any(rid.endswith(".1") for rid in d.requests) and d.steps % 2 == 0)
    before = {f"{gid}-{k}": list(e.token_ids) for gid, g in d.rollout.groups.items() for k, e in enumerate(g.episodes)}
    assert any(before.values()) and len(before) == 4
    d._abort(list(d.requests))  # the process dies: its requests and scoring processes with it, no journal records
    d.rollout.pool.close()
    d.rollout.journal.close()

    d2 = Driver(engine, journal, episode={"on_restart": on_restart})
    try:
        assert d2.rollout.counts["started"] == 4  # the ledger goes on from the journal
        d2.rollout.resume()
        d2.run()
    finally:
        d2.rollout.close()
    c = d2.rollout.counts
    assert c["started"] == 4 == c["finished"] + c["failed"] + c["dropped"], c
    if on_restart == "drop":
        assert c["dropped"] == 4 and c["resumed"] == 0 and not d2.groups, c
        return
    assert c["resumed"] == 4 and c["finished"] == 4 and sorted(g.group_id for g in d2.groups) == ["x", "y"], c
    ref = Reference(engine["model_dir"], "float32")
    weights = lambda label: engine["versions"][int(label)]  # noqa: E731
    for s in (s for g in d2.groups for s in g.samples):
        assert s.token_ids[: len(before[s.sample_id])] == before[s.sample_id]  # nothing sampled before was lost
        assert len(policy_runs(s)) == 3
        for a, b in policy_runs(s):
            context, labels = s.prompt_ids + s.token_ids[:a], [str(v) for v in s.versions[a:b]]
            want = replay(ref, weights, context, s.token_ids[a:b], labels, labels[0])
            assert float((torch.tensor(s.logprobs[a:b], dtype=torch.float64) - want).abs().max()) < EXACT
