"""The trainer on two ranks (FSDP2 over gloo, fp32, CPU) takes the steps one process takes.

Each parity case feeds the same rollout groups to a one-process ``Policy`` and to rank 0 of
two (``TrainerRanks``, the other rank in ``follow_rank_0``, as ``inflight train --nproc 2``
runs them): per step, the loss, the gradient norm and every tensor a push sends agree within
1e-5. A checkpoint written by either resumes on the other: the optimizer state is a
``torch.distributed.checkpoint`` resharded on load.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import os
import re
from pathlib import Path

import pytest
import torch

from inflight.protocol import RolloutGroup
from inflight.transport.store import release_port, reserve_port
from tests.helpers import shared_prompt_groups

STEPS = 5
SETTINGS = {
    "plain": {},
    "micro_batches": {"optim": {"micro_batch_tokens": 40}, "engine": {"max_model_len": 40},
                      "task": {"completion_tokens": 16}},
    "kl": {"loss": {"kl_coef": 0.05}},
    "lora": {"model": {"lora": {"rank": 4, "alpha": 8.0}}, "loss": {"kl_coef": 0.05}},
    # lr 1e-4: Adam's first step moves a weight by lr * g / (|g| + eps), so where a gradient is
    # near eps, rounding-level differences between the two sums move it by a share of lr
    # (at 1e-3, 1.3e-5 in one of the MoE's k_proj elements)
    "routing_replay": {"loss": {"routing_replay": True}, "optim": {"micro_batch_tokens": 64, "lr": 1e-4},
                       "engine": {"max_model_len": 40}, "task": {"completion_tokens": 16}},
    # the trainer as it was: rows padded, whole logits, every activation kept (on one process;
    # ``test_packed_ranks_take_the_padded_steps`` runs the default layout on two against it)
    "padded": {"optim": {"packing": "padded", "activation_checkpointing": False}},
}
"""Each is ``_config``'s base with these sections merged in; ``lora``: an adapter trains on a
frozen base (``Policy``'s ``adapter_dir``), its KL reference the base with the adapter off."""
MODELS = {"kl": "tiny_qwen", "lora": "tiny_qwen", "routing_replay": "tiny_moe"}
"""The model each setting trains (default ``tiny_llama``, an untied LM head): ``tiny_qwen`` has
tied embeddings and qkv biases, one tensor under two names when rank 0 fills the others'."""


def _groups(step: int, routers: int = 0) -> list[RolloutGroup]:
    """Step ``step``'s batch: 4 groups of 3, each of one prompt (``shared_prompt_groups``); with
    ``routers`` MoE layers, each token's recorded routing: 2 distinct experts of 4 in each."""
    return shared_prompt_groups(torch.Generator().manual_seed(100 + step), 4, 3, routers=routers)


def _config(model_dir: str, setting: dict):
    from inflight.trainer.config_files import config_from_dict

    base = {"model": {"path": model_dir}, "rollout": {"group_size": 3, "groups_per_step": 4},
            "loss": {"max_lag": 2}, "optim": {}}  # optim.lr: the default, 1e-3
    for key, values in setting.items():
        base[key] = {**base.get(key, {}), **values}
    return config_from_dict(base)


def _steps(policy, first: int, last: int) -> list[dict]:
    """Steps ``first`` .. ``last - 1``: each one's loss, gradient norm and pushed tensors."""
    out = []
    for step in range(first, last):
        result = policy.step(_groups(step, len(policy.replay.routers)), version=2, step=step)
        out.append({"loss": result.loss, "grad_norm": result.grad_norm, "routing": policy.replay.enabled and
                    (result.metrics["routing_replayed_rows"], result.metrics["routing_mismatch"]),
                    "weights": {k: v.clone() for k, v in policy.weights().items()}})
    return out


def _save(policy, path: Path, step: int) -> None:
    from torch.distributed import HashStore

    from inflight.rollout_queue import RolloutBuffer, RolloutQueue

    policy.save(path, step, 2, RolloutBuffer(RolloutQueue(HashStore(), capacity=4), admit_lag=2))


def _join(rank: int, world: int, port: int) -> None:
    """This spawned process is trainer rank ``rank`` of ``world``, rank 0's store on ``port``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _rank(rank: int, port: int, model_dir: str, setting: dict, plan: tuple, out: str, adapter: str | None,
          world: int) -> None:
    """One of ``world`` trainer ranks: rank 0 runs ``plan`` = (resume from, first step, last
    step, checkpoint to) and saves what it saw to ``out``; the others follow. A world of 1 is
    a one-process run (a process group of its own only if ``optim.compute_dtype`` needs one)."""
    _join(rank, world, port)
    from inflight.trainer.policy import Policy
    from inflight.trainer.ranks import TrainerRanks
    from inflight.trainer.train import follow_rank_0

    cfg = _config(model_dir, setting)
    ranks = TrainerRanks.from_env()
    try:
        if rank:
            return follow_rank_0(cfg, ranks)
        resume_from, first, last, save_to = plan
        policy = Policy(cfg, Path(resume_from or model_dir), None, Path(adapter) if adapter else None, ranks=ranks,
                        resume=resume_from is not None)
        seen = _steps(policy, first, last)
        if save_to:
            _save(policy, Path(save_to), last)
        policy.close()
        if ranks is None:  # the process group a one-process policy formed for bf16 compute: left
            assert not torch.distributed.is_initialized()
        torch.save(seen, out)
    finally:
        if ranks is not None:
            ranks.stop()


def _on_ranks(model_dir: Path, setting: dict, plan: tuple, out: Path, adapter: Path | None = None, *,
               world: int = 2) -> list[dict]:
    """Rank 0 of ``world`` spawned ranks runs ``plan`` (``_rank``); what it saw."""
    ctx = mp.get_context("spawn")
    port = reserve_port()
    release_port("127.0.0.1", port)  # rank 0's rendezvous store listens there
    procs = [ctx.Process(target=_rank, args=(r, port, str(model_dir), setting, plan, str(out),
                                             adapter and str(adapter), world)) for r in range(world)]
    for p in procs:
        p.start()
    while (running := [p.sentinel for p in procs if p.exitcode is None]) and not any(p.exitcode for p in procs):
        mp.connection.wait(running)
    for p in procs:  # one rank failed: the other would wait for it
        if p.exitcode is None:
            p.kill()
        p.join()
    assert [p.exitcode for p in procs] == [0] * world
    return torch.load(out, weights_only=True)


def _one_process(model_dir: Path, setting: dict, plan: tuple, adapter: Path | None = None) -> list[dict]:
    from inflight.trainer.policy import Policy

    threads = torch.get_num_threads()
    resume_from, first, last, save_to = plan
    try:
        policy = Policy(_config(str(model_dir), setting), Path(resume_from or model_dir), None, adapter,
                        resume=resume_from is not None)
        seen = _steps(policy, first, last)
        if save_to:
            _save(policy, Path(save_to), last)
    finally:
        torch.set_num_threads(threads)
    return seen


def _assert_same(one: list[dict], two: list[dict]) -> None:
    assert len(one) == len(two)
    for step, (a, b) in enumerate(zip(one, two)):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (step, a["loss"], b["loss"])
        assert a["routing"] == b["routing"], (step, a["routing"], b["routing"])  # every rank's replays counted
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1.0, a["grad_norm"]), step
        assert a["weights"].keys() == b["weights"].keys()
        diffs = sorted((float((a["weights"][k] - b["weights"][k]).abs().max()), k) for k in a["weights"])
        assert diffs[-1][0] < 1e-5, (step, diffs[-4:])  # the worst tensors, named


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_two_ranks_take_the_steps_of_one_process(request, tmp_path, name: str) -> None:
    from inflight.trainer.lora_policy import write_first_adapter

    model_dir = request.getfixturevalue(MODELS.get(name, "tiny_llama"))  # the model of this setting
    setting = SETTINGS[name]
    lora = _config(str(model_dir), setting).model.lora
    adapter = write_first_adapter(model_dir, lora, tmp_path / "adapter", seed=0) if lora.enabled else None
    one = _one_process(model_dir, setting, (None, 0, STEPS, None), adapter)
    two = _on_ranks(model_dir, setting, (None, 0, STEPS, None), tmp_path / "two.pt", adapter)
    _assert_same(one, two)
    if name == "routing_replay":  # the replay ran, and changed what the routers chose
        assert all(r["routing"][0] > 0 and r["routing"][1] > 0.3 for r in one), [r["routing"] for r in one]
    if lora.enabled:  # what a push sends: the adapter alone, by PEFT's names
        assert one[0]["weights"] and all("lora_A" in k or "lora_B" in k for k in one[0]["weights"])
    # the steps moved the weights, and the loss and gradients were not degenerate
    first, last = one[0]["weights"], one[-1]["weights"]
    assert all(float((first[k] - last[k]).abs().max()) > 1e-4 for k in first if "norm" not in k)
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in one)


def test_packed_ranks_take_the_padded_steps(tiny_llama, tmp_path) -> None:
    """Two ranks packed, prefix-shared and checkpointed (the defaults) take the steps of one
    padded process with every activation kept: the trainer before packing."""
    one = _one_process(tiny_llama, SETTINGS["padded"], (None, 0, STEPS, None))
    two = _on_ranks(tiny_llama, SETTINGS["micro_batches"], (None, 0, STEPS, None), tmp_path / "two.pt")
    _assert_same(one, two)


def test_bf16_compute_on_one_rank_and_two(tiny_qwen, tmp_path) -> None:
    """``optim.compute_dtype = "bfloat16"``: FSDP2's mixed precision on one rank and on two
    take the same steps within bf16's rounding, and differ from fp32 compute by more than it;
    the master weights and every push stay fp32."""
    bf16 = {"optim": {"compute_dtype": "bfloat16"}}
    fp32 = _one_process(tiny_qwen, {}, (None, 0, STEPS, None))
    one = _on_ranks(tiny_qwen, bf16, (None, 0, STEPS, None), tmp_path / "one.pt", world=1)
    two = _on_ranks(tiny_qwen, bf16, (None, 0, STEPS, None), tmp_path / "two.pt")

    def worst(a: dict, b: dict) -> float:
        return max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])

    # step 1, from the same weights: bf16 on 1 rank and on 2 compute the same forward (the same
    # bf16 parameters) and gradients within their fp32 sums' rounding (measured 9e-6 of the
    # norm); fp32 compute differs by more (measured 1.3e-5 in the loss, 1.2e-3 of the norm)
    a, b, c = one[0], two[0], fp32[0]
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * c["grad_norm"]
    assert abs(a["loss"] - c["loss"]) > 5e-6 and abs(a["grad_norm"] - c["grad_norm"]) > 5e-4 * c["grad_norm"]
    # then Adam turns rounding into steps of up to lr (1e-3) each: 5 steps stay within bf16's reach
    assert all(abs(x["loss"] - y["loss"]) < 1e-3 for x, y in zip(one, two))
    assert max(float((one[-1]["weights"][k] - two[-1]["weights"][k]).abs().max()) for k in one[-1]["weights"]) < 1e-2
    assert all(t.dtype == torch.float32 for r in one + two for t in r["weights"].values())


def _rank_killed_mid_gather(rank: int, port: int, model_dir: str, out: str) -> None:
    """Rank 0 takes steps until it fails; rank 1 is SIGKILLed (by itself) in step 2's gather
    into rank 0's push copy, 3 tensors in. Rank 0 saves its error and how long it took."""
    import signal
    import time

    _join(rank, 2, port)
    from inflight.trainer.policy import Policy
    from inflight.trainer.ranks import RankLost, TrainerRanks
    from inflight.trainer.train import follow_rank_0
    from inflight.transport.sources import ShardedSource

    cfg = _config(model_dir, {"run": {"rank_timeout_s": 30.0}})
    ranks = TrainerRanks.from_env(cfg.run.rank_timeout_s)
    if rank:
        gather, taken = ShardedSource._gather, []

        def dying(self, name):
            taken.append(name)
            if self._version == 2 and len(taken) > 2 * len(self.named) + 3:  # v0 and v1 whole, then 3 of v2
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(self, name)

        ShardedSource._gather = dying
        return follow_rank_0(cfg, ranks)
    policy = Policy(cfg, Path(model_dir), None, ranks=ranks)
    policy.step(_groups(0), version=2, step=0)
    t0 = time.monotonic()
    try:
        policy.step(_groups(1), version=2, step=1)
    except RankLost as e:
        seconds = time.monotonic() - t0
        try:
            policy.weights()
            refused = ""
        except RuntimeError as r:  # the copy is half-written: no push or save reads it
            refused = str(r)
        torch.save({"error": str(e), "seconds": seconds, "refused": refused}, out)


def test_a_rank_killed_in_the_gather_is_named_within_seconds(tiny_llama, tmp_path) -> None:
    """SIGKILL of rank 1 in the middle of the ranks' part of a push (the gather of the step's
    weights into rank 0's copy): rank 0's step fails with ``RankLost`` naming rank 1 within
    seconds, not at ``run.rank_timeout_s``; the half-gathered copy is refused to any push or
    save that would read it (``train`` saves only after whole steps besides)."""
    ctx = mp.get_context("spawn")
    port = reserve_port()
    release_port("127.0.0.1", port)
    out = tmp_path / "lost.pt"
    procs = [ctx.Process(target=_rank_killed_mid_gather, args=(r, port, str(tiny_llama), str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.exitcode is None:
            p.kill()
    assert procs[1].exitcode == -9 and procs[0].exitcode == 0
    lost = torch.load(out, weights_only=True)
    print(f"rank 1 killed mid-gather: rank 0 named it {lost['seconds']:.1f} s into the step")
    assert re.search(r"^step 2: a collective of the trainer's ranks failed \(.*\); trainer rank 1 did not answer",
                     lost["error"]), lost["error"]
    assert lost["seconds"] < 15, lost
    assert "half-written: the gather of version 2 did not finish" in lost["refused"], lost


@pytest.mark.parametrize("saved_on", [1, 2])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tiny_llama, tmp_path, saved_on: int) -> None:
    """10 steps on ``saved_on`` ranks, a checkpoint; 3 more on the other number, from it: the
    same 3 steps as an uninterrupted one-process run (Adam's moments came through)."""
    whole = _one_process(tiny_llama, {}, (None, 0, 13, None))
    ckpt = tmp_path / "checkpoint"
    if saved_on == 1:
        _one_process(tiny_llama, {}, (None, 0, 10, str(ckpt)))
        rest = _on_ranks(tiny_llama, {}, (str(ckpt), 10, 13, None), tmp_path / "rest.pt")
    else:
        _on_ranks(tiny_llama, {}, (None, 0, 10, str(ckpt)), tmp_path / "first.pt")
        rest = _one_process(tiny_llama, {}, (str(ckpt), 10, 13, None))
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer" / ".metadata").exists()
    _assert_same(whole[10:], rest)


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of trainer rank ``rank`` under the launcher process ``agent`` (by its ``RANK``)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
            ancestors = _ancestors(int(proc.name))
        except (OSError, ValueError):
            continue
        if agent in ancestors and env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env \
                and b"inflight.trainer.train" in (proc / "cmdline").read_bytes():
            return int(proc.name)
    return None


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


SMALL_DEMO = ["rollout.group_size=4", "rollout.groups_per_step=2", "rollout.in_flight_groups=4",
              "rollout.queue_capacity=4", "task.completion_tokens=16"]


def _train(out: Path, nproc: int, *sets: str):
    import subprocess
    import sys

    return subprocess.Popen([str(Path(sys.executable).parent / "inflight"), "train", "--config", "demo",
                             "--nproc", str(nproc), *[a for s in (f"run.out_dir={out}", *SMALL_DEMO, *sets)
                                                      for a in ("--set", s)]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rows_when(run, out: Path, n: int) -> list[dict]:
    """metrics.jsonl once it has ``n`` rows (the run still going)."""
    import time

    rows: list[dict] = []
    while len(rows) < n:
        assert run.poll() is None, run.stderr.read()[-3000:]
        time.sleep(0.5)
        metrics = out / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return rows


def test_a_two_rank_run_pushes_in_flight_and_stops_when_a_rank_dies(tmp_path) -> None:
    """``inflight train --config demo --nproc 2``: steps land as pushes the engine commits
    while it samples; SIGKILL of trainer rank 1 then stops the run with one line naming it,
    and leaves no trainer or engine process behind."""
    import time

    out = tmp_path / "run"
    run = _train(out, 2, "run.steps=500", "engine.commit_unit=layer")  # layer-granular pushes from the ranks
    try:
        rows = _rows_when(run, out, 4)  # four steps done, each pushed (the engine decodes all along)
        assert [r["version"] for r in rows[:4]] == [1, 2, 3, 4]
        assert [v for r in rows for v, _ in r["pushes_landed"]][:3] == [1, 2, 3]
        assert all(r["grad_norm"] > 0 for r in rows)
        engine = int((out / "engine0.pid").read_text())
        rank0, rank1 = _rank_pid(run.pid, 0), _rank_pid(run.pid, 1)
        assert rank0 and rank1
        os.kill(rank1, 9)
        t0 = time.monotonic()
        code = run.wait(timeout=300)
        took = time.monotonic() - t0
        err = run.stderr.read()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
    print(f"rank 1 killed: the run stopped in {took:.1f} s")
    assert code != 0
    assert "trainer rank 1 of 2 failed first (signal SIGKILL)" in err, err[-3000:]
    assert took < 60, took  # measured: docs/LOG.md
    for pid in (rank0, engine):  # the engine sees its trainer gone and ends by itself
        for _ in range(600):
            if (not Path(f"/proc/{pid}").exists()
                    or "Z" in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3])):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"process {pid} outlived the run")


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_hung_rank_stops_the_run_naming_it(tmp_path) -> None:
    """Trainer rank 1 stopped (SIGSTOP, as a hang looks from outside): rank 0 stops the run
    once ``run.rank_timeout_s`` passes in a step, its error naming rank 1."""
    import signal
    import time

    out = tmp_path / "run"
    run = _train(out, 2, "run.steps=500", "run.rank_timeout_s=10", "transport.encoding=sparse")
    rank1 = None
    try:
        rows = _rows_when(run, out, 3)  # sparse pushes from the ranks' copy land as dense ones do
        assert [v for r in rows for v, _ in r["pushes_landed"]][:2] == [1, 2]
        rank0, rank1 = _rank_pid(run.pid, 0), _rank_pid(run.pid, 1)
        assert rank0 and rank1
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        while not _gone(rank0) and time.monotonic() - t0 < 600:
            time.sleep(0.2)
        took = time.monotonic() - t0
        os.kill(rank1, signal.SIGCONT)  # the launcher's stop can act on it now
        code, err = run.wait(timeout=300), run.stderr.read()
    finally:
        if rank1 and not _gone(rank1):
            os.kill(rank1, signal.SIGCONT)
        if run.poll() is None:
            os.killpg(run.pid, 9)
    print(f"rank 1 stopped: rank 0 gave up {took:.1f} s later")
    # rank 1 named: by the order it did not take, or the barrier after a collective it left hanging
    assert code != 0 and re.search(r"inflight train: error: (trainer rank 1 did not|step \d+: .*Ranks? 1 failed to "
                                   r"pass monitoredBarrier).*run\.rank_timeout_s", err), err[-3000:]
    assert "inflight train: error: trainer rank 0 of 2 stopped the run" in err
    assert took < 120, took  # the timeout, after the step in progress and the wait for its rollouts


LORA = ["model.lora.rank=8", "model.lora.alpha=16.0", 'model.lora.target_modules=["q_proj", "v_proj", "up_proj"]',
        "optim.lr=3e-3"]


def test_ctrl_c_on_two_lora_ranks_then_a_resume_on_one(tmp_path) -> None:
    """A LoRA run on two ranks: each push carries the adapter alone, gathered from the ranks
    (what it holds is the one-process adapter: the parity test's ``lora`` case). Ctrl-C (SIGINT to ``inflight
    train --nproc 2``) stops after a whole step with a checkpoint (the adapter); ``run.resume``
    on one rank goes on from it: the next steps, Adam's step count continued from the sharded
    optimizer state."""
    import signal

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "run"
    run = _train(out, 2, "run.steps=500", *LORA)
    try:
        _rows_when(run, out, 3)
        run.send_signal(signal.SIGINT)
        code, err = run.wait(timeout=600), run.stderr.read()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
    assert code == 130 and "stopped by Ctrl-C after step" in err, err[-3000:]
    stopped = json.loads((out / "checkpoint" / "state.json").read_text())["step"]
    assert stopped >= 3
    ckpt = out / "checkpoint"
    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    assert not (ckpt / "model.safetensors").exists() and {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj",
                                                                                               "up_proj"}
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the adapter trained
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    adapter_mb = sum(t.numel() * 4 for t in adapter.values()) / 2**20
    assert rows and all(r["push_mb"] == pytest.approx(adapter_mb, rel=1e-9) for r in rows if "push_mb" in r)
    assert [v for r in rows for v, _ in r["pushes_landed"]][:2] == [1, 2]
    resumed = _train(out, 1, "run.resume=true", f"run.steps={stopped + 2}", *LORA)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped + 3))
    assert set(load_file(str(ckpt / "adapter_model.safetensors"))) == set(adapter)
    dcp_to_torch_save(out / "checkpoint" / "optimizer", tmp_path / "optimizer.pt")
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert {float(s["step"]) for s in state.values()} == {float(stopped + 2)}


