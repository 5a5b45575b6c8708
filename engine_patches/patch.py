"""The step-boundary patch `inflight` applies to vLLM, and the function that applies it (the
other, the KV cache's budget on a GPU, is ``inflight.engine.kv_budget``; the plugin applies both).
Also ``count_worker_steps``, which ``inflight_start`` applies to its own worker: the worker's
count of the model steps it ran.
Also the opt-in plain CPU GEMM (``use_plain_cpu_gemm``), applied only where
``INFLIGHT_CPU_PLAIN_GEMM=1``: a CPU engine the ``copy`` commit is right for.

Why a patch at all: in vLLM 0.32 nothing runs between two EngineCore steps except client
requests (utility calls), and workers cannot issue those. A commit that must land at a
step boundary on every worker of an engine *and* move the version label in the same
window (two separate utility calls mislabel a token per request) needs the step itself to
look for it, and EngineCore must know it serves an in-flight engine. Everything else (the
receiver, the staging, the per-worker commit) lives in the worker extension; the
engine-level commit lives in ``inflight.engine.coordinator``.
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "__inflight_engine_core__"


def patch_engine_core() -> None:
    """Wrap eight methods of ``vllm.v1.engine.core.EngineCore``, and ``EngineCoreProc``'s own
    ``pause_scheduler`` (vLLM 0.32.0).

    - ``collective_rpc``: when ``inflight_start`` passes through (from ``LLM``, ``AsyncLLM``
      or the OpenAI server's ``/collective_rpc``), check the engine, attach a
      ``CommitCoordinator`` to this EngineCore and tell the workers it exists; on
      ``inflight_stop``, detach it. While one is attached, every collective RPC holds its
      step lock, so a user's RPC never interleaves with a commit, and ``inflight_status``
      gains the engine's live version and step count.
    - ``step``: with a coordinator attached, the step runs under its lock and a pending
      commit is applied first, on the engine thread; with ``record_routing``, the step's
      outputs get the routing of the forward that sampled them (``inflight.engine.routing``).
      Engines without one are untouched.
    - ``step_with_batch_queue`` (async scheduling: the next batch is dispatched before the
      last one's output is processed): with a coordinator attached, runs under its lock with
      a pending commit applied first, as ``step`` does; each batch's outputs carry the label of
      the weights that computed it (``inflight.engine.batch_labels``). Pipeline parallelism,
      the other user of the batch queue, is refused at ``inflight_start``.
    - ``shutdown``: stops the coordinator and every worker's listener first (``inflight_stop``).
    - ``preprocess_add_request``: on an adapter engine (``InflightConfig.adapter``), refuses a
      request that does not decode with the policy adapter (``inflight.engine.adapter_engine.
      check_request``): vLLM answers the request alone with an error; the engine serves on.
    - on an engine whose weight-transfer backend is ``inflight`` (``inflight.engine.rl_api``):
      ``collective_rpc`` routes vLLM's RL API calls to the worker extension;
      ``set_weight_version`` accepts only a label the next commit (or the live weights) bears
      and leaves the label to the commit; ``pause_scheduler(mode="keep")`` does not stop
      decoding (``sleep``'s own pause still does). A refusal of either leaves an EngineCore
      process with its HTTP status in its text (``inflight.engine.rl_status``).
    - on an engine running this worker extension, ``collective_rpc("update_weights_from_path")``
      (prime-rl's update call) reads the directory in flight (``inflight.engine.checkpoint_api``).

    Idempotent; raises if vLLM's EngineCore no longer has these methods. Must run before an
    EngineCore binds ``self.step_fn`` in ``__init__``, which the ``vllm.general_plugins``
    entry point guarantees (plugins load at the top of ``EngineCore.__init__``).
    """
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    for name in _ENGINE_CORE_WRAPPERS:
        if not callable(getattr(EngineCore, name, None)):
            raise RuntimeError(f"inflight: vllm EngineCore has no {name}(); this vLLM is not 0.32-compatible")
    if getattr(EngineCore.step, _MARK, False):
        return
    for cls in (EngineCore, EngineCoreProc):  # EngineCoreProc defines a pause_scheduler of its own
        for name, wrap in _ENGINE_CORE_WRAPPERS.items():
            if name in cls.__dict__:
                fn = functools.wraps(cls.__dict__[name])(wrap(cls.__dict__[name]))
                setattr(fn, _MARK, True)
                setattr(cls, name, fn)


def _wrap_step(original_step: Any) -> Any:
    """``step`` and ``step_with_batch_queue`` alike: the batch queue runs only with async
    scheduling, which ``check_engine`` refuses beside ``record_routing``."""
    from inflight.engine.coordinator import ATTR

    def step(self):
        coordinator = self.__dict__.get(ATTR)
        if coordinator is None:
            return original_step(self)
        with coordinator.step() as report:
            meter = coordinator.spec_decode  # speculation runs with synchronous steps only (``check_engine``)
            if meter is not None:
                meter.before_step()
            outputs, executed = original_step(self)
            report(executed)
            if executed and meter is not None:
                meter.after_step(outputs, coordinator.live_version)
            if executed and coordinator.config.record_routing:  # the rows of this forward, before the next one
                from inflight.engine.routing import attach_routing

                attach_routing(self, outputs)
        return outputs, executed

    return step


def _wrap_collective_rpc(original_rpc: Any) -> Any:
    from inflight.engine import checkpoint_api, rl_api
    from inflight.engine.coordinator import ATTR, CommitCoordinator, check_engine
    from inflight.engine.engine_config import InflightConfig
    from inflight.engine.rl_status import crossing
    from inflight.engine.transfer_engine import RLApiError

    def start(self, config: InflightConfig, timeout: Any) -> list[Any]:
        coordinator = CommitCoordinator(self, config, check_engine(self.vllm_config, config, self.scheduler))
        # the second argument tells each worker that its EngineCore will drive the commit
        results = original_rpc(self, "inflight_start", timeout, (config.to_json(), coordinator.instance_id), None)
        self.__dict__[ATTR] = coordinator
        coordinator.start()
        return results

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list[Any]:
        coordinator = self.__dict__.get(ATTR)
        if method == "inflight_start":
            if coordinator is not None:
                raise RuntimeError("inflight: already started on this engine")
            return start(self, InflightConfig.from_json(args[0]), timeout)
        if method in rl_api.METHODS and rl_api.uses_backend(self):
            try:
                return rl_api.call(self, method, kwargs or {}, lambda m, a, k: collective_rpc(self, m, timeout, a, k),
                                   lambda config: start(self, config, timeout), coordinator)
            except RLApiError as e:
                raise crossing(self, e) from None
        if checkpoint_api.handles(self, method):
            def locked(m: str, a: tuple, k: Any) -> list[Any]:  # the workers' own method, between two steps
                with self.__dict__[ATTR].lock:
                    return original_rpc(self, m, timeout, a, k)
            try:
                return checkpoint_api.call(self, args, kwargs, locked, lambda config: start(self, config, timeout),
                                           coordinator)
            except RLApiError as e:
                raise crossing(self, e) from None
        if coordinator is None:
            return original_rpc(self, method, timeout, args, kwargs)
        if method == "inflight_stop":
            coordinator.stop()
            del self.__dict__[ATTR]
            return original_rpc(self, method, timeout, args, kwargs)
        with coordinator.lock:
            results = original_rpc(self, method, timeout, args, kwargs)
        if method == "inflight_status":
            import msgspec

            from inflight.engine.rpc import WorkerStatus, as_result

            results = [msgspec.structs.replace(as_result(r, WorkerStatus), engine=coordinator.status())
                       for r in results]
        return results

    return collective_rpc


def _wrap_shutdown(original_shutdown: Any) -> Any:
    from inflight.engine.coordinator import ATTR

    def shutdown(self):
        # the in-flight machinery stops with the engine (``del llm``, a server's exit): the
        # coordinator and every worker's listener let go of the trainer's store first
        if self.__dict__.get(ATTR) is not None:
            try:
                self.collective_rpc("inflight_stop", timeout=15.0)  # dead workers must not hang the shutdown
            except Exception:  # a half-dead executor: its own shutdown reports it
                pass
        return original_shutdown(self)

    return shutdown


def _wrap_preprocess(original_preprocess: Any) -> Any:
    from inflight.engine.coordinator import ATTR

    def preprocess_add_request(self, request):
        coordinator = self.__dict__.get(ATTR)
        if coordinator is not None and coordinator.config.adapter is not None:
            from inflight.engine.adapter_engine import check_request

            check_request(request.request_id, request.lora_request, coordinator.config.adapter)
        return original_preprocess(self, request)

    return preprocess_add_request


def _wrap_set_weight_version(original: Any) -> Any:
    from inflight.engine import rl_api
    from inflight.engine.coordinator import ATTR
    from inflight.engine.rl_status import crossing
    from inflight.engine.transfer_engine import RLApiError

    def set_weight_version(self, weight_version):
        if not rl_api.uses_backend(self):
            return original(self, weight_version)
        # the coordinator moves the label at the commit: a label set now would tag the old weights' tokens
        try:
            rl_api.check_label(self, weight_version, self.__dict__.get(ATTR))
        except RLApiError as e:
            raise crossing(self, e) from None
        return None

    return set_weight_version


def _wrap_pause_scheduler(original: Any) -> Any:
    from inflight.engine import rl_api

    def pause_scheduler(self, mode="abort", clear_cache=True):
        if mode == "keep" and rl_api.uses_backend(self) and not rl_api.state(self).sleeping:
            return None  # decoding goes on: the update the client pauses for commits in flight
        return original(self, mode, clear_cache)

    return pause_scheduler


def _wrap_sleep(original: Any) -> Any:
    from inflight.engine import rl_api

    def sleep(self, *args, **kwargs):
        api = rl_api.state(self)
        api.sleeping = True  # sleep's own pause is a real one, keep mode included
        try:
            return original(self, *args, **kwargs)
        finally:
            api.sleeping = False

    return sleep


_ENGINE_CORE_WRAPPERS = {"step": _wrap_step, "step_with_batch_queue": _wrap_step,
                         "collective_rpc": _wrap_collective_rpc, "shutdown": _wrap_shutdown,
                         "preprocess_add_request": _wrap_preprocess, "set_weight_version": _wrap_set_weight_version,
                         "pause_scheduler": _wrap_pause_scheduler, "sleep": _wrap_sleep}
"""EngineCore's methods ``patch_engine_core`` wraps, each with its wrapper's factory."""


def patch_inprocess_refusals() -> None:
    """Wrap ``vllm.v1.engine.llm_engine.LLMEngine.add_request`` (vLLM 0.32.0) so that a
    request EngineCore refuses (``inflight.engine.adapter_engine.RequestRefused``) leaves nothing
    behind in the front end.

    ``LLMEngine.add_request`` registers a request with its output processor before it hands
    it to the engine core. With the core in another process, a refusal comes back as the
    request's error output, which finishes it; with the core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the refusal is raised through ``add_request``, and
    the request would stay registered, unfinished, so ``LLM.generate`` would wait for it
    forever. The wrapper aborts it in the output processor and raises on. Idempotent."""
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine.add_request
    if getattr(original, _MARK, False):
        return

    from inflight.engine.adapter_engine import RequestRefused

    @functools.wraps(original)
    def add_request(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except RequestRefused as e:
            self.output_processor.abort_requests([e.request_id], internal=True)
            raise

    setattr(add_request, _MARK, True)
    LLMEngine.add_request = add_request


CPU_ASYNC_SCHEDULING_ENV = "INFLIGHT_CPU_ASYNC_SCHEDULING"
"""``1``: a CPU engine keeps ``async_scheduling=True`` when asked for it (``keep_cpu_async_scheduling``)."""


def keep_cpu_async_scheduling() -> None:
    """Let a CPU engine keep the async scheduling it was asked for (vLLM 0.32.0).

    ``vllm.platforms.cpu.CpuPlatform.check_and_update_config`` sets
    ``scheduler_config.async_scheduling = False`` unconditionally ("not required on CPU"),
    though vLLM's async path runs on CPU as it is: both executors support it, the CPU model
    runner inherits the GPU runner's ``execute_model``/``sample_tokens`` split, and the CPU
    worker stubs the CUDA streams and events it uses (measured: greedy and seeded sampled
    outputs bit-identical to the synchronous engine, in-process and multiprocess). Wrapped,
    the method puts back a ``True`` the user set, where ``INFLIGHT_CPU_ASYNC_SCHEDULING=1``
    in the process's environment at the call: the way in-flight commits under async
    scheduling are tested on CPU. Installed by the plugin in every process; idempotent."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        import os

        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if wanted is True and os.environ.get(CPU_ASYNC_SCHEDULING_ENV, "") == "1":
            vllm_config.scheduler_config.async_scheduling = True

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def plain_cpu_gemm_requested() -> bool:
    """Whether this process's environment asks for ``use_plain_cpu_gemm`` (the one place the
    variable is read; TP workers inherit it from the process that starts them)."""
    import os

    from inflight.settings import PLAIN_CPU_GEMM_ENV

    return os.environ.get(PLAIN_CPU_GEMM_ENV, "") == "1"


def use_plain_cpu_gemm() -> None:
    """Make vLLM CPU's linear layers keep their weights in their parameters (vLLM 0.32.0).

    ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (run by each linear
    and LM head's ``process_weights_after_loading``) prepacks the weight for oneDNN and, for
    linears, empties ``layer.weight``: a ``copy`` commit (``load_weights`` into the live
    storage) would then write into empty placeholders. With ``vllm._custom_ops._supports_onednn``
    False, the dispatch falls through to ``torch.nn.functional.linear`` on the parameter
    itself, unless the sgl kernel applies (AMX with bf16/fp16 weights; never float32) or the
    platform is Zen (``commit.base.cpu_gemm_prepacks`` names both and refuses ``copy`` there).
    So a CPU engine runs the ``copy`` commit exactly as a GPU engine does, which is how it is
    tested on CPU; its GEMMs are slower than oneDNN's. The dispatch reads the flag at call
    time, so this must run before the model is loaded: the plugin applies it (only when
    ``INFLIGHT_CPU_PLAIN_GEMM=1``). Idempotent."""
    import vllm._custom_ops as ops

    if not hasattr(ops, "_supports_onednn"):
        raise RuntimeError("inflight: vllm._custom_ops has no _supports_onednn; this vLLM is not 0.32-compatible")
    ops._supports_onednn = False



_STEP_MARK = "__inflight_counts_steps__"


def count_worker_steps(worker: Any) -> None:
    """Wrap this vLLM worker's ``execute_model`` (an instance attribute over the class's, vLLM
    0.32.0: ``Worker.execute_model(scheduler_output)``, which ``WorkerWrapperBase`` and every
    executor call by name) so that each call that schedules tokens first calls
    ``worker._inflight_target.on_step()``, on the execution thread.

    Why not a forward pre-hook on the model: a step that replays a full CUDA graph never calls
    the model's ``forward``, so the hook's count would stop on a GPU engine; ``execute_model``
    runs once per engine step, graph or not. Idempotent: the target is looked up on each call,
    so an engine started again counts for its new target.
    """
    if getattr(worker.execute_model, _STEP_MARK, False):
        return
    original = worker.execute_model

    @functools.wraps(original)
    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        target = getattr(worker, "_inflight_target", None)
        if target is not None and getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0:
            target.on_step()
        return original(scheduler_output, *args, **kwargs)

    setattr(execute_model, _STEP_MARK, True)
    worker.execute_model = execute_model
