"""Expert parallelism on two trainer ranks (gloo, fp32, CPU) takes the steps one process takes.

``tiny_moe`` (Qwen3-MoE, 4 experts in each of 2 MoE layers) trains on two ranks with
``optim.expert_parallel`` (each rank owns 2 experts of each layer; tokens go to their
expert's owner all-to-all) and in one process, on ``test_trainer_ranks``' batches: per step the
loss, the gradient norm and every pushed tensor agree within 1e-5, routing replay on and off.
Inside the ranks' processes, probes that wrap the real functions and call them: each rank's
expert shards are exactly its slice of the full weights, rank 0's push copy equals DTensor's
own gather bit for bit, and every FSDP all-gather is counted by the unit it gathers. A
checkpoint saved on either number of ranks resumes on the other; tokens sent to the wrong
owner break parity.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing as mp
import multiprocessing.connection
import re
from pathlib import Path

import pytest
import torch

from inflight.transport.store import release_port, reserve_port
from tests.engine.test_trainer_ranks import SETTINGS, _assert_same, _one_process, _rank

REPLAY = SETTINGS["routing_replay"]
"""test_trainer_ranks' MoE setting (its lr of 1e-4, and why, are there)."""
CASES = {"replay": REPLAY,
         "no_replay": {**REPLAY, "loss": {**REPLAY.get("loss", {}), "routing_replay": False, "kl_coef": 0.05}}}
"""Routing replay on, and off with a KL reference (a second expert-parallel model, forward only)."""
STEPS = 3


def _install_probes(source_dir: str) -> dict:
    """In a rank's process: what ``_probed_rank`` reports, recorded by wrapping FSDP2's unshard
    and all-gather, ``fill_from_rank_0`` and ``GatheredWeights.gather`` (each still runs)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    from inflight.trainer.expert_parallel import experts_modules
    from inflight.trainer.ranks import GatheredWeights, TrainerRanks

    seen: dict = {"all_gathers": [], "owned": {}, "push_exact": [], "model": None}
    unit: list[str | None] = [None]
    policy: set[int] = set()  # the policy's modules (the first model filled), not the KL reference's
    unshard, all_gather, fill, gather = (FSDPParamGroup.unshard, dist.all_gather_single,
                                         TrainerRanks.fill_from_rank_0, GatheredWeights.gather)

    def unsharding(self, *args, **kwargs):
        unit[0] = f"{'policy' if id(self.modules[0]) in policy else 'reference'}." \
                  f"{type(self.modules[0]).__name__.removeprefix('FSDP')}"
        try:
            return unshard(self, *args, **kwargs)
        finally:
            unit[0] = None

    def all_gathering(output, *args, **kwargs):
        if unit[0] is not None:  # FSDP's, not DTensor.full_tensor's below
            seen["all_gathers"].append((unit[0], output.numel() * output.element_size()))
        return all_gather(output, *args, **kwargs)

    def filled(self, model, full):
        fill(self, model, full)
        if seen["model"] is not None:
            return
        seen["model"] = model
        policy.update(id(m) for m in model.modules())
        from transformers import AutoModelForCausalLM

        weights = dict(AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).named_parameters())
        for name, m in experts_modules(model).items():
            ep = getattr(m, "_inflight_ep", None)
            for p in ("gate_up_proj", "down_proj") if ep else ():
                local, whole = getattr(m, p).to_local(), weights[f"{name}.{p}"].detach()
                seen["owned"][f"{name}.{p}"] = (torch.equal(local, whole[ep.rank * ep.per_rank:][:ep.per_rank]),
                                                tuple(local.shape), tuple(whole.shape))

    def gathering(self, version):
        gather(self, version)
        whole = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in self.source.named.items()}
        if self.ranks.rank == 0:
            seen["push_exact"].append(all(torch.equal(self.copy[n], t) for n, t in whole.items()))

    FSDPParamGroup.unshard, dist.all_gather_single = unsharding, all_gathering
    TrainerRanks.fill_from_rank_0, GatheredWeights.gather = filled, gathering
    return seen


def _probed_rank(rank: int, port: int, model_dir: str, setting: dict, plan: tuple, out: str, world: int,
                 mutant: bool) -> None:
    """``test_trainer_ranks._rank`` with ``_install_probes``' probes; each rank saves what they
    saw, and its all-to-all bytes, to ``out.<rank>``. ``mutant``: expert e's tokens go to rank
    e % world, not to the rank whose block holds e."""
    from inflight.trainer import expert_parallel, policy

    if mutant:
        expert_parallel.owner = lambda experts, per_rank: experts % world
    seen, sent = _install_probes(plan[0] or model_dir), {}

    def counted(model, reset: bool = False) -> dict[str, int]:  # rank 0 reads, and resets, every step's
        out = expert_parallel.all_to_all_bytes(model, reset=reset)
        for name, b in out.items():
            sent[name] = sent.get(name, 0) + b
        return out
    policy.all_to_all_bytes = counted
    _rank(rank, port, model_dir, setting, plan, out, None, world)
    counted(seen.pop("model"))  # what no step read: a following rank's, and rank 0's after its last step
    seen["all_to_all"] = sent
    torch.save(seen, f"{out}.{rank}")


def _on_probed_ranks(model_dir: Path, setting: dict, plan: tuple, out: Path, *, mutant: bool = False,
                     world: int = 2) -> tuple[list[dict], list[dict]]:
    """``test_trainer_ranks._on_ranks`` with ``_probed_rank``: what rank 0 saw, and each rank's probes."""
    ctx = mp.get_context("spawn")
    port = reserve_port()
    release_port("127.0.0.1", port)
    procs = [ctx.Process(target=_probed_rank, args=(r, port, str(model_dir), setting, plan, str(out), world, mutant))
             for r in range(world)]
    for p in procs:
        p.start()
    while (running := [p.sentinel for p in procs if p.exitcode is None]) and not any(p.exitcode for p in procs):
        mp.connection.wait(running)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    assert [p.exitcode for p in procs] == [0] * world
    return torch.load(out, weights_only=True), [torch.load(f"{out}.{r}", weights_only=True) for r in range(world)]


