"""Routing capture for mixture-of-experts engines: the experts that chose every sampled token.

Rollout routing replay (R3, why: docs/design.md) needs the engine's choices. vLLM 0.32's own capture
(``enable_return_routed_experts``) needs Model Runner V2, hence Triton on a GPU, so an eager CPU engine (or a
V1 GPU engine) records with this module instead, along the path the version tags take:
1. worker (``RoutingRecorder``): vLLM's capture hook on every MoE router (``BaseRouter.set_capture_fn``) keeps
   the logical top-k expert ids of each layer for the batch; a forward hook on the model then keeps, per
   request, the row of the position whose logits sample its next token (``query_start_loc[i + 1] - 1``: the
   last scheduled token, as vLLM's ``logits_indices``);
2. EngineCore (``attach_routing``, called by the patched ``step`` under the coordinator's lock, right after the
   step that ran that forward): takes the rows from worker 0 (every TP rank computes the same ids) and sets
   them as each output's ``EngineCoreOutput.routed_experts`` (one row per new token);
3. vLLM's output processor keeps them per request, trims them with the tokens a stop string drops, and
   concatenates them into the finished ``CompletionOutput.routed_experts``: ``[tokens, moe_layers, k]`` int16,
   aligned with the token ids, log-probs and version tags. A preempted request's next row comes from the
   forward that recomputes it on resumption, as its version tag does.

Row t of a completion is the routing of the forward position whose logits sampled token t, the position the
trainer's forward scores token t at (``inflight.trainer.routing_replay``). Prompt positions before the last
are not recorded. Layers are the MoE layers in model order.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

ROUTING_DTYPE = np.int16
"""Expert ids fit int16 (vLLM's own capture uses at most uint16; 32767 experts is plenty)."""


def moe_runners(model: torch.nn.Module) -> list[Any]:
    """vLLM's MoE layers of ``model`` (``MoERunner``), in model order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def capture_problem(runner_class: type, *, device_type: str, enforce_eager: bool, cudagraph_mode: Any) -> str | None:
    """Why this module cannot record routing on an engine of this kind, or None.

    It needs Model Runner V1 (vLLM 0.32's ``vllm.v1.worker.gpu_model_runner``, which the CPU
    runner extends): rows are aligned with requests through its ``input_batch`` and
    ``query_start_loc``, which V2 (picked on CUDA with Triton) does not have, so the hook would
    raise inside a forward and fail the step. And it needs eager forwards: under CUDA-graph
    replay Python hooks do not run, so rows would silently be missing or stale."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    if not issubclass(runner_class, V1Runner):
        return (f"the engine runs {runner_class.__module__}.{runner_class.__qualname__} (Model Runner V2), which "
                "has no input_batch/query_start_loc to align rows with requests: use vLLM's own capture there "
                "(enable_return_routed_experts=True), or VLLM_USE_V2_MODEL_RUNNER=0 for this recorder")
    graphs = getattr(cudagraph_mode, "name", str(cudagraph_mode)) not in ("NONE", "None")
    if device_type == "cuda" and not enforce_eager and graphs:
        return (f"the engine replays CUDA graphs (cudagraph_mode={getattr(cudagraph_mode, 'name', cudagraph_mode)}), "
                "in which the capture hooks do not run: start it with enforce_eager=True")
    return None


class RoutingRecorder:
    """Worker side: the top-k expert ids, per MoE layer, of every request's sampling position
    in the last forward pass. Installed by ``inflight_start`` when ``record_routing`` is on."""

    def __init__(self, model_runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        vc = model_runner.vllm_config
        problem = capture_problem(type(model_runner), device_type=torch.device(model_runner.device).type,
                                  enforce_eager=vc.model_config.enforce_eager,
                                  cudagraph_mode=vc.compilation_config.cudagraph_mode)
        if problem is not None:
            raise RuntimeError(f"inflight: record_routing=True cannot capture on this engine: {problem}")
        self.runner = model_runner
        model = model_runner.get_model()
        runners = moe_runners(model)
        if not runners:
            raise RuntimeError(f"inflight: record_routing=True but {type(model).__name__} has no MoE layer")
        routers = [r.router for r in runners]
        odd = [type(r).__name__ for r in routers if not isinstance(r, BaseRouter)]
        if odd or any(getattr(r, "capture_fn", None) is not None for r in routers):
            raise RuntimeError(f"inflight: record_routing=True, but the MoE routers of {type(model).__name__} "
                               f"({odd or 'already captured by vLLM'}) take no capture hook")
        self.layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self._routers = routers
        self._step: list[torch.Tensor | None] = [None] * self.layers
        self._last: tuple[list[str], np.ndarray] = ([], np.zeros((0, self.layers, self.top_k), ROUTING_DTYPE))
        for i, router in enumerate(routers):
            router.set_capture_fn(partial(self._capture, i))
        self._hook = model.register_forward_hook(self._after_forward)

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step[layer] = topk_ids  # a fresh tensor per call (the router's output): no copy needed

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if any(t is None for t in self._step):
            return  # a forward that routed nothing (none runs after start-up; be safe)
        n = self.runner.input_batch.num_reqs
        req_ids = list(self.runner.input_batch.req_ids[:n])
        positions = torch.from_numpy(self.runner.query_start_loc.np[1: n + 1] - 1).to(torch.long)
        rows = torch.stack([t[positions.to(t.device)] for t in self._step], dim=1)  # (requests, layers, k)
        self._last = (req_ids, rows.to(device="cpu", dtype=torch.int16).numpy())
        self._step = [None] * self.layers

    def take(self) -> tuple[list[str], np.ndarray]:
        """The last forward's rows: request ids and ``[requests, layers, k]`` int16."""
        last, self._last = self._last, ([], self._last[1][:0])
        return last

    def close(self) -> None:
        for router in self._routers:
            router.set_capture_fn(None)
        self._hook.remove()


def attach_routing(core: Any, outputs: dict[int, Any]) -> None:
    """EngineCore side, right after a step that ran the model: give each output that carries
    new tokens the routing rows of the forward that sampled them."""
    req_ids, rows = core.model_executor.collective_rpc("inflight_take_routing")[0]
    index = {rid: i for i, rid in enumerate(req_ids)}
    for eco in outputs.values():
        for out in eco.outputs:
            n = len(out.new_token_ids)
            i = index.get(out.request_id)
            if n == 0 or i is None:
                continue
            if n != 1:  # speculative decoding (refused at start) would sample several tokens per forward
                raise RuntimeError(f"inflight: {n} tokens in one step for {out.request_id}; routing covers one")
            out.routed_experts = rows[i: i + 1]


def routing_of(completion: Any) -> np.ndarray:
    """``[tokens, moe_layers, k]`` int16 routing of a finished ``CompletionOutput``."""
    routed = completion.routed_experts
    n = len(completion.token_ids)
    if routed is None:
        raise ValueError("completion has no routing: start the engine with InflightConfig(record_routing=True)")
    if routed.ndim != 3 or routed.shape[0] != n:
        raise ValueError(f"{n} tokens but routing of shape {tuple(routed.shape)}")
    return np.ascontiguousarray(routed, dtype=ROUTING_DTYPE)


def streamed_routing(engine: Any, request_id: str) -> np.ndarray | None:
    """The routing of the tokens a running request (user id ``request_id``, ``n = 1``) has so
    far, read from vLLM's output processor as ``stream_tagged`` reads the version tags."""
    processor = engine.output_processor
    for internal_id in processor.external_req_ids.get(request_id, []):
        state = processor.request_states.get(internal_id)
        if state is not None and state.routed_experts_chunks:
            return np.concatenate(state.routed_experts_chunks, axis=0)
    return None


def routing_fields(completion: Any) -> dict[str, Any]:
    """A finished completion's routing as ``RolloutSample`` fields (``routing``, ``routing_layers``, ``routing_k``)."""
    rows = np.ascontiguousarray(routing_of(completion), dtype="<i2")
    return {"routing": rows.tobytes(), "routing_layers": int(rows.shape[1]), "routing_k": int(rows.shape[2])}


def unpack(data: bytes, layers: int, k: int) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").reshape(-1, layers, k)
