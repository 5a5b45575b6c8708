"""The training entry point end to end: engine process, queue, in-flight pushes, outputs."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.trainer.config_files import config_from_dict, load_config
from inflight.trainer.metrics import after_first_commit
from inflight.trainer.train import train

SMALL = {
    "run": {"steps": 6, "seed": 3},
    "model": {"tiny": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}},
    "task": {"completion_tokens": 24},
    "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 2},
    "transport": {"bucket_mb": 0.05},
}


def test_training_run_end_to_end(tmp_path) -> None:
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "out_dir": str(tmp_path / "run")}})
    summary = train(cfg)
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["version"] for r in rows] == list(range(1, 7))
    for key in ("ratio_hist", "frac_truncated", "frac_masked_lag", "lag_hist", "ess", "kl_mu_pi", "entropy",
                "reward_mean", "queue_depth", "rejected", "dropped_stale"):
        assert key in rows[-1], key
    # every push was committed by the engine: the last row carries the last commit
    assert rows[-1]["pushed_version"] == 6 and rows[-1]["stall_ms"] > 0
    assert all(sum(r["ratio_hist"]) > 0 for r in rows)
    # the engine samples within loss.max_lag and the buffer admits no group the loss would mask whole
    assert all(r["tokens_in_loss"] > 0 and "push_wait_ms" in r for r in rows)
    # tokens came from several versions, some samples from more than one
    assert summary["max_versions_per_sample"] >= 2
    assert any(int(lag) > 0 for r in rows for lag in r["lag_hist"])
    # step 1 trained on samples decoded before any push: none spans; the share from the first
    # step a commit reached is over the steps from there on
    newest = [max(v for vs in r["versions_by_engine"].values() for v in vs) for r in rows]
    first = next(i for i, v in enumerate(newest) if v > 0)
    assert first >= 1 and rows[0]["frac_multi_version"] == 0.0
    assert summary["frac_samples_multi_version_after_first_commit"] == pytest.approx(
        sum(r["frac_multi_version"] for r in rows[first:]) / len(rows[first:]))
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6 and state["version"] == 6
    for name in ("model.safetensors", "optimizer/.metadata", "pending.msgpack", "tokenizer.json"):
        assert (out / "checkpoint" / name).exists(), name
    assert (out / "training.png").stat().st_size > 10_000
    assert json.loads((out / "summary.json").read_text()) == summary
    # the final model: a Hugging Face directory with its tokenizer, loaded as any other
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final, tok = (AutoModelForCausalLM.from_pretrained(out / "checkpoint"),
                  AutoTokenizer.from_pretrained(out / "checkpoint"))
    assert torch.isfinite(final(**tok("1 2 3", return_tensors="pt")).logits).all()


def test_config_errors_name_the_key(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ngroup_size = 1\n")
    with pytest.raises(ValueError, match=r"rollout: rollout.group_size=1: GRPO needs at least 2"):
        load_config(bad)
    bad.write_text("[loss.objective]\nname = 'sft'\n")
    with pytest.raises(ValueError,
                       match=r"loss.objective: loss.objective.name='sft' is not one of 'reinforce', 'ppo', "
                             r"'icepop', 'none'"):
        load_config(bad)
    bad.write_text("[loss]\nmax_lag = 0\n")
    with pytest.raises(ValueError, match=r"loss.max_lag=0 with rollout.mode='inflight'"):
        load_config(bad)
    bad.write_text("[engine]\nspeculative_tokens = 3\n[loss]\nrouting_replay = true\n")
    with pytest.raises(ValueError, match=r"engine.speculative_tokens=3 with loss.routing_replay"):
        load_config(bad)
    bad.write_text("[engine]\nspeculative_tokens = -1\n")
    with pytest.raises(ValueError, match=r"engine.speculative_tokens=-1 must be a whole number >= 0"):
        load_config(bad)
    bad.write_text("[optim]\nlearning_rate = 1\n")
    with pytest.raises(ValueError, match=r"optim: unknown key\(s\) \['learning_rate'\]"):
        load_config(bad)


def test_a_run_with_ngram_speculation_trains_on_its_tagged_samples(tmp_path) -> None:
    """``engine.speculative_tokens``: the engine speculates (n-gram lookup), every push commits
    and every step trains on samples tagged by version, as without speculation."""
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": 3, "out_dir": str(tmp_path / "run")},
                            "engine": {"speculative_tokens": 3}})
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3] and rows[-1]["pushed_version"] == 3
    assert all(r["tokens_in_loss"] > 0 and sum(r["ratio_hist"]) > 0 for r in rows)
    assert summary["max_versions_per_sample"] >= 1
    # the engine's speculation in the training metrics, one entry per version that verified drafts
    # (the tiny policy's samples at temperature 1 seldom repeat, so n-gram drafts are seldom accepted)
    assert all(0 <= r["spec_acceptance"] <= 1 and r["spec_tokens_per_step"] >= 1 for r in rows), rows
    assert "0" in rows[-1]["spec_by_version"] and set(rows[-1]["spec_by_version"]) <= {"0", "1", "2", "3"}
    assert "draft_loss" not in rows[-1]


def test_a_run_with_a_draft_model_distills_it_and_pushes_it_with_the_policy(tmp_path) -> None:
    """``draft.layers``: the engines speculate with a one-layer draft cut from the policy; the
    trainer distills it on each batch (``draft_loss`` falls over the run on the tiny task) and
    every push carries it, so the engine verifies its drafts under each version it commits."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": 4, "out_dir": str(out)},
                            "rollout": {**SMALL["rollout"], "temperature": 0.25},  # sharp: drafts are accepted
                            "draft": {"layers": 1, "learning_rate": 3e-3, "steps_per_update": 2}})
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # every push landed: the engine refuses an update that lacks the draft's tensors
    assert [r["version"] for r in rows] == [1, 2, 3, 4] and rows[-1]["pushed_version"] == 4
    assert all(r["tokens_in_loss"] > 0 and r["draft_loss"] > 0 and 0 <= r["draft_top1"] <= 1 for r in rows)
    assert all(r["draft_loss_last"] < r["draft_loss"] for r in rows)  # each batch: distillation lowers its loss
    # a draft proposes at every decode step, so every version that sampled a trained token verified
    # drafts before its group shipped, and the last row's tally (the engine's newest) holds it
    by_version = rows[-1]["spec_by_version"]
    sampled = {str(v) for r in rows for vs in r["versions_by_engine"].values() for v in vs}
    assert "0" in sampled and sampled <= set(by_version), (sampled, by_version)
    assert by_version["0"][1] > 1.05 and all(0 < a <= 1 for a, _ in by_version.values()), by_version
    init, last = load_file(str(out / "draft_init" / "model.safetensors")), load_file(
        str(out / "checkpoint" / "draft" / "model.safetensors"))
    assert sorted(init) == sorted(last) and any(not torch.equal(init[n], last[n]) for n in init)  # it trained
    assert (out / "checkpoint" / "draft" / "optimizer.pt").exists()


