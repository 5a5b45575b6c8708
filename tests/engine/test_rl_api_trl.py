"""TRL 1.16's AsyncGRPO clients, unchanged, on ``vllm serve --weight-transfer-config '{"backend": "inflight"}'``.

TRL's ``VLLMClient`` (every HTTP call of its trainer) and ``WeightTransferClient`` (its weight
sync: the nccl backend's init info, ``pause(keep)``, start, ``update_weights`` beside the packed
broadcast, finish with no version, ``resume``) are called as TRL's ``AsyncGRPOTrainer`` calls
them; its ``AsyncRolloutWorker`` (a spawned process on ``/v1/completions``) generates
throughout. The one part that needs CUDA, the broadcast itself (vLLM's ``trainer_init`` and
``packed_nccl_broadcast_producer``, which TRL's module imports), is the project's gloo sender of
vLLM's packed wire here (``inflight.transport.packed_wire``): TRL's HTTP calls, payloads and their
order are TRL's own. The trainer itself, unchanged on NCCL, is ``test_trls_async_grpo_trainer_commits_in_flight``.
"""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import requests
import torch

from inflight.engine.rpc import WorkerStatus, as_result
from inflight.transport.packed_wire import GlooWire, send_packed
from inflight.versions import boundaries, tags_from_spans
from tests.engine.test_rl_api_serve import Stream, _Span
from tests.engine_harness import Reference, replay, serve_process
from tests.helpers import wait_until

pytest.importorskip("trl", reason="TRL's AsyncGRPO is the trl extra (pip install -e '.[trl]')")

FLAGS = ["--weight-transfer-config", '{"backend": "inflight"}', "--enable-scale-out", "--max-model-len", "1024"]
TOKENS = 900
"""Each stream's length: every sync lands while it decodes."""


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    """What TRL's trainer has set up by the time its clients run (their logger is accelerate's)."""
    from accelerate import PartialState

    PartialState()


@pytest.fixture(scope="module")
def server(tiny_qwen, tmp_path_factory):
    with serve_process(tiny_qwen, tmp_path_factory.mktemp("rl_api_trl"), FLAGS) as base:
        yield base


class GlooEndpoint:
    """What vLLM's ``trainer_init`` hands TRL (a ``PyNcclCommunicator``, its ``.group`` the
    rendezvous TRL's ``destroy`` drops) on CPU: rank 0 of the packed wire's gloo group."""

    opened: list[GlooEndpoint] = []

    def __init__(self, init_info: dict) -> None:
        self.wire = GlooWire(init_info["master_address"], init_info["master_port"], 0, init_info["world_size"],
                             timeout_s=120.0)
        self.group = types.SimpleNamespace(store=self.wire, socket=None)
        self.chunks: list[list[list[str]]] = []
        GlooEndpoint.opened.append(self)


def gloo_producer(iterator, group: GlooEndpoint, src: int, post_iter_func, buffer_size_bytes: int | None = None,
                  num_buffers: int = 2) -> None:
    """vLLM's ``packed_nccl_broadcast_producer`` on the gloo group: the same chunks (vLLM's
    ``pack_tensors``), the same byte layout, vLLM's default buffer size unless told."""
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    assert src == 0
    pairs = ((name, post_iter_func((name, t))) for name, t in iterator)
    group.chunks.append(send_packed(pairs, group.wire, buffer_size_bytes or DEFAULT_PACKED_BUFFER_SIZE_BYTES))


@pytest.fixture
def trl_on_gloo(monkeypatch):
    """TRL's ``weight_transfer`` module with vLLM's two NCCL functions it imports sent over gloo."""
    import trl.experimental.async_grpo.weight_transfer as wt

    monkeypatch.setattr(wt, "open_trainer_endpoint", GlooEndpoint)
    monkeypatch.setattr(wt, "packed_nccl_broadcast_producer", gloo_producer)
    yield wt
    for endpoint in GlooEndpoint.opened:
        endpoint.wire.close()
    GlooEndpoint.opened.clear()


def engine_status(server: str) -> WorkerStatus:
    """The engine's worker and coordinator (``inflight_status`` on the dev-mode ``/collective_rpc``)."""
    r = requests.post(server + "/collective_rpc", json={"method": "inflight_status"}, timeout=60)
    r.raise_for_status()
    return as_result(r.json()["results"][0], WorkerStatus)


