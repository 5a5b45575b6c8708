"""Per-step metrics: a JSONL log, a PNG of reward, lag and stall over steps, a summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from inflight.protocol import VersionSpecStats
from inflight.trainer.trackers import Trackers


def _keep_samples(path: Path, through: int) -> None:
    """``samples.jsonl`` without the lines of steps after ``through``."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines(keepends=True)
                 if line.strip() and json.loads(line).get("step", 0) <= through]
        path.write_text("".join(lines))


class MetricsLog:
    """Appends one JSON object per step; ``rows`` keeps them for the plot and the summary; each
    row also goes to the run's experiment trackers (``inflight.trainer.trackers``), closed by ``close``."""

    def __init__(self, path: Path, *, append: bool = False, trackers: Trackers | None = None,
                 through: int | None = None) -> None:
        """``append``: go on after the rows there; ``through``: keeping only those of steps up to
        this one (a resume from that step's checkpoint: the steps a crashed run wrote after it
        are trained again, and must not appear twice)."""
        self.path = Path(path)
        self.trackers = trackers if trackers is not None else Trackers([])
        self.rows: list[dict[str, Any]] = []
        if append and self.path.exists():
            self.rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if through is not None:
                self.rows = [r for r in self.rows if r.get("step", 0) <= through]
                self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
                _keep_samples(self.path.with_name("samples.jsonl"), through)
        else:
            self.path.write_text("")
            self.path.with_name("samples.jsonl").write_text("")

    def write(self, row: dict[str, Any], groups: list | None = None) -> None:
        """Append ``row``; and ``groups``, the step's, to ``samples.jsonl`` (``samples``)."""
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.trackers.log(row)
        if groups:
            self.samples(row["step"], groups)

    def samples(self, step: int, groups: list) -> None:
        """Every sample trained on at ``step`` to ``samples.jsonl`` beside the metrics: one
        line per group, its prompt and each sample's completion, reward and versions."""
        with self.path.with_name("samples.jsonl").open("a") as f:
            for g in groups:
                f.write(json.dumps({"step": step, "group_id": g.group_id, "prompt": g.samples[0].prompt_text[-500:],
                                    "samples": [{"reward": s.reward, "versions": sorted(set(s.versions)),
                                                 "completion": s.completion_text} for s in g.samples]}) + "\n")

    def close(self) -> None:
        self.trackers.close()


class RolloutLedger:
    """The engines' rollout totals (``RolloutGroup.engine_ledger``, the latest of each engine,
    summed) beside what the trainer trained on: ``rollout/`` metrics of every step; with them
    the engines' speculation (``SpeculationTally``).

    Every total goes on across a resume: the engines keep theirs in the run directory
    (the episode journals, ``episodes-e<i>.journal``), this side's are in the checkpoint
    (``state``), and so is how many groups the queue carried before (``queue_base``)."""

    def __init__(self, resumed: Any = None) -> None:
        """``resumed``: the ``TrainerState`` a resumed run starts from (its ``ledger``), or None."""
        state = resumed.ledger if resumed is not None else {}
        self.latest: dict[str, dict[str, int]] = {e: dict(v) for e, v in state.get("latest", {}).items()}
        self.groups_trained = int(state.get("groups_trained", 0))
        self.episodes_trained = int(state.get("episodes_trained", 0))
        self.queue_base: dict[str, int] = dict(state.get("queue", {"put": 0, "read": 0}))
        self.speculation = SpeculationTally()  # the engines' speculative decoding, by version

    def state(self, queue: Any) -> dict:
        """What a checkpoint keeps; ``queue``: the run's ``RolloutQueue``."""
        return {"latest": self.latest, "groups_trained": self.groups_trained,
                "episodes_trained": self.episodes_trained, "queue": self.queue_totals(queue)}

    def queue_totals(self, queue: Any) -> dict[str, int]:
        """Slots claimed ("put") and read on the queue, over every process of the run."""
        return {"put": self.queue_base["put"] + queue.store.add("tail", 0),
                "read": self.queue_base["read"] + queue.store.add("head", 0)}

    def update(self, groups: list) -> dict[str, Any]:
        for g in groups:
            if g.engine_ledger:
                self.latest[g.engine_id] = dict(g.engine_ledger)
            self.groups_trained += 1
            if "episodes_started" in g.engine_ledger:
                self.episodes_trained += len(g.samples)
        totals: dict[str, int] = {}
        for ledger in self.latest.values():
            for k, v in ledger.items():
                totals[k] = totals.get(k, 0) + v
        out: dict[str, Any] = {f"rollout_{k}": v for k, v in sorted(totals.items())}
        out["rollout_groups_trained"] = self.groups_trained
        if "episodes_started" in totals:
            out["rollout_episodes_trained"] = self.episodes_trained
        return {**out, **self.speculation.update(groups)}


