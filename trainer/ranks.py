"""The trainer's ranks: one training run over N torch.distributed processes (FSDP2).

Launched by ``torchrun`` (or ``accelerate launch``, Slurm: anything that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``), or by ``inflight train --nproc N``,
which runs torch's own elastic agent (``launch_ranks``). Rank 0 is the trainer of a
one-process run: it starts the engines, reads the rollout queue, pushes and writes the
metrics; every other rank follows its orders (``inflight.trainer.train.follow_rank_0``).

Invariants:
- the policy, its gradients, its optimizer state and the KL reference are sharded
  (``fully_shard`` per decoder layer, then the root; a MoE layer's experts by expert, each
  rank computing its own: ``inflight.trainer.expert_parallel``), and each gradient is a sum over ranks:
  every rank's loss is already divided by the whole batch's tokens, so N ranks take the
  step one process would (``shard``);
- every rank gets whole groups of each batch (``rows``), contiguous in the batch's order;
- orders travel as protocol messages (``inflight.protocol``: msgpack, no pickle) on a gloo
  group of their own, never interleaved with FSDP's collectives, which run on the mesh;
- after each step every rank gathers the new weights through a ``ShardedSource`` (each
  tensor once) into rank 0's host copy (``GatheredWeights``): pushes, evaluations and the
  Hugging Face checkpoint read it, so no push ever has to call the other ranks.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from inflight.protocol import RolloutGroup, TrainerStop, Wire, decode_trainer, encode
from inflight.transport.sources import ShardedSource

ORDER_TIMEOUT = timedelta(hours=6)
"""How long a following rank waits for rank 0's next order: rank 0 may wait on engine starts
and rollouts for long. A rank that dies is seen at once (its sockets close), and the launcher
stops the others."""


class RankLost(RuntimeError):
    """Another trainer rank did not answer in time, or is gone: the run stops, naming it."""


STOP_TIMEOUT_S = 300
"""After a Ctrl-C, how long ``launch_ranks`` lets the ranks stop on their own (rank 0 ends its
step, lands its push and writes the checkpoint) before it kills them."""


@dataclass
class TrainerRanks:
    """This process's place among the trainer's ranks, and the groups they talk on."""

    rank: int
    world: int
    device: torch.device
    mesh: object
    """The 1-D device mesh FSDP shards over (``torch.distributed.device_mesh.DeviceMesh``)."""
    orders: dist.ProcessGroup
    """Gloo: rank 0's orders and the followers' replies."""
    gathers: dist.ProcessGroup
    """Gloo: ``GatheredWeights``' gathers."""
    checks: dist.ProcessGroup | None = None
    """Gloo: the monitored barriers that name a rank which does not answer (``check_in``,
    ``lost``), on a group of their own that no timed-out collective has closed."""

    timeout: timedelta = timedelta(minutes=5)
    """How long a rank waits for another within a step (``run.rank_timeout_s``)."""

    @classmethod
    def from_env(cls, timeout_s: float = 300.0, *, alone: bool = False) -> TrainerRanks | None:
        """The ranks of a run launched with ``WORLD_SIZE`` > 1 (the process group formed here,
        its collectives failing after ``timeout_s``); None for a one-process run, unless
        ``alone``: then a group of this process alone (FSDP2 on one rank: ``optim.compute_dtype``)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not alone:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        cuda = torch.cuda.is_available()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            store = dist.HashStore() if world <= 1 else None  # alone: no rendezvous
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timeout, store=store,
                                    **({"rank": 0, "world_size": 1} if store is not None else {}))
        world = dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        return cls(rank=dist.get_rank(), world=world, device=device, mesh=mesh,
                   orders=dist.new_group(backend="gloo", timeout=ORDER_TIMEOUT),
                   gathers=dist.new_group(backend="gloo", timeout=timeout),
                   checks=dist.new_group(backend="gloo", timeout=timeout), timeout=timeout)

    def shard(self, model: torch.nn.Module, compute_dtype: str = "float32", expert_parallel: bool = True
              ) -> torch.nn.Module:
        """``model`` sharded in place: each decoder layer (``_no_split_modules``) its own FSDP
        unit, then the root; gradients summed over ranks, not averaged. ``compute_dtype``
        ``bfloat16``: parameters gathered in bf16, gradients reduced and outputs returned in fp32.
        ``expert_parallel`` (on several ranks, a MoE model): each MoE layer's experts sharded by
        expert first (``inflight.trainer.expert_parallel``), which FSDP then leaves alone."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from inflight.trainer.expert_parallel import shard_experts

        layers = set(getattr(model, "_no_split_modules", None) or ())
        units = [m for m in model.modules() if type(m).__name__ in layers]
        if not units:
            raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): cannot "
                             "shard it layer by layer")
        layer, root = {}, {}
        if compute_dtype != "float32":  # the layers pass bf16 on; the root returns fp32 logits
            dtype = getattr(torch, compute_dtype)
            layer = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
            root = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float32)}
        experts = shard_experts(model, self.mesh, self.device) if expert_parallel and self.world > 1 else []
        ignored = {"ignored_params": set(experts)} if experts else {}
        for unit in units:
            fully_shard(unit, mesh=self.mesh, **ignored, **layer)
        fully_shard(model, mesh=self.mesh, **ignored, **root)
        for unit in [*units, model]:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    def fill_from_rank_0(self, model: torch.nn.Module, full: dict[str, torch.Tensor] | None) -> None:
        """Every rank, after ``shard``: each rank's shards of rank 0's ``full`` state dict (its
        unsharded tensors, on the host; None on the others, whose model was built on the meta
        device and is allocated here), and rank 0's buffers (a buffer a state dict leaves out,
        such as rotary frequencies, is the same on every rank). No rank but 0 ever holds
        the whole model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.rank != 0:
            model.to_empty(device=self.device)
        set_model_state_dict(model, full if self.rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        with torch.no_grad():
            for buffer in model.buffers():
                dist.broadcast(buffer, 0)

    def rows(self, groups: list[RolloutGroup]) -> list[list[RolloutGroup]]:
        """``groups`` cut into ``world`` contiguous runs of whole groups, balanced by their tokens
        (prompt and completion), each at least one (``groups`` holds at least one per rank)."""
        if len(groups) < self.world:
            raise ValueError(f"{len(groups)} groups for {self.world} trainer ranks: each rank needs a whole group")
        sizes = [sum(len(s.prompt_ids) + len(s.token_ids) for s in g.samples) for g in groups]
        total, parts, start = sum(sizes), [], 0
        for r in range(1, self.world):
            goal, end, run = total * r / self.world, start, sum(sizes[:start])
            while end < len(groups) - (self.world - r) and (end == start or run + sizes[end] / 2 <= goal):
                run, end = run + sizes[end], end + 1
            parts.append(groups[start:end])
            start = end
        return [*parts, groups[start:]]

    def send(self, message: Wire, rank: int, timeout: timedelta | None = None) -> None:
        """One protocol message to ``rank``, taken within ``timeout`` (default ``self.timeout``)
        or ``RankLost``."""
        data = encode(message)
        for t in (torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)):
            self._wait(dist.isend(t, rank, group=self.orders), rank, timeout, f"take a {type(message).__name__}")

    def receive_bytes(self, rank: int, timeout: timedelta | None = None) -> bytes:
        """The next message's bytes from ``rank``, within ``timeout`` (default ``self.timeout``)
        or ``RankLost``."""
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(size, rank, group=self.orders), rank, timeout, "send its message")
        data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(dist.irecv(data, rank, group=self.orders), rank, timeout, "send its message")
        return data.numpy().tobytes()

    def receive(self) -> Wire:
        """Rank 0's next order (``TrainerSetup``, ``TrainerOrder``, ``TrainerSave``,
        ``TrainerStop``): waited for as long as rank 0 waits for rollouts (``ORDER_TIMEOUT``)."""
        return decode_trainer(self.receive_bytes(0, ORDER_TIMEOUT))

    def check_in(self, step: int) -> None:
        """Every rank, at the start of optimizer step ``step``: rank 0 names each rank that did
        not come within ``self.timeout`` (gloo's monitored barrier), before any collective of
        the step could hang on it."""
        try:
            dist.monitored_barrier(group=self.checks, timeout=self.timeout, wait_all_ranks=True)
        except Exception as e:
            raise RankLost(f"step {step + 1}: {_first_line(e)} (hung or gone; run.rank_timeout_s)") from None

    def stop(self, reason: str = "") -> None:
        """Rank 0 tells the others to leave (``TrainerStop``); every rank leaves the process
        group. Idempotent; a broken group (a rank died) is left as it is."""
        if not dist.is_initialized():
            return
        if self.rank == 0:
            for r in range(1, self.world):
                try:
                    self.send(TrainerStop(reason=reason), r, timeout=timedelta(seconds=5))
                except Exception:  # gone, or waiting in a collective: rank 0's exit breaks it, the launcher ends it
                    return
        try:
            dist.destroy_process_group()
        except Exception:  # a rank already died: nothing to tell the others
            pass

    @contextmanager
    def naming_the_lost(self, step: int) -> Iterator[None]:
        """Step ``step`` of this rank: a collective that fails in it (gloo: a timeout, or a rank's
        sockets closed) becomes ``lost``'s ``RankLost``, naming the ranks that do not answer."""
        try:
            yield
        except RankLost:
            raise
        except RuntimeError as e:
            raise self.lost(step, e) from e

    def lost(self, step: int, error: BaseException) -> RankLost:
        """What a collective of step ``step`` that failed (``error``) says: the ranks that do not
        come to a monitored barrier within a few seconds are named (hung or gone). A rank that
        died closes its sockets, which fails the barrier at once without naming it: every
        live rank also says it is alive in the process group's store, and rank 0 names the
        ranks that did not."""
        store = dist.distributed_c10d._get_default_store()
        if self.rank:
            store.set(f"inflight/alive/{step}/{self.rank}", "1")
        try:
            dist.monitored_barrier(group=self.checks, timeout=timedelta(seconds=5), wait_all_ranks=True)
            who = "every rank answered after it"
        except Exception as e:
            who = _first_line(e)
            silent = self._silent(store, step) if self.rank == 0 else []
            if silent:
                who = (f"trainer rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer "
                       f"({who})")
        return RankLost(f"step {step + 1}: a collective of the trainer's ranks failed ({_first_line(error)}); {who} "
                        f"(hung or gone; run.rank_timeout_s)")

    def _silent(self, store, step: int, wait_s: float = 5.0) -> list[int]:
        """The ranks that did not say they are alive (``lost``) within ``wait_s``."""
        deadline, silent = time.monotonic() + wait_s, []
        for r in range(1, self.world):
            try:
                store.wait([f"inflight/alive/{step}/{r}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except Exception:  # not there in time
                silent.append(r)
        return silent

    def _wait(self, work, rank: int, timeout: timedelta | None, what: str) -> None:
        setting = "; run.rank_timeout_s" if timeout is None else ""
        timeout = self.timeout if timeout is None else timeout
        try:
            done = work.wait(timeout)
        except Exception as e:  # gloo: a timeout, or the peer's sockets closed (it died)
            done, why = False, ": " + _first_line(e)
        else:
            why = ""
        if done is False:
            raise RankLost(f"trainer rank {rank} did not {what} within {timeout.total_seconds():.0f} s "
                           f"(hung or gone{setting}){why}")


def _first_line(e: BaseException) -> str:
    """An error's first line without gloo's source location (``[.../unbound_buffer.cc:129] ...``)."""
    return re.sub(r"^(\[[^\]]*\]\s*:?\s*)+", "", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


class GatheredWeights:
    """Rank 0's host copy of the sharded policy's live tensors ``named`` (by the names it was
    given: a module's in-memory ones, so a tensor fused in memory stays one), refreshed
    after each optimizer step by every rank at once (``gather``), through a ``ShardedSource``."""

    def __init__(self, ranks: TrainerRanks, named: dict[str, torch.Tensor]) -> None:
        self.ranks = ranks
        self.source = ShardedSource(named, ranks.gathers)
        self.copy: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """Rank 0: the version ``copy`` holds whole; None while a gather fills it, and after one failed."""
        self.failed: int | None = None
        """Rank 0: the version whose gather failed, leaving ``copy`` half-written."""
        self.seconds: list[float] = []
        """Rank 0: how long each gather took."""

    @torch.no_grad()
    def gather(self, version: int) -> None:
        """Every rank calls this after the same optimizer step: rank 0's ``copy`` becomes the
        weights of ``version`` (fp32 on the host), each tensor gathered once."""
        if self.ranks.rank != 0:
            self.source.follow(version)
            return
        names, start = list(self.source.named), time.perf_counter()
        self.version, self.failed = None, version  # until every tensor is in
        self.source.begin(version, names)
        try:
            for name in names:
                full = self.source.take(name)
                held = self.copy.get(name)
                if held is None or held.shape != full.shape:
                    self.copy[name] = held = torch.empty(full.shape, dtype=full.dtype, device="cpu")
                held.copy_(full)
                self.source.drop(name)
        finally:
            self.source.finish(version)
        self.version, self.failed = version, None
        self.seconds.append(time.perf_counter() - start)

    def whole(self) -> dict[str, torch.Tensor]:
        """Rank 0's ``copy``, refused while it is not one version's whole (its gather failed
        part way: some tensors new, some old)."""
        if self.version is None:
            raise RuntimeError(f"rank 0's copy of the weights is half-written: the gather of version "
                               f"{self.failed} did not finish, so no push or save may read it")
        return self.copy


def launch_ranks(n: int, argv: list[str], prog: str, facts: dict | None = None) -> int | str:
    """``inflight train --nproc N``: N ranks of ``python -m inflight.trainer.train`` (``argv``
    without ``--nproc``) on this machine, under torch's elastic agent (``torchrun --standalone
    --max-restarts 0``): one rank that fails stops the others. Returns 0, or the line naming the
    rank that failed first; of a rank killed by SIGKILL, whether the kernel's OOM killer did it
    (``inflight.trainer.memory_watch``), what lowers its memory and where to resume (``facts``:
    ``inflight.trainer.supervisor.run_facts``)."""
    import signal
    import sys
    import uuid

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from inflight.trainer.memory_watch import ChildrenWatch
    from inflight.trainer.supervisor import rank_killed

    args = _without_nproc(argv)
    os.environ["INFLIGHT_PROG"] = prog  # the ranks' errors name the command the user ran
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2, start_method="spawn",
                          shutdown_timeout=STOP_TIMEOUT_S)
    try:
        with ChildrenWatch() as watch:  # the ranks' memory, looked at while they run
            elastic_launch(config, sys.executable)("-u", "-m", "inflight.trainer.train", *args)
    except SignalException as e:  # Ctrl-C: the agent passed it on to the ranks; rank 0 said where it stopped
        return 130 if e.sigval == signal.SIGINT else f"{prog}: stopped by {e.sigval.name}"
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if rank == 0 and failure.exitcode == 130:  # rank 0 stopped after a Ctrl-C, and said so
            return 130
        if rank == 0 and failure.exitcode == 1:  # rank 0 stopped the run; its error, above, says why
            return f"{prog}: error: trainer rank 0 of {n} stopped the run (its error is above); the others were stopped"
        if failure.exitcode == -signal.SIGKILL:
            return rank_killed(prog, rank, n, watch.death(failure.pid), facts or {})
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        return f"{prog}: error: trainer rank {rank} of {n} failed first ({how}); the others were stopped"
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def decode_floats(data: bytes, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) float32 tensor from its bytes (``TrainerPart``)."""
    if len(data) != 4 * rows * cols:
        raise ValueError(f"{len(data)} bytes for a {rows}x{cols} float32 tensor")
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(rows, cols).clone()