RUNS = {  # name: (on two probed ranks, setting, plan); a plan's checkpoint names a run's directory
    "one_replay": (False, CASES["replay"], (None, 0, 2 * STEPS, None)),
    "one_replay_saved": (False, CASES["replay"], (None, 0, STEPS, "ckpt")),
    "one_no_replay": (False, CASES["no_replay"], (None, 0, STEPS, None)),
    "ep_replay_saved": (True, CASES["replay"], (None, 0, STEPS, "ckpt")),
    "ep_no_replay": (True, CASES["no_replay"], (None, 0, STEPS, None)),
    "fsdp_no_replay": (True, {**CASES["no_replay"], "optim": {**CASES["no_replay"].get("optim", {}),
                                                              "expert_parallel": False}}, (None, 0, 1, None)),
    "ep_mutant": (True, CASES["no_replay"], (None, 0, 1, None)),
    "ep_resumed": (True, CASES["replay"], ("one_replay_saved", STEPS, 2 * STEPS, None)),
    "one_resumed": (False, CASES["replay"], ("ep_replay_saved", STEPS, 2 * STEPS, None)),
}


@pytest.fixture(scope="module")
def run(tiny_moe, tmp_path_factory):
    """``run(name)``: ``RUNS[name]`` once per module, as (what rank 0 saw, each rank's probes)."""
    done: dict[str, tuple] = {}
    dirs = {name: tmp_path_factory.mktemp(name) for name in RUNS}

    def get(name: str) -> tuple[list[dict], list[dict]]:
        if name not in done:
            ranks, setting, (resume, first, last, save) = RUNS[name]
            if resume:
                get(resume)
            plan = (resume and str(dirs[resume] / "ckpt"), first, last, save and str(dirs[name] / save))
            if ranks:
                done[name] = _on_probed_ranks(tiny_moe, setting, plan, dirs[name] / "seen.pt", mutant="mutant" in name)
            else:
                done[name] = (_one_process(tiny_moe, setting, plan), [])
        return done[name]

    get.dirs = dirs
    return get


