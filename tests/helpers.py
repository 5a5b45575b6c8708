"""Helpers shared by test modules: training runs (a small config, reading the run's metrics
and checkpoint, the rollout queue's ledger), a free port for a server that is not a store, and
the pusher's fault-injection seam (``tampering``)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import torch

from inflight.protocol import RolloutGroup, RolloutSample, decode_group
from inflight.trainer.config import TrainConfig
from inflight.trainer.config_files import config_from_dict
from inflight.transport.bucket import BucketSender, Tamper
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.peer import DictTarget
from inflight.transport.pusher import PushConfig, WeightPusher
from inflight.transport.schema import TensorSchema

RUN_BASE = {  # a tiny policy, short completions, small groups
    "run": {"seed": 5},
    "model": {"tiny": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}},
    "task": {"completion_tokens": 24},
    "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 4},
    "transport": {"bucket_mb": 0.05, "collective_timeout_s": 15.0, "reply_timeout_s": 15.0, "stale_timeout_s": 15.0,
                  "rejoin_timeout_s": 180.0},
}


def run_config(out: Path, steps: int, **sections) -> TrainConfig:
    """``RUN_BASE`` for ``steps`` steps writing to ``out``, each section updated with ``sections``."""
    data = {k: dict(v) for k, v in RUN_BASE.items()}
    data["run"].update(steps=steps, out_dir=str(out))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


def metrics_rows(out: Path) -> list[dict]:
    """The rows the run in ``out`` has written so far (none before its first): whole lines
    only, as a row being written may be read half-way (a thread that waits on rows died of
    that read once, leaving the engine it froze frozen)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text.splitlines(keepends=True) if x.endswith("\n")]


WAIT_S = 600.0
"""The longest a test waits for one event of a run or an engine (a row, a step, a commit, a
restart) before it fails naming what it waited for: an engine's start on a 2-core machine at
load 10 is the slowest such event measured. A bound for a hang, never a check of speed."""


def wait_until(done: Callable[[], object], what: str, *, poll_s: float = 0.05, timeout_s: float = WAIT_S) -> None:
    """Poll ``done()`` every ``poll_s`` until it is true; after ``timeout_s`` fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(poll_s)


def wait_rows(out: Path, n: int, *, where: Callable[[list[dict]], bool] = lambda rows: True) -> list[dict]:
    """Block until the run has written ``n`` rows (one at least) and ``where(rows)`` holds:
    an event of the run's own (``wait_until`` bounds it). Returns the rows."""
    seen: list[list[dict]] = []

    def written() -> bool:
        rows = metrics_rows(out)
        seen[:] = [rows]
        return bool(rows) and len(rows) >= n and where(rows)

    wait_until(written, f"{n} rows in {out} matching {where.__doc__ or where}")
    return seen[0]


_ADMITTED: list[str] = []
"""The ids of the groups the run that ``train_beside`` runs admitted so far, in order."""


def wait_admitted(engine_id: str) -> None:
    """Block until the run that ``train_beside`` runs admitted a group of engine ``engine_id``
    ("e1"): an event of the run's own, which comes however slow that engine is (with
    ``kill_before_last_step`` the last step admits queued groups while it waits)."""
    wait_until(lambda: any(g.startswith(f"{engine_id}.") for g in list(_ADMITTED)),
               f"the trainer to admit a group of engine {engine_id}")