def test_trls_vllm_client_reads_the_inflight_server(server, tiny_qwen) -> None:
    """What TRL's trainer reads of the server before its first sync, through its own client."""
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    client = VLLMClient(server, server_timeout=60)
    client.wait_for_server_ready(poll_interval_s=0.2)
    assert client.get_max_model_len() == 1024
    assert client.get_dtype() == "torch.float32"
    assert client.get_world_size() == 1
    assert client.get_server_info()["weight_transfer_config"]["backend"] == "inflight"


def trl_manifest(model: torch.nn.Module) -> dict:
    """``weight_update_info`` as ``AsyncGRPOTrainer.__init__`` builds it, from TRL's own walk of the parameters."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    pairs = list(_iter_vllm_named_params(model))
    return {"names": [n for n, _ in pairs], "dtype_names": [str(p.dtype).split(".")[-1] for _, p in pairs],
            "shapes": [list(p.shape) for _, p in pairs]}


def streaming_iter(model: torch.nn.Module):
    """``AsyncGRPOTrainer._streaming_iter`` on one CPU process: TRL's walk, each parameter detached."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    for name, param in _iter_vllm_named_params(model):
        yield name, param.detach()


def sync_as_trl(client, model: torch.nn.Module, server: str, streams: list[Stream]) -> dict[str, tuple]:
    """``AsyncGRPOTrainer._sync_weight_merged`` on rank 0: ``pause``, ``send_weights``, ``resume``
    of TRL's client. Between two calls every stream takes 2 tokens (an event: a real pause would
    hang here). Returns each call's (stream progress, engine steps) as it returned."""
    at: dict[str, tuple] = {}

    def mark(call: str) -> None:
        at[call] = ([s.progress for s in streams], engine_status(server).engine.steps)
        wait_until(lambda: all(s.progress >= m + 2 for s, m in zip(streams, at[call][0])) or
                   any(not s.is_alive() for s in streams), f"2 tokens of every stream after TRL's {call}")
        assert all(s.is_alive() for s in streams), f"a stream ended before TRL's {call} was followed by tokens"

    client.pause()
    assert requests.get(server + "/is_paused", timeout=60).json() == {"is_paused": False}
    mark("pause")
    client.send_weights(streaming_iter(model))
    mark("send_weights")
    client.resume()
    at["resume"] = ([s.progress for s in streams], engine_status(server).engine.steps)
    return at