def _worst(one: list[dict], two: list[dict]) -> tuple[float, float, float]:
    """The largest differences over the steps: loss, gradient norm, any pushed element."""
    return (max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two)),
            max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(one, two)),
            max(float((a["weights"][k] - b["weights"][k]).abs().max()) for a, b in zip(one, two) for k in a["weights"]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_expert_parallel_ranks_take_the_steps_of_one_process(run, case: str) -> None:
    """3 steps on two expert-parallel ranks and in one process: loss, gradient norm (over
    FSDP's shards and the experts' together) and every pushed tensor within 1e-5; the
    all-to-alls carried each MoE layer's rows both ways on both ranks."""
    one = run("one_replay")[0][:STEPS] if case == "replay" else run("one_no_replay")[0]
    two, probes = run("ep_replay_saved" if case == "replay" else f"ep_{case}")
    _assert_same(one, two)
    print(f"{case}: {STEPS} steps, worst |loss|, |grad norm|, |pushed element| differences %.1e %.1e %.1e"
          % _worst(one, two))
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in one)
    if case == "replay":  # the replay ran on every rank, and changed what the routers chose
        assert all(r["routing"][0] > 0 and r["routing"][1] > 0.3 for r in two), [r["routing"] for r in two]
    for p in probes:  # the experts' tokens crossed over, every layer, both ways, on both ranks
        assert len(p["all_to_all"]) == 2 and all(b > 0 for b in p["all_to_all"].values()), p["all_to_all"]


