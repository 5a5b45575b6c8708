"""The ``inflight`` backend of vLLM's weight-transfer API, trainer side: ``InflightTrainerWeightTransferEngine``.

For trainers written against vLLM's API: they name the backend and keep their code::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from inflight.trainer.transfer_trainer import InflightTrainerInitInfo  # registers the backend
    engine = WeightTransferTrainerFactory.trainer_init(
        InflightTrainerInitInfo(rank=0, port=29600, push=PushConfig(dtype="float32")),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    result = engine.send_weights()  # returns once the engine serves the new version

``send_weights`` drives vLLM's handshake (start, update with the update's version and tensors, finish with its
version) and pushes the bytes on the project's transport while the engines decode; it returns once every engine
committed, with the commit step and each request's tokens at the commit (``PushResult``). A list of clients (or of
Ray actor handles) is a fleet: one weight group per engine (``FleetPusher``). Invariants: only rank 0 (``is_sender``)
talks to the clients and pushes; versions move by one per ``send_weights`` from the newest the engines serve when the
trainer joins (``initial_version`` on fresh engines); a failed push leaves every engine serving its last good
version, and the session is closed without a label.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from inflight.engine.engine_config import InflightConfig
from inflight.engine.transfer_engine import BACKEND
from inflight.transport.bucket import dtype_name
from inflight.transport.fleet_pusher import FleetPusher
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushResult, WeightPusher
from inflight.transport.sources import ShardedSource, weights_of


@dataclass
class InflightTrainerInitInfo(TrainerInitInfo):
    """Where the trainer hosts the weight group, how it pushes, and what every engine's worker is started with."""

    backend: ClassVar[str] = BACKEND
    port: int = 29600
    """The weight group's store port (rank 0 hosts it)."""
    host: str = "127.0.0.1"
    """The address the store listens on; the engines connect to it."""
    tensor_parallel_size: int | Sequence[int] = 1
    """Workers of each engine: one number for every engine, or one per client."""
    push: PushConfig = field(default_factory=PushConfig)
    """How updates are packed and sent; ``dtype`` should be the engines' (``encoding="sparse"``
    starts the engines with ``keep_base``)."""
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    """Other ``InflightConfig`` fields for every engine (``initial_version``, ``adapter`` for a
    LoRA policy, ``commit``, ``staging``, ...)."""
    timeout_s: float = 120.0
    """The weight group's collective timeout (``GroupConfig.timeout_s``)."""
    join_timeout_s: float = 600.0
    """How long ``trainer_init`` waits for every engine's workers to join."""