def test_trls_clients_commit_in_flight_while_requests_decode(server, tiny_qwen, trl_on_gloo) -> None:
    """TRL's ``WeightTransferClient`` joins the engine with its own init info and syncs four
    times, each ``pause(keep)``, ``send_weights``, ``resume`` as its trainer issues them, its
    ``AsyncRolloutWorker`` started after the first (cold) sync as the trainer starts it. For the
    three syncs while 4 requests stream: tokens and engine steps flow between pause and resume,
    each version lands while they decode, first tagged after its pause; a transformers replay
    from the tags alone gives the behaviour log-probs within 1e-4, where a one-token shift of
    the tags does not. The worker's samples carry TRL's versions, and those sampled under v1
    alone are its log-probs within 1e-4."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.float32)
    client = trl_on_gloo.WeightTransferClient(VLLMClient(server, 60), trl_manifest(model), weight_sync_timeout=120)
    client.init_weight_transfer()
    live = engine_status(server).live_version
    worker, samples, streams = rollout_worker(server, tiny_qwen), [], []
    try:
        states, syncs, v1_samples = _four_syncs(client, model, server, streams, worker, samples, live)
        assert all(s.is_alive() for s in streams), "a stream ended before every sync landed"
        wait_until(lambda: any(s.model_version == 4 for s in drain(worker, samples)), "a sample of TRL's version 4")
    finally:
        worker.stop()
        client.destroy()
    assert requests.get(server + "/weight_info", timeout=60).json() == {"weight_version": str(live + 4)}
    assert all(len(chunks) == 1 for e in GlooEndpoint.opened for chunks in e.chunks)  # vLLM's 1 GiB default
    for at in syncs:
        assert at["resume"][1] > at["pause"][1], at  # engine steps between TRL's pause and its resume
    _check_tags(tiny_qwen, streams, syncs, states, live + 1)
    assert {s.model_version for s in samples} >= {1, 4} and {s.model_version for s in v1_samples} == {1}
    check_samples(tiny_qwen, v1_samples, states[live + 1])


def _four_syncs(client, model, server: str, streams: list[Stream], worker, samples: list,
                live: int) -> tuple[dict, list, list]:
    """The trainer's loop: an optimizer step, a sync, the worker told the version. The first
    (cold) sync comes before the worker starts (once v1 committed, so what it samples before
    the second pause is v1's alone) and before ``streams`` start. Returns the states sent by
    version, the marks of the three syncs while the streams decode, the v1 samples."""
    snapshot = lambda: {n: t.clone() for n, t in streaming_iter(model)}  # noqa: E731
    states, syncs, v1_samples = {live: snapshot()}, [], []
    gen = torch.Generator().manual_seed(7)
    for k in range(1, 5):
        if k == 2:
            streams += [Stream(server, 300 + i, [3 + (11 * i + j) % 250 for j in range(6 + 3 * i)], TOKENS)
                        for i in range(4)]
            wait_until(lambda: len(drain(worker, samples)) >= 2, "2 samples of TRL's rollout worker")
            v1_samples = list(samples)
        wait_until(lambda k=k, ss=streams: min((s.progress for s in ss), default=0) >= 24 * (k - 1)
                   or any(not s.is_alive() for s in ss), f"every stream at {24 * (k - 1)} tokens")
        with torch.no_grad():  # the optimizer's step
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        states[live + k] = snapshot()
        marks = sync_as_trl(client, model, server, streams)
        syncs += [marks] if streams else []
        worker.update_model_version(k)
        wait_until(lambda k=k: engine_status(server).live_version == live + k, f"v{live + k} to commit")
        if k == 1:
            worker.start()
    return states, syncs, v1_samples


def rollout_worker(server: str, tiny_qwen):
    """TRL's ``AsyncRolloutWorker`` as ``AsyncGRPOTrainer`` builds it (its child process posts
    ``/v1/completions``), with TRL's own ``think_format_reward``: groups of 2, 8 tokens each."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
    from trl.rewards import think_format_reward

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen), padding_side="left")
    tok.chat_template = qwen2_5_chat_template  # the tiny Qwen2's tokenizer has none: TRL's own for Qwen2.5
    rows = [{"prompt": [{"role": "user", "content": f"{i} cats sat on {i + 1} mats"}]} for i in range(8)]
    return AsyncRolloutWorker(model_name=str(tiny_qwen), dataset=Dataset.from_list(rows),
                              reward_funcs=[think_format_reward], processing_class=tok,
                              eos_token_ids=[tok.eos_token_id], num_generations=2, max_inflight_tasks=4,
                              vllm_server_url=server, max_tokens=8, temperature=1.0, request_timeout=300)


def drain(worker, samples: list) -> list:
    """Every sample the worker queued so far, appended to ``samples``."""
    import queue

    while True:
        try:
            samples.append(worker.rollout_buffer.get_nowait())
        except queue.Empty:
            return samples


def check_samples(tiny_qwen, samples: list, state: dict) -> None:
    """A TRL sample's behaviour log-probs (``old_log_probs`` on its ``completion_mask``) are the
    engine's at ``state``: a transformers forward gives them within 1e-4."""
    ref = Reference(tiny_qwen, "float32").load(state)
    for s in samples:
        ids, mask = torch.as_tensor(s.input_ids), torch.as_tensor(s.completion_mask).bool()
        assert 1 <= int(mask.sum()) <= 8, s  # 8 tokens, or fewer ending in EOS
        with torch.no_grad():
            logits = ref.model(ids[None]).logits[0].double()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        got = torch.as_tensor(s.old_log_probs, dtype=torch.float64)
        torch.testing.assert_close(got[1:][mask[1:]], want[mask[1:]], atol=1e-4, rtol=0)


def _check_tags(tiny_qwen, streams: list[Stream], syncs: list[dict], states: dict, live: int) -> None:
    ref = Reference(tiny_qwen, "float32")
    for i, s in enumerate(streams):
        assert s.finished()
        first = boundaries(tags_from_spans([_Span(**x) for x in s.spans], len(s.tokens)))
        assert sorted(first) == [live, live + 1, live + 2, live + 3], first
        for k, at in enumerate(syncs, start=1):
            assert first[live + k] >= at["pause"][0][i] + 2, (k, first, at)  # sampled after its bytes were sent
    for s in streams[:2]:
        labels = s.labels()
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        want = replay(ref, lambda label: states[int(label)], s.prompt, s.tokens, labels, labels[0])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        off = replay(ref, lambda label: states[int(label)], s.prompt, s.tokens, labels[1:] + labels[-1:], labels[0])
        assert (got - off).abs().max() > 1e-3