class SpeculationTally:
    """The engines' speculative decoding as metrics (``RolloutGroup.engine_spec``, the latest of
    each engine, summed over the engines by version): ``spec_acceptance`` and
    ``spec_tokens_per_step`` under the newest version that verified drafts (still counting: it
    is live), and ``spec_by_version``, each version's ``[acceptance, tokens per step]``: one
    entry per update. Empty without speculation."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[VersionSpecStats, ...]] = {}

    def update(self, groups: list) -> dict[str, Any]:
        for g in groups:
            if g.engine_spec:
                self.latest[g.engine_id] = g.engine_spec
        totals: dict[int, VersionSpecStats] = {}
        for s in (s for stats in self.latest.values() for s in stats):
            t = totals.get(s.version, VersionSpecStats(version=s.version))
            totals[s.version] = VersionSpecStats(version=s.version, steps=t.steps + s.steps,
                                                 emitted=t.emitted + s.emitted, drafted=t.drafted + s.drafted,
                                                 accepted=t.accepted + s.accepted)
        verified = [t for _, t in sorted(totals.items()) if t.drafted and t.steps]
        if not verified:
            return {}
        return {"spec_acceptance": verified[-1].acceptance, "spec_tokens_per_step": verified[-1].tokens_per_step,
                "spec_by_version": {str(t.version): [round(t.acceptance, 4), round(t.tokens_per_step, 4)]
                                    for t in verified}}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer steps' rows (row "step 0" holds only the evaluation before training)."""
    return [r for r in rows if "reward_mean" in r]


