"""``inflight.bench.inflight``'s trainer process: owns the weights, pushes or broadcasts them when told.

It hosts both groups' stores (in-flight and native), so it holds their ports
(``reserve_port``) and sends the two ``GroupConfig``s to the engine's process first. It
stands in for a trainer on other hardware, so it runs at low priority: on this machine it
shares the cores with the engine it measures. The same code drives a whole-model and a
layer-granular engine: ``WeightPusher.push`` tells them apart by their hellos. Given a
``SlowLink`` (``inflight.bench.slow_link``), it runs in the link's namespace and hosts both
groups on its end, so every byte of both update paths crosses the shaped link.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inflight.bench.slow_link import SlowLink
    from inflight.transport.pusher import PushResult


def push_report(r: PushResult, version: int, cpu_s: float) -> dict:
    """What the driver records of one in-flight push (a ``PushResult``). A layer-granular push
    commits each group at its own step boundary: ``commit_step`` and ``commit_ms`` are its last
    group's, ``stall_ms`` sums every group's commit and ``groups`` counts them."""
    c = r.commits[1]
    return {"version": version, "commit_step": c.step, "commit_ms": c.commit_ms, "stall_ms": r.stall_ms,
            "groups": len(r.groups) or 1, "send_s": r.send.send_s, "nbytes": r.send.nbytes,
            "push_s": r.stage_wait_s + r.commit_wait_s, "stage_ms": r.staged[1].receive_ms, "pack_s": r.send.pack_s,
            "cpu_s": cpu_s}


def trainer(conn: Connection, model_dir: str, link: SlowLink | None = None, native: bool = True) -> None:
    """The process's entry point: serves ``("push" | "native" | "stop", version)`` from ``conn``
    (``native`` False: an engine without the native group, whose rows only push)."""
    from safetensors.torch import load_file

    if link is not None:  # first: every socket and thread of this process is then in the namespace
        from inflight.bench.slow_link import enter

        enter(link)
    os.nice(19)
    torch.set_num_threads(1)
    from inflight.trainer.native_update import broadcast_state
    from inflight.transport.group import WeightGroup
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import PushConfig, WeightPusher
    from inflight.transport.store import reserve_port

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    # Two weight sets, alternated: making new weights is the trainer's job (on its own hardware
    # in a real run), not part of the update path being measured, so it is done once, up front.
    states = [{k: v + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for k, v in base.items()}
              for i in range(2)]
    del base  # memory: a real model's weights are 0.5+ GB here, on a shared machine
    # over a slow link: the namespace's end of a private veth pair on this machine, no MAC (as native's)
    where = {"timeout_s": 120.0} if link is None else {"host": link.inner, "insecure": True, "timeout_s": 600.0}
    host = where.get("host", GroupConfig.host)  # the store's address: its port is reserved there
    inflight_group = GroupConfig(port=reserve_port(host), world_size=2, **where)
    native_group = GroupConfig(port=reserve_port(host), world_size=2, backend="gloo", name="native", **where)
    conn.send((inflight_group, native_group))
    pusher = WeightPusher(inflight_group, PushConfig(bucket_mb=64))
    group = WeightGroup(native_group, 0) if native else None
    conn.send("ready")
    while True:
        cmd, version = conn.recv()
        state = states[version % 2]
        if cmd == "push":
            cpu0 = time.process_time()  # every thread of this process: the send's gloo threads and kernel copies too
            r = pusher.push(version, state)
            conn.send(push_report(r, version, time.process_time() - cpu0))
        elif cmd == "native":
            t0 = time.perf_counter()
            assert group is not None, "a native update on an engine without the native group"
            nbytes = broadcast_state(group, state)
            conn.send({"version": version, "send_s": time.perf_counter() - t0, "nbytes": nbytes})
        else:
            pusher.close()
            if group is not None:
                group.close()
            return