def test_batch_mode_samples_each_step_from_one_version(tmp_path) -> None:
    """The synchronous baseline: every sample of step k was drawn entirely by version k-1.
    Sampled with top-k and top-p, which the trainer mirrors: the policy it trains is the one
    that sampled, so (nearly) every importance ratio is 1. The pushes are sparse after the
    first (``transport.encoding``): a wrongly rebuilt weight would move the ratios too."""
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": 4, "out_dir": str(tmp_path / "run")},
                            "rollout": {**SMALL["rollout"], "mode": "batch", "top_k": 20, "top_p": 0.9},
                            "transport": {**SMALL["transport"], "encoding": "sparse"}})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:  # trained at version v = step - 1 on samples of exactly that version
        assert r["lag_hist"] == {"0": r["tokens"]} and r["frac_multi_version"] == 0.0
        assert r["rejected"] == {}  # no sampling_mismatch: the groups report the filters the trainer applies
    # ratios in [0.95, 1.05): a token whose top-p cut the two implementations place apart may leave it
    centre = sum(r["ratio_hist"][3] for r in rows) / sum(sum(r["ratio_hist"]) for r in rows)
    assert centre >= 0.98, [r["ratio_hist"] for r in rows]
    pushes = [r for r in rows if r.get("dense_mb")]
    assert pushes[0]["changed_frac"] is None and pushes[0]["sent_mb"] == pushes[0]["dense_mb"]  # no base yet: dense
    assert len(pushes) >= 3 and all(0 < r["changed_frac"] <= 1 and r["sent_mb"] < r["dense_mb"]
                                    for r in pushes[1:]), pushes


