"""The ``inflight`` backend of vLLM's weight-transfer API, worker side: ``InflightWeightTransferEngine``.

vLLM builds one per worker from ``--weight-transfer-config '{"backend": "inflight"}'`` (the plugin
registers the name in every vLLM process); the worker extension (``inflight.engine.rl_api``) hands it
the RL API's calls. ``init_weight_transfer_engine`` is ``inflight_start`` (an ``InflightConfig``: the
listener joins the trainer's weight group; vLLM's ``nccl`` init info: a ``PackedReceiver`` takes its
packed broadcast). ``start_weight_update`` opens a session, ``update_weights(update_info)`` checks what
the update carries (``InflightUpdateInfo``, or a ``weight_dir``: ``inflight.engine.checkpoint_reader``)
against this worker's tensors and version, ``finish_weight_update`` closes it. Each returns at once;
the bytes are staged off the step loop and commit at a step boundary (``inflight.engine.coordinator``).

Invariants: none of these touches live weights, staging or the label; a session's version is newer
than every version served or announced; a refused start or update leaves the session as it was, and
``finish`` always closes it; on the nccl wire an update that staged but did not commit is reported by
the next ``start_weight_update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from inflight.engine.rpc import BAD_INPUT, OUT_OF_ORDER
from inflight.transport.bucket import torch_dtype
from inflight.transport.schema import TensorSchema

BACKEND = "inflight"
"""The backend's name in vLLM's registries (worker and trainer side alike)."""


@dataclass
class InflightInitInfo(WeightTransferInitInfo):
    """Never parsed here: EngineCore turns the init info into an ``InflightConfig`` and starts
    the worker with it (``inflight.engine.rl_api``)."""


@dataclass
class InflightUpdateInfo(WeightTransferUpdateInfo):
    """What one update will carry, sent with ``update_weights``: its version and its tensors
    as they travel (checkpoint names, full shapes, wire dtypes). The bytes come on the weight
    group, not with this."""

    version: int
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)


class RLApiError(ValueError):
    """A call of vLLM's RL API that this engine refuses; the message names the problem and the
    fix, ``status`` (``inflight.engine.rpc.BAD_INPUT``, ``OUT_OF_ORDER``, ``ENGINE_SETUP``) is the
    HTTP status the OpenAI server answers it with (``inflight.engine.rl_status``)."""

    def __init__(self, message: str, status: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.status)


@dataclass
class _Session:
    update: InflightUpdateInfo | None = None


class InflightWeightTransferEngine(WeightTransferEngine[InflightInitInfo, InflightUpdateInfo]):
    init_info_cls = InflightInitInfo
    update_info_cls = InflightUpdateInfo
    supports_draft_weight_update = False
    """A draft model's update is refused by name: speculative decoding is refused at start."""

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._schema: TensorSchema | None = None
        self._live: Callable[[], int] = lambda: 0
        self._session: _Session | None = None
        self._newest = -1  # the newest version a session of this engine named
        self._receiver: Any = None  # a PackedReceiver: vLLM's nccl wire (inflight.engine.packed_receiver)
        self._reader: Any = None  # a CheckpointReader: checkpoint directories (inflight.engine.checkpoint_reader)

    def bind(self, schema: TensorSchema, live_version: Callable[[], int], receiver: Any = None,
             reader: Any = None) -> None:
        """Called by ``inflight_start`` on this worker: the tensors an update must match, the
        version this worker serves and, on vLLM's nccl wire, its ``PackedReceiver``; reading
        checkpoint directories, its ``CheckpointReader``."""
        self._schema, self._live, self._receiver, self._reader = schema, live_version, receiver, reader
        self._newest = max(self._newest, live_version())

    def init_transfer_engine(self, init_info: InflightInitInfo) -> None:
        raise RuntimeError("inflight: init_weight_transfer_engine reached the worker without passing through the "
                           "inflight plugin's EngineCore (install this package in the engine's environment; check "
                           "VLLM_PLUGINS)")

    def start_weight_update(self) -> None:
        self._check_started("start_weight_update")
        if self._session is not None:
            raise RLApiError("inflight: start_weight_update while an update is open: call finish_weight_update first",
                             OUT_OF_ORDER)
        queue = self._receiver or self._reader
        if queue is not None:
            if self._receiver is not None and self._receiver.broken:
                self._receiver.take_refusal()  # the update the failure took down: reported by this error
                raise RLApiError(f"inflight: the trainer's group failed ({self._receiver.broken}): call "
                                 "init_weight_transfer_engine again", OUT_OF_ORDER)
            if (refused := queue.take_refusal()) is not None:
                raise RLApiError(f"inflight: {refused}; this engine serves v{self._live()} (start again to send the "
                                 "next)")
        self._session = _Session()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Check ``update_info`` and record it; the bytes are the listener's to receive."""
        self._check_started("update_weights")
        if self._session is None:
            raise RLApiError("inflight: update_weights before start_weight_update", OUT_OF_ORDER)
        if self._session.update is not None:
            raise RLApiError(f"inflight: update_weights twice in one update (v{self._session.update.version} is open): "
                             "an update is announced once, whole", OUT_OF_ORDER)
        if isinstance(update_info, dict) and "weight_dir" in update_info:
            self._session.update = self._expect_dir(update_info)
            self._newest = self._session.update.version
            return
        if self._reader is not None:
            raise RLApiError("inflight: this engine reads its updates from checkpoint directories: update_info must "
                             "name one (weight_dir)")
        if self._receiver is not None:
            info = self._wire_update_info(update_info)
        else:
            info = self.parse_update_info(update_info)
        self._check_update(info)
        if self._receiver is not None:
            self._expect(info)
        self._session.update = info
        self._newest = info.version

    def receive_weights(self, update_info: InflightUpdateInfo) -> None:
        raise RuntimeError("inflight: weights arrive on the listener thread, never inside an engine step")

    def finish_weight_update(self) -> None:
        self._check_started("finish_weight_update")
        if self._session is None:
            raise RLApiError("inflight: finish_weight_update without start_weight_update", OUT_OF_ORDER)
        session, self._session = self._session, None  # closed either way: the next start opens a new one
        if session.update is None:
            raise RLApiError("inflight: finish_weight_update without update_weights: the update is closed unannounced "
                             "(announce its version and tensors between start and finish)", OUT_OF_ORDER)
        if (queue := self._receiver or self._reader) is not None:
            queue.finish(session.update.version)

    def abandon(self) -> None:
        """Drop an open session (its client went away); the next start opens a new one, and
        may name the version the dropped one announced."""
        self._session = None
        self._newest = self._live()
        if (queue := self._receiver or self._reader) is not None:
            queue.abandon()

    @property
    def open_version(self) -> int | None:
        """The version of the open session's update, if one was announced."""
        return None if self._session is None or self._session.update is None else self._session.update.version

    def shutdown(self) -> None:
        """The listener stops with the engine (``inflight_stop``); nothing else is held here."""
        self._session = None

    def parse_update_info(self, update_dict: dict[str, Any]) -> InflightUpdateInfo:
        if not isinstance(update_dict, dict):
            raise RLApiError(f"inflight: update_info must be an object, not {type(update_dict).__name__}")
        try:
            info = InflightUpdateInfo(**update_dict)
        except TypeError as e:
            raise RLApiError(f"inflight: update_info {sorted(update_dict)}: {e} (expected version, names, shapes, "
                             "dtype_names)") from None
        if not isinstance(info.version, int) or isinstance(info.version, bool):
            raise RLApiError(f"inflight: update_info.version={info.version!r} must be an integer")
        if not len(info.names) == len(info.shapes) == len(info.dtype_names):
            raise RLApiError(f"inflight: update_info has {len(info.names)} names, {len(info.shapes)} shapes and "
                             f"{len(info.dtype_names)} dtype_names: one of each per tensor")
        return info

    def _wire_update_info(self, update_dict: Any) -> InflightUpdateInfo:
        """vLLM's ``nccl`` update info (``names``, ``dtype_names``, ``shapes``; ``version``
        optional): the version is the next after every one this engine served or was told of."""
        if not isinstance(update_dict, dict):
            raise RLApiError(f"inflight: update_info must be an object, not {type(update_dict).__name__}")
        unknown = sorted(set(update_dict) - {"names", "dtype_names", "shapes", "version", "packed"})
        if unknown:
            raise RLApiError(f"inflight: update_info has unknown fields {unknown} (vLLM's nccl backend sends names, "
                             "dtype_names, shapes; version is optional)")
        if "packed" in update_dict and update_dict["packed"] != self._receiver.packed:
            raise RLApiError(f"inflight: update_info.packed={update_dict['packed']!r}, but init_weight_transfer_engine "
                             f"said packed={self._receiver.packed}: the wire's packing is set once, at init")
        version = update_dict.get("version", max(self._live(), self._newest) + 1)
        fields_ = {k: update_dict.get(k, []) for k in ("names", "dtype_names", "shapes")}
        return self.parse_update_info({"version": version, **fields_})

    def _expect_dir(self, update_dict: dict[str, Any]) -> InflightUpdateInfo:
        """A checkpoint directory (``weight_dir``; ``version`` optional: ``step_N`` names it),
        checked from its headers and queued for the reader's thread."""
        if self._reader is None:
            raise RLApiError("inflight: update_info names a weight_dir, but this engine takes updates from elsewhere "
                             "(a trainer's weight group, vLLM's nccl wire): start it with init_info "
                             '{"checkpoints": true} to take checkpoint directories', OUT_OF_ORDER)
        unknown = sorted(set(update_dict) - {"weight_dir", "version"})
        if unknown:
            raise RLApiError(f"inflight: update_info has unknown fields {unknown} beside weight_dir (give weight_dir "
                             "and, unless the directory is named step_<N>, version)")
        job = self._reader.check(update_dict["weight_dir"], update_dict.get("version"), self._newest)
        self._reader.expect(job)
        return InflightUpdateInfo(version=job.version)

    def _expect(self, info: InflightUpdateInfo) -> None:
        """Check the wire dtypes and hand the update to the receiver, whose thread takes its bytes."""
        import torch

        from inflight.engine.packed_receiver import WireUpdate

        assert self._schema is not None
        dtypes = []
        for name, dname in zip(info.names, info.dtype_names):
            dtype = getattr(torch, str(dname), None)
            own_name = self._schema.tensors[name][1]
            own = torch_dtype(own_name)
            if (not isinstance(dtype, torch.dtype)
                    or not (dtype == own or (dtype.is_floating_point and own.is_floating_point))):
                raise RLApiError(f"inflight: v{info.version}: {name} travels as {dname!r}, which this engine cannot "
                                 f"take into its {own_name} (a float converts to any float; anything else must match)")
            dtypes.append(dtype)
        self._receiver.expect(WireUpdate(info.version, list(info.names), [list(s) for s in info.shapes], dtypes))

    def _check_started(self, call: str) -> None:
        if self._schema is None:
            raise RLApiError(f"inflight: {call} before init_weight_transfer_engine", OUT_OF_ORDER)

    def _check_update(self, info: InflightUpdateInfo) -> None:
        assert self._schema is not None
        live = self._live()
        if info.version <= max(live, self._newest):
            raise RLApiError(f"inflight: update_info.version={info.version} is not newer than "
                             f"v{max(live, self._newest)} (this engine serves v{live}): versions only move forward",
                             OUT_OF_ORDER)
        tensors = self._schema.tensors
        unknown = [n for n in info.names if n not in tensors]
        if unknown:
            raise RLApiError(f"inflight: v{info.version} names tensors this engine does not have: {unknown[:5]}")
        for name, shape in zip(info.names, info.shapes):
            if tuple(shape) != tuple(tensors[name][0]):
                raise RLApiError(f"inflight: v{info.version}: {name} has shape {tuple(shape)}, this engine's is "
                                 f"{tuple(tensors[name][0])}")
        if len(set(info.names)) != len(info.names):
            raise RLApiError(f"inflight: v{info.version} names a tensor twice")
        missing = sorted(set(tensors) - set(info.names))
        if missing:
            raise RLApiError(f"inflight: v{info.version} leaves out tensors of this engine: {missing[:5]} "
                             f"({len(missing)} in all); an update carries every tensor")