def train_beside(cfg: TrainConfig, beside: Callable[[], None], *, kill_before_last_step: bool = False
                 ) -> tuple[dict, list[dict]]:
    """``train(cfg)`` while ``beside`` runs in a thread (a fault or an input it injects when
    the run's rows or admitted groups say so: ``wait_rows``, ``wait_admitted``). With
    ``kill_before_last_step`` (``beside`` kills an engine) the last step waits until
    ``beside`` returned and the fleet sees the engine's death, admitting the queued groups
    meanwhile (so no engine blocks on a full queue), and the kill is recovered inside the
    run however late what it waits for comes (a slow engine's first group, on a busy
    machine). Returns the run's summary and its rows."""
    from inflight.rollout_queue import RolloutBuffer
    from inflight.trainer.train import train
    from inflight.trainer.weight_sync import WeightSync

    failed: list[BaseException] = []

    def run_beside() -> None:  # its error is the test's: re-raised once the run ends
        try:
            beside()
        except BaseException as e:
            failed.append(e)
            raise
    t = threading.Thread(target=run_beside, daemon=True)
    next_batch, admit, calls = WeightSync.next_batch, RolloutBuffer._admit, []
    _ADMITTED.clear()

    def recording(self: RolloutBuffer, data: bytes, current_version: int) -> None:
        before = len(self.pending)
        admit(self, data, current_version)
        if len(self.pending) > before:
            _ADMITTED.append(self.pending[-1].group_id)

    def after_the_kill(self: WeightSync, buffer: RolloutBuffer, version: int):
        calls.append(version)
        if len(calls) == cfg.run.steps:
            # what ``beside`` waits for (a row, a group, a kill) comes in the run's time: this
            # bound only turns a fault that never comes into a failure naming it
            deadline = time.monotonic() + cfg.transport.rejoin_timeout_s
            while t.is_alive() and time.monotonic() < deadline:
                buffer.drain(version)
                t.join(0.05)
            if t.is_alive():
                raise AssertionError("the fault beside the run did not come by its last step: "
                                     f"{beside.__doc__ or beside}")
            wait_until(lambda: self.fleet.restarts or self.fleet.exit_problem(), "the fleet to see the engine's death")
        return next_batch(self, buffer, version)

    t.start()
    RolloutBuffer._admit = recording  # type: ignore[method-assign]
    if kill_before_last_step:
        WeightSync.next_batch = after_the_kill  # type: ignore[method-assign]
    try:
        summary = train(cfg)
    finally:
        WeightSync.next_batch, RolloutBuffer._admit = next_batch, admit  # type: ignore[method-assign]
    t.join(5)
    if failed:
        raise AssertionError(f"what ran beside the run failed: {failed[0]!r}") from failed[0]
    return summary, metrics_rows(Path(cfg.run.out_dir))


def check_tags(summary: dict, rows: list[dict], max_lag: int) -> None:
    """Every token a step trained on is tagged with a version the trainer had published
    before that step and at most ``max_lag`` behind it, and the summary's most versions in
    one sample is its rows' most."""
    for r in rows:
        tags = {v for vs in r["versions_by_engine"].values() for v in vs}
        assert tags and r["version"] - 1 - max_lag <= min(tags) and max(tags) < r["version"], r
        assert 1 <= r["max_versions_per_sample"] <= len(tags), r
    assert summary["max_versions_per_sample"] == max(r["max_versions_per_sample"] for r in rows)


def pending_ids(out: Path) -> list[str]:
    """The ids of the groups the run's last checkpoint kept for the next run."""
    raw = msgspec.msgpack.decode((out / "checkpoint" / "pending.msgpack").read_bytes())
    return [decode_group(b).group_id for b in raw]


def check_ledger(summary: dict, rows: list[dict], pending: list[str]) -> list[str]:
    """Every queued slot was read, every read is admitted, refused or a hole, and every admitted
    group was trained on, dropped as stale, or saved as pending. Returns the consumed ids."""
    q = summary["queue"]
    consumed = [g for r in rows for g in r["group_ids"]]
    dropped = [g for r in rows for g in r["dropped_ids"]]
    assert q["put"] == q["read"], q  # the final checkpoint drained the queue
    assert q["admitted"] + sum(q["rejected"].values()) + q["queue_holes"] == q["read"], q
    assert len(consumed) + len(dropped) + len(pending) == q["admitted"], (len(consumed), len(dropped), pending, q)
    assert len(set(consumed + dropped + pending)) == len(consumed) + len(dropped) + len(pending), "a group came twice"
    return consumed