def test_each_rank_holds_its_slice_of_the_experts_and_the_push_copy_is_exact(run) -> None:
    """After sharding and the fill from rank 0, rank r's ``gate_up_proj`` and ``down_proj``
    of each layer are exactly experts [2r, 2r + 2) of the full weights; after every step
    rank 0's gathered copy (what a push and the Hugging Face checkpoint read) equals each
    tensor's ``full_tensor()`` bit for bit."""
    _, probes = run("ep_no_replay")
    for rank, p in enumerate(probes):
        assert len(p["owned"]) == 4, p["owned"]  # 2 layers, 2 tensors
        for name, (exact, local, whole) in p["owned"].items():
            assert exact and local == (whole[0] // 2, *whole[1:]) and whole[0] == 4, (rank, name, local, whole)
    assert probes[0]["push_exact"] == [True] * (STEPS + 1)  # the first weights, then each step's


def test_fsdp_all_gathers_of_a_moe_layer_drop_to_at_most_half(run) -> None:
    """The bytes FSDP all-gathers for one MoE decoder layer, counted at FSDP2's all-gather
    during the steps: with expert parallelism they are the layer without its experts, the
    policy's (forward and backward) and the KL reference's (forward) alike."""
    experts = 4 * (2 * 128 * 128 + 128 * 128) * 4  # gate_up_proj and down_proj, fp32: never gathered with EP
    figures = {}
    for model in ("policy", "reference"):
        for name in ("fsdp_no_replay", "ep_no_replay"):
            gathers = [b for unit, b in run(name)[1][0]["all_gathers"] if unit == f"{model}.Qwen3MoeDecoderLayer"]
            assert gathers and len(set(gathers)) == 1, (name, model, sorted(set(gathers)))  # every gather alike
            steps = RUNS[name][2][2] - RUNS[name][2][1]
            figures[model, name] = (gathers[0], sum(gathers) / steps / 2)  # one gather; a step's, per layer
        (fsdp, fsdp_step), (ep, ep_step) = figures[model, "fsdp_no_replay"], figures[model, "ep_no_replay"]
        print(f"{model}: all-gathered per MoE layer: FSDP {fsdp} B, expert parallel {ep} B ({ep / fsdp:.3f}x); "
              f"per step {fsdp_step:.0f} B vs {ep_step:.0f} B")
        assert ep / fsdp <= 0.5 and ep_step / fsdp_step <= 0.5
        assert fsdp - ep == experts, (model, fsdp, ep, experts)
    a2a = run("ep_no_replay")[1][0]["all_to_all"]
    print(f"all-to-all bytes rank 0 sent per step, policy layers: {[round(b / STEPS) for b in a2a.values()]}")


def test_tokens_sent_to_the_wrong_owner_break_parity(run) -> None:
    """A mutant that sends expert e's rows to rank e % 2 (each rank still runs its own experts
    on what arrives): the parity check fails on the first step."""
    one = run("one_no_replay")[0][:1]
    two, probes = run("ep_mutant")
    assert all(b > 0 for p in probes for b in p["all_to_all"].values())
    with pytest.raises(AssertionError):
        _assert_same(one, two)
    print("mutant owner: worst |loss|, |grad norm|, |pushed element| differences %.1e %.1e %.1e" % _worst(one, two))


@pytest.mark.parametrize("saved_on", [1, 2])
def test_an_expert_parallel_checkpoint_resumes_on_another_number_of_ranks(run, saved_on: int) -> None:
    """3 steps on ``saved_on`` ranks (2: expert parallel), a checkpoint; 3 more on the other
    number from it: the steps of an uninterrupted one-process run (Adam's moments of every
    expert came through the sharded optimizer state). The Hugging Face checkpoint the
    expert-parallel ranks wrote is their last push, exactly."""
    from safetensors.torch import load_file

    whole = run("one_replay")[0]
    saved, resumed = ("one_replay_saved", "ep_resumed") if saved_on == 1 else ("ep_replay_saved", "one_resumed")
    rest = run(resumed)[0]
    ckpt = run.dirs[saved] / "ckpt"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer" / ".metadata").exists()
    _assert_same(whole[STEPS:], rest)
    if saved_on == 2:
        written, pushed = load_file(str(ckpt / "model.safetensors")), run(saved)[0][-1]["weights"]
        assert set(written) <= set(pushed) and any(".experts.3." in k for k in written)
        assert all(torch.equal(written[k], pushed[k]) for k in written)


def _meta(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_what_expert_parallelism_cannot_shard_is_refused_by_name() -> None:
    """Before any collective: experts that the ranks cannot share evenly, and experts modules
    of another contract (Llama-4's transposed experts, gpt-oss's biased ones), each named
    with the setting that turns expert parallelism off; a dense model has nothing to shard."""
    from transformers import GptOssConfig, Llama4TextConfig, LlamaConfig, Qwen3MoeConfig

    from inflight.trainer.expert_parallel import check_expert_parallel

    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=128)
    moe = _meta(Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    assert list(check_expert_parallel(moe, 2)) == ["model.layers.0.mlp.experts"]
    assert check_expert_parallel(_meta(LlamaConfig(**small)), 2) == {}
    with pytest.raises(ValueError, match=r"^optim\.expert_parallel=true: model\.layers\.0\.mlp\.experts "
                                         r"\(Qwen3MoeExperts\) has 4 experts, which 3 trainer ranks cannot own in "
                                         r"equal shares.*optim\.expert_parallel=false"):
        check_expert_parallel(moe, 3)
    for config, cls in ((Llama4TextConfig(**small, num_local_experts=4, intermediate_size_mlp=64), "Llama4TextExperts"),
                        (GptOssConfig(**small, num_local_experts=4), "GptOssExperts")):
        with pytest.raises(ValueError, match=rf"^optim\.expert_parallel=true: \S+ is a {cls}, not one of the experts "
                                             r"modules .* set optim\.expert_parallel=false"):
            check_expert_parallel(_meta(config), 2)


def test_the_supported_families_share_qwen3_moes_experts_contract() -> None:
    """Every class ``SUPPORTED`` names is, in this transformers, Qwen3-MoE's experts module
    under another name: the same eager forward word for word, the default gate, and (built
    from its family's default config, on the meta device) the fused layout and decorator
    defaults ``shard_experts`` relies on."""
    import transformers.models
    from transformers.integrations.moe import _default_apply_gate
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from inflight.trainer.expert_parallel import SUPPORTED, _fused_contract

    def words(f) -> str:
        return re.sub(r"\s+", " ", inspect.cleandoc(inspect.getsource(f)))

    where = {}
    for f in Path(transformers.models.__file__).parent.glob("*/modeling_*.py"):
        for name in re.findall(r"^class (\w+Experts)\(", f.read_text(), re.MULTILINE):
            where[name] = f.parent.name
    for name in sorted(SUPPORTED):
        family = where[name]
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        assert words(cls.forward.__wrapped__) == words(Qwen3MoeExperts.forward.__wrapped__), name
        assert cls._apply_gate is _default_apply_gate, name
        configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        built = []
        for config in (c for c in vars(configs).values() if inspect.isclass(c) and c.__module__ == configs.__name__):
            try:
                with torch.device("meta"):
                    built.append(cls(config()))
            except (AttributeError, TypeError):  # another part's config (vision, audio): not the experts'
                continue
        assert built and all(_fused_contract(m) for m in built), name
