"""A LoRA run of the training entry point: the trainer trains a PEFT adapter on the fixed base,
each push carries the adapter alone, the engine serves it from its adapter slot, and a
resumed run starts its engine from the checkpoint's adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from inflight.trainer.loss_config import LossConfig
from inflight.trainer.train import train
from tests.helpers import check_tags, metrics_rows, run_config

LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def test_a_lora_run_pushes_the_adapter_alone_and_resumes_from_its_checkpoint(tmp_path) -> None:
    out = tmp_path / "run"
    summary = train(run_config(out, 4, model={"lora": LORA}, run={"checkpoint_every": 2}, optim={"lr": 3e-3}))
    rows = metrics_rows(out)
    assert [r["version"] for r in rows] == [1, 2, 3, 4] and rows[-1]["pushed_version"] == 4
    ckpt = out / "checkpoint"
    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    assert not (ckpt / "model.safetensors").exists()  # the base never moves: the checkpoint is the adapter
    assert sorted({k.split(".")[-2] for k in adapter}) == ["lora_A", "lora_B"]
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj", "up_proj", "down_proj"}
    adapter_mb = sum(t.numel() * 4 for t in adapter.values()) / 2**20
    assert all(r["push_mb"] == pytest.approx(adapter_mb, rel=1e-9) for r in rows if "push_mb" in r)
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the adapter trained
    assert all(r["tokens_in_loss"] > 0 for r in rows)
    check_tags(summary, rows, LossConfig().max_lag)
    # the engine decoded with the trainer's adapter: where a token's version is the trainer's,
    # its behaviour log-prob is the trainer's own (fp32 both sides)
    assert max(r["kl_mu_pi"] for r in rows) < 1e-3, [r["kl_mu_pi"] for r in rows]

    summary = train(run_config(out, 6, model={"lora": LORA}, run={"checkpoint_every": 2, "resume": True},
                               optim={"lr": 3e-3}))
    rows = metrics_rows(out)
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 6 and state["version"] == 6
    resumed = load_file(str(ckpt / "adapter_model.safetensors"))
    assert set(resumed) == set(adapter) and any(not torch.equal(resumed[k], adapter[k]) for k in adapter)
