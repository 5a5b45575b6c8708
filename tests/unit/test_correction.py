"""Sequence-level objectives, correction masks and their metrics against values computed by hand.

One batch for all of them (``_batch``): trainer version 5, max_lag 2, pi = 0.5 on every token,
log-ratios l = log pi - mu chosen so the per-sample means are round numbers:

    sample 0: versions [4, 4, 5, 5]     lags [1, 1, 0, 0]   l = [0.4, 0.2, -0.2, 0.4]   A = +1
    sample 1: versions [2, 4, 5, pad]   lags [3, 1, 0, -]   l = [-5, 0.1, -0.5, -9]     A = -2
    sample 2: versions [5, 5, pad, pad] lags [0, 0, -, -]   l = [-1.0, 0.2, -9, -9]     A = 0.5

Token (1, 0) is lag-masked, so over the kept tokens the samples' mean log-ratios are 0.2, -0.2,
-0.4 (s_i = e^0.2, e^-0.2, e^-0.4) and their sums 0.8, -0.4, -0.8. Padding carries l = -9 (a
catastrophic ratio): any leak of padding into a mean, a veto or a metric changes the numbers.
N = 9 real tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.trainer.correction import m2po_keep
from inflight.trainer.loss import Batch, compute_loss
from inflight.trainer.loss_config import LossConfig, ObjectiveConfig
from inflight.trainer.metrics import ess_warning

LOG_HALF = math.log(0.5)
S = [math.exp(0.2), math.exp(-0.2), math.exp(-0.4)]
A = [1.0, -2.0, 0.5]
KEPT = [[1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0]]  # real and lag <= 2


def _batch() -> tuple[Batch, torch.Tensor]:
    log_r = torch.tensor([[0.4, 0.2, -0.2, 0.4], [-5.0, 0.1, -0.5, -9.0], [-1.0, 0.2, -9.0, -9.0]])
    logp = torch.full((3, 4), LOG_HALF)
    batch = Batch(
        input_ids=torch.zeros(3, 5, dtype=torch.long), attention_mask=torch.ones(3, 5, dtype=torch.long),
        position_ids=torch.zeros(3, 5, dtype=torch.long), completion_ids=torch.zeros(3, 4, dtype=torch.long),
        completion_mask=torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]),
        behaviour_logp=logp - log_r, versions=torch.tensor([[4, 4, 5, 5], [2, 4, 5, 5], [5, 5, 5, 5]]),
        rewards=torch.zeros(3), advantages=torch.tensor(A),
    )
    return batch, logp


def _run(impl: str = "reference", **cfg) -> tuple[torch.Tensor, torch.Tensor, dict]:
    batch, logp0 = _batch()
    logp = logp0.clone().requires_grad_()
    loss, m = compute_loss(logp, torch.zeros(3, 4), batch, version=5, cfg=LossConfig(max_lag=2, **cfg), impl=impl)
    loss.backward()
    return loss.detach(), logp.grad, m


def _grad(per_token: list[list[float]]) -> torch.Tensor:
    return torch.tensor(per_token) / 9


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_gspo_sequence_ratio_clip_by_hand(impl: str) -> None:
    loss, grad, m = _run(impl, level="sequence", objective=ObjectiveConfig(name="ppo", clip_low=0.2, clip_high=0.1))
    # sample 0: s = 1.221 > 1.1, A > 0: clipped, -1.1 per kept token, no gradient
    # sample 1: s = 0.819 inside [0.8, 1.1]: -s A = 2 s per token; d/dlogp_t = -A s n_i/(N n_i) = 2 s / 9
    # sample 2: s = 0.670 < 0.8, A > 0: min picks the unclipped s A: -0.5 s per token, grad -0.5 s / 9
    assert float(loss) == pytest.approx((4 * -1.1 + 2 * 2 * S[1] + 2 * -0.5 * S[2]) / 9, abs=1e-6)
    torch.testing.assert_close(grad, _grad([[0, 0, 0, 0], [0, 2 * S[1], 2 * S[1], 0],
                                            [-0.5 * S[2], -0.5 * S[2], 0, 0]]), atol=1e-7, rtol=0)
    assert m["frac_truncated_high"] == pytest.approx(4 / 8) and m["frac_truncated_low"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_seq_tis_truncates_the_sequence_ratio(impl: str) -> None:
    loss, grad, m = _run(impl, level="sequence", objective=ObjectiveConfig(truncation=1.1))
    w = [1.1, S[1], S[2]]  # min(s_i, C), the same on every token of a sample
    assert float(loss) == pytest.approx(-LOG_HALF * (4 * w[0] * A[0] + 2 * w[1] * A[1] + 2 * w[2] * A[2]) / 9, abs=1e-6)
    want = [[-w[i] * A[i] * k for k in KEPT[i]] for i in range(3)]
    torch.testing.assert_close(grad, _grad(want), atol=1e-7, rtol=0)
    assert m["frac_truncated_high"] == pytest.approx(4 / 8)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_lag_aware_truncation_token_level(impl: str) -> None:
    # C_t = 2 * 0.5 ** lag_t: sample 0 [1, 1, 2, 2], sample 1 [-, 1, 2], sample 2 [2, 2]
    loss, grad, m = _run(impl, objective=ObjectiveConfig(truncation=2.0, lag_decay=0.5))
    w = [[1.0, 1.0, math.exp(-0.2), math.exp(0.4)], [0, 1.0, math.exp(-0.5), 0], [math.exp(-1.0), math.exp(0.2), 0, 0]]
    want = [[-w[i][t] * A[i] * KEPT[i][t] for t in range(4)] for i in range(3)]
    torch.testing.assert_close(grad, _grad(want), atol=1e-7, rtol=0)
    assert float(loss) == pytest.approx(LOG_HALF * float(_grad(want).sum()), abs=1e-6)
    assert m["frac_truncated_high"] == pytest.approx(3 / 8)  # e^0.4, e^0.2, e^0.1 > 1 at lag 1


def test_lag_aware_truncation_sequence_level_uses_the_oldest_kept_token() -> None:
    # lag_i = max kept lag: [1, 1, 0] -> C_i = [1, 1, 2]; w = [1, s1, s2]
    _, grad, _ = _run(level="sequence", objective=ObjectiveConfig(truncation=2.0, lag_decay=0.5))
    w = [1.0, S[1], S[2]]
    torch.testing.assert_close(grad, _grad([[-w[i] * A[i] * k for k in KEPT[i]] for i in range(3)]), atol=1e-7, rtol=0)


def test_m2po_greedy_mask_by_hand() -> None:
    # kept q = l^2: [.16 .04 .04 .16 | .01 .25 | 1 .04], mean .2125 > .05: drop 1 (mean .1),
    # .25 (.075), .16 (.058), .16 (.0325 <= .05): four tokens go
    loss, grad, m = _run(objective=ObjectiveConfig(name="none"), m2_threshold=0.05)
    kept = [[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0]]
    want = [[-A[i] * kept[i][t] for t in range(4)] for i in range(3)]
    torch.testing.assert_close(grad, _grad(want), atol=1e-7, rtol=0)
    assert float(loss) == pytest.approx(-LOG_HALF * (2 * 1.0 - 2.0 + 0.5) / 9, abs=1e-6)
    assert m["frac_masked_m2po"] == pytest.approx(4 / 9) and m["frac_masked"] == pytest.approx(5 / 9)
    assert m["tokens_in_loss"] == 4


def test_m2po_keeps_everything_under_the_threshold_and_can_drop_all() -> None:
    log_r = torch.tensor([[0.1, -0.2, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the masked 3.0 never counts
    assert m2po_keep(log_r, mask, 0.026).tolist() == [[1.0, 1.0, 0.0]]  # mean (.01 + .04) / 2 = .025
    assert m2po_keep(log_r, mask, 0.02).tolist() == [[1.0, 0.0, 0.0]]
    assert m2po_keep(torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 0.1).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("kind, low, high, kept_samples", [
    ("product", 0.5, 2.0, [1]),          # e^0.8 = 2.23 and e^-0.8 = 0.45 leave [0.5, 2]
    ("geometric", 0.75, 1.25, [0, 1]),   # e^0.2, e^-0.2 inside; e^-0.4 = 0.67 outside
])
def test_seq_mis_masks_whole_samples(kind: str, low: float, high: float, kept_samples: list[int]) -> None:
    loss, grad, m = _run(objective=ObjectiveConfig(name="none"), seq_mask=kind, seq_mask_low=low, seq_mask_high=high)
    want = [[-A[i] * KEPT[i][t] * (i in kept_samples) for t in range(4)] for i in range(3)]
    torch.testing.assert_close(grad, _grad(want), atol=1e-7, rtol=0)
    dropped = sum(sum(KEPT[i]) for i in range(3) if i not in kept_samples)
    assert m["frac_masked_seq"] == pytest.approx(dropped / 9)
    assert m["frac_seq_masked"] == pytest.approx((3 - len(kept_samples)) / 3)


def test_veto_drops_samples_with_a_catastrophic_kept_token() -> None:
    # r = e^-1 = 0.37 < 0.4 in sample 2; sample 1's e^-5 is lag-masked and its padding e^-9 is not
    # a token, so sample 1 stays
    _, grad, m = _run(objective=ObjectiveConfig(name="none"), veto=True, veto_threshold=0.4)
    want = [[-A[i] * KEPT[i][t] * (i != 2) for t in range(4)] for i in range(3)]
    torch.testing.assert_close(grad, _grad(want), atol=1e-7, rtol=0)
    assert m["frac_masked_veto"] == pytest.approx(2 / 9) and m["frac_seq_vetoed"] == pytest.approx(1 / 3)
    assert m["catastrophic"] == pytest.approx(1 / 8)


def test_metrics_by_hand() -> None:
    _, _, m = _run(objective=ObjectiveConfig(truncation=1.3), veto_threshold=0.4)
    log_r = [0.4, 0.2, -0.2, 0.4, 0.1, -0.5, -1.0, 0.2]  # the kept tokens
    r = [math.exp(x) for x in log_r]
    mean = sum(r) / 8
    assert m["ratio_mean"] == pytest.approx(mean)
    assert m["ratio_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in r) / 8))
    assert m["chi2_token"] == pytest.approx(sum(x * x for x in r) / 8 - 1)
    assert m["kl_mu_pi"] == pytest.approx(sum(x - 1 - y for x, y in zip(r, log_r)) / 8)
    assert m["chi2_seq"] == pytest.approx((math.exp(1.6) + math.exp(-0.8) + math.exp(-1.6)) / 3 - 1)
    assert m["ppl_ratio"] == pytest.approx((math.exp(-0.2) + math.exp(0.2) + math.exp(0.4)) / 3)
    w = [min(x, 1.3) for x in r]
    assert m["ess"] == pytest.approx(sum(w) ** 2 / (8 * sum(x * x for x in w)))
    assert m["ess_ratio"] == pytest.approx(sum(r) ** 2 / (8 * sum(x * x for x in r)))
    assert m["frac_truncated_high"] == pytest.approx(2 / 8) and m["frac_truncated_low"] == 0.0
    assert m["frac_truncated"] == pytest.approx(2 / 8)
    assert m["catastrophic"] == pytest.approx(1 / 8)
    assert m["frac_masked"] == pytest.approx(1 / 9) and m["frac_masked_lag"] == pytest.approx(1 / 9)
    assert m["frac_seq_masked"] == 0.0 and m["tokens"] == 9
    assert m["seq_ratio_mean"] == pytest.approx(sum(S) / 3)
    # per lag bucket, over every real token (the lag-masked one too); samples by their oldest token
    by = m["by_lag"]
    assert set(by) == {"0", "1", "3-4"}
    assert by["1"]["tokens"] == 3 and by["1"]["ratio_mean"] == pytest.approx(sum(map(math.exp, [0.4, 0.2, 0.1])) / 3)
    assert by["1"]["frac_truncated_high"] == pytest.approx(1 / 3)
    assert by["3-4"] | {} == by["3-4"] and by["3-4"]["tokens"] == 1
    assert by["3-4"]["ratio_mean"] == pytest.approx(math.exp(-5)) and by["3-4"]["catastrophic"] == 1.0
    assert by["3-4"]["frac_masked"] == 1.0 and by["3-4"]["ess"] == 0.0
    assert by["3-4"]["seqs"] == 1 and by["3-4"]["chi2_seq"] == pytest.approx(math.exp(-10.8) - 1)
    assert by["3-4"]["ppl_ratio"] == pytest.approx(math.exp(1.8)) and by["3-4"]["frac_seq_masked"] == 0.0
    assert by["0"]["tokens"] == 5 and by["0"]["seqs"] == 1  # sample 2 only; its chi2 e^{2(-0.8)} - 1
    assert by["0"]["chi2_seq"] == pytest.approx(math.exp(-1.6) - 1)


def test_ess_warning() -> None:
    _, _, m = _run(objective=ObjectiveConfig(truncation=1.3))
    assert ess_warning(m, 0.3) is None
    msg = ess_warning({**m, "ess": 0.2}, 0.3)
    assert msg is not None and msg.startswith("ESS 0.20 < 0.3")
    assert m["ess_low"] is False and _run(objective=ObjectiveConfig(truncation=1.3), ess_warn=1.0)[2]["ess_low"] is True


@pytest.mark.parametrize("field, value, match", [
    ("level", "group", r"loss.level='group' is not one of 'token', 'sequence'"),
    ("seq_mask", "arith", r"loss.seq_mask='arith' is not one of 'off', 'geometric', 'product'"),
    ("seq_mask_low", 3.0, r"loss.seq_mask=\(3.0, 2.0\) needs 0 <= low < high"),
    ("veto_threshold", 0.0, r"loss.veto_threshold=0.0 must be in \(0, 1\)"),
    ("m2_threshold", -1.0, r"loss.m2_threshold=-1.0 must be >= 0"),
    ("ess_warn", 1.5, r"loss.ess_warn=1.5 must be in \[0, 1\]"),
])
def test_config_rejects_bad_values(field: str, value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossConfig(**{field: value})
    with pytest.raises(ValueError, match=r"loss.objective.lag_decay=0.0 must be in \(0, 1\]"):
        ObjectiveConfig(lag_decay=0.0)