def test_accelerate_launch_starts_the_same_ranks(tmp_path) -> None:
    """``accelerate launch --multi_gpu --num_processes 2 -m inflight.trainer.train``: torchrun
    under accelerate (on CPU too: accelerate's ``--cpu`` runs one process unless given mpirun),
    so the two processes are the trainer's two ranks and each writes its optimizer shard."""
    import subprocess
    import sys

    out = tmp_path / "run"
    sets = [a for s in (f"run.out_dir={out}", *SMALL_DEMO, "run.steps=2", "optim.compute_dtype=bfloat16")
            for a in ("--set", s)]  # and with bf16 compute, end to end
    done = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes",
                           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m",
                           "inflight.trainer.train", "--config", "demo", *sets],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["pushed_version"] == 2
    assert sorted(p.name for p in (out / "checkpoint" / "optimizer").glob("*.distcp")) == ["__0_0.distcp",
                                                                                        "__1_0.distcp"]


def test_ranks_get_whole_groups_balanced_by_tokens() -> None:
    from inflight.trainer.ranks import TrainerRanks

    groups = [g for step in range(3) for g in _groups(step)][:10]
    size = {g.group_id: sum(len(s.prompt_ids) + len(s.token_ids) for s in g.samples) for g in groups}
    for world in (2, 3, 10):
        parts = TrainerRanks(rank=0, world=world, device=torch.device("cpu"), mesh=None, orders=None,
                             gathers=None).rows(groups)
        assert [g for p in parts for g in p] == groups and all(parts), world  # contiguous, whole, none empty
        loads = [sum(size[g.group_id] for g in p) for p in parts]
        assert max(loads) - sum(loads) / world <= max(size.values()), (world, loads)
    with pytest.raises(ValueError, match="11 trainer ranks"):
        TrainerRanks(rank=0, world=11, device=torch.device("cpu"), mesh=None, orders=None, gathers=None).rows(groups)