def after_first_commit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps from the first whose samples carry a version this run pushed: the steps before
    it trained only on samples decoded before any of its commits, which cannot span versions."""
    start = rows[0]["version"] - 1 if rows else 0
    first = next((i for i, r in enumerate(rows)
                  if max(v for vs in r["versions_by_engine"].values() for v in vs) > start), len(rows))
    return rows[first:]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward of the first vs the last 20% of steps, multi-version samples (over every step,
    and from the first step a commit of this run reached), stall per update, mean ESS, steps
    under ``loss.ess_warn``, mean fraction of tokens masked; with evaluation on, the first and
    last greedy accuracy and reward on the held-out prompts."""
    evals = [r for r in rows if "eval_accuracy" in r]
    rows = _train_rows(rows)
    n = len(rows)
    k = max(1, n // 5)
    stalls = [r["stall_ms"] for r in rows if r.get("stall_ms") is not None]
    return {
        "steps": n,
        "reward_first_20pct": _mean([r["reward_mean"] for r in rows[:k]]),
        "reward_last_20pct": _mean([r["reward_mean"] for r in rows[-k:]]),
        "frac_samples_multi_version": _mean([r["frac_multi_version"] for r in rows]),
        "frac_samples_multi_version_after_first_commit": _mean([r["frac_multi_version"]
                                                                for r in after_first_commit(rows)]),
        "max_versions_per_sample": max((r.get("max_versions_per_sample", 1) for r in rows), default=1),
        "hybrid_token_frac": _mean([r.get("hybrid_token_frac", 0.0) for r in rows]),
        "stall_ms_mean": _mean(stalls),
        "stall_ms_max": max(stalls, default=float("nan")),
        "lag_mean": _mean([r["lag_mean"] for r in rows]),
        "ess_mean": _mean([r["ess"] for r in rows]),
        "ess_low_steps": sum(bool(r.get("ess_low")) for r in rows),
        "frac_masked_mean": _mean([r.get("frac_masked", r["frac_masked_lag"]) for r in rows]),
        **step_time(rows),
        **({"eval_accuracy_first": evals[0]["eval_accuracy"], "eval_accuracy_last": evals[-1]["eval_accuracy"],
            "eval_reward_first": evals[0]["eval_reward"], "eval_reward_last": evals[-1]["eval_reward"],
            "eval_versions": [evals[0]["version"], evals[-1]["version"]], "eval_prompts": evals[-1]["eval_prompts"]}
           if evals else {}),
    }


STEP_PARTS = ("step_ms", "wait_ms", "forward_ms", "backward_ms", "reference_ms", "optimizer_ms", "push_wait_ms",
              "read_wait_ms")
"""Where a step's wall time goes (docs/training.md): ``wait_ms`` for rollouts, the trainer's
passes and optimizer, and what the push in flight held it (``push_wait_ms``, ``read_wait_ms``)."""


def step_time(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's medians of where each step went, the share of the run's step time spent
    waiting for rollouts (near 0: the loop is trainer-bound), throughput and peak memory."""
    rows = [r for r in rows if "forward_ms" in r]
    if not rows:
        return {}
    med = lambda key: statistics.median(r.get(key, 0.0) or 0.0 for r in rows)  # noqa: E731
    engine = [r["engine_tokens_per_s"] for r in rows if r.get("engine_tokens_per_s") is not None]
    return {**{f"{k}_median": med(k) for k in STEP_PARTS},
            "wait_share": sum(r["wait_ms"] for r in rows) / max(sum(r["step_ms"] for r in rows), 1e-9),
            "trainer_tokens_per_s_median": med("trainer_tokens_per_s"),
            "trainer_prompt_tokens_median": med("trainer_prompt_tokens"),
            "trainer_completion_tokens_median": med("trainer_completion_tokens"),
            "engine_tokens_per_s_median": statistics.median(engine) if engine else None,
            "peak_rss_gb_max": max(r.get("peak_rss_gb", 0.0) for r in rows)}


def plot_run(rows: list[dict[str, Any]], png: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evals = [r for r in rows if "eval_accuracy" in r]
    rows = _train_rows(rows)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    reward = [r["reward_mean"] for r in rows]
    window = max(1, len(rows) // 20)
    smooth = [_mean(reward[max(0, i - window + 1): i + 1]) for i in range(len(reward))]
    axes[0].plot(steps, reward, alpha=0.35, label="batch mean")
    axes[0].plot(steps, smooth, label=f"moving mean ({window})")
    if evals:  # held-out greedy evaluation, at the step whose weights it scored (0: before training)
        axes[0].plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", color="C3",
                     label=f"eval: greedy accuracy, {evals[-1]['eval_prompts']} held-out prompts")
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    axes[1].plot(steps, [r["lag_mean"] for r in rows], label="mean lag")
    axes[1].plot(steps, [max(r["lag_hist"] or {"0": 0}, key=int) for r in rows], label="max lag", alpha=0.6)
    axes[1].set_ylabel("token lag (versions)")
    axes[1].legend(loc="upper right")
    axes[2].plot(steps, [r.get("stall_ms") or float("nan") for r in rows], label="engine stall per update (commit)")
    axes[2].plot(steps, [r.get("push_ms") or float("nan") for r in rows], label="push, announce..commit", alpha=0.6)
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("optimizer step")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    axes[2].legend(loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- off-policy correction metrics (verl's rollout-correction set), per step and per lag bucket --

LAG_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 4, "3-4"), (5, 8, "5-8"), (9, 1 << 62, "9+"))
SEQ_LOG_BOUND = 20.0  # |sum_t l_t| is clamped here before exp in chi2_seq, as verl does


def _ratio_of(a: float, b: float, empty: float = 0.0) -> float:
    return a / b if b > 0 else empty


def correction_stats(log_ratio, w, rho, low, high, *, cand, final, real, seq_sel, seq_cand, seq_final, seq_real,
                     catastrophic: float) -> dict:
    """Rollout-correction metrics of one selection of tokens and samples.

    Token metrics over ``cand`` (tokens with l_t = log r_t): ratio_mean, ratio_std of r_t;
    chi2_token = mean(r^2) - 1; kl_mu_pi = mean((r - 1) - log r) (k3 of KL(mu || pi));
    catastrophic = fraction with r < ``catastrophic``. Over ``final`` (the loss's tokens):
    ess = (sum w)^2 / (n sum w^2) of the weights w (ess_ratio: the same of the raw r_t over ``cand``,
    whatever the objective); frac_truncated_high / _low = fraction whose
    objective ratio rho (r_t, or s_i at the sequence level) is above ``high`` / below ``low``.
    frac_masked = 1 - |final| / |real|. Samples ``seq_sel`` over their ``seq_cand`` tokens:
    chi2_seq = mean(exp(2 clamp(sum_t l_t, +-20))) - 1 (product ratio), ppl_ratio =
    mean(exp(-mean_t l_t)) = PPL_pi / PPL_mu; frac_seq_masked = fraction of those with a
    ``seq_real`` token that have no ``seq_final`` token. All masks (B, T); ``seq_sel`` (B,) bool.
    """
    c, f = cand > 0, final > 0
    r = torch.exp(log_ratio[c].double())
    n_c, n_f, n_real = int(c.sum()), int(f.sum()), float(real.sum())
    wf = w[f].double()
    out = {
        "tokens": int(n_real),
        "ratio_mean": float(r.mean()) if n_c else 1.0,
        "ratio_std": float(r.std(unbiased=False)) if n_c else 0.0,
        "chi2_token": float((r ** 2).mean() - 1) if n_c else 0.0,
        "kl_mu_pi": float(((r - 1) - log_ratio[c].double()).mean()) if n_c else 0.0,
        "catastrophic": float((r < catastrophic).double().mean()) if n_c else 0.0,
        "ess": _ratio_of(float(wf.sum() ** 2), n_f * float((wf ** 2).sum())),
        "ess_ratio": _ratio_of(float(r.sum() ** 2), n_c * float((r ** 2).sum())),
        "frac_truncated_high": float((rho[f] > high[f]).double().mean()) if n_f else 0.0,
        "frac_truncated_low": float((rho[f] < low[f]).double().mean()) if n_f else 0.0,
        "frac_masked": 1.0 - _ratio_of(n_f, n_real, 1.0),
    }
    sc = seq_cand.double()
    n_tok = sc.sum(-1)
    sel = seq_sel & (n_tok > 0)
    sum_l = (log_ratio.double() * sc).sum(-1)[sel]
    n_seq = int(sel.sum())
    out["seqs"] = n_seq
    out["chi2_seq"] = float(torch.exp(2 * sum_l.clamp(-SEQ_LOG_BOUND, SEQ_LOG_BOUND)).mean() - 1) if n_seq else 0.0
    out["ppl_ratio"] = float(torch.exp(-sum_l / n_tok[sel]).mean()) if n_seq else 1.0
    has_real = seq_sel & (seq_real.sum(-1) > 0)
    out["frac_seq_masked"] = _ratio_of(float((has_real & (seq_final.sum(-1) == 0)).sum()), float(has_real.sum()))
    return out


def by_lag(log_ratio, w, rho, low, high, final, real, lag, catastrophic: float) -> dict[str, dict]:
    """``correction_stats`` per lag bucket over every real token, lag-masked ones included
    (they show what a looser max_lag would let in); a sample falls in the bucket of its
    oldest token."""
    out = {}
    seq_lag = (lag * real).amax(-1)
    for lo, hi, name in LAG_BUCKETS:
        in_b = real * ((lag >= lo) & (lag <= hi)).float()
        if in_b.sum() == 0:
            continue
        seq_sel = (seq_lag >= lo) & (seq_lag <= hi)
        out[name] = correction_stats(log_ratio, w, rho, low, high, cand=in_b, final=final * in_b, real=in_b,
                                     seq_sel=seq_sel, seq_cand=real, seq_final=final, seq_real=real,
                                     catastrophic=catastrophic)
    return out


def ess_warning(m: dict[str, Any], threshold: float) -> str | None:
    """A warning line when the step's ESS fraction is below ``threshold`` (None otherwise)."""
    if m.get("tokens_in_loss", 1) == 0 or m["ess"] >= threshold:
        return None
    return (f"ESS {m['ess']:.2f} < {threshold}: the importance weights are dominated by a few tokens "
            f"(ratio std {m['ratio_std']:.2f}, chi2 {m['chi2_token']:.2f}, masked {100 * m['frac_masked']:.0f}%); "
            "lower loss.max_lag or tighten the correction")