def test_placement_splits_gpus_and_never_puts_nccl_on_one_device() -> None:
    from inflight.trainer.fleet import Placement, place

    assert place("auto", spawn=True, gpus=[]) == Placement(backend="gloo", engine_devices=None)
    # one GPU, shared: NCCL cannot connect two ranks on it
    assert place("auto", spawn=True, gpus=["3"]) == Placement(backend="gloo", engine_devices=None)
    with pytest.raises(ValueError, match=r"needs the engine on a GPU of its own, and only one GPU \(3\)"):
        place("nccl", spawn=True, gpus=["3"])
    with pytest.raises(ValueError, match="no GPU is visible"):
        place("nccl", spawn=False, gpus=[])
    # the trainer keeps the first visible GPU, a spawned engine gets the rest, in order
    assert place("auto", spawn=True, gpus=["2", "5", "7"]) == Placement(backend="nccl", engine_devices="5,7")
    assert place("gloo", spawn=True, gpus=["0", "1"]) == Placement(backend="gloo", engine_devices="1")
    # an engine on another machine keeps its own GPUs
    assert place("auto", spawn=False, gpus=["0"]) == Placement(backend="nccl", engine_devices=None)
    with pytest.raises(ValueError, match="transport.backend='ib' is not one of 'auto', 'gloo', 'nccl'"):
        config_from_dict({"transport": {"backend": "ib"}})  # refused where the setting is read, once


FAULTY_TASK = '''
import math, pathlib, time
from inflight.trainer.envs import build_task
from inflight.trainer.tasks import Task


class Faulty(Task):
    """repeat_digit, except that its scoring raises once, returns NaN once and hangs once (each
    fault marked by a file in ``marks``: a replaced scoring process does not repeat it). Every
    call after the hang waits until the engine's log names its timeout (an event: the pool's
    kill), so the run cannot reach its last step before the hang is named."""

    def __init__(self, tokenizer, marks, log):
        from inflight.trainer.envs.digits import RepeatDigit
        self.inner, self.marks = RepeatDigit(tokenizer, 24, 0.5), pathlib.Path(marks)
        self.log = pathlib.Path(log)

    def sample(self, rng):
        return self.inner.sample(rng)

    def eval_prompts(self, n):
        return self.inner.eval_prompts(n)

    def _first(self, fault):
        mark = self.marks / fault
        if mark.exists():
            return False
        mark.write_text("")
        return True

    def score(self, prompts, completions):
        if self._first("raise"):
            raise ValueError("the verifier's sandbox refused this program")
        if self._first("nan"):
            return [math.nan] * len(completions)
        if self._first("hang"):
            time.sleep(3600)
        while "timeout_s=5" not in self.log.read_text():
            time.sleep(0.01)
        return self.inner.score(prompts, completions)


def make(tokenizer, marks, log):
    return Faulty(tokenizer, marks, log)
'''


