"""The training loop's draft model (``inflight.trainer.draft``) and the speculation metrics
(``inflight.trainer.metrics.SpeculationTally``), against pure torch and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.protocol import RolloutGroup, RolloutSample, VersionSpecStats
from inflight.trainer.config_files import config_from_dict
from inflight.trainer.draft import DraftTrainer, completion_batch, draft_dir, truncated_draft, write_initial_draft
from inflight.trainer.metrics import SpeculationTally
from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("policy") / "m", default_corpus(), TinyModelConfig(num_layers=3))


def _sample(i: int, prompt: list[int], tokens: list[int], observation: list[bool] = ()) -> RolloutSample:
    return RolloutSample(sample_id=f"s{i}", group_id="g", prompt_ids=prompt, token_ids=tokens,
                         logprobs=[-1.0] * len(tokens), versions=[0] * len(tokens), reward=0.0,
                         observation=list(observation))


def _groups() -> list[RolloutGroup]:
    return [RolloutGroup(group_id="g", samples=(_sample(0, [5, 6, 7], [8, 9]),
                                                _sample(1, [5, 6], [10, 11, 12, 13], [False, True, True, False])))]


def test_a_truncated_draft_is_the_policy_run_through_its_first_layers(policy_dir) -> None:
    """Embeddings, the first layer, the final norm and the head, exactly the policy's: the
    draft's logits equal the policy's own with its later layers removed."""
    draft = truncated_draft(policy_dir, 1)
    reference = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    reference.model.layers = reference.model.layers[:1]
    reference.config.num_hidden_layers = 1
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    with torch.no_grad():
        assert torch.equal(draft(input_ids=ids).logits, reference(input_ids=ids).logits)
        full = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
        assert not torch.allclose(draft(input_ids=ids).logits, full(input_ids=ids).logits, atol=1e-3)
    assert draft.config.num_hidden_layers == 1
    for layers in (0, 3):
        with pytest.raises(ValueError, match=rf"draft.layers={layers}: the policy has 3 decoder layers"):
            truncated_draft(policy_dir, layers)


def test_the_completion_batch_labels_only_the_policys_sampled_tokens() -> None:
    ids, mask, labels = completion_batch(_groups())
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 10, 11, 12, 13]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, -100, 8, 9, -100], [-100, -100, 10, -100, -100, 13]]


def _reference_loss(model: torch.nn.Module, groups: list[RolloutGroup]) -> float:
    """Mean cross-entropy of each policy-sampled completion token given everything before it,
    one sample at a time, unpadded."""
    losses = []
    for s in (s for g in groups for s in g.samples):
        seq = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), -1)
        for k, token in enumerate(s.token_ids):
            if not (s.observation and s.observation[k]):
                losses.append(-float(logp[len(s.prompt_ids) + k - 1, token]))
    return sum(losses) / len(losses)


def test_the_draft_distills_on_the_sampled_tokens_and_keeps_its_state(policy_dir, tmp_path) -> None:
    cfg = config_from_dict({"run": {"out_dir": str(tmp_path / "run")},
                            "draft": {"layers": 1, "learning_rate": 1e-2, "steps_per_update": 3}})
    start = write_initial_draft(cfg, policy_dir)
    assert start == tmp_path / "run" / "draft_init" and draft_dir(cfg, policy_dir) == start
    drafter = DraftTrainer(cfg, start)
    before = _reference_loss(drafter.model, _groups())
    metrics = drafter.step(_groups())
    assert metrics["draft_loss"] == pytest.approx(before, abs=1e-5)  # measured before it trains on the batch
    assert metrics["draft_loss_last"] < metrics["draft_loss"]  # the last of 3 steps' losses, before that step
    after = _reference_loss(drafter.model, _groups())
    assert after < metrics["draft_loss_last"]
    pushed = drafter.weights()
    assert sorted(pushed) == sorted(f"draft.{n}" for n, _ in drafter.model.named_parameters())
    # a checkpoint's draft: weights and optimizer state go on where they were
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "draft").mkdir(parents=True)
    drafter.save(checkpoint / "draft")
    (checkpoint / "state.json").write_text("{}")
    assert draft_dir(cfg, checkpoint) == checkpoint / "draft"
    again = DraftTrainer(cfg, checkpoint / "draft")
    assert all(torch.equal(t, again.weights()[n]) for n, t in pushed.items())
    assert again.optimizer.state_dict()["state"][0]["step"] == 3
    frozen = DraftTrainer(config_from_dict({"run": {"out_dir": str(tmp_path / "run")},
                                            "draft": {"layers": 1, "train": False}}), start)
    fixed = {n: t.clone() for n, t in frozen.weights().items()}
    assert set(frozen.step(_groups())) == {"draft_loss", "draft_top1"}
    assert all(torch.equal(t, frozen.weights()[n]) for n, t in fixed.items())


def test_a_draft_of_another_vocabulary_is_refused_by_name(policy_dir, tmp_path) -> None:
    other = build_tiny_model(tmp_path / "other", default_corpus()[:40], TinyModelConfig(num_layers=1))
    cfg = config_from_dict({"run": {"out_dir": str(tmp_path / "run")}, "draft": {"path": str(other)}})
    ours = AutoModelForCausalLM.from_pretrained(str(policy_dir)).config.vocab_size
    theirs = AutoModelForCausalLM.from_pretrained(str(other)).config.vocab_size
    assert ours != theirs
    with pytest.raises(ValueError, match=rf"a vocabulary of {theirs} tokens, the policy's has {ours}"):
        write_initial_draft(cfg, policy_dir)


@pytest.mark.parametrize(("section", "message"), [
    ({"engine": {"speculative_tokens": 2}}, r"engine.speculative_tokens=2 \(n-gram lookup\) with a draft model"),
    ({"engine": {"tensor_parallel_size": 2}}, r"engine.tensor_parallel_size=2 with a draft model"),
    ({"engine": {"commit_unit": "layer"}}, r"engine.commit_unit='layer' with a draft model"),
    ({"transport": {"encoding": "sparse"}}, r"transport.encoding='sparse' with a draft model"),
    ({"model": {"lora": {"rank": 8}}}, r"model.lora.rank=8 with a draft model"),
    ({"rollout": {"mode": "pause"}}, r"rollout.mode='pause' with a draft model"),
])
def test_settings_a_draft_does_not_cover_are_refused_by_name(section, message) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict({"draft": {"layers": 1}, **section})
    with pytest.raises(ValueError, match=r"draft.path='d' and draft.layers=1: name one draft"):
        config_from_dict({"draft": {"layers": 1, "path": "d"}})


def _group(engine: str, *stats: tuple[int, int, int, int, int]) -> RolloutGroup:
    return RolloutGroup(group_id="g", samples=(), engine_id=engine,
                        engine_spec=tuple(VersionSpecStats(version=v, steps=s, emitted=e, drafted=d, accepted=a)
                                          for v, s, e, d, a in stats))


def test_speculation_metrics_sum_each_engines_latest_tallies_by_version() -> None:
    tally = SpeculationTally()
    assert tally.update([_group("e0")]) == {}  # no speculation: no metrics
    tally.update([_group("e0", (0, 10, 18, 30, 8))])
    row = tally.update([_group("e0", (0, 10, 18, 30, 8), (1, 4, 10, 12, 6)),  # e0's newer tally replaces its older
                        _group("e1", (1, 6, 9, 18, 3), (2, 0, 0, 0, 0))])  # v2: nothing verified yet
    assert row["spec_by_version"] == {"0": [round(8 / 30, 4), 1.8], "1": [0.3, 1.9]}
    assert row["spec_acceptance"] == pytest.approx(9 / 30) and row["spec_tokens_per_step"] == pytest.approx(19 / 10)