class EngineWatch(threading.Thread):
    """While a trainer runs: one tagged request after another on ``/inference/v1/generate``,
    each started once the engine serves a version (after the trainer's cold sync)."""

    def __init__(self, server: str) -> None:
        super().__init__(daemon=True)
        self.server, self.streams, self.done = server, [], threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            status = engine_status(self.server)
            if status.started and status.live_version >= 1 and not any(s.is_alive() for s in self.streams):
                self.streams.append(Stream(self.server, 500 + len(self.streams), [5, 6, 7, 8], TOKENS))
            self.done.wait(0.05)

    def finish(self) -> list[list[int]]:
        """Stop starting requests; each finished request's tagged versions, in order."""
        self.done.set()
        self.join(60)
        return [sorted(boundaries(tags_from_spans([_Span(**x) for x in s.spans], len(s.tokens))))
                for s in self.streams if s.finished()]


def _hub_kernels(monkeypatch) -> None:
    """TRL's tree attention imports ``kernels``, the hub's kernel loader; in a checkout the
    project's own ``kernels/`` folder comes first by that name: the hub's package takes it."""
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        pytest.skip("TRL's tree attention needs the hub's kernels package (pip install 'kernels>=0.17,<0.18')")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernels", module)
    spec.loader.exec_module(module)


def _skip_without_trls_gpu_path(monkeypatch) -> None:
    """What TRL's trainer needs beyond the CPU tests: two GPUs, a CUDA build of vLLM (NCCL), and
    the FA3 kernel of its tree attention (``kernels-community/flash-attn3``, from the hub cache)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, has {torch.cuda.device_count()}: TRL's trainer and the server each hold one "
                    "(NCCL refuses two ranks of a communicator on one device)")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"needs a CUDA build of vLLM, not {type(current_platform).__name__}")
    from trl.experimental.async_grpo.packing import _flash_attn

    _hub_kernels(monkeypatch)
    try:
        _flash_attn()
    except Exception as e:  # the kernels package, the hub cache, the GPU's architecture: each a reason
        pytest.skip(f"TRL's tree attention needs the FA3 kernel (tests/gpu_trl.sh fetches it): {e}")


@pytest.mark.gpu
def test_trls_async_grpo_trainer_commits_in_flight(tiny_qwen, tmp_path, monkeypatch) -> None:
    """TRL's ``AsyncGRPOTrainer``, unchanged (its ``WeightTransferClient`` on NCCL, its rollout
    worker), trains 4 steps against the inflight server, a sync after each: every version
    commits (the engine serves v5: the cold sync and 4), tagged requests decode throughout, and
    one of them carries tokens of two versions (a commit landed while it decoded)."""
    _skip_without_trls_gpu_path(monkeypatch)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.rewards import think_format_reward

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen), padding_side="left")
    tok.chat_template = qwen2_5_chat_template
    rows = [{"prompt": [{"role": "user", "content": f"{i} cats sat on {i + 1} mats"}]} for i in range(16)]
    with contextlib.ExitStack() as stack:
        with monkeypatch.context() as env:  # the server's process on the last GPU, the trainer on cuda:0
            env.setenv("CUDA_VISIBLE_DEVICES", str(torch.cuda.device_count() - 1))
            base = stack.enter_context(serve_process(tiny_qwen, tmp_path, FLAGS))
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), vllm_server_base_url=base, max_steps=4,
                               per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
                               learning_rate=0.1, weight_sync_steps=1, report_to="none", save_strategy="no")
        trainer = AsyncGRPOTrainer(model=str(tiny_qwen), reward_funcs=think_format_reward, args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=tok)
        watch = EngineWatch(base)
        try:
            trainer.train()
            wait_until(lambda: engine_status(base).live_version == 5, "the last sync to commit")
            started = len(watch.streams)
            wait_until(lambda: len(watch.streams) > started, "a request started on v5")
        finally:
            versions = watch.finish()
    assert trainer.state.global_step == 4
    assert versions and all(v == list(range(v[0], v[-1] + 1)) and 1 <= v[0] for v in versions), versions
    assert {x for v in versions for x in v} >= {2, 3, 4, 5}, versions  # every trained version sampled tokens
    assert any(len(v) >= 2 for v in versions), versions