def test_a_verifier_that_raises_returns_nan_or_hangs_fails_its_group_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    """Scoring runs in the engine's scoring processes (``inflight.trainer.rollout.episode_rollout``): each fault
    fails its group alone, named in the engine's log with the task and the group; the engine
    decodes on and the run reaches its last step."""
    (tmp_path / "faulty_task_39.py").write_text(FAULTY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "marks").mkdir()
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": 4, "out_dir": str(tmp_path / "run")},
                            "task": {**SMALL["task"], "name": "faulty_task_39:make",
                                     "options": {"marks": str(tmp_path / "marks"),
                                                 "log": str(tmp_path / "run" / "engine0.log")},
                                     "scoring": {"timeout_s": 5.0}}})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "marks").iterdir()) == ["hang", "nan", "raise"]
    log = (tmp_path / "run" / "engine0.log").read_text()
    for error in ("Faulty.score raised ValueError: the verifier's sandbox refused this program", "reward [0] is nan",
                  "timeout_s=5"):
        assert "task faulty_task_39:make failed to score group" in log and error in log, error


def test_a_multi_turn_task_trains_on_whole_episodes(tmp_path) -> None:
    """``tests.episode_envs:make`` (3 turns, a tool's answer between them) through the training
    loop: every sample is an episode whose environment tokens are masked from the loss, the
    engine's episode ledger reaches the metrics and balances with what was trained on, and
    greedy evaluation plays whole episodes."""
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": 3, "out_dir": str(tmp_path / "run")},
                            "task": {"name": "tests.episode_envs:make", "completion_tokens": 6,
                                     "options": {"turns": 3, "prompt_chars": 40}},
                            "eval": {"every": 3, "prompts": 4}})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    last = steps[-1]
    assert last["rollout_groups_trained"] == 3 * SMALL["rollout"]["groups_per_step"]
    assert last["rollout_episodes_trained"] == last["rollout_groups_trained"] * SMALL["rollout"]["group_size"]
    assert last["rollout_episodes_trained"] <= last["rollout_episodes_shipped"] <= last["rollout_episodes_finished"]
    assert last["rollout_episodes_failed"] == last["rollout_episodes_dropped"] == last["rollout_groups_failed"] == 0
    # 3 turns of 6 tokens each, and the environment's (" obs 1 ", " ids 2 ") between them: 18 in the loss
    assert all(r["tokens_in_loss"] <= 18 * 8 for r in steps)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(r["eval_prompts"] == 4 for r in evals)
    # every sample trained on is in samples.jsonl, its completion the whole episode
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [g["group_id"] for g in logged] == [gid for r in steps for gid in r["group_ids"]]
    assert all(len(g["samples"]) == SMALL["rollout"]["group_size"] and "[ obs 1 ]" in s["completion"]
               for g in logged for s in g["samples"])
    # the environment's answers, the second given as token ids, read back as text in the transcript
    assert all(e["completion"].count("[ obs 1 ]") == e["completion"].count("[ ids 2 ]") == 1
               for e in evals[-1]["eval_examples"]), evals[-1]["eval_examples"]


def test_the_steps_before_a_commit_reached_are_left_out_of_the_spanning_share() -> None:
    """By hand, and on a resumed run (its first version is not 1): the steps whose samples carry
    only versions from before the run's first push are left out, and none after them."""
    def row(version: int, tags: list[int]) -> dict:
        return {"version": version, "versions_by_engine": {"e0": tags}}

    rows = [row(1, [0]), row(2, [0]), row(3, [0, 1]), row(4, [0]), row(5, [2, 3])]
    assert after_first_commit(rows) == rows[2:]  # step 4 (tags [0]) stays: a commit had reached the engine
    resumed = [row(11, [9, 10]), row(12, [10]), row(13, [10, 11])]
    assert after_first_commit(resumed) == resumed[2:]
    assert after_first_commit([row(1, [0])]) == [] and after_first_commit([]) == []