class InflightTrainerWeightTransferEngine(TrainerWeightTransferEngine[InflightTrainerInitInfo]):
    init_info_cls = InflightTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients: list[Any] = []
        self.pusher: WeightPusher | FleetPusher | None = None
        self.push_config = PushConfig()
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: InflightTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> InflightTrainerWeightTransferEngine:
        """Start every engine's in-flight worker through its client, then host the weight
        group and wait for the workers to join."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        clients = clients_of(client)
        configs, fleet = engine_configs(init_info, len(clients))
        engine.version, engine.push_config = configs[0].initial_version, init_info.push
        if not engine.is_sender:
            if not isinstance(source, ShardedSource):
                raise ValueError("inflight: a multi-rank trainer passes the same ShardedSource on every rank; rank 0 "
                                 "pushes and the others follow")
            return engine
        engine.clients = clients
        for c, config in zip(engine.clients, configs):
            c.init_weight_transfer_engine(msgspec.json.decode(config.to_json()))
        if fleet is None:
            engine.pusher = WeightPusher(configs[0].group, init_info.push, join_timeout_s=init_info.join_timeout_s)
            live = engine.pusher.engine_versions.values()
        else:
            engine.pusher = FleetPusher(fleet, [c.group.world_size - 1 for c in configs], init_info.push,
                                        join_timeout_s=init_info.join_timeout_s)
            live = [v for p in engine.pusher.pushers.values() for v in p.engine_versions.values()]
        engine.version = max(engine.version, *live)  # a restarted trainer goes on from what the engines serve
        return engine

    def send_weights(self, version: int | None = None) -> PushResult | dict[int, PushResult] | None:
        """Push the next version (or ``version``) of the source to every engine; returns once
        each committed it: a ``PushResult`` (a dict of them by engine for a fleet; None on a
        following rank)."""
        version = self.version + 1 if version is None else version
        if not self.is_sender:
            self.source.follow(version)
            self.version = version
            return None
        weights = _weights(self.source)
        info = update_info(version, weights, self.push_config.dtype)
        for c in self.clients:
            c.start_weight_update()
        try:
            for c in self.clients:
                c.update_weights(info)
            result = self.pusher.push(version, weights)
        except BaseException:
            for c in self.clients:  # the session ends without a label: every engine serves its last good version
                with contextlib.suppress(Exception):
                    c.finish_weight_update()
            raise
        for c in self.clients:
            c.finish_weight_update(str(version))
        self.version = version
        return result

    def shutdown(self) -> None:
        """Leave the weight group; the engines keep serving and wait for the next trainer."""
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None


def engine_configs(info: InflightTrainerInitInfo, engines: int) -> tuple[list[InflightConfig], GroupConfig | None]:
    """Each engine's ``InflightConfig`` and, for a fleet, the group its per-engine groups share."""
    tps = [info.tensor_parallel_size] * engines if isinstance(info.tensor_parallel_size, int) else list(
        info.tensor_parallel_size)
    if len(tps) != engines or any(t < 1 for t in tps):
        raise ValueError(f"InflightTrainerInitInfo.tensor_parallel_size={info.tensor_parallel_size!r}: one size >= 1, "
                         f"or one per engine ({engines})")
    options = dict(info.engine_options)
    for reserved in ("group", "rank"):
        if reserved in options:
            raise ValueError(f"InflightTrainerInitInfo.engine_options sets {reserved!r}: the backend assigns it")
    if info.push.encoding == "sparse":
        options.setdefault("keep_base", True)
    if engines == 1:
        group = GroupConfig(host=info.host, port=info.port, world_size=1 + tps[0], timeout_s=info.timeout_s)
        return [InflightConfig(group=group, rank=1, **options)], None
    base = GroupConfig(host=info.host, port=info.port, world_size=1 + sum(tps), timeout_s=info.timeout_s)
    return [InflightConfig(group=base.for_engine(e, tp), rank=1, **options) for e, tp in enumerate(tps)], base


def clients_of(client: Any) -> list[Any]:
    """One ``VLLMWeightSyncClient`` per engine: a client, a list of clients, Ray actor handles,
    a ``RayVLLMWeightSyncClient`` over several handles (each its own engine here), or ``LLM``s."""
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    items = list(client) if isinstance(client, (list, tuple)) else [client]
    out: list[Any] = []
    for item in items:
        if isinstance(item, RayVLLMWeightSyncClient):
            out.extend(RayVLLMWeightSyncClient(h) for h in item.handles)
        elif type(item).__name__ == "ActorHandle":
            out.append(RayVLLMWeightSyncClient(item))
        elif hasattr(item, "llm_engine") and hasattr(item, "init_weight_transfer_engine"):
            out.append(OfflineClient(item))
        else:
            out.append(item)
    if not out:
        raise ValueError("inflight: no client: pass a VLLMWeightSyncClient, a list of them, or Ray actor handles")
    return out


class OfflineClient:
    """``LLM``'s own RL methods (``vllm.entrypoints.rl.offline``) as a ``VLLMWeightSyncClient``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _weights(source: Any) -> Any:
    """What the pusher reads: a module, a mapping, a ``ShardedSource``, or a vLLM ``WeightSource``'s pairs."""
    if source is None:
        raise ValueError("inflight: trainer_init(source=...) is needed: a module, a mapping of tensors, a "
                         "vLLM WeightSource or a ShardedSource")
    if isinstance(source, WeightSource):
        return dict(iter(source))
    return source


def update_info(version: int, weights: Any, dtype: str) -> dict[str, Any]:
    """What ``update_weights`` tells each engine of ``version``: its tensors as they travel."""
    named = weights.meta if isinstance(weights, ShardedSource) else weights_of(weights)
    cast = None if dtype == "keep" else getattr(torch, dtype)
    return {"version": version, "names": list(named), "shapes": [list(t.shape) for t in named.values()],
            "dtype_names": [dtype_name(cast if cast is not None and t.is_floating_point() else t.dtype)
                            for t in named.values()]}


def _register() -> None:
    from inflight.engine.plugin import register_backend

    register_backend()


_register()  # importing the init info is enough to find the backend by name, with or without vLLM's plugins