def test_the_documented_memory_figures_are_a_committed_run() -> None:
    """docs/training.md's table of bytes per rank quotes a run in bench/results/trainer_ranks.jsonl,
    and that run's sharded bytes per rank at 2 ranks are at most 0.55x of one rank's."""
    root = Path(__file__).resolve().parents[2]
    runs = [json.loads(line) for line in (root / "bench" / "results" / "trainer_ranks.jsonl").read_text().splitlines()]
    docs = (root / "docs" / "training.md").read_text()
    mib = float(1 << 20)

    def quoted(run: dict) -> bool:
        return all(f"| {n} | {r['param_bytes'] / mib:.0f} MiB | {r['grad_bytes'] / mib:.0f} MiB | "
                   f"{r['optimizer_bytes'] / mib:.0f} MiB | {run['held_ratio'] if n > 1 else 1:.2f}x | "
                   f"{r['rss_bytes'] / mib:.0f} MiB" in docs for n, r in ((1, run["one"]), (run["nproc"], run["many"])))

    run = next((r for r in runs if r["model"] == "smollm2" and quoted(r)), None)
    assert run is not None, "docs/training.md's memory table matches no committed run"
    assert run["held_ratio"] <= 0.55 and run["nproc"] == 2
    assert run["command"].startswith("python -m inflight.bench.trainer_ranks") and run["git"] and run["started"]


def test_what_several_ranks_cannot_do_is_refused_by_name(tiny_llama) -> None:
    from inflight.trainer.policy import check_ranks

    check_ranks(_config(str(tiny_llama), {"rollout": {"groups_per_step": 1}}), 1)  # one rank: nothing refused
    for setting in (SETTINGS["lora"], SETTINGS["routing_replay"]):  # an adapter, routing replay: on ranks
        check_ranks(_config(str(tiny_llama), setting), 2)
    for setting, name in (({"rollout": {"groups_per_step": 1}}, "rollout.groups_per_step=1"),):
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}.* on 2 trainer ranks"):
            check_ranks(_config(str(tiny_llama), setting), 2)