def engines_that_fed(summary: dict, rows: list[dict], out: Path) -> set[str]:
    """``check_ledger`` over the run in ``out``; the engines ("e0", ...) whose groups are in its
    ledger: trained on, dropped as stale, or saved as pending for the next run."""
    pending = pending_ids(out)
    consumed = check_ledger(summary, rows, pending)
    return {g.split(".", 1)[0] for g in consumed + [g for r in rows for g in r["dropped_ids"]] + pending}


def free_port() -> int:
    """A port free now, for a server that is not the group's store (``vllm serve``'s HTTP
    port). It cannot be held as ``reserve_port`` holds a store's: the server is another
    process that binds the port itself, from a number on its command line, so the socket is
    closed here first and the port may in principle be taken in between. Group stores never
    use this: the ``port`` fixture holds theirs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail_next_commit_on_vllm_rank_1(worker) -> int:
    """Runs inside each worker process (collective_rpc with a callable): the worker of vLLM
    rank 1 (weight-group rank 2) fails its next apply, before touching any weight."""
    if worker.rank != 1:
        return 0
    strategy = worker._inflight_target.strategy
    real = strategy.apply

    def apply() -> None:
        strategy.apply = real
        raise RuntimeError("injected commit failure")

    strategy.apply = apply
    return 1


def fail_after_applying(worker) -> int:
    """Inside the worker: its next apply writes the new weights, then fails (a half-done commit)."""
    strategy = worker._inflight_target.strategy
    real = strategy.apply

    def apply() -> None:
        strategy.apply = real
        real()
        raise RuntimeError("injected failure after the weights were written")

    strategy.apply = apply
    return 1


@contextlib.contextmanager
def tampering(pusher: WeightPusher | BucketSender, fn: Tamper | None) -> Iterator[None]:
    """Inside the block, every bucket ``pusher`` sends goes through ``fn`` (the sender's
    fault-injection seam: it may replace a bucket's header and bytes; None: untouched). A
    background push (``push_async``) must end inside the block: collect its outcome there."""
    sender = pusher.sender if isinstance(pusher, WeightPusher) else pusher
    before, sender._tamper = sender._tamper, fn
    try:
        yield
    finally:
        sender._tamper = before


MOE = dict(arch="qwen3_moe", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256,
           num_experts=4, experts_per_token=2, moe_intermediate_size=128)


def state_dict_of(path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by name (one safetensors file)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def moe_trainer_model(path, seed: int | None = None):
    """The policy as the trainer holds it (experts fused), optionally moved by a perturbation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


class ListenerPair:
    """Trainer rank 0 in the test thread, a listener (rank 1) in a background thread."""

    def __init__(self, port: int, schema: TensorSchema | None, timeout_s: float = 20.0, *,
                 target: DictTarget | None = None, bucket_mb: float = 0.01) -> None:
        self.config = GroupConfig(port=port, world_size=2, timeout_s=timeout_s)
        self.target = target if target is not None else DictTarget()
        self.error: BaseException | None = None
        ready = threading.Event()

        def serve() -> None:
            try:
                group = WeightGroup(self.config, 1)
                self.listener = UpdateListener(group, self.target, schema)
                ready.set()
                self.listener.run(self.stop)
            except BaseException as e:  # reported by the test
                self.error = e
                ready.set()

        self.stop = threading.Event()
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        self.pusher = WeightPusher(self.config, PushConfig(bucket_mb=bucket_mb))
        assert ready.wait(30)

    def close(self) -> None:
        self.pusher.close()
        self.thread.join(10)


def form_pair(port: int, timeout_s: float = 10.0,
              stop: threading.Event | None = None) -> tuple[WeightGroup, WeightGroup]:
    """A formed two-member group in this process: (trainer rank 0, worker rank 1; ``stop``: the worker's)."""
    config = GroupConfig(port=port, world_size=2, timeout_s=timeout_s)
    trainers: list[WeightGroup] = []
    t = threading.Thread(target=lambda: trainers.append(WeightGroup(config, 0, join_timeout_s=60.0)), daemon=True)
    t.start()
    worker = WeightGroup(config, 1, join_timeout_s=60.0, stop=stop)
    t.join(60)
    return trainers[0], worker


def random_groups(g: torch.Generator, n_groups: int, size: int) -> list[RolloutGroup]:
    """Groups of awkward lengths: prompts of 2-9 tokens, completions of 1-12, some tokens the
    environment's (observation), tags of versions 0-2, random behaviour log-probs and rewards."""
    groups = []
    for gi in range(n_groups):
        samples = []
        for si in range(size):
            p, t = int(torch.randint(2, 10, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g))
            obs = [bool(x) for x in (torch.rand(t, generator=g) < 0.25).tolist()]
            obs[0] = False
            samples.append(RolloutSample(
                sample_id=f"g{gi}-{si}", group_id=f"g{gi}",
                prompt_ids=torch.randint(3, 250, (p,), generator=g).tolist(),
                token_ids=torch.randint(3, 250, (t,), generator=g).tolist(),
                logprobs=[0.0 if o else float(x) for o, x in zip(obs, -torch.rand(t, generator=g) * 4)],
                versions=sorted(torch.randint(0, 3, (t,), generator=g).tolist()),
                reward=float(torch.rand(1, generator=g)), observation=obs))
        groups.append(RolloutGroup(group_id=f"g{gi}", samples=tuple(samples)))
    return groups


def shared_prompt_groups(g: torch.Generator, n_groups: int, size: int, *, vocab: int = 250, prompt: tuple = (3, 20),
                         completion: tuple = (1, 13), routers: int = 0, experts: int = 4) -> list[RolloutGroup]:
    """GRPO groups as an engine returns them: every sample of a group shares its group's prompt
    (prompts of ``prompt`` tokens), every other sample opens with the same 3 tokens (a shared
    history past the prompt), completions of ``completion`` tokens, some of them the
    environment's (observation), versions 0-2, random behaviour log-probs and rewards. With
    ``routers`` MoE layers, each token's recorded routing (2 of ``experts``; the shared opening
    routed alike, so its positions stay shareable)."""
    import msgspec

    groups = []
    for gi in range(n_groups):
        ids = torch.randint(3, vocab, (int(torch.randint(*prompt, (1,), generator=g)),), generator=g).tolist()
        stem = torch.randint(3, vocab, (3,), generator=g).tolist()
        stem_route = torch.rand(3, routers, experts, generator=g).argsort(-1)[..., :2]
        samples = []
        for si in range(size):
            t = int(torch.randint(*completion, (1,), generator=g))
            tokens = torch.randint(3, vocab, (t,), generator=g).tolist()
            if si % 2:
                tokens = (stem + tokens)[:max(t, 4)]
            t = len(tokens)
            obs = [bool(x) for x in (torch.rand(t, generator=g) < 0.25).tolist()]
            obs[0] = False
            s = RolloutSample(
                sample_id=f"g{gi}-{si}", group_id=f"g{gi}", prompt_ids=ids, token_ids=tokens,
                logprobs=[0.0 if o else float(x) for o, x in zip(obs, -torch.rand(t, generator=g) * 4)],
                versions=sorted(torch.randint(0, 3, (t,), generator=g).tolist()),
                reward=float(torch.rand(1, generator=g)), observation=obs)
            if routers:
                route = torch.rand(t, routers, experts, generator=g).argsort(-1)[..., :2]
                if si % 2:
                    route[:3] = stem_route[:t]
                s = msgspec.structs.replace(s, routing=route.to(torch.int16).numpy().tobytes(), routing_layers=routers,
                                            routing_k=2)
            samples.append(s)
        groups.append(RolloutGroup(group_id=f"g{gi}", samples=tuple(samples)))
    return groups
